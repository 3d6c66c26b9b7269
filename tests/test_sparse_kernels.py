"""DIPR's kernels (the key sketch write and the decode) against their PyTorch references (on CPU in Triton's
interpreter, see conftest.py).

Shapes are vLLM's: block size 16, head_dim 64, 4 query heads on 2 KV heads, three sequences of 1, 37 and 150
tokens scattered over a shuffled block pool. Outputs are compared with the float64 reference and selections are
checked for a margin first (``numerics.py``: ``assert_close_to_exact``, ``settled_dipr_selection``).
"""

from __future__ import annotations

import pytest
import torch
from numerics import DEVICE, assert_close_to_exact, gamma, settled_dipr_selection, summation_orders

from kvreuse.errors import KernelArgumentError
from kvreuse.kernels.dipr_decode import (
    DIPRDecode,
    dense_decode_reference,
    dipr_selection_reference,
    masked_decode_reference,
)
from kvreuse.kernels.key_sketch import (
    CODE_SLACK,
    KeySketch,
    KeySketchWrite,
    logit_bounds_reference,
    sketch_reference,
    sketch_written_reference,
)
from kvreuse.sparse.figures import recovery_ratio, sample_recovery

BLOCK, KV_HEADS, Q_HEADS, DIM = 16, 2, 4, 64
LENS = [1, 37, 150]
SINK, LOCAL = 4, 8
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def paged(lens, dtype, *, peaked=False, seed=0, pool=40, block=BLOCK):
    """Random caches, a shuffled block table, the keys' sketch and queries.

    ``peaked``: keys are small noise except, per KV head, one key aligned with that head's queries at position
    0 (an attention sink, logit ~32) and a stronger one at position 70 (logit ~35, above every window logit, so
    the exact DIPR set's threshold lies above the kernel's); logits of the rest are ~0.
    """
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(pool, block, KV_HEADS, DIM, generator=g)
    values = torch.randn(pool, block, KV_HEADS, DIM, generator=g)
    query = torch.randn(len(lens), Q_HEADS, DIM, generator=g)
    order = torch.randperm(pool, generator=g).to(torch.int32)
    table = torch.zeros(len(lens), 12, dtype=torch.int32)
    used = 0
    for s, n in enumerate(lens):
        blocks = -(-n // block)
        table[s, :blocks] = order[used : used + blocks]
        used += blocks
    if peaked:
        keys *= 0.05
        direction = torch.randn(KV_HEADS, DIM, generator=g)
        query = 4 * direction.repeat_interleave(Q_HEADS // KV_HEADS, 0)[None] + 0.1 * query
        for s, n in enumerate(lens):
            for pos, strength in ((0, 1.0), (70, 1.1)):
                if pos < n:
                    keys[table[s, pos // block], pos % block] = strength * direction
    keys, values, query = (t.to(dtype).to(DEVICE) for t in (keys, values, query))
    table = table.to(DEVICE)
    sketch = KeySketch(*sketch_reference(keys))
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    return query, keys, values, sketch, table, seq_lens


def decode(case, beta, *, splits=3):
    """The kernel's output and counters, and the exact (float64) selection, whose decisions have a margin."""
    query, keys, values, sketch, table, seq_lens = case
    op = DIPRDecode(Q_HEADS, KV_HEADS, DIM, keys.shape[1], sink=SINK, local=LOCAL)
    op.plan(seq_lens, table, num_splits=splits)
    out, counters = op.run(query, keys, values, sketch, beta, return_counters=True)
    selection = settled_dipr_selection(query, keys, sketch, table, seq_lens, beta, op.scale, SINK, LOCAL)
    return out, counters, selection


def attention_over(case, selection, beta):
    """Attention over ``selection``'s attended set: (the fp32 reference in each summation order, the float64 exact
    result, the same softmax over ``|v|``, the magnitude its rounding errors scale with). The fp32 reference must
    select alike in every order: the decisions are settled."""
    query, keys, values, sketch, table, seq_lens = case
    references = []
    for order in summation_orders(DIM):
        q, k, b = query[..., order], keys[..., order], KeySketch(sketch.codes[..., order], sketch.scales)
        fp32 = dipr_selection_reference(q, k, b, table, seq_lens, beta, DIM**-0.5, SINK, LOCAL)
        assert all(torch.equal(ours, exact) for ours, exact in zip(fp32.attended, selection.attended))
        references.append(masked_decode_reference(values, table, seq_lens, fp32.logits, fp32.attended))
    exact, magnitude = (
        masked_decode_reference(v, table, seq_lens, selection.logits, selection.attended)
        for v in (values.double(), values.double().abs())
    )
    return references, exact, magnitude


# ---------------------------------------------------------------------------------------------------- sketch


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_sketch_kernel_codes_each_written_key_as_the_reference_does_and_skips_padding(dtype):
    g = torch.Generator().manual_seed(1)
    pool = 6
    cache = torch.randn(pool, BLOCK, KV_HEADS, DIM, generator=g)
    cache[..., 3] *= 20  # an outlier channel, as real keys have
    cache[2, 5] = 0  # a zero key: scale 0, codes 0
    cache = cache.to(dtype).to(DEVICE)
    slots = torch.tensor([-1, 2 * BLOCK + 5, 7, 8, 5 * BLOCK + 15, -1], dtype=torch.int64, device=DEVICE)
    sketch, mirror = (KeySketch.allocate(pool, BLOCK, KV_HEADS, DIM, DEVICE) for _ in range(2))
    KeySketchWrite(BLOCK, KV_HEADS, DIM).run(cache, sketch, slots)
    sketch_written_reference(cache, mirror, slots)
    assert torch.equal(sketch.codes, mirror.codes) and torch.equal(sketch.scales, mirror.scales)
    written = torch.zeros(pool * BLOCK, dtype=torch.bool)
    written[slots[slots >= 0].cpu()] = True
    assert not bool(sketch.codes.flatten(0, 1)[~written.to(DEVICE)].any())  # nothing else touched
    assert int(sketch.codes[0, 7].abs().max()) == 127 and float(sketch.scales[2, 5].abs().max()) == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_sketch_bounds_contain_every_logit_within_half_a_code_step(dtype):
    g = torch.Generator().manual_seed(2)
    keys = torch.randn(500, DIM, generator=g) * torch.linspace(0.1, 30, DIM)  # channels of very different sizes
    keys = keys.to(dtype).float()
    query = torch.randn(6, DIM, generator=g) * DIM**-0.5
    codes, scales = sketch_reference(keys)
    upper, lower = logit_bounds_reference(query, codes, scales)
    logits = query @ keys.T
    assert bool((lower <= logits).all()) and bool((logits <= upper).all())
    width = query.abs().sum(-1, keepdim=True) * scales * (0.5 + CODE_SLACK)
    torch.testing.assert_close(upper - lower, 2 * width)


# ---------------------------------------------------------------------------------------------------- decode


@pytest.mark.parametrize("dtype", DTYPES)
def test_beta_inf_equals_dense_attention(dtype):
    case = paged(LENS, dtype)
    out, counters, _ = decode(case, float("inf"))
    query, keys, values, _, table, seq_lens = case
    dense = [
        dense_decode_reference(query[..., order], keys[..., order], values, table, seq_lens, DIM**-0.5)
        for order in summation_orders(DIM)
    ]
    exact, magnitude = (
        dense_decode_reference(query.double(), keys.double(), v, table, seq_lens, DIM**-0.5)
        for v in (values.double(), values.double().abs())
    )
    assert_close_to_exact(out, dense, exact, magnitude=magnitude)
    assert counters.blocks_read.tolist() == [[1, 1], [3, 3], [10, 10]]
    assert counters.tokens_attended.tolist() == [[n] * Q_HEADS for n in LENS]


@pytest.mark.parametrize("dtype", DTYPES)
# beta 29, not 30: at 30 a token of the 37-token sequence lies within rounding of the sketch's threshold (a tie).
@pytest.mark.parametrize(("peaked", "beta"), [(False, 1.0), (True, 8.0), (True, 29.0)])
def test_output_is_attention_over_the_attended_set(dtype, peaked, beta):
    case = paged(LENS, dtype, peaked=peaked)
    out, counters, sel = decode(case, beta)
    references, exact, magnitude = attention_over(case, sel, beta)
    assert_close_to_exact(out, references, exact, magnitude=magnitude)
    assert counters.tokens_attended.tolist() == [a.sum(1).tolist() for a in sel.attended]


@pytest.mark.parametrize(("peaked", "beta"), [(False, 0.0), (False, 2.0), (True, 0.5), (True, 8.0), (True, 25.0)])
def test_attended_set_contains_the_exact_dipr_set(peaked, beta):
    _, counters, sel = decode(paged(LENS, torch.float16, peaked=peaked, seed=3), beta)
    for attended, exact in zip(sel.attended, sel.exact):
        assert not bool((exact & ~attended).any())  # no false negatives
    assert counters.tokens_attended.tolist() == [a.sum(1).tolist() for a in sel.attended]


def test_pruned_blocks_are_not_read_and_their_count_is_the_bound_count():
    case = paged(LENS, torch.float32, peaked=True)
    query, keys, values, sketch, table, seq_lens = case
    _, counters, sel = decode(case, 8.0)
    expected = [r.sum(1).tolist() for r in sel.blocks_read]
    assert counters.blocks_read.tolist() == expected
    # sequence of 150 tokens: the sink block, the hot block at token 70 and the two blocks of the last 8 tokens
    assert expected[2] == [4, 4] and counters.blocks_total.tolist() == [1, 3, 10]
    # Values of pruned blocks are poisoned with NaN: the output stays finite, so they were never loaded.
    poisoned = values.clone()
    for s, read in enumerate(sel.blocks_read):
        for h in range(KV_HEADS):
            skipped = table[s, : read.shape[1]][~read[h]].long()
            poisoned[skipped, :, h] = float("nan")
    out, _, _ = decode((query, keys, poisoned, sketch, table, seq_lens), 8.0)
    assert bool(torch.isfinite(out).all())


def test_a_block_size_that_is_not_a_power_of_two_prunes_and_attends_like_the_reference():
    case = paged(LENS, torch.float32, peaked=True, block=24)
    out, counters, sel = decode(case, 8.0)
    references, exact, magnitude = attention_over(case, sel, 8.0)
    assert_close_to_exact(out, references, exact, magnitude=magnitude)
    assert counters.blocks_read.tolist() == [r.sum(1).tolist() for r in sel.blocks_read]
    assert counters.tokens_attended.tolist() == [a.sum(1).tolist() for a in sel.attended]


def test_output_does_not_depend_on_the_number_of_splits():
    """Splits change only the order of the sums: each split count lands as close to the exact result as the
    reference does (not bitwise on each other)."""
    case = paged(LENS, torch.float32, peaked=True, seed=5)
    runs = {n: decode(case, 6.0, splits=n) for n in (1, 4)}
    references, exact, magnitude = attention_over(case, runs[1][2], 6.0)
    for n, (out, _, _) in runs.items():
        assert_close_to_exact(out, references, exact, magnitude=magnitude, what=f"{n} split(s)")


def test_per_sequence_beta_keeps_short_sequences_dense():
    case = paged(LENS, torch.float32, peaked=True)
    betas = torch.tensor([float("inf"), float("inf"), 8.0], device=DEVICE)
    _, counters, sel = decode(case, betas)
    assert counters.blocks_read.tolist() == [[1, 1], [3, 3], [4, 4]]
    assert counters.tokens_attended[1].tolist() == [37] * Q_HEADS


def test_an_empty_sequence_yields_zeros_and_reads_nothing():
    case = paged([0, 20], torch.float32, peaked=True)
    out, counters, sel = decode(case, 4.0, splits=2)
    assert bool((out[0] == 0).all()) and counters.blocks_read.tolist() == [[0, 0], [2, 2]]
    assert counters.tokens_attended.tolist() == [a.sum(1).tolist() for a in sel.attended]


def test_attended_set_keeps_at_least_the_dense_mass_of_the_exact_set():
    query, keys, _, sketch, table, seq_lens = paged(LENS, torch.float32, peaked=True)
    scale = DIM**-0.5
    sel = dipr_selection_reference(query, keys, sketch, table, seq_lens, 2.0, scale, SINK, LOCAL)
    kept = sample_recovery(query, keys, sketch, table, seq_lens, 2.0, scale, SINK, LOCAL)
    exact = torch.stack([recovery_ratio(lg, ex) for lg, ex in zip(sel.logits, sel.exact)])
    # No tolerance: both sum the same softmax weights (the reference computed alike, bitwise) in the same order, the
    # attended set adding non-negative terms where the exact set has zeros, and rounding is monotone.
    assert bool((kept >= exact).all()) and bool((kept > 0.99).all())
    dense = sample_recovery(query, keys, sketch, table, seq_lens, float("inf"), scale, SINK, LOCAL)
    # All softmax weights: 1 up to the roundings of the exponentials, the division and a sum of max(LENS) terms.
    assert bool(((dense - 1).abs() <= gamma(max(LENS) + 4)).all()), dense


def test_bad_arguments_name_the_tensor():
    query, keys, values, sketch, table, seq_lens = paged([5, 20], torch.float16)
    op = DIPRDecode(Q_HEADS, KV_HEADS, DIM, BLOCK)
    with pytest.raises(KernelArgumentError, match="before plan"):
        op.run(query, keys, values, sketch, 1.0)
    with pytest.raises(KernelArgumentError, match="seq_lens must be a 1-D int32"):
        op.plan(seq_lens.long(), table)
    op.plan(seq_lens, table)
    with pytest.raises(KernelArgumentError, match=r"query must be \[num_seqs, num_q_heads, head_dim\]"):
        op.run(query[:, :2], keys, values, sketch, 1.0)
    with pytest.raises(KernelArgumentError, match="value_cache dtype"):
        op.run(query, keys, values.float(), sketch, 1.0)
    with pytest.raises(KernelArgumentError, match="sketch codes must be int8"):
        op.run(query, keys, values, KeySketch(sketch.codes.float(), sketch.scales), 1.0)
    with pytest.raises(KernelArgumentError, match="sketch scales must be float32"):
        op.run(query, keys, values, KeySketch(sketch.codes, sketch.scales[:, :, :1]), 1.0)
    with pytest.raises(KernelArgumentError, match="beta must be >= 0"):
        op.run(query, keys, values, sketch, -1.0)
    with pytest.raises(KernelArgumentError, match="num_q_heads .3. must be a positive multiple"):
        DIPRDecode(3, 2, DIM, BLOCK)
    with pytest.raises(KernelArgumentError, match="key_cache must be"):
        KeySketchWrite(BLOCK, KV_HEADS, DIM).run(keys[:, :8], sketch, table[0])
