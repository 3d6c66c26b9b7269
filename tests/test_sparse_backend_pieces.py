"""The sparse attention backend's pieces without an engine (``kvreuse.sparse.paged``), on vLLM's plain layout.

Shapes are the small test model's: head_dim 64, 4 query heads on 2 KV heads, block size 32; a shuffled block pool;
two requests prefilled (300 and 45 tokens) and then decoded token by token, as vLLM's batches carry them. Outputs
are compared with the same step computed in float64, selections checked for a margin first (``numerics.py``).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from numerics import DEVICE, assert_close_to_exact, settled_dipr_selection, summation_orders

from kvreuse.kernels.dipr_decode import dense_decode_reference, dipr_selection_reference, masked_decode_reference
from kvreuse.kernels.key_sketch import KeySketch, sketch_reference
from kvreuse.kernels.paged_write import store_kv_reference
from kvreuse.sparse.config import SparseConfig
from kvreuse.sparse.paged import PagedBatch, SparseAttention

BLOCK, KV_HEADS, Q_HEADS, DIM, POOL = 32, 2, 4, 64, 40
SCALE = DIM**-0.5
PROMPTS = [300, 45]


class Engine:
    """A stand-in for vLLM's model runner: a block pool, block tables, slot mappings and batches."""

    def __init__(
        self,
        config: SparseConfig,
        seed: int = 0,
        peaked: bool = False,
        kernels: bool | None = None,
        dtype: torch.dtype = torch.float32,
        coordinates: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
    ):
        """``dtype`` float64 (with ``kernels`` off) gives the exact result of what a float32 engine of the same seed
        computes: the same data, drawn in float32 and widened, through the same PyTorch path. ``coordinates`` (one of
        ``numerics.summation_orders``) stores queries and keys with their head_dim coordinates in that order: the
        same attention, its dot products summed in another order. ``device``: where the caches, the step's tensors and
        the batch's device metadata live (its host copies stay on the CPU), as in a model runner on that device."""
        self.g = torch.Generator().manual_seed(seed)
        self.dtype, self.device = dtype, device
        self.coordinates = torch.arange(DIM) if coordinates is None else coordinates
        self.attention = SparseAttention(Q_HEADS, KV_HEADS, DIM, BLOCK, SCALE, config, kernels=kernels)
        # One tensor like vLLM's LBNHC layer view: [blocks, tokens, heads, K|V].
        kv = torch.zeros(POOL, BLOCK, KV_HEADS, 2 * DIM, dtype=dtype, device=device)
        self.key_cache, self.value_cache = kv.split(DIM, dim=-1)
        self.sketch = self.attention.allocate_sketch(POOL, device)
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
        if self.peaked:
            # Small noise, with strong keys at positions 0 (logit ~32, a sink) and 200 (~35, stronger than any window
            # key): the heavy hitters DIPR must keep, of distinct strengths, so no two logits tie.
            k *= 0.05
            for pos, strength in ((0, 1.0), (200, 1.1)):
                if start <= pos < start + n:
                    k[pos - start] = strength * self.direction
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
        key, query = key[..., self.coordinates], query[..., self.coordinates]
        key, value, query = (t.to(self.dtype).to(self.device) for t in (key, value, query))
        starts = torch.tensor([0] + new_tokens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        lens = torch.tensor(self.lens, dtype=torch.int32)
        batch = PagedBatch(
            starts.to(self.device),
            starts,
            lens.to(self.device),
            lens,
            self.table.clone().to(self.device),  # a copy: later steps fill the engine's own table
            torch.tensor(slots, dtype=torch.int64, device=self.device),
            total,
            max(self.lens),
        )
        self.attention.write(key, value, self.key_cache, self.value_cache, self.sketch, batch.slot_mapping)
        return query, key, value, batch

    def attend(self, layer: int, query: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        out = torch.empty_like(query)
        return self.attention.attend(layer, query, self.key_cache, self.value_cache, self.sketch, batch, out)

    def settled_dipr(self, query: torch.Tensor, batch: PagedBatch):
        """The exact selection of the step's DIPR decodes (sparse layers), checked for a margin; None if none."""
        sub = self.attention._plan(batch, False).dipr
        if sub is None:
            return None
        config = self.attention.config
        return settled_dipr_selection(
            query[sub.query_starts.long()],
            self.key_cache,
            self.sketch,
            sub.block_table,
            sub.seq_lens,
            config.beta,
            SCALE,
            config.sink,
            config.local,
        )


def dense(engine: Engine, query: torch.Tensor, batch: PagedBatch) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Dense decode attention of the batch's requests by the reference: fp32 in each summation order, and float64
    (exact)."""
    table, lens, keys, values = batch.block_table, batch.seq_lens, engine.key_cache, engine.value_cache
    references = [
        dense_decode_reference(query[..., o], keys[..., o], values, table, lens, SCALE) for o in summation_orders(DIM)
    ]
    return references, dense_decode_reference(query.double(), keys.double(), values.double(), table, lens, SCALE)


def sparse(beta: float, **settings) -> SparseConfig:
    return SparseConfig(**{"beta": beta, "min_context": 0, "dense_layers": 0, "sink": 16, "local": 64, **settings})


def test_cache_write_stores_each_token_at_its_slot_in_the_plain_layout():
    engine = Engine(sparse(float("inf")))
    _, key, value, batch = engine.step(PROMPTS)
    for t, slot in enumerate(batch.slot_mapping.tolist()):  # a copy: bitwise
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
        attention = partial(torch.nn.functional.scaled_dot_product_attention, is_causal=True, scale=SCALE)
        expected = [attention(q[..., o], k[..., o], v).transpose(0, 1) for o in summation_orders(DIM)]
        exact = attention(q.double(), k.double(), v.double()).transpose(0, 1)
        assert_close_to_exact(out[first:last], expected, exact)


def test_decode_at_beta_inf_equals_the_dense_reference():
    engine = Engine(sparse(float("inf")))
    engine.step(PROMPTS)
    for _ in range(3):
        query, _, _, batch = engine.step([1, 1])
        out = engine.attend(1, query, batch)
        assert_close_to_exact(out, *dense(engine, query, batch))
    rows = engine.attention.figures.rows()
    assert rows[0]["block_fraction"] == 1.0 and rows[0]["token_fraction"] == 1.0


def test_finite_beta_attends_a_superset_of_the_exact_dipr_set_and_reads_fewer_blocks():
    engine = Engine(sparse(4.0, sink=4, local=8), peaked=True)
    engine.step(PROMPTS)
    query, _, _, batch = engine.step([1, 1])
    out = engine.attend(1, query, batch)
    sel = engine.settled_dipr(query, batch)  # min_context 0: both requests decode with DIPR
    for attended, exact in zip(sel.attended, sel.exact):
        assert bool((attended | ~exact).all()), "a token of the exact DIPR set was not attended"
    table, lens, values = batch.block_table, batch.seq_lens, engine.value_cache
    references = []
    for o in summation_orders(DIM):
        fp32 = dipr_selection_reference(
            query[..., o],
            engine.key_cache[..., o],
            KeySketch(engine.sketch.codes[..., o], engine.sketch.scales),
            table,
            lens,
            4.0,
            SCALE,
            4,
            8,
        )
        assert all(torch.equal(a, b) for a, b in zip(fp32.attended, sel.attended))  # settled: fp32 decides alike
        references.append(masked_decode_reference(values, table, lens, fp32.logits, fp32.attended))
    exact = masked_decode_reference(values.double(), table, lens, sel.logits, sel.attended)
    assert_close_to_exact(out, references, exact)
    row = engine.attention.figures.rows()[0]
    # 301 tokens = 10 blocks: the sink block, the local block and block 6 (position 200) are read, 7 are not.
    assert row["block_fraction"] < 0.5 and row["token_fraction"] < 0.1


def test_the_triton_path_computes_what_the_pytorch_path_computes_step_by_step():
    """What the backend runs on a GPU (the Triton kernels, on CUDA tensors where there is a GPU, else in Triton's
    interpreter) against what it runs on CPU: a prefill, then steps mixing DIPR decodes (request 0, 300+ tokens),
    dense decodes (request 1, under ``min_context``) and a 20-token chunk of request 0. Both against the same steps
    in float64: the Triton path lands as close to the exact outputs as the PyTorch path does; its selections,
    counted in the figures, are the same, every DIPR decision having a margin."""
    config = sparse(4.0, sink=4, local=8, min_context=100)
    triton = Engine(config, peaked=True, kernels=True, device=DEVICE)
    exact = Engine(config, peaked=True, kernels=False, dtype=torch.float64)
    pytorch = [Engine(config, peaked=True, kernels=False, coordinates=o) for o in summation_orders(DIM)]
    for new_tokens in (PROMPTS, [1, 1], [20, 1], [1, 1]):
        steps = [engine.step(new_tokens) for engine in (triton, exact, *pytorch)]
        exact.settled_dipr(steps[1][0], steps[1][3])
        for layer in (0, 1):
            kernels, want, *references = (
                engine.attend(layer, query, batch)
                for engine, (query, _, _, batch) in zip((triton, exact, *pytorch), steps)
            )
            assert_close_to_exact(kernels, references, want, what=f"Triton path, layer {layer}, step {new_tokens}")
        # The same keys (pytorch[0] keeps the coordinates in order), each sketched by a maximum, one correctly rounded
        # division and a floor: bitwise.
        assert torch.equal(triton.sketch.codes.cpu(), pytorch[0].sketch.codes)
        assert torch.equal(triton.sketch.scales.cpu(), pytorch[0].sketch.scales)
    # Counts of blocks and tokens; their decisions are settled, so they are equal in every implementation.
    rows = triton.attention.figures.rows()
    assert all(rows == engine.attention.figures.rows() for engine in (exact, *pytorch))
    assert rows[1]["block_fraction"] < 0.8


@pytest.mark.parametrize("settings", [{"dense_layers": 2}, {"min_context": 1000}])
def test_dense_layers_and_short_contexts_decode_densely(settings):
    engine = Engine(sparse(0.5, **settings), peaked=True)
    engine.step(PROMPTS)
    query, _, _, batch = engine.step([1, 1])
    out = engine.attend(1, query, batch)
    assert_close_to_exact(out, *dense(engine, query, batch))
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
    again = engine.attend(2, query, batch)
    assert torch.equal(again[0], outs[2][0])  # request 0: DIPR under both settings, the same operations in order
    # Request 1 moves from the dense path to DIPR, which keeps all its 46 tokens (decisions settled): dense again.
    assert engine.settled_dipr(query, batch).attended[1].sum(1).tolist() == [46] * Q_HEADS
    references, exact = dense(engine, query, batch)
    assert_close_to_exact(again[1:], [r[1:] for r in references], exact[1:])
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


@pytest.mark.parametrize("beta", [float("inf"), 4.0])
def test_a_single_token_moved_to_its_own_position_attends_by_position_not_as_a_decode(beta):
    """The module cache may schedule one recomputed token of a spliced run in a step: one new token, but at its own
    position inside the run, not the sequence's last. It must attend the keys at or before that position (it was
    taken for a DIPR decode over the whole sequence, later keys included), and a decode beside it stays a decode."""
    engine = Engine(sparse(beta))
    engine.step(PROMPTS)
    query, _, _, decode = engine.step([1, 0])  # request 0 decodes position 300
    moved = torch.randn(1, Q_HEADS, DIM, generator=engine.g)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32)
    lens = torch.tensor(engine.lens, dtype=torch.int32)
    step = PagedBatch(
        starts, starts, lens, lens, engine.table.clone(), torch.full((2,), -1), 2, max(engine.lens),
        query_positions=torch.tensor([300, 20]),  # request 1 (45 tokens): one token moved to position 20
    )  # fmt: skip
    plan = engine.attention._plan(step, False)
    assert plan.dipr is not None and plan.dipr.reqs == (0,) and plan.moved is not None and plan.moved.reqs == (1,)
    out = engine.attend(1, torch.cat([query, moved]), step)
    assert torch.equal(out[0], engine.attend(1, query, decode)[0])
    blocks = engine.table[1, :1].long()  # position 20 lies in the request's first block
    keys = engine.key_cache[blocks].reshape(-1, KV_HEADS, DIM)[:21].double()
    values = engine.value_cache[blocks].reshape(-1, KV_HEADS, DIM)[:21].double()
    q = moved[0].double().view(KV_HEADS, -1, DIM) * SCALE
    weights = torch.softmax(torch.einsum("hgd,nhd->hgn", q, keys), -1)
    expected = torch.einsum("hgn,nhd->hgd", weights, values).reshape(Q_HEADS, DIM)
    torch.testing.assert_close(out[1].double(), expected, rtol=1e-4, atol=1e-5)
