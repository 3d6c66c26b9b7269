"""The key sketch's compiled CPU work (``kvreuse.sparse.sketch_scan``) against its PyTorch references.

``write_sketch`` stores exactly ``sketch_reference``'s codes and scales and names the blocks a write starts without
filling; ``prune_by_sketch`` reads every block of ``prune_block_table(dipr_read_blocks(...))`` and at most a few
more (its query is rounded to int16, which widens the bounds by the rounding's bound) on random keys and on
SmolLM2-135M's real keys (``tests/data/smollm2_keys.pt``), its bounds enclose every real logit, and it never drops a
key within beta of the largest logit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvreuse.errors import KernelArgumentError
from kvreuse.kernels.key_sketch import CODE_MAX, CODE_SLACK, KeySketch, sketch_reference
from kvreuse.sparse.cpu_attention import dipr_read_blocks
from kvreuse.sparse.pruned import PrunedTables, prune_block_table
from kvreuse.sparse.sketch_scan import prune_by_sketch, query_codes, warm_up, write_sketch

FIXTURE = Path(__file__).resolve().parent / "data" / "smollm2_keys.pt"
BLOCK, KV_HEADS, GROUP, DIM = 32, 3, 3, 64


def reference_tables(q, sketch, table, lens, beta, sink, local) -> PrunedTables:
    """``prune_block_table`` of ``dipr_read_blocks``, sequence by sequence."""
    block_size = sketch.codes.shape[1]
    read = torch.zeros(len(lens), q.shape[1], table.shape[1], dtype=torch.bool)
    for i, n in enumerate(lens.tolist()):
        blocks = -(-n // block_size)
        read[i, :, :blocks] = dipr_read_blocks(q[i], sketch, table[i, :blocks].long(), n, beta, sink, local)[0]
    return prune_block_table(read, table, lens, block_size)


def assert_reads_the_references_blocks(
    got: PrunedTables, want: PrunedTables, lens, extra: float, block_size: int = BLOCK
) -> None:
    """``got`` reads every block ``want`` reads (the query's int16 rounding only widens the bounds) and at most a
    block and a share ``extra`` of a sequence's blocks more, per KV head and sequence."""
    for h in range(got.kept.shape[0]):
        for i, n in enumerate(lens.tolist()):
            mine = set(got.block_table[h, i, : int(got.kept[h, i])].tolist())
            theirs = set(want.block_table[h, i, : int(want.kept[h, i])].tolist())
            assert theirs <= mine, (h, i, sorted(theirs - mine))
            assert len(mine) - len(theirs) <= 1 + extra * -(-n // block_size), (h, i, len(mine), len(theirs))


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
    assert torch.equal(sketch.codes.reshape(-1, KV_HEADS, DIM)[slots], codes)
    assert torch.equal(sketch.scales.reshape(-1, KV_HEADS)[slots], scales)


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


def random_pool(g, pool, width, sequences, block, kv_heads, dim, strong) -> tuple[KeySketch, torch.Tensor]:
    """A sketch of ``pool`` blocks of random keys of mixed magnitudes, ``strong`` of them 6x stronger, and a table
    of ``sequences`` rows of ``width`` shuffled blocks."""
    keys = torch.randn(pool * block, kv_heads, dim, generator=g) * torch.rand(pool * block, kv_heads, 1, generator=g)
    keys[torch.randint(0, pool * block, (strong,), generator=g)] *= 6
    sketch = KeySketch.allocate(pool, block, kv_heads, dim, "cpu")
    write_sketch(keys, sketch, torch.arange(pool * block), block)
    table = torch.stack([torch.randperm(pool, generator=g)[:width] for _ in range(sequences)]).to(torch.int32)
    return sketch, table


@pytest.mark.parametrize("beta", [0.5, 2.0, 4.0, 8.0])
def test_prune_by_sketch_reads_the_pytorch_references_blocks_on_random_keys(beta):
    """Four sequences over a shuffled pool (one shorter than the window, one ending mid-block), keys of mixed
    magnitudes and a few strong ones, so every beta keeps a different share of the blocks."""
    g = torch.Generator().manual_seed(1)
    sketch, table = random_pool(g, 300, 100, 4, BLOCK, KV_HEADS, DIM, strong=40)
    lens = torch.tensor([3000, 1000, 40, 2999], dtype=torch.int32)
    q = 0.3 * torch.randn(4, KV_HEADS, GROUP, DIM, generator=g)
    got = prune_by_sketch(q, sketch, table, lens, beta, 4, 16)
    assert_reads_the_references_blocks(got, reference_tables(q, sketch, table, lens, beta, 4, 16), lens, 0.03)
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
def test_prune_by_sketch_reads_the_pytorch_references_blocks_on_real_keys(real, beta):
    for layer_index in range(len(real["layers"])):
        for step_index in range(len(real["query_positions"])):
            q, _, sketch, table, lens = real_step(real, layer_index, step_index)
            got = prune_by_sketch(q, sketch, table, lens, beta, 16, 64)
            want = reference_tables(q, sketch, table, lens, beta, 16, 64)
            assert_reads_the_references_blocks(got, want, lens, 0.03)


def query_bounds(q: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The decision's bounds ``[g, n]`` on ``q[g, d] . k_j`` in float64 from ``query_codes``' int16 codes, scale
    and half-width: ``s_j sigma (q16 . u_j) +- s_j slack``."""
    group, dim = q.shape
    q16 = np.empty((group, dim), np.int16)
    sigma, slack = np.empty(group, np.float32), np.empty(group, np.float32)
    query_codes(q.numpy(), q16, sigma, slack, 0.5 + CODE_SLACK, float(CODE_MAX))
    dots = torch.from_numpy(q16).double() @ codes.double().T  # exact: integers below 2**53
    centre = dots * torch.from_numpy(sigma).double()[:, None] * scales.double()[None]
    width = torch.from_numpy(slack).double()[:, None] * scales.double()[None]
    return centre + width, centre - width


def test_the_int16_query_bounds_enclose_every_real_keys_logit(real):
    """The bound the decision rests on, in exact arithmetic: for every fixture key and query (and the queries
    scaled far up and down, and one with a single large channel) the real logit lies within the bounds."""
    for layer_index in range(len(real["layers"])):
        keys = real["keys"][layer_index].float()
        codes, scales = sketch_reference(keys)
        for step_index in range(len(real["query_positions"])):
            q = real["queries"][layer_index][step_index].float().view(KV_HEADS, GROUP, DIM) * real["scale"]
            spike = q.clone()
            spike[..., 5] = 40.0
            for query in (q, q * 1e-20, q * 1e6, spike):
                for h in range(KV_HEADS):
                    upper, lower = query_bounds(query[h], codes[:, h], scales[:, h])
                    logits = query[h].double() @ keys[:, h].double().T
                    assert bool((lower <= logits).all() and (logits <= upper).all()), (layer_index, step_index, h)
                    if query is q:  # and tight: on real queries the rounding adds ~2% to the key's half-step
                        key_only = q[h].double().abs().sum(-1, keepdim=True) * scales[:, h].double() * 0.5
                        assert bool(((upper - lower) / 2 <= key_only * 1.05).all())


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


@pytest.mark.parametrize(
    ("kv_heads", "group", "block", "dim"),
    [(1, 1, 16, 32), (2, 2, 48, 64), (1, 5, 16, 128), (2, 8, 64, 64), (1, 4, 24, 256)],
    ids=["mha", "gqa2-block48", "group5-dim128", "group8-block64", "group4-block24-dim256"],
)
def test_prune_by_sketch_reads_the_references_blocks_for_other_shapes(kv_heads, group, block, dim):
    """Groups of 1 to 8 query heads (the scan takes at most 4 per pass), blocks of 16 to 64 tokens (24: rows padded
    to 32 in the CPU layout), head_dim 32 to 256, sequences ending mid-block and mid-row of 16 tokens."""
    g = torch.Generator().manual_seed(kv_heads * 1000 + group * 100 + block + dim)
    width = 60
    sketch, table = random_pool(g, 120, width, 3, block, kv_heads, dim, strong=20)
    lens = torch.tensor([width * block, 7 * block + 5, 3 * block + 17], dtype=torch.int32)
    q = 0.4 * torch.randn(3, kv_heads, group, dim, generator=g) * dim**-0.5 * 8
    for beta in (1.0, 4.0):
        got = prune_by_sketch(q, sketch, table, lens, beta, 4, 16)
        want = reference_tables(q, sketch, table, lens, beta, 4, 16)
        assert_reads_the_references_blocks(got, want, lens, 0.03, block)
    assert 0 < int(got.kept.sum()) < kv_heads * int(((lens + block - 1) // block).sum())  # it prunes, not all


def test_prune_by_sketch_refuses_a_sketch_in_another_layout():
    """The compiled scan reads 16 tokens of a channel at once, so it takes only the CPU layout (the engine's and
    ``KeySketch.allocate``'s on a CPU); a sketch laid out as a GPU's, or contiguous, is refused, not misread."""
    keys = torch.randn(4 * BLOCK, KV_HEADS, DIM)
    q = torch.randn(1, KV_HEADS, GROUP, DIM)
    table, lens = torch.arange(4, dtype=torch.int32)[None], torch.tensor([4 * BLOCK], dtype=torch.int32)
    contiguous = KeySketch(*sketch_reference(keys.view(4, BLOCK, KV_HEADS, DIM)))
    with pytest.raises(KernelArgumentError, match="CPU sketch layout"):
        prune_by_sketch(q, contiguous, table, lens, 4.0, 16, 64)


def test_prune_by_sketch_refuses_a_length_past_its_block_table_before_reading():
    """The compiled scan reads a sequence's blocks from its table row without bounds checks: a length the row cannot
    hold (here the second decode's, one token past its 2 blocks) is refused, with the tables left unread."""
    sketch = KeySketch.allocate(4, BLOCK, KV_HEADS, DIM, "cpu")
    q = torch.zeros(2, KV_HEADS, GROUP, DIM)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    fits = prune_by_sketch(q, sketch, table, torch.tensor([2 * BLOCK, 2 * BLOCK], dtype=torch.int32), 4.0, 0, 1)
    assert fits.kept.shape == (KV_HEADS, 2)
    with pytest.raises(KernelArgumentError, match=f"seq_lens \\(up to {2 * BLOCK + 1}\\) must fit block_table's 2"):
        prune_by_sketch(q, sketch, table, torch.tensor([BLOCK, 2 * BLOCK + 1], dtype=torch.int32), 4.0, 0, 1)


def test_prune_by_sketch_refuses_an_odd_head_dim():
    sketch = KeySketch.allocate(1, BLOCK, 1, 63, "cpu")
    with pytest.raises(KernelArgumentError, match="head_dim 63 is odd"):
        prune_by_sketch(
            torch.zeros(1, 1, 1, 63), sketch, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
            4.0, 0, 1,
        )  # fmt: skip


def test_top_pages_at_least_the_blocks_dipr_reads_changes_nothing(real):
    q, _, sketch, table, lens = real_step(real, 1, 2)
    exact = prune_by_sketch(q, sketch, table, lens, 4.0, 16, 64)
    assert_same_tables(prune_by_sketch(q, sketch, table, lens, 4.0, 16, 64, int(table.shape[1])), exact)


def test_prune_by_sketch_refuses_a_head_dim_whose_integer_dot_products_could_overflow():
    sketch = KeySketch.allocate(1, BLOCK, 1, 320, "cpu")
    q = torch.zeros(1, 1, 1, 320)
    with pytest.raises(KernelArgumentError, match="head_dim 320 over 256"):
        prune_by_sketch(q, sketch, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 4.0, 0, 1)
