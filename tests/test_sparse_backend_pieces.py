"""The sparse attention backend's pieces without an engine (``kvreuse.sparse.paged``), on vLLM's plain layout.

Shapes are the small test model's: head_dim 64, 4 query heads on 2 KV heads, block size 32; a shuffled block pool;
two requests prefilled (300 and 45 tokens) and then decoded token by token, as vLLM's batches carry them.
"""

from __future__ import annotations

import pytest
import torch

from kvreuse.kernels.dipr_decode import dense_decode_reference, dipr_selection_reference, masked_decode_reference
from kvreuse.kernels.key_sketch import sketch_reference
from kvreuse.kernels.paged_write import store_kv_reference
from kvreuse.sparse.config import SparseConfig
from kvreuse.sparse.paged import PagedBatch, SparseAttention

BLOCK, KV_HEADS, Q_HEADS, DIM, POOL = 32, 2, 4, 64, 40
SCALE = DIM**-0.5
PROMPTS = [300, 45]


class Engine:
    """A stand-in for vLLM's model runner: a block pool, block tables, slot mappings and batches."""

    def __init__(self, config: SparseConfig, seed: int = 0, peaked: bool = False, kernels: bool | None = None):
        self.g = torch.Generator().manual_seed(seed)
        self.attention = SparseAttention(Q_HEADS, KV_HEADS, DIM, BLOCK, SCALE, config, kernels=kernels)
        # One tensor like vLLM's LBNHC layer view: [blocks, tokens, heads, K|V].
        kv = torch.zeros(POOL, BLOCK, KV_HEADS, 2 * DIM)
        self.key_cache, self.value_cache = kv.split(DIM, dim=-1)
        self.sketch = self.attention.allocate_sketch(POOL, "cpu")
        self.order = torch.randperm(POOL, generator=self.g).to(torch.int32)
        self.table = torch.zeros(len(PROMPTS), 16, dtype=torch.int32)
        self.lens = [0] * len(PROMPTS)
        self.used = 0
        self.peaked = peaked
        self.direction = torch.randn(KV_HEADS, DIM, generator=self.g)

    def _slot(self, req: int, pos: int) -> int:
        if pos % BLOCK == 0:
            self.table[req, pos // BLOCK] = self.order[self.used]
            self.used += 1
        return int(self.table[req, pos // BLOCK]) * BLOCK + pos % BLOCK

    def keys(self, n: int, start: int) -> torch.Tensor:
        k = torch.randn(n, KV_HEADS, DIM, generator=self.g)
        if self.peaked:  # small noise, with strong keys at positions 0 and 200 (the heavy hitters DIPR must keep)
            k *= 0.05
            for pos in (0, 200):
                if start <= pos < start + n:
                    k[pos - start] = self.direction
        return k

    def step(self, new_tokens: list[int]):
        """Write one step's keys and values; return (query, key, value, batch)."""
        slots, keys = [], []
        for req, n in enumerate(new_tokens):
            slots += [self._slot(req, self.lens[req] + i) for i in range(n)]
            keys.append(self.keys(n, self.lens[req]))
            self.lens[req] += n
        total = sum(new_tokens)
        key = torch.cat(keys)
        value = torch.randn(total, KV_HEADS, DIM, generator=self.g)
        query = torch.randn(total, Q_HEADS, DIM, generator=self.g)
        if self.peaked:
            query = 4 * self.direction.repeat_interleave(Q_HEADS // KV_HEADS, 0)[None] + 0.1 * query
        starts = torch.tensor([0] + new_tokens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        lens = torch.tensor(self.lens, dtype=torch.int32)
        batch = PagedBatch(
            starts,
            starts,
            lens,
            lens,
            self.table.clone(),
            torch.tensor(slots, dtype=torch.int64),
            total,
            max(self.lens),
        )
        self.attention.write(key, value, self.key_cache, self.value_cache, self.sketch, batch.slot_mapping)
        return query, key, value, batch

    def attend(self, layer: int, query: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        out = torch.empty_like(query)
        return self.attention.attend(layer, query, self.key_cache, self.value_cache, self.sketch, batch, out)


def sparse(beta: float, **settings) -> SparseConfig:
    return SparseConfig(**{"beta": beta, "min_context": 0, "dense_layers": 0, "sink": 16, "local": 64, **settings})


def test_cache_write_stores_each_token_at_its_slot_in_the_plain_layout():
    engine = Engine(sparse(float("inf")))
    _, key, value, batch = engine.step(PROMPTS)
    for t, slot in enumerate(batch.slot_mapping.tolist()):
        assert torch.equal(engine.key_cache[slot // BLOCK, slot % BLOCK], key[t])
        assert torch.equal(engine.value_cache[slot // BLOCK, slot % BLOCK], value[t])


def test_cache_write_skips_padding_slots():
    cache = torch.zeros(2, 4, 1, 2), torch.zeros(2, 4, 1, 2)
    key = torch.ones(3, 1, 2)
    store_kv_reference(key, 2 * key, *cache, torch.tensor([5, -1, 6]))
    assert int((cache[0] != 0).any(-1).sum()) == 2 and torch.equal(cache[1][1, 2, 0], torch.tensor([2.0, 2.0]))


def test_the_sketch_is_the_sketch_of_every_stored_key_after_prefill_and_each_decode():
    engine = Engine(sparse(6.0))
    for new_tokens in (PROMPTS, [1, 1], *([[1, 1]] * 40)):  # request 1 crosses block boundaries
        engine.step(new_tokens)
        slots = torch.tensor(
            [int(engine.table[r, p // BLOCK]) * BLOCK + p % BLOCK for r, n in enumerate(engine.lens) for p in range(n)]
        )
        codes, scales = sketch_reference(engine.key_cache.flatten(0, 1)[slots])
        assert torch.equal(engine.sketch.codes.flatten(0, 1)[slots], codes)
        assert torch.equal(engine.sketch.scales.flatten(0, 1)[slots], scales)


def test_a_reused_slot_gets_its_new_keys_sketch():
    attention = SparseAttention(1, 1, 2, 4, 1.0)
    cache, sketch = torch.zeros(1, 4, 1, 2), attention.allocate_sketch(1, "cpu")
    attention.write(
        torch.tensor([[[100.0, -100.0]]]),
        torch.zeros(1, 1, 2),
        cache,
        torch.zeros_like(cache),
        sketch,
        torch.tensor([0]),
    )
    attention.write(
        torch.tensor([[[1.0, 2.0]]]), torch.zeros(1, 1, 2), cache, torch.zeros_like(cache), sketch, torch.tensor([0])
    )
    assert sketch.codes[0, 0, 0].tolist() == [64, 127] and sketch.scales[0, 0, 0] == pytest.approx(2 / 127)


def test_prefill_is_dense_and_causal():
    engine = Engine(sparse(1.0))
    query, key, value, batch = engine.step(PROMPTS)
    out = engine.attend(1, query, batch)
    for first, last in zip(batch.query_start_loc.tolist(), batch.query_start_loc.tolist()[1:]):
        q = query[first:last].transpose(0, 1)
        k = key[first:last].transpose(0, 1).repeat_interleave(2, 0)
        v = value[first:last].transpose(0, 1).repeat_interleave(2, 0)
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE)
        torch.testing.assert_close(out[first:last], expected.transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_decode_at_beta_inf_equals_the_dense_reference():
    engine = Engine(sparse(float("inf")))
    engine.step(PROMPTS)
    for _ in range(3):
        query, _, _, batch = engine.step([1, 1])
        out = engine.attend(1, query, batch)
        expected = dense_decode_reference(
            query, engine.key_cache, engine.value_cache, batch.block_table, batch.seq_lens, SCALE
        )
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    rows = engine.attention.figures.rows()
    assert rows[0]["block_fraction"] == 1.0 and rows[0]["token_fraction"] == 1.0


def test_finite_beta_attends_a_superset_of_the_exact_dipr_set_and_reads_fewer_blocks():
    engine = Engine(sparse(4.0, sink=4, local=8), peaked=True)
    engine.step(PROMPTS)
    query, _, _, batch = engine.step([1, 1])
    out = engine.attend(1, query, batch)
    sel = dipr_selection_reference(
        query, engine.key_cache, engine.sketch, batch.block_table, batch.seq_lens, 4.0, SCALE, 4, 8
    )
    for attended, exact in zip(sel.attended, sel.exact):
        assert bool((attended | ~exact).all()), "a token of the exact DIPR set was not attended"
    torch.testing.assert_close(
        out,
        masked_decode_reference(engine.value_cache, batch.block_table, batch.seq_lens, sel.logits, sel.attended),
        atol=1e-5,
        rtol=1e-5,
    )
    row = engine.attention.figures.rows()[0]
    # 301 tokens = 10 blocks: the sink block, the local block and block 6 (position 200) are read, 7 are not.
    assert row["block_fraction"] < 0.5 and row["token_fraction"] < 0.1


def test_the_triton_path_computes_what_the_pytorch_path_computes_step_by_step():
    """What the backend runs on a GPU (the Triton kernels, here in Triton's interpreter) against what it runs on CPU:
    a prefill, then steps mixing DIPR decodes (request 0, 300+ tokens), dense decodes (request 1, under
    ``min_context``) and a 20-token chunk of request 0."""
    config = sparse(4.0, sink=4, local=8, min_context=100)
    engines = [Engine(config, peaked=True, kernels=kernels) for kernels in (False, True)]
    for new_tokens in (PROMPTS, [1, 1], [20, 1], [1, 1]):
        (q0, _, _, batch0), (q1, _, _, batch1) = (engine.step(new_tokens) for engine in engines)
        for layer in (0, 1):
            torch.testing.assert_close(
                engines[1].attend(layer, q1, batch1), engines[0].attend(layer, q0, batch0), atol=1e-5, rtol=0
            )
        assert torch.equal(engines[1].sketch.codes, engines[0].sketch.codes)
        assert torch.equal(engines[1].sketch.scales, engines[0].sketch.scales)
    assert engines[1].attention.figures.rows() == engines[0].attention.figures.rows()
    assert engines[1].attention.figures.rows()[1]["block_fraction"] < 0.8


@pytest.mark.parametrize("settings", [{"dense_layers": 2}, {"min_context": 1000}])
def test_dense_layers_and_short_contexts_decode_densely(settings):
    engine = Engine(sparse(0.5, **settings), peaked=True)
    engine.step(PROMPTS)
    query, _, _, batch = engine.step([1, 1])
    out = engine.attend(1, query, batch)
    expected = dense_decode_reference(
        query, engine.key_cache, engine.value_cache, batch.block_table, batch.seq_lens, SCALE
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert engine.attention.figures.rows()[0]["block_fraction"] == 1.0


def test_sample_recovery_measures_the_kept_attention_mass_every_nth_dipr_decode():
    engine = Engine(sparse(4.0, sink=4, local=8, sample_recovery=2), peaked=True)
    engine.step(PROMPTS)
    for _ in range(3):  # DIPR decodes 0, 1, 2 of the layer: 0 and 2 are sampled, 2 sequences x 4 heads each
        query, _, _, batch = engine.step([1, 1])
        engine.attend(1, query, batch)
    row = engine.attention.figures.rows()[0]
    assert row["samples"] == 2 * 2 * Q_HEADS
    assert 0.99 < row["recovery_min"] <= row["recovery_mean"] <= 1.0


def test_a_step_is_split_once_per_kind_of_layer_and_again_after_new_settings(monkeypatch):
    """Dense and sparse layers share their step's sub-batches: the metadata is gathered (and sent to the device)
    once per step and kind, not per layer."""
    from kvreuse.sparse import paged

    calls = []
    real = paged.split_batch
    monkeypatch.setattr(paged, "split_batch", lambda *args: calls.append(args[1]) or real(*args))
    engine = Engine(sparse(4.0, dense_layers=2, min_context=100))
    engine.step(PROMPTS)
    query, _, _, batch = engine.step([1, 1])
    outs = [engine.attend(layer, query, batch) for layer in range(4)]
    assert calls == [True, False]  # layers 0-1 dense, 2-3 sparse
    plan = engine.attention._plan(batch, False)
    assert plan.dipr.reqs == (0,) and plan.dense.reqs == (1,)  # request 1 (46 tokens) is under min_context
    assert plan.dense_decodes == (1, 2, 46)  # one decode, its 2 blocks and 46 tokens
    engine.attention.configure(sparse(4.0, dense_layers=2, min_context=10))
    torch.testing.assert_close(engine.attend(2, query, batch), outs[2], atol=1e-5, rtol=0)
    assert calls == [True, False, False] and engine.attention._plan(batch, False).dipr.reqs == (0, 1)


def test_a_decode_kept_dense_by_min_context_is_said_once_per_setting_with_the_fix(caplog):
    engine = Engine(sparse(4.0, min_context=100))
    engine.step(PROMPTS)
    with caplog.at_level("INFO", logger="kvreuse.sparse"):
        for _ in range(2):
            query, _, _, batch = engine.step([1, 1])
            for layer in range(2):
                engine.attend(layer, query, batch)
        notes = [r.getMessage() for r in caplog.records if "min_context" in r.getMessage()]
        assert len(notes) == 1
        assert "min_context = 100" in notes[0] and "(first one: 46 tokens)" in notes[0]
        assert "KVREUSE_SPARSE_MIN_CONTEXT" in notes[0]
        engine.attention.configure(sparse(4.0, min_context=10))  # nothing under it now: nothing said
        query, _, _, batch = engine.step([1, 1])
        engine.attend(0, query, batch)
        assert len([r for r in caplog.records if "min_context" in r.getMessage()]) == 1
