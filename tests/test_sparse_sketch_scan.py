"""The key sketch's compiled CPU work (``kvreuse.sparse.sketch_scan``) against its PyTorch references.

``write_sketch`` stores exactly ``sketch_reference``'s codes and scales and names the blocks a write starts without
filling; ``prune_by_sketch`` gives the pruned tables of ``prune_block_table(dipr_read_blocks(...))`` on random keys
and on SmolLM2-135M's real keys (``tests/data/smollm2_keys.pt``), and never drops a key within beta of the largest
logit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvreuse.kernels.key_sketch import KeySketch, sketch_reference
from kvreuse.sparse.cpu_attention import dipr_read_blocks
from kvreuse.sparse.pruned import PrunedTables, prune_block_table
from kvreuse.sparse.sketch_scan import prune_by_sketch, warm_up, write_sketch

FIXTURE = Path(__file__).resolve().parent / "data" / "smollm2_keys.pt"
BLOCK, KV_HEADS, GROUP, DIM = 32, 3, 3, 64


def reference_tables(q, sketch, table, lens, beta, sink, local) -> PrunedTables:
    """``prune_block_table`` of ``dipr_read_blocks``, sequence by sequence."""
    read = torch.zeros(len(lens), q.shape[1], table.shape[1], dtype=torch.bool)
    for i, n in enumerate(lens.tolist()):
        blocks = -(-n // BLOCK)
        read[i, :, :blocks] = dipr_read_blocks(q[i], sketch, table[i, :blocks].long(), n, beta, sink, local)[0]
    return prune_block_table(read, table, lens, BLOCK)


def assert_same_tables(got: PrunedTables, want: PrunedTables) -> None:
    assert torch.equal(got.block_table, want.block_table)
    assert torch.equal(got.seq_lens, want.seq_lens)
    assert torch.equal(got.kept, want.kept)


def test_write_sketch_stores_the_references_codes_and_scales_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    pool = 40
    keys = torch.randn(pool * BLOCK, KV_HEADS, DIM, generator=g) * torch.rand(pool * BLOCK, KV_HEADS, 1, generator=g)
    keys[5, 1] = 0.0  # a zero key: scale 0, codes 0
    keys[9, 2, :3] = torch.tensor([1e-30, -3e4, 0.5])  # extreme magnitudes in one key
    slots = torch.randperm(pool * BLOCK, generator=g)
    sketch = KeySketch.allocate(pool, BLOCK, KV_HEADS, DIM, "cpu")
    write_sketch(keys, sketch, slots, BLOCK)
    codes, scales = sketch_reference(keys)
    assert torch.equal(sketch.codes.view(-1, KV_HEADS, DIM)[slots], codes)
    assert torch.equal(sketch.scales.view(-1, KV_HEADS)[slots], scales)


def test_write_sketch_skips_padding_slots():
    sketch = KeySketch.allocate(2, BLOCK, KV_HEADS, DIM, "cpu")
    write_sketch(torch.ones(3, KV_HEADS, DIM), sketch, torch.tensor([-1, 33, -1]), BLOCK)
    assert int((sketch.scales != 0).sum()) == KV_HEADS and bool((sketch.scales[1, 1] > 0).all())


def test_write_sketch_names_the_blocks_it_starts_without_filling():
    """Issue 26: a freed block's old values past a new request's tokens must not reach CPU_ATTN's kernel (which
    weighs them with 0: ``0 * NaN`` is NaN), so the write names the blocks started (slot 0 written) and not filled,
    which the cache write zeroes first; a block filled in the step, one continued from an earlier step and padding
    slots (-1) are not named."""
    block = 4
    sketch = KeySketch.allocate(8, block, KV_HEADS, DIM, "cpu")
    slots = torch.tensor([8, 9, 10, 11, 12, 13, -1, 21, 24])  # block 2 filled, 3 started, 5 continued, 6 started
    assert write_sketch(torch.randn(9, KV_HEADS, DIM), sketch, slots, block).tolist() == [3, 6]
    assert write_sketch(torch.randn(2, KV_HEADS, DIM), sketch, torch.tensor([-1, -1]), block).tolist() == []


@pytest.mark.parametrize("beta", [0.5, 2.0, 4.0, 8.0])
def test_prune_by_sketch_equals_the_pytorch_reference_on_random_keys(beta):
    """Four sequences over a shuffled pool (one shorter than the window, one ending mid-block), keys of mixed
    magnitudes and a few strong ones, so every beta keeps a different share of the blocks."""
    g = torch.Generator().manual_seed(1)
    pool, width = 300, 100
    keys = torch.randn(pool * BLOCK, KV_HEADS, DIM, generator=g) * torch.rand(pool * BLOCK, KV_HEADS, 1, generator=g)
    keys[torch.randint(0, pool * BLOCK, (40,), generator=g)] *= 6
    sketch = KeySketch.allocate(pool, BLOCK, KV_HEADS, DIM, "cpu")
    write_sketch(keys, sketch, torch.arange(pool * BLOCK), BLOCK)
    table = torch.stack([torch.randperm(pool, generator=g)[:width] for _ in range(4)]).to(torch.int32)
    lens = torch.tensor([3000, 1000, 40, 2999], dtype=torch.int32)
    q = 0.3 * torch.randn(4, KV_HEADS, GROUP, DIM, generator=g)
    got = prune_by_sketch(q, sketch, table, lens, beta, 4, 16)
    assert_same_tables(got, reference_tables(q, sketch, table, lens, beta, 4, 16))
    assert 0 < int(got.kept.sum()) < KV_HEADS * int(((lens + BLOCK - 1) // BLOCK).sum())  # it prunes, not all


@pytest.fixture(scope="module")
def real():
    return torch.load(FIXTURE)


def real_step(real, layer_index: int, step_index: int):
    """One decode step of one layer on the fixture's keys, in a shuffled block pool: the scaled query ``[1, kv, g,
    d]``, the keys ``[n, kv, d]``, the sketch, the block table and the length."""
    position = int(real["query_positions"][step_index])
    keys = real["keys"][layer_index][: position + 1].float()
    n = len(keys)
    blocks = -(-n // BLOCK)
    g = torch.Generator().manual_seed(step_index)
    table = torch.randperm(blocks + 7, generator=g)[:blocks].to(torch.int32)
    sketch = KeySketch.allocate(blocks + 7, BLOCK, KV_HEADS, DIM, "cpu")
    slots = (table.long()[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:n]
    write_sketch(keys, sketch, slots, BLOCK)
    q = real["queries"][layer_index][step_index].float().view(1, KV_HEADS, GROUP, DIM) * real["scale"]
    return q, keys, sketch, table[None], torch.tensor([n], dtype=torch.int32)


@pytest.mark.parametrize("beta", [1.0, 4.0, 8.0])
def test_prune_by_sketch_equals_the_pytorch_reference_on_real_keys(real, beta):
    for layer_index in range(len(real["layers"])):
        for step_index in range(len(real["query_positions"])):
            q, _, sketch, table, lens = real_step(real, layer_index, step_index)
            got = prune_by_sketch(q, sketch, table, lens, beta, 16, 64)
            assert_same_tables(got, reference_tables(q, sketch, table, lens, beta, 16, 64))


@pytest.mark.parametrize("beta", [1.0, 2.0, 4.0, 8.0])
def test_prune_by_sketch_keeps_every_key_within_beta_of_the_largest_logit_on_real_keys(real, beta):
    for layer_index in range(len(real["layers"])):
        for step_index in range(len(real["query_positions"])):
            q, keys, sketch, table, lens = real_step(real, layer_index, step_index)
            pruned = prune_by_sketch(q, sketch, table, lens, beta, 16, 64)
            logits = torch.einsum("hgd,nhd->hgn", q[0].double(), keys.double())  # [kv, g, n]
            near = (logits >= logits.amax(-1, keepdim=True) - beta).any(1)  # [kv, n]: some query head needs it
            position_block = table[0].long()[torch.arange(len(keys)) // BLOCK]  # each key's block id
            for h in range(KV_HEADS):
                kept = set(pruned.block_table[h, 0, : int(pruned.kept[h, 0])].tolist())
                needed = set(position_block[near[h]].tolist())
                assert needed <= kept, (real["layers"][layer_index], step_index, h)


def test_warm_up_compiles_under_the_default_dtype_vllm_builds_a_bfloat16_model_with():
    """vLLM builds the attention layers (and so calls ``warm_up``) with torch's default dtype set to the model's."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        warm_up(2, 64, 32)
    finally:
        torch.set_default_dtype(before)


@pytest.mark.parametrize("top_pages", [1, 3, 8])
def test_top_pages_keeps_the_window_and_the_blocks_whose_bounds_reach_furthest_above_tau(real, top_pages):
    """``sparse.top_pages`` (approximate): of the blocks exact DIPR reads outside the window, each KV head keeps the
    ``top_pages`` whose largest sketch upper bound lies furthest above ``tau`` (the bounds computed in float64 here,
    by the reference's formula), and every window block."""
    from kvreuse.kernels.key_sketch import CODE_SLACK

    sink, local, beta = 16, 64, 8.0
    for layer_index in range(len(real["layers"])):
        q, keys, sketch, table, lens = real_step(real, layer_index, 0)
        n = int(lens[0])
        blocks = -(-n // BLOCK)
        exact = prune_by_sketch(q, sketch, table, lens, beta, sink, local)
        got = prune_by_sketch(q, sketch, table, lens, beta, sink, local, top_pages)
        window = set(range(-(-sink // BLOCK))) | set(range((n - local) // BLOCK, blocks))
        codes = sketch.codes[table[0].long()].reshape(-1, KV_HEADS, DIM)[:n].double()
        scales = sketch.scales[table[0].long()].reshape(-1, KV_HEADS)[:n].double()
        approx = torch.einsum("hgd,nhd->hgn", q[0].double(), codes) * scales.T[:, None]
        half = q[0].double().abs().sum(-1, keepdim=True) * scales.T[:, None] * (0.5 + CODE_SLACK)
        upper, lower = approx + half, approx - half
        tau = lower.amax(-1, keepdim=True) - beta
        pad = blocks * BLOCK - n
        reach = torch.nn.functional.pad(upper - tau, (0, pad), value=-torch.inf).view(KV_HEADS, GROUP, blocks, -1)
        margin = reach.amax(-1).amax(1)  # [kv, blocks]
        position = {int(b): i for i, b in enumerate(table[0].tolist())}
        for h in range(KV_HEADS):
            read_exact = {position[b] for b in exact.block_table[h, 0, : int(exact.kept[h, 0])].tolist()}
            read = {position[b] for b in got.block_table[h, 0, : int(got.kept[h, 0])].tolist()}
            outside = sorted(read_exact - window, key=lambda b: -float(margin[h, b]))
            assert len(outside) > top_pages  # the budget binds: exact DIPR reads more
            assert read == window | set(outside[:top_pages]), (real["layers"][layer_index], h)
            assert read <= read_exact and int(got.kept[h, 0]) == len(read)


def test_top_pages_at_least_the_blocks_dipr_reads_changes_nothing(real):
    q, _, sketch, table, lens = real_step(real, 1, 2)
    exact = prune_by_sketch(q, sketch, table, lens, 4.0, 16, 64)
    assert_same_tables(prune_by_sketch(q, sketch, table, lens, 4.0, 16, 64, int(table.shape[1])), exact)
