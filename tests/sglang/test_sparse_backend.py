"""``--attention-backend kvreuse_sparse`` on SGLang's real KV pool, ``ForwardBatch`` and ``RadixAttention`` layers.

Shapes: head_dim 64, 4 query heads on 2 KV heads, two layers, ``--page-size 16``; a real ``MHATokenToKVPool`` and
``ReqToTokenPool`` on CPU. SGLang's ``ModelRunner`` cannot be built without a GPU, so a namespace hands the backend
the five things it reads from one (device, page size, the two pools, MLA or not); pages are handed out from a
shuffled list, as SGLang's paged allocator would (token ``t`` of a request in slot ``page * 16 + t % 16``). Every
forward goes through ``RadixAttention.__call__`` under SGLang's ``forward_context``, as in a model.

Two requests are prefilled (300 and 45 tokens, one extend batch) and then decoded token by token; the reference is
dense causal attention over the keys and values the test generated, or DIPR's selection of them, in fp32 and in
float64 (``tests/numerics.py``: outputs within the fp32 reference's own error of the exact ones, selections checked
for a margin).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from numerics import assert_close_to_exact, settled_dipr_selection, summation_orders
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

from kvreuse.errors import ConfigError
from kvreuse.kernels.dipr_decode import dipr_selection_reference, masked_decode_reference
from kvreuse.kernels.key_sketch import KeySketch, sketch_reference
from kvreuse.sglang.attention import SparseAttnBackend
from kvreuse.sparse.config import SparseConfig

PAGE, KV_HEADS, Q_HEADS, DIM, LAYERS, PAGES = 16, 2, 4, 64, 2, 48
SCALE = DIM**-0.5
PROMPTS = [300, 45]


def sparse(beta: float, **settings) -> SparseConfig:
    return SparseConfig(**{"beta": beta, "min_context": 0, "dense_layers": 0, "sink": 16, "local": 32, **settings})


class Engine:
    """SGLang's pools and batches for two requests, a stand-in only for the scheduler's page allocator."""

    def __init__(self, config: SparseConfig, page_size: int = PAGE, seed: int = 0, peaked: bool = False):
        self.g = torch.Generator().manual_seed(seed)
        self.page = page_size
        self.kv_pool = MHATokenToKVPool(
            size=PAGES * page_size,
            page_size=page_size,
            dtype=torch.float32,
            head_num=KV_HEADS,
            head_dim=DIM,
            layer_num=LAYERS,
            device="cpu",
            enable_memory_saver=False,
        )
        self.req_pool = ReqToTokenPool(size=4, max_context_len=1024, device="cpu", enable_memory_saver=False)
        self.runner = SimpleNamespace(
            device="cpu",
            page_size=page_size,
            req_to_token_pool=self.req_pool,
            token_to_kv_pool=self.kv_pool,
            use_mla_backend=False,
        )
        self.backend = SparseAttnBackend(self.runner, config)
        self.layers = [RadixAttention(Q_HEADS, DIM, SCALE, KV_HEADS, layer_id=i) for i in range(LAYERS)]
        self.free_pages = (torch.randperm(PAGES - 1, generator=self.g) + 1).tolist()  # page 0 holds slot 0 (padding)
        self.rows = [1, 2]  # req_pool_indices
        self.lens = [0, 0]
        self.peaked = peaked
        self.direction = torch.randn(KV_HEADS, DIM, generator=self.g)
        self.history = [[{"k": [], "v": []} for _ in PROMPTS] for _ in range(LAYERS)]

    def _slot(self, req: int, pos: int) -> int:
        row = self.req_pool.req_to_token[self.rows[req]]
        if pos % self.page == 0:
            page = self.free_pages.pop()
        else:
            page = int(row[pos - 1]) // self.page
        slot = page * self.page + pos % self.page
        row[pos] = slot
        return slot

    def batch(self, new_tokens: list[int]) -> ForwardBatch:
        slots = [self._slot(r, self.lens[r] + i) for r, n in enumerate(new_tokens) for i in range(n)]
        prefix = list(self.lens)
        self.lens = [a + b for a, b in zip(self.lens, new_tokens)]
        decode = all(n == 1 for n in new_tokens)
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
            batch_size=len(new_tokens),
            input_ids=torch.zeros(sum(new_tokens), dtype=torch.int64),
            req_pool_indices=torch.tensor(self.rows),
            seq_lens=torch.tensor(self.lens),
            out_cache_loc=torch.tensor(slots),
            seq_lens_sum=sum(self.lens),
            seq_lens_cpu=torch.tensor(self.lens),
        )
        if not decode:
            fb.extend_seq_lens = torch.tensor(new_tokens)
            fb.extend_prefix_lens = torch.tensor(prefix)
            fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu = list(new_tokens), prefix
        return fb

    def qkv(self, new_tokens: list[int], layer: int):
        total = sum(new_tokens)
        k = torch.randn(total, KV_HEADS, DIM, generator=self.g)
        v = torch.randn(total, KV_HEADS, DIM, generator=self.g)
        q = torch.randn(total, Q_HEADS, DIM, generator=self.g)
        if self.peaked:
            # Small noise keys, with strong ones at positions 0 (logit ~32) and 200 (~35): the heavy hitters, of
            # distinct strengths, so no two logits tie.
            k *= 0.05
            q = 4 * self.direction.repeat_interleave(Q_HEADS // KV_HEADS, 0)[None] + 0.1 * q
            at = 0
            for r, n in enumerate(new_tokens):
                for pos, strength in ((0, 1.0), (200, 1.1)):
                    if self.lens[r] - n <= pos < self.lens[r]:
                        k[at + pos - (self.lens[r] - n)] = strength * self.direction
                at += n
        at = 0
        for r, n in enumerate(new_tokens):
            self.history[layer][r]["k"].append(k[at : at + n])
            self.history[layer][r]["v"].append(v[at : at + n])
            at += n
        return q, k, v

    def step(self, new_tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One forward of every layer through SGLang's RadixAttention; (output, query) per layer."""
        fb = self.batch(new_tokens)
        self.backend.init_forward_metadata(fb)
        results = []
        with forward_context(ForwardContext(attn_backend=self.backend)):
            for i, layer in enumerate(self.layers):
                q, k, v = self.qkv(new_tokens, i)
                out = layer(q.reshape(len(q), -1), k.reshape(len(k), -1), v.reshape(len(v), -1), fb)
                results.append((out.view(-1, Q_HEADS, DIM), q))
        return results

    def dense(
        self,
        layer: int,
        q: torch.Tensor,
        new_tokens: list[int],
        dtype: torch.dtype = torch.float32,
        order: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Dense causal attention of the step's queries over the keys and values generated so far, in ``dtype``, the
        dot products summed in ``order`` (``numerics.summation_orders``)."""
        out, at = [], 0
        order = torch.arange(DIM) if order is None else order
        q = q.to(dtype)[..., order]
        for r, n in enumerate(new_tokens):
            keys = (
                torch.cat(self.history[layer][r]["k"]).to(dtype)[..., order].repeat_interleave(Q_HEADS // KV_HEADS, 1)
            )
            values = torch.cat(self.history[layer][r]["v"]).to(dtype).repeat_interleave(Q_HEADS // KV_HEADS, 1)
            total = len(keys)
            logits = torch.einsum("qhd,nhd->hqn", q[at : at + n], keys) * SCALE
            future = torch.arange(total)[None, :] > torch.arange(total - n, total)[:, None]
            weights = torch.softmax(logits.masked_fill(future[None], float("-inf")), -1)
            out.append(torch.einsum("hqn,nhd->qhd", weights, values))
            at += n
        return torch.cat(out)


def test_prefill_and_decode_with_infinite_beta_equal_dense_attention():
    engine = Engine(sparse(float("inf")))
    for new_tokens in (PROMPTS, [1, 1], [1, 1], [1, 1]):
        for layer, (out, q) in enumerate(engine.step(new_tokens)):
            dense = [engine.dense(layer, q, new_tokens, order=order) for order in summation_orders(DIM)]
            exact = engine.dense(layer, q, new_tokens, torch.float64)
            assert_close_to_exact(out, dense, exact, what=f"layer {layer}, step {new_tokens}")


def test_the_metadata_is_sglangs_batch_in_pages():
    engine = Engine(sparse(8.0))
    fb = engine.batch(PROMPTS)
    engine.backend.init_forward_metadata(fb)
    batch = engine.backend.forward_metadata
    assert batch.query_start_loc_cpu.tolist() == [0, 300, 345]
    assert batch.seq_lens_cpu.tolist() == [300, 45] and batch.max_seq_len == 300 and batch.num_actual_tokens == 345
    assert batch.block_table.shape == (2, 19) and batch.block_table.dtype == torch.int32
    rows = engine.req_pool.req_to_token
    for r, n in enumerate(PROMPTS):  # every token's slot is page * 16 + offset, the page from the block table
        pages = batch.block_table[r, torch.arange(n) // PAGE].long()
        assert torch.equal(pages * PAGE + torch.arange(n) % PAGE, rows[engine.rows[r], :n].long())
    assert torch.equal(batch.slot_mapping, fb.out_cache_loc)
    fb = engine.batch([1, 1])
    engine.backend.init_forward_metadata(fb)
    assert engine.backend.forward_metadata.query_start_loc_cpu.tolist() == [0, 1, 2]
    assert engine.backend.forward_metadata.seq_lens_cpu.tolist() == [301, 46]


def test_the_kv_and_the_key_sketch_are_written_into_sglangs_pool():
    engine = Engine(sparse(8.0))
    engine.step(PROMPTS)
    for layer in range(LAYERS):
        keys = engine.kv_pool.get_key_buffer(layer)
        slots = engine.req_pool.req_to_token[engine.rows[0], :300].long()
        assert torch.equal(keys[slots], torch.cat(engine.history[layer][0]["k"]))  # a copy: bitwise
        sketch = engine.backend.sketches[layer]
        codes, scales = sketch_reference(keys[slots])
        # A maximum, one correctly rounded division and a floor, computed alike: bitwise.
        assert torch.equal(sketch.codes.flatten(0, 1)[slots], codes)
        assert torch.equal(sketch.scales.flatten(0, 1)[slots], scales)


def dipr_expected(engine: Engine, layer: int, q: torch.Tensor, beta: float):
    """What the backend's DIPR decode of ``q`` must give in ``layer``: (the fp32 reference on the backend's views of
    SGLang's pool in each summation order, the float64 result over the exact selection, that selection, checked for a
    margin)."""
    key_cache, value_cache, sketch = engine.backend._caches(engine.layers[layer])
    batch = engine.backend.forward_metadata
    config = engine.backend.attention.config
    table, lens = batch.block_table, batch.seq_lens_cpu
    exact = settled_dipr_selection(q, key_cache, sketch, table, lens, beta, SCALE, config.sink, config.local)
    references = []
    for o in summation_orders(DIM):
        fp32 = dipr_selection_reference(
            q[..., o],
            key_cache[..., o],
            KeySketch(sketch.codes[..., o], sketch.scales),
            table,
            lens,
            beta,
            SCALE,
            config.sink,
            config.local,
        )
        assert all(torch.equal(a, b) for a, b in zip(fp32.attended, exact.attended))  # settled: fp32 decides alike
        references.append(masked_decode_reference(value_cache, table, lens, fp32.logits, fp32.attended))
    want = masked_decode_reference(value_cache.double(), table, lens, exact.logits, exact.attended)
    return references, want, exact


def test_decode_with_finite_beta_reads_fewer_tokens_and_keeps_the_heavy_hitters():
    engine = Engine(sparse(4.0), peaked=True)
    engine.step(PROMPTS)
    for _ in range(2):
        for layer, (out, q) in enumerate(engine.step([1, 1])):
            references, exact, selection = dipr_expected(engine, layer, q, 4.0)
            assert_close_to_exact(out, references, exact, what=f"layer {layer}")
            assert bool(selection.attended[0][:, [0, 200]].all())  # request 0's heavy hitters (200: outside the window)
    rows = {row["layer"]: row for row in engine.backend.attention.figures.rows()}
    assert set(rows) == {0, 1}
    assert all(row["token_fraction"] < 0.5 for row in rows.values())


def test_the_triton_kernel_reads_sglangs_pool_pages_as_the_backend_does():
    """The DIPR kernel (Triton's interpreter on CPU) on the backend's views of SGLang's pool gives the backend's
    decode output: the layout mapping holds for the kernel, not only for the PyTorch path."""
    from kvreuse.kernels.dipr_decode import DIPRDecode

    assert os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
    engine = Engine(sparse(6.0), peaked=True)
    engine.step(PROMPTS)
    fb = engine.batch([1, 1])
    engine.backend.init_forward_metadata(fb)
    q, k, v = engine.qkv([1, 1], 1)
    with forward_context(ForwardContext(attn_backend=engine.backend)):
        out = engine.layers[1](q.reshape(2, -1), k.reshape(2, -1), v.reshape(2, -1), fb).view(2, Q_HEADS, DIM)
    key_cache, value_cache, sketch = engine.backend._caches(engine.layers[1])
    batch = engine.backend.forward_metadata
    kernel = DIPRDecode(Q_HEADS, KV_HEADS, DIM, PAGE, scale=SCALE, sink=16, local=32)
    kernel.plan(batch.seq_lens.to(torch.int32), batch.block_table, max_seq_len=batch.max_seq_len)
    result = kernel.run(q.contiguous(), key_cache, value_cache, sketch, torch.full((2,), 6.0))
    references, exact, _ = dipr_expected(engine, 1, q, 6.0)
    assert_close_to_exact(out, references, exact, what="the backend")
    assert_close_to_exact(result, references, exact, what="the kernel")


def test_page_size_one_is_refused_naming_the_flag():
    with pytest.raises(ConfigError, match="--page-size"):
        Engine(sparse(8.0), page_size=1)


def test_unsupported_layers_and_cuda_graphs_are_refused():
    engine = Engine(sparse(8.0))
    window = RadixAttention(Q_HEADS, DIM, SCALE, KV_HEADS, layer_id=0, sliding_window_size=128)
    with pytest.raises(ConfigError, match="sliding windows"):
        engine.backend._attention(window)
    with pytest.raises(ConfigError, match="--disable-cuda-graph"):
        engine.backend.init_cuda_graph_state(8, 8)
