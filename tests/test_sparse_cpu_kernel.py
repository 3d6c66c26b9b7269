"""DIPR as a filter in front of vLLM's own CPU attention ops (``kvreuse.vllm.sparse.cpu_kernel``), without an engine.

The caches are CPU_ATTN's (LBHNC: per block and KV head a packed key tile, then a value tile) with the key sketches
after every block's K/V, as the backend lays them out on vLLM's CPU build; the kernel is vLLM's C++ op.
Shapes: head_dim 64, 6 query heads on 3 KV heads, block size 32 (CPU_ATTN's "vec" variant on this machine).
"""

from __future__ import annotations

import math

import pytest
import torch

from kvreuse.errors import ConfigError
from kvreuse.sparse.config import SparseConfig
from kvreuse.sparse.cpu_attention import dipr_read_blocks
from kvreuse.sparse.paged import PagedBatch, SparseAttention, split_batch
from kvreuse.sparse.pruned import prune_block_table
from kvreuse.vllm.sparse.backend import layer_cache, sketch_bytes
from kvreuse.vllm.sparse.cpu_kernel import CPUAttentionKernel

BLOCK, KV_HEADS, Q_HEADS, DIM, POOL = 32, 3, 6, 64, 48
GROUP = Q_HEADS // KV_HEADS
SCALE = DIM**-0.5


def vllm_view(fill: float = 0.0) -> torch.Tensor:
    """CPU_ATTN's per-layer view of the padded pages vLLM allocates for a layer, every byte ``fill`` at first."""
    row = KV_HEADS * 2 * DIM  # a token row's elements; vLLM pads a page by the sketch's rows (customize_spec)
    kv_elements = BLOCK * row
    pad = -(-sketch_bytes(BLOCK, KV_HEADS, DIM) // (4 * row)) * row
    pages = torch.full((POOL, kv_elements + pad), fill)
    return pages[:, :kv_elements].view(POOL, KV_HEADS, BLOCK, 2 * DIM)


def stock_caches(fill: float = 0.0):
    """Key and value caches and key sketch as the backend lays out the padded pages vLLM allocates for a layer
    (``layer_cache`` of ``vllm_view``)."""
    cache = layer_cache(vllm_view(fill))
    return cache.key_cache, cache.value_cache, cache.sketch


def kernel() -> CPUAttentionKernel:
    return CPUAttentionKernel(torch.float32, BLOCK, DIM, SCALE)


def test_vllm_picks_the_vec_variant_whose_key_tiles_kvreuse_knows():
    assert kernel().isa == "vec"  # the other tests read keys through plain_keys, which knows this variant


def test_the_op_stores_each_key_where_plain_keys_reads_it_and_values_in_plain_rows():
    key_cache, value_cache, _ = stock_caches()
    g = torch.Generator().manual_seed(0)
    slots = torch.randperm(POOL * BLOCK, generator=g)[:100]
    k, v = torch.randn(2, 100, KV_HEADS, DIM, generator=g)
    kernel().write(k, v, key_cache, value_cache, slots, torch.zeros(0, dtype=torch.int64))
    blocks, offsets = slots // BLOCK, slots % BLOCK
    assert torch.equal(kernel().plain_keys(key_cache)[blocks, offsets], k)
    assert torch.equal(value_cache[blocks, :, offsets], v)


class Engine:
    """Requests prefilled into a shuffled block pool, then decoded, through ``SparseAttention`` on the op."""

    def __init__(self, config: SparseConfig, prompts: list[int], seed: int = 0):
        self.g = torch.Generator().manual_seed(seed)
        self.key_cache, self.value_cache, self.sketch = stock_caches()
        self.attention = SparseAttention(Q_HEADS, KV_HEADS, DIM, BLOCK, SCALE, config, paged_kernel=kernel())
        self.order = torch.randperm(POOL, generator=self.g).to(torch.int32)
        self.table = torch.zeros(len(prompts), 24, dtype=torch.int32)
        self.lens = [0] * len(prompts)
        self.used = 0
        # strong keys at positions 0 and 200 along one direction per KV head, the rest small: DIPR prunes
        self.direction = torch.randn(KV_HEADS, DIM, generator=self.g)
        self.prompts = prompts

    def _slot(self, req: int, pos: int) -> int:
        if pos % BLOCK == 0:
            self.table[req, pos // BLOCK] = self.order[self.used]
            self.used += 1
        return int(self.table[req, pos // BLOCK]) * BLOCK + pos % BLOCK

    def step(self, new_tokens: list[int]):
        slots, keys = [], []
        for req, n in enumerate(new_tokens):
            start = self.lens[req]
            slots += [self._slot(req, start + i) for i in range(n)]
            k = 0.05 * torch.randn(n, KV_HEADS, DIM, generator=self.g)
            for pos, strength in ((0, 1.0), (200, 1.1)):
                if start <= pos < start + n:
                    k[pos - start] = strength * self.direction
            keys.append(k)
            self.lens[req] += n
        total = sum(new_tokens)
        key = torch.cat(keys)
        value = torch.randn(total, KV_HEADS, DIM, generator=self.g)
        query = 4 * self.direction.repeat_interleave(GROUP, 0)[None] + 0.1 * torch.randn(
            total, Q_HEADS, DIM, generator=self.g
        )
        starts = torch.tensor([0, *new_tokens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        lens = torch.tensor(self.lens, dtype=torch.int32)
        batch = PagedBatch(
            starts, starts, lens, lens, self.table.clone(), torch.tensor(slots), total, max(self.lens)
        )  # fmt: skip
        self.attention.write(key, value, self.key_cache, self.value_cache, self.sketch, batch.slot_mapping)
        return query, batch

    def attend(self, layer: int, query: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        out = torch.empty_like(query)
        return self.attention.attend(layer, query, self.key_cache, self.value_cache, self.sketch, batch, out)

    def stock(self, query: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        """The stock backend's call of the op over the whole batch."""
        op = kernel()
        out = torch.empty_like(query)
        schedule = op.schedule(batch.query_start_loc, batch.seq_lens, Q_HEADS, KV_HEADS)
        op.attend(
            query, self.key_cache, self.value_cache, out, batch.query_start_loc, batch.seq_lens, batch.block_table,
            schedule,
        )  # fmt: skip
        return out

    def tokens(self, req: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request ``req``'s keys and values ``[seq_len, kv, d]`` in float64, read back from the caches."""
        n = self.lens[req]
        blocks = self.table[req, : -(-n // BLOCK)].long()
        keys = kernel().plain_keys(self.key_cache)[blocks].reshape(-1, KV_HEADS, DIM)[:n]
        values = self.value_cache[blocks].transpose(1, 2).reshape(-1, KV_HEADS, DIM)[:n]
        return keys.double(), values.double()


def sparse(beta: float, **settings) -> SparseConfig:
    return SparseConfig(beta=beta, dense_layers=0, min_context=0, **settings)


@pytest.mark.parametrize("beta", [float("inf"), 4.0])
def test_prefill_is_the_stock_kernels_call_bit_for_bit(beta):
    engine = Engine(sparse(beta), [300, 45])
    query, batch = engine.step([300, 45])
    assert torch.equal(engine.attend(1, query, batch), engine.stock(query, batch))


def test_decodes_at_beta_inf_are_the_stock_kernels_call_bit_for_bit_and_read_everything():
    engine = Engine(sparse(float("inf")), [300, 45])
    engine.step([300, 45])
    for _ in range(3):
        query, batch = engine.step([1, 1])
        assert torch.equal(engine.attend(1, query, batch), engine.stock(query, batch))
    row = engine.attention.figures.rows()[0]
    assert row["block_fraction"] == 1.0 and row["token_fraction"] == 1.0 and row["dipr_decodes"] == 6


def assert_dipr_rows(engine: Engine, query: torch.Tensor, out: torch.Tensor, reqs: int) -> None:
    """The first ``reqs`` rows of ``out`` (one decode each, beta = 4, sink 4, local 8) attend every token of the
    blocks the reference decision reads for their KV heads and no other, and no key within beta of a query head's
    largest logit lies in a block its KV head skips."""
    for req in range(reqs):
        n = engine.lens[req]
        keys, values = engine.tokens(req)
        q = query[req].double().view(KV_HEADS, GROUP, DIM) * SCALE
        blocks = engine.table[req, : -(-n // BLOCK)].long()
        read, _ = dipr_read_blocks(q.float(), engine.sketch, blocks, n, 4.0, 4, 8)
        logits = torch.einsum("hgd,nhd->hgn", q, keys)
        near = logits >= logits.amax(-1, keepdim=True) - 4.0
        kept = read.repeat_interleave(BLOCK, dim=1)[:, None, :n]  # [kv, 1, n]
        assert bool((kept | ~near).all())
        weights = torch.softmax(logits.masked_fill(~kept, -math.inf), -1)
        expected = torch.einsum("hgn,nhd->hgd", weights, values).reshape(Q_HEADS, DIM)
        torch.testing.assert_close(out[req].double(), expected, rtol=1e-4, atol=1e-5)


def test_a_finite_beta_attends_every_token_of_the_blocks_each_kv_head_reads_and_no_other():
    engine = Engine(sparse(4.0, sink=4, local=8), [300, 450])
    engine.step([300, 450])
    query, batch = engine.step([1, 1])
    out = engine.attend(1, query, batch)
    assert_dipr_rows(engine, query, out, 2)
    row = engine.attention.figures.rows()[0]
    # per KV head, the sink block, block 6 (position 200) and the window's last blocks: 1 of 301 tokens' 10 blocks,
    # 2 of 451 tokens' 15 (the last 8 tokens, 443-450, span blocks 13 and 14)
    assert row["blocks_read"] == KV_HEADS * (3 + 4) and row["blocks_total"] == KV_HEADS * (10 + 15)
    # every token of the blocks read, per query head: two full blocks and the last one's 13 tokens of the first
    # sequence, three full blocks and the last one's 3 of the second
    assert row["tokens_attended"] == Q_HEADS * (2 * BLOCK + 13 + 3 * BLOCK + 3)
    assert row["tokens_total"] == Q_HEADS * (301 + 451) and row["dipr_decodes"] == 2


@pytest.mark.parametrize("decodes", [1, 2])
def test_dipr_decodes_read_in_place_give_the_rows_they_give_gathered(decodes):
    """A step of decodes only has the op read their queries and write their outputs in place (they are the batch's
    first rows); behind a request without new tokens they are gathered and scattered back: the same rows, bit for
    bit, and the reference's (one decode: each KV head a sequence of the op's call; two: the heads regrouped)."""
    prompts = [300, 450][:decodes]
    engine = Engine(sparse(4.0, sink=4, local=8), prompts)
    engine.step(prompts)
    query, batch = engine.step([1] * decodes)
    zero = torch.zeros(1, dtype=torch.int32)
    starts = torch.cat([zero, batch.query_start_loc])
    lens = torch.cat([zero + BLOCK, batch.seq_lens])
    table = torch.cat([torch.zeros_like(batch.block_table[:1]), batch.block_table])
    behind = PagedBatch(starts, starts, lens, lens, table, batch.slot_mapping, decodes, batch.max_seq_len)
    leading, behind_it = split_batch(batch, False, 0, BLOCK).dipr, split_batch(behind, False, 0, BLOCK).dipr
    assert leading is not None and leading.reqs == tuple(range(decodes))
    assert behind_it is not None and behind_it.reqs == tuple(range(1, decodes + 1))
    in_place = engine.attend(1, query, batch)
    assert torch.equal(in_place, engine.attend(1, query, behind))
    assert_dipr_rows(engine, query, in_place, decodes)


def test_a_step_with_a_prefill_and_dipr_decodes_gives_the_prefill_the_stock_kernels_rows():
    engine = Engine(sparse(4.0, sink=4, local=8), [300, 45])
    engine.step([300, 0])
    query, batch = engine.step([1, 45])
    out = engine.attend(1, query, batch)
    assert torch.equal(out[1:], engine.stock(query, batch)[1:])


def test_the_op_masks_keys_past_a_sequences_length_and_reads_no_block_past_its_table():
    """NaN in the keys of the last block's slots past the sequence and in every block after it leave the output
    finite, for the whole cache and for one KV head's view with a pruned table. (The op does multiply the last
    block's values past the length by zero weights, as the stock backend does: stale NaN there is not masked.)"""
    key_cache, value_cache, _ = stock_caches()
    g = torch.Generator().manual_seed(1)
    n = 45  # one full block and 13 tokens of the next
    k, v = torch.randn(2, n, KV_HEADS, DIM, generator=g)
    op = kernel()
    op.write(k, v, key_cache, value_cache, torch.arange(n) + 7 * BLOCK, torch.zeros(0, dtype=torch.int64))
    op.plain_keys(key_cache)[8, n - BLOCK :] = float("nan")
    key_cache[9:], value_cache[9:] = float("nan"), float("nan")
    q = torch.randn(1, Q_HEADS, DIM, generator=g)
    starts, lens = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
    table = torch.tensor([[7, 8, 9]], dtype=torch.int32)
    out = torch.empty_like(q)
    op.attend(q, key_cache, value_cache, out, starts, lens, table, op.schedule(starts, lens, Q_HEADS, KV_HEADS))
    logits = torch.einsum("hd,nhd->hn", q[0], k.repeat_interleave(GROUP, 1))
    expected = torch.einsum("hn,nhd->hd", torch.softmax(logits * SCALE, -1), v.repeat_interleave(GROUP, 1))
    torch.testing.assert_close(out[0], expected, rtol=1e-4, atol=1e-5)
    # KV head 1 alone, its table pruned to the partial last block
    head = torch.empty(1, GROUP, DIM)
    lens = torch.tensor([n - BLOCK], dtype=torch.int32)
    op.attend(
        q[:, GROUP : 2 * GROUP], key_cache[:, 1:2], value_cache[:, 1:2], head, starts, lens,
        torch.tensor([[8, 9]], dtype=torch.int32), op.schedule(starts, lens, GROUP, 1),
    )  # fmt: skip
    weights = torch.softmax(q[0, GROUP : 2 * GROUP] @ k[BLOCK:, 1].T * SCALE, -1)
    torch.testing.assert_close(head[0], weights @ v[BLOCK:, 1], rtol=1e-4, atol=1e-5)


def test_prune_block_table_lists_each_heads_read_blocks_in_order_and_counts_their_tokens():
    table = torch.tensor([[10, 11, 12, 13, 0], [20, 21, 22, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([120, 70])  # 4 blocks (the last holds 24 tokens), 3 blocks (the last holds 6)
    read = torch.zeros(2, 2, 5, dtype=torch.bool)
    read[0, 0, [0, 2, 3]] = True  # the partial last block kept: 2 full blocks + 24 tokens
    read[0, 1, [1]] = True  # one full block
    read[1, 0, [0, 1, 2]] = True  # everything
    read[1, 1, [2]] = True  # the last block alone: 6 tokens
    pruned = prune_block_table(read, table, lens, 32)
    assert pruned.block_table[0, 0, :3].tolist() == [10, 12, 13]
    assert pruned.block_table[1, 0, :1].tolist() == [11]
    assert pruned.block_table[0, 1, :3].tolist() == [20, 21, 22]
    assert pruned.block_table[1, 1, :1].tolist() == [22]
    assert pruned.seq_lens.tolist() == [[88, 70], [32, 6]]
    assert pruned.kept.tolist() == [[3, 3], [1, 1]]
    assert pruned.block_table.dtype == torch.int32 and pruned.block_table.is_contiguous()


@pytest.mark.parametrize("seed", range(3))
def test_prune_block_table_equals_a_row_by_row_construction_on_random_reads(seed):
    g = torch.Generator().manual_seed(seed)
    n, kv, width, block = 5, 3, 9, 16
    lens = torch.randint(1, width * block + 1, (n,), generator=g)
    table = torch.randint(0, 1000, (n, width), generator=g, dtype=torch.int32)
    read = torch.rand(n, kv, width, generator=g) < 0.4
    read &= torch.arange(width)[None, None, :] < ((lens + block - 1) // block)[:, None, None]
    pruned = prune_block_table(read, table, lens, block)
    for i in range(n):
        for h in range(kv):
            kept = read[i, h].nonzero().flatten()
            assert pruned.block_table[h, i, : len(kept)].tolist() == table[i, kept].tolist()
            tokens = sum(min(block, int(lens[i]) - int(b) * block) for b in kept)
            assert int(pruned.seq_lens[h, i]) == tokens and int(pruned.kept[h, i]) == len(kept)
            assert bool((pruned.block_table[h, i, len(kept) :] == table[i, 0]).all())


def test_a_layout_with_kv_heads_inside_token_rows_prunes_the_union_of_the_heads_blocks():
    """FlashAttention's and FlashInfer's paged layouts (a block's token rows hold every KV head) can skip a block
    only for all heads: the GPU path's table is ``prune_block_table`` of the union, one table per sequence."""
    table = torch.tensor([[4, 5, 6, 7]], dtype=torch.int32)
    read = torch.tensor([[[True, False, False, True], [False, False, True, True]]])  # [1 sequence, 2 KV heads, 4]
    pruned = prune_block_table(read.any(1, keepdim=True), table, torch.tensor([100]), 32)
    assert pruned.block_table.shape == (1, 1, 4) and pruned.block_table[0, 0, :3].tolist() == [4, 6, 7]
    assert pruned.seq_lens.tolist() == [[68]]  # two full blocks and the last block's 4 tokens


def test_a_write_zeroes_the_blocks_it_is_told_to_clear_before_storing():
    """Issue 26: the blocks a step starts without filling (``sketch_scan.write_sketch`` names them) are zeroed, K
    and V, before the op stores the step's tokens; other blocks keep what they hold."""
    key_cache, value_cache, _ = stock_caches(fill=float("nan"))
    k, v = torch.ones(2, 1, KV_HEADS, DIM)
    kernel().write(k, v, key_cache, value_cache, torch.tensor([3 * BLOCK]), torch.tensor([3]))
    assert float(value_cache[3, :, 0].sum()) == KV_HEADS * DIM and float(value_cache[3, :, 1:].abs().sum()) == 0
    assert float(key_cache[3].sum()) == KV_HEADS * DIM
    assert bool(value_cache[4].isnan().all())


def test_a_write_keeps_the_finite_kv_of_a_block_it_starts_and_zeroes_the_rest():
    """The module cache writes a block's slots out of order: a spliced module's K/V first, then the tokens it
    recomputes, from the block's slot 0. The write that starts the block must keep the module's K/V (finite) while
    it still zeroes what another request's overflow left (NaN, inf)."""
    key_cache, value_cache, _ = stock_caches(fill=float("nan"))
    op = kernel()
    g = torch.Generator().manual_seed(5)
    module_k, module_v = torch.randn(2, BLOCK - 8, KV_HEADS, DIM, generator=g)
    module_slots = 3 * BLOCK + 8 + torch.arange(BLOCK - 8)  # slots 8.. of block 3: the module (its 8 first recomputed)
    op.write(module_k, module_v, key_cache, value_cache, module_slots, torch.zeros(0, dtype=torch.int64))
    k, v = torch.randn(2, 4, KV_HEADS, DIM, generator=g)
    op.write(k, v, key_cache, value_cache, 3 * BLOCK + torch.arange(4), torch.tensor([3]))  # slots 0-3 of 8 recomputed
    keys, values = op.plain_keys(key_cache), op.plain_values(value_cache)
    assert torch.equal(keys[3, 8:], module_k) and torch.equal(values[3, 8:], module_v)
    assert torch.equal(keys[3, :4], k) and torch.equal(values[3, :4], v)
    assert float(keys[3, 4:8].abs().sum()) == 0 and float(values[3, 4:8].abs().sum()) == 0  # NaN, zeroed
    assert bool(values[4].isnan().all())  # a block the write did not start keeps what it holds


@pytest.mark.parametrize("garbage", [3e38, -3e38])
def test_finite_stale_slots_past_a_sequence_leave_the_op_bit_for_bit_unchanged(garbage):
    """Why zeroing what is not finite suffices: the op masks keys past a sequence and weighs their values by zero,
    so finite K/V there (even near the float's limit) change nothing."""
    g = torch.Generator().manual_seed(6)
    n = 45
    k, v = torch.randn(2, n, KV_HEADS, DIM, generator=g)
    q = torch.randn(1, Q_HEADS, DIM, generator=g)
    starts, lens = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
    table = torch.tensor([[7, 8]], dtype=torch.int32)
    op = kernel()
    outs = []
    for fill in (0.0, garbage):
        key_cache, value_cache, _ = stock_caches(fill=fill)
        op.write(k, v, key_cache, value_cache, torch.arange(n) + 7 * BLOCK, torch.zeros(0, dtype=torch.int64))
        out = torch.empty_like(q)
        op.attend(q, key_cache, value_cache, out, starts, lens, table, op.schedule(starts, lens, Q_HEADS, KV_HEADS))
        outs.append(out)
    assert bool(outs[0].isfinite().all()) and torch.equal(outs[0], outs[1])


def test_a_step_that_attends_by_position_reads_the_ops_tiles_through_plain_views():
    """The module cache's recompute step (tokens at their own positions, which the op cannot mask by): kvreuse's
    PyTorch attention over the op's cache, each query over the keys at or before its position."""
    engine = Engine(sparse(4.0), [300])
    engine.step([300])
    keys, values = engine.tokens(0)
    g = torch.Generator().manual_seed(7)
    positions = torch.tensor([10, 150, 299])
    query = torch.randn(3, Q_HEADS, DIM, generator=g)
    starts, lens = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([300], dtype=torch.int32)
    batch = PagedBatch(
        starts, starts, lens, lens, engine.table.clone(), torch.full((3,), -1), 3, 300, query_positions=positions
    )  # fmt: skip
    out = engine.attend(1, query, batch)
    for i, p in enumerate(positions.tolist()):
        torch.testing.assert_close(out[i].double(), positional(query[i], keys, values, p), rtol=1e-4, atol=1e-5)


def positional(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: int) -> torch.Tensor:
    """Float64 attention of one token's ``query[q_heads, d]`` over the keys at or before ``position``."""
    q = query.double().view(KV_HEADS, GROUP, DIM) * SCALE
    weights = torch.softmax(torch.einsum("hgd,nhd->hgn", q, keys[: position + 1]), -1)
    return torch.einsum("hgn,nhd->hgd", weights, values[: position + 1]).reshape(Q_HEADS, DIM)


@pytest.mark.parametrize("beta", [float("inf"), 4.0])
def test_a_step_mixing_moved_tokens_and_decodes_gives_the_decodes_the_ops_rows(beta):
    """The module cache's recompute shares a step with other requests' decodes (continuous batching): the moved
    requests attend by position in PyTorch, one with a single token too (a recompute token, not a decode), and the
    decode gets what the op gives it in a step of its own, bit for bit."""
    engine = Engine(sparse(beta, sink=4, local=8), [300, 400, 350])
    engine.step([300, 400, 350])
    query, alone = engine.step([1, 0, 0])  # request 0 decodes position 300
    g = torch.Generator().manual_seed(9)
    moved = torch.randn(4, Q_HEADS, DIM, generator=g)
    positions = torch.tensor([300, 20, 150, 399, 50])  # request 1: three moved tokens; request 2: one
    starts = torch.tensor([0, 1, 4, 5], dtype=torch.int32)
    lens = torch.tensor(engine.lens, dtype=torch.int32)
    step = PagedBatch(
        starts, starts, lens, lens, engine.table.clone(), torch.full((5,), -1), 5, max(engine.lens),
        query_positions=positions,
    )  # fmt: skip
    out = engine.attend(1, torch.cat([query[:1], moved]), step)
    assert torch.equal(out[0], engine.attend(1, query[:1], alone)[0])
    for row, (req, position) in enumerate(zip([1, 1, 1, 2], [20, 150, 399, 50]), start=1):
        keys, values = engine.tokens(req)
        expected = positional(moved[row - 1], keys, values, position)
        torch.testing.assert_close(out[row].double(), expected, rtol=1e-4, atol=1e-5)


def test_dipr_decodes_on_a_variant_whose_key_tiles_kvreuse_does_not_read(monkeypatch):
    """Without the module cache nothing but sampled recovery reads the op's tiles, so DIPR decodes run on any of
    CPU_ATTN's variants: a step reads no plain view it does not need."""
    from kvreuse.vllm.sparse import cpu_kernel

    engine = Engine(sparse(4.0, sink=4, local=8, sample_recovery=0), [300, 450])
    engine.step([300, 450])
    query, batch = engine.step([1, 1])
    known = engine.attend(1, query, batch)
    monkeypatch.setattr(cpu_kernel, "TRANSPOSED_KEY_TILES", ())
    assert not engine.attention.paged_kernel.knows_key_tiles
    assert torch.equal(engine.attend(1, query, batch), known)


def test_the_module_cache_reads_every_key_and_value_the_op_stored_through_plain_kv(monkeypatch):
    from kvreuse.vllm.sparse import backend

    view = vllm_view()
    cache = layer_cache(view)
    attention = SparseAttention(Q_HEADS, KV_HEADS, DIM, BLOCK, SCALE, sparse(4.0), paged_kernel=kernel())
    monkeypatch.setattr(backend, "sparse_attention", lambda: attention)
    g = torch.Generator().manual_seed(8)
    slots = torch.randperm(POOL * BLOCK, generator=g)[:100]
    k, v = torch.randn(2, 100, KV_HEADS, DIM, generator=g)
    attention.write(k, v, cache.key_cache, cache.value_cache, cache.sketch, slots)
    keys, values = backend.plain_kv(view)
    assert torch.equal(keys[slots // BLOCK, slots % BLOCK], k) and torch.equal(values[slots // BLOCK, slots % BLOCK], v)
    monkeypatch.setattr(backend, "sparse_attention", lambda: None)
    with pytest.raises(ConfigError, match="CPU_ATTN's tiles"):
        backend.plain_kv(view)


def test_the_op_over_head_tiles_equals_one_call_per_kv_head():
    """``attend_pruned``'s single call (every (KV head, sequence) pair over ``head_tiles``) gives what one call per
    KV head on ``key_cache[:, h : h + 1]`` gives, bit for bit, on random pruned tables of the backend's layout."""
    from kvreuse.vllm.sparse.cpu_kernel import head_tiles

    key_cache, value_cache, _ = stock_caches()
    g = torch.Generator().manual_seed(3)
    op = kernel()
    k, v = torch.randn(2, POOL * BLOCK, KV_HEADS, DIM, generator=g)
    op.write(k, v, key_cache, value_cache, torch.arange(POOL * BLOCK), torch.zeros(0, dtype=torch.int64))
    assert head_tiles(key_cache).shape == (POOL * KV_HEADS, 1, BLOCK, DIM)
    n, width = 2, 20
    read = torch.rand(n, KV_HEADS, width, generator=g) < 0.5
    read[..., -1] = True
    table = torch.stack([torch.randperm(POOL, generator=g)[:width] for _ in range(n)]).to(torch.int32)
    pruned = prune_block_table(read, table, torch.tensor([width * BLOCK - 5] * n), BLOCK)
    q = torch.randn(n, Q_HEADS, DIM, generator=g)
    out = torch.empty_like(q)
    op.attend_pruned(q, key_cache, value_cache, out, pruned)
    starts = torch.arange(n + 1, dtype=torch.int32)
    for h in range(KV_HEADS):
        head = torch.empty(n, GROUP, DIM)
        lens, rows = pruned.seq_lens[h], pruned.block_table[h]
        op.attend(
            q[:, h * GROUP : (h + 1) * GROUP], key_cache[:, h : h + 1], value_cache[:, h : h + 1], head, starts,
            lens, rows, op.schedule(starts, lens, GROUP, 1),
        )  # fmt: skip
        assert torch.equal(out[:, h * GROUP : (h + 1) * GROUP], head)
