"""DIPR on real keys: the keys (after RoPE) and decode queries of SmolLM2-135M on a 1K-token retrieval prompt
(``tests/data/smollm2_keys.pt``, written by ``benchmarks/sparse_real_keys.py --fixture``; layers 4 and 20, 3 KV
heads x 3 query heads, head_dim 64), in vLLM's paged layout with 32-token blocks.

Exactness: no key within beta of the largest logit is ever dropped, by the reference, the CPU path or the Triton
kernel. Pruning: on these keys the sketch reads about the blocks an oracle would (those holding a key within beta
of the largest), where Quest's per-block boxes read all of them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from numerics import DEVICE
from test_sparse_cpu_attention import estimates_against_reference

from kvreuse.kernels.dipr_decode import DIPRDecode, dipr_selection_reference, masked_decode_reference
from kvreuse.kernels.key_sketch import KeySketch, sketch_reference
from kvreuse.sparse import cpu_attention

FIXTURE = Path(__file__).resolve().parent / "data" / "smollm2_keys.pt"
BLOCK, SINK, LOCAL = 32, 16, 64
BETAS = [1.0, 2.0, 4.0, 8.0]


@pytest.fixture(scope="module")
def real():
    return torch.load(FIXTURE)


def step(real, layer_index: int, step_index: int, seed: int = 0):
    """One decode step of one layer: query ``[1, 9, 64]``, paged caches of the keys up to the query's position
    (values random: they do not decide what is read), the sketch, a shuffled block table, the length."""
    position = int(real["query_positions"][step_index])
    keys = real["keys"][layer_index][: position + 1].float()
    n, heads, dim = keys.shape
    blocks = -(-n // BLOCK)
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(blocks + 7, generator=g)[:blocks].to(torch.int32)
    key_cache = torch.zeros(blocks + 7, BLOCK, heads, dim)
    value_cache = torch.randn(blocks + 7, BLOCK, heads, dim, generator=g)
    padded = torch.cat([keys, keys.new_zeros(blocks * BLOCK - n, heads, dim)]).view(blocks, BLOCK, heads, dim)
    key_cache[table.long()] = padded
    query = real["queries"][layer_index][step_index].float()[None]
    return query, key_cache, value_cache, KeySketch(*sketch_reference(key_cache)), table[None], torch.tensor([n])


def test_no_key_within_beta_of_the_largest_logit_is_dropped_on_real_keys(real):
    for layer_index in range(len(real["layers"])):
        for step_index in range(len(real["query_positions"])):
            query, key_cache, value_cache, sketch, table, lens = step(real, layer_index, step_index)
            for beta in BETAS:
                sel = dipr_selection_reference(query, key_cache, sketch, table, lens, beta, real["scale"], SINK, LOCAL)
                assert bool((sel.exact[0] & ~sel.attended[0]).sum() == 0), (real["layers"][layer_index], beta)


@pytest.mark.parametrize("beta", BETAS)
def test_the_cpu_path_attends_the_references_set_on_real_keys(real, beta):
    query, key_cache, value_cache, sketch, table, lens = step(real, 1, 0)
    sel = dipr_selection_reference(query, key_cache, sketch, table, lens, beta, real["scale"], SINK, LOCAL)
    got = cpu_attention.dipr_decode(
        query[0],
        key_cache,
        value_cache,
        sketch,
        table[0],
        int(lens[0]),
        beta,
        real["scale"],
        SINK,
        LOCAL,
    )
    assert got.tokens_attended.tolist() == sel.attended[0].sum(1).tolist()
    assert got.blocks_read.tolist() == sel.blocks_read[0].sum(1).tolist()
    want = masked_decode_reference(value_cache, table, lens, sel.logits, sel.attended)[0]
    eps = torch.finfo(torch.float32).eps
    assert (got.out - want).abs().max() <= 2 * int(lens[0]) * eps * value_cache.abs().max()


@pytest.mark.parametrize("beta", [2.0, 4.0])
def test_the_kernel_reads_and_attends_what_the_reference_does_on_real_keys(real, beta):
    query, key_cache, value_cache, sketch, table, lens = step(real, 1, 1)
    kernel = DIPRDecode(9, 3, 64, BLOCK, scale=real["scale"], sink=SINK, local=LOCAL)
    kernel.plan(lens.to(torch.int32).to(DEVICE), table.to(DEVICE), num_splits=3)
    out, counters = kernel.run(
        *(x.to(DEVICE) for x in (query, key_cache, value_cache)),
        KeySketch(sketch.codes.to(DEVICE), sketch.scales.to(DEVICE)),
        beta,
        return_counters=True,
    )
    out = out.cpu()
    sel = dipr_selection_reference(query, key_cache, sketch, table, lens, beta, real["scale"], SINK, LOCAL)
    assert counters.blocks_read[0].tolist() == sel.blocks_read[0].sum(1).tolist()
    assert counters.tokens_attended[0].tolist() == sel.attended[0].sum(1).tolist()
    want = masked_decode_reference(value_cache, table, lens, sel.logits, sel.attended)
    eps = torch.finfo(torch.float32).eps
    assert (out - want).abs().max() <= 2 * int(lens[0]) * eps * value_cache.abs().max()


def test_the_sketch_reads_about_what_an_oracle_reads_where_block_boxes_read_everything(real):
    query, key_cache, value_cache, sketch, table, lens = step(real, 1, 3)
    n = int(lens[0])
    n_blocks = -(-n // BLOCK)
    sel = dipr_selection_reference(query, key_cache, sketch, table, lens, 4.0, real["scale"], SINK, LOCAL)
    read = sel.blocks_read[0].float().mean()
    # The oracle reads the window's blocks and those holding a key of the exact DIPR set, per KV head.
    exact = torch.zeros(9, n_blocks * BLOCK, dtype=torch.bool)
    exact[:, :n] = sel.exact[0]
    positions = torch.arange(n)
    window_blocks = torch.zeros(n_blocks, dtype=torch.bool)
    window_blocks[positions[(positions < SINK) | (positions >= n - LOCAL)] // BLOCK] = True
    oracle = (exact.view(3, 3, n_blocks, BLOCK).any(-1).any(1) | window_blocks).float().mean()
    assert read <= oracle + 2 / n_blocks and read < 0.25  # measured: 0.17 of 32 blocks, the oracle 0.15
    # Quest's per-block box on the same keys: the bound of (almost) every block reaches the threshold.
    keys = key_cache[table[0].long()].float()  # [blocks, 32, 3, 64], in sequence order
    hi, lo = keys.amax(1), keys.amin(1)  # the last block's zero padding only widens its box
    q = (query[0].float() * real["scale"]).view(3, 3, 64)  # [kv, group, dim]
    box = torch.maximum(q[:, :, None] * hi.transpose(0, 1)[:, None], q[:, :, None] * lo.transpose(0, 1)[:, None])
    tau = sel.logits[0].amax(-1).view(3, 3) - 4.0  # generous: from the true largest logit
    box_read = (box.sum(-1) >= tau[..., None]).any(1).float().mean()
    assert box_read > 0.9


def test_the_cpu_paths_sketch_estimates_bracket_the_bounds_on_real_keys(real):
    """``cpu_attention.sketch_estimates`` (the int8 product that settles most of DIPR's decisions on a CPU) on every
    real decode query of the fixture: its brackets hold the reference's fp32 bounds and are under 1% of the bound's
    half-width wide."""
    for layer_index in range(len(real["layers"])):
        for step_index in range(len(real["query_positions"])):
            query, key_cache, _, _, table, _ = step(real, layer_index, step_index)
            upper, lower, width, want_upper, want_lower = estimates_against_reference(
                query[0], key_cache, table[0], real["scale"]
            )
            where = (layer_index, step_index)
            assert bool(((upper <= want_upper) & (want_upper <= upper + width)).all()), where
            assert bool(((lower <= want_lower) & (want_lower <= lower + width)).all()), where
            assert bool((width <= 0.01 * (want_upper - want_lower) / 2).all()), where
