"""The dense paged causal attention kernel against its PyTorch reference (Triton's interpreter on CPU).

One batch mixes what vLLM's batches carry: a fresh 45-token prefill, a 20-token chunk after 37 cached tokens, a
decode token of a 150-token sequence and a 3-token speculative verification after 67, scattered over a shuffled
block pool. Shapes: GQA with groups of 2 and of 3 (a group that is not a power of two), head_dim 64 and 48, block
sizes 16, 24 (not a power of two) and 32, and plain multi-head attention. Outputs are compared with the float64
reference (``numerics.assert_close_to_exact``).
"""

from __future__ import annotations

import pytest
import torch
from numerics import DEVICE, assert_close_to_exact, summation_orders

from kvreuse.errors import KernelArgumentError
from kvreuse.kernels import paged_causal
from kvreuse.kernels.dipr_decode import dense_decode_reference
from kvreuse.kernels.paged_causal import PagedCausalAttention, causal_attention_reference, paged_causal_reference

# (new tokens, total tokens) per request
REQUESTS = [(45, 45), (20, 57), (1, 150), (3, 70)]
SHAPES = {"gqa2": (4, 2, 64, 16), "gqa3-d48-b24": (6, 2, 48, 24), "mha-b32": (4, 4, 64, 32)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def batch(shape, dtype, requests=REQUESTS, *, seed=0, poison=False):
    """query, caches, per-request tensors; ``poison``: every cache slot that holds no token of the batch is NaN."""
    q_heads, kv_heads, dim, block = shape
    g = torch.Generator().manual_seed(seed)
    pool = sum(-(-n // block) for _, n in requests) + 5
    keys = torch.randn(pool, block, kv_heads, dim, generator=g)
    values = torch.randn(pool, block, kv_heads, dim, generator=g)
    order = torch.randperm(pool, generator=g).to(torch.int32)
    table = torch.zeros(len(requests), 12, dtype=torch.int32)
    used_slots = torch.zeros(pool, block, dtype=torch.bool)
    taken = 0
    for i, (_, n) in enumerate(requests):
        blocks = -(-n // block)
        table[i, :blocks] = order[taken : taken + blocks]
        taken += blocks
        for pos in range(n):
            used_slots[table[i, pos // block], pos % block] = True
    if poison:
        keys[~used_slots] = float("nan")
        values[~used_slots] = float("nan")
    ends = torch.tensor([q for q, _ in requests], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    starts = ends - torch.tensor([q for q, _ in requests], dtype=torch.int32)
    query = torch.randn(int(ends[-1]), q_heads, dim, generator=g)
    seq_lens = torch.tensor([n for _, n in requests], dtype=torch.int32)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return (
        to(query.to(dtype)),
        to(keys.to(dtype)),
        to(values.to(dtype)),
        to(starts),
        to(ends),
        to(seq_lens),
        to(table),
    )


def run(shape, case, *, requests=None):
    query, keys, values, starts, ends, seq_lens, table = case
    picked = torch.arange(len(seq_lens), device=DEVICE) if requests is None else torch.tensor(requests, device=DEVICE)
    op = PagedCausalAttention(shape[0], shape[1], shape[2], shape[3])
    max_query_len = int((ends - starts)[picked].max())
    op.plan(starts[picked], ends[picked], seq_lens[picked], table[picked].contiguous(), max_query_len)
    out = torch.full_like(query, 7.0)
    return op.run(query, keys, values, out), op.scale


def reference(case, scale, dtype, *, absolute=False, order=None):
    """The reference's output in ``dtype`` arithmetic (float64: exact), its dot products summed in ``order`` (see
    ``numerics.summation_orders``); ``absolute``: attention over ``|v|``, the magnitude the kernel's rounding errors
    scale with."""
    query, keys, values, starts, ends, seq_lens, table = case
    wide = dtype == torch.float64
    query, keys, values = (t.double() if wide else t for t in (query, keys, values))
    values = values.abs() if absolute else values
    if order is not None:
        query, keys = query[..., order], keys[..., order]
    out = torch.empty_like(query, dtype=dtype)
    return paged_causal_reference(query, keys, values, starts, ends, seq_lens, table, scale, out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_mixed_batch_equals_the_reference(shape, dtype):
    case = batch(SHAPES[shape], dtype)
    out, scale = run(SHAPES[shape], case)
    assert_close_to_exact(
        out,
        [reference(case, scale, torch.float32, order=order) for order in summation_orders(SHAPES[shape][2])],
        reference(case, scale, torch.float64),
        magnitude=reference(case, scale, torch.float64, absolute=True),
    )


def test_slots_past_each_requests_causal_end_are_never_loaded():
    shape = SHAPES["gqa3-d48-b24"]
    out, scale = run(shape, batch(shape, torch.float32, poison=True))
    assert bool(torch.isfinite(out).all())
    clean, _ = run(shape, batch(shape, torch.float32))
    torch.testing.assert_close(out, clean, atol=0, rtol=0)  # the same launch on the same loaded values: bitwise


def test_a_sub_batch_writes_only_its_requests_rows():
    shape = SHAPES["gqa2"]
    case = batch(shape, torch.float32)
    everything, _ = run(shape, case)
    some, _ = run(shape, case, requests=[3, 1])
    starts, ends = case[3].tolist(), case[4].tolist()
    for i in range(len(REQUESTS)):
        rows = slice(starts[i], ends[i])
        if i in (1, 3):
            # Bitwise: both launches tile these requests alike (32 query tokens per program, from max_query_len 45
            # and 20 alike), so each row goes through the same operations in the same order.
            torch.testing.assert_close(some[rows], everything[rows], atol=0, rtol=0)
        else:
            assert bool((some[rows] == 7.0).all())


def test_one_new_token_is_decode_attention():
    shape = SHAPES["gqa2"]
    decodes = [(1, 1), (1, 37), (1, 150)]
    case = batch(shape, torch.float32, decodes)
    out, scale = run(shape, case)
    query, keys, values, _, _, seq_lens, table = case
    expected = [
        dense_decode_reference(query[..., order], keys[..., order], values, table, seq_lens, scale)
        for order in summation_orders(shape[2])
    ]
    exact = dense_decode_reference(query.double(), keys.double(), values.double(), table, seq_lens, scale)
    assert_close_to_exact(out, expected, exact)


def test_the_reference_takes_long_prompts_in_query_chunks_with_the_same_result(monkeypatch):
    _, keys, values, _, _, _, table = batch(SHAPES["gqa2"], torch.float32)
    query = torch.randn(45, 4, 64).to(DEVICE)
    whole = [
        causal_attention_reference(query[..., order], keys[..., order], values, table[0], 45, 0.125)
        for order in summation_orders(64)
    ]
    exact = causal_attention_reference(query.double(), keys.double(), values.double(), table[0], 45, 0.125)
    monkeypatch.setattr(paged_causal, "REFERENCE_LOGITS", 4 * 45 * 7)  # 7 query rows at a time
    chunked = causal_attention_reference(query, keys, values, table[0], 45, 0.125)
    assert_close_to_exact(chunked, whole, exact, what="the reference in query chunks")


def test_arguments_are_checked_and_named():
    op = PagedCausalAttention(4, 2, 64, 16)
    lens = torch.tensor([5], dtype=torch.int32)
    with pytest.raises(KernelArgumentError, match="query_ends must be a 1-D int32"):
        op.plan(lens, lens.long(), lens, torch.zeros(1, 2, dtype=torch.int32), 5)
    with pytest.raises(KernelArgumentError, match="before plan"):
        op.run(torch.zeros(5, 4, 64), torch.zeros(2, 16, 2, 64), torch.zeros(2, 16, 2, 64))
    op.plan(lens - 5, lens, lens, torch.zeros(1, 2, dtype=torch.int32), 5)
    with pytest.raises(KernelArgumentError, match=r"key_cache must be \[num_blocks, block_size=16"):
        op.run(torch.zeros(5, 4, 64), torch.zeros(2, 32, 2, 64), torch.zeros(2, 16, 2, 64))
    with pytest.raises(KernelArgumentError, match="num_q_heads \\(6\\) must be a positive multiple"):
        PagedCausalAttention(6, 4, 64, 16)
