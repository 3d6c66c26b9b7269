"""The sparse backend's CPU attention (``kvreuse.sparse.cpu_attention``) against the kernels' PyTorch references.

The caches have vLLM's page layout with kvreuse's key sketch after the tokens: ``[blocks, block_size + 5, kv_heads,
K|V]`` of which the first ``block_size`` rows are tokens and the rest hold NaN here (as floats, the sketch's bytes
may read as anything), so that a computation touching them would show; block size 32, head_dim 64, 6 query heads on
2 KV heads.
Tolerances follow from the dtype and the length of the sums: a softmax-weighted sum of ``n`` values computed in
two summation orders differs by at most about ``n * eps`` times the largest value.
"""

from __future__ import annotations

import pytest
import torch

from kvreuse.kernels.dipr_decode import (
    dense_decode_reference,
    dipr_selection_reference,
    masked_decode_reference,
)
from kvreuse.kernels.key_sketch import KeySketch, sketch_reference
from kvreuse.kernels.paged_causal import causal_attention_reference
from kvreuse.sparse import cpu_attention

BLOCK, KV_HEADS, Q_HEADS, DIM, POOL = 32, 2, 6, 64, 48
SCALE = DIM**-0.5
SINK, LOCAL = 16, 64


def tolerance(dtype: torch.dtype, n: int, magnitude: float) -> float:
    """Largest expected difference between two fp32 evaluations of an ``n``-term weighted sum of values up to
    ``magnitude`` stored in ``dtype``: inputs are rounded once in ``dtype`` (relative ``eps(dtype)``), sums of ``n``
    terms add ``n * eps(fp32)``."""
    return magnitude * (2 * torch.finfo(dtype).eps + 2 * n * torch.finfo(torch.float32).eps)


def caches(dtype=torch.float32, seed=0, peaked=False):
    """Key and value caches as views of one padded page tensor (as vLLM hands them), the sketch rows NaN.

    ``peaked``: small keys, so that the keys ``peaked_sequence`` aligns with the query stand out.
    """
    g = torch.Generator().manual_seed(seed)
    pages = torch.randn(POOL, BLOCK + 5, KV_HEADS, 2 * DIM, generator=g)
    if peaked:
        pages *= 0.05
    pages[:, BLOCK:] = float("nan")
    pages = pages.to(dtype)
    key_cache, value_cache = pages[:, :BLOCK].split(DIM, dim=-1)
    return key_cache, value_cache, g


def sketch_of(key_cache) -> KeySketch:
    return KeySketch(*sketch_reference(key_cache))


def table(n: int, consecutive: bool, g: torch.Generator) -> torch.Tensor:
    blocks = -(-n // BLOCK)
    ids = torch.arange(5, 5 + blocks) if consecutive else torch.randperm(POOL, generator=g)[:blocks]
    return ids.to(torch.int32)


def test_gather_blocks_copies_whole_pages_or_takes_the_view_of_consecutive_ones():
    key_cache, value_cache, _ = caches()
    scattered = torch.tensor([7, 2, 30])
    for cache in (key_cache, value_cache):
        gathered = cpu_attention.gather_blocks(cache, scattered)
        assert torch.equal(gathered, cache[scattered]) and gathered.stride()[1:] == cache.stride()[1:]
        run = cpu_attention.gather_blocks(cache, torch.tensor([4, 5, 6]))
        assert run.data_ptr() == cache[4].data_ptr() and torch.equal(run, cache[4:7])


def test_gather_kv_copies_scattered_pages_once_for_keys_and_values():
    key_cache, value_cache, _ = caches()
    scattered = torch.tensor([7, 2, 30])
    keys, values = cpu_attention.gather_kv(key_cache, value_cache, scattered)
    assert torch.equal(keys, key_cache[scattered]) and torch.equal(values, value_cache[scattered])
    assert keys.untyped_storage().data_ptr() == values.untyped_storage().data_ptr()  # one copy holds both
    keys, values = cpu_attention.gather_kv(key_cache, value_cache, torch.tensor([4, 5, 6]))
    assert keys.data_ptr() == key_cache[4].data_ptr() and values.data_ptr() == value_cache[4].data_ptr()
    apart = value_cache.clone()  # caches in separate memory: gathered one by one
    keys, values = cpu_attention.gather_kv(key_cache, apart, scattered)
    assert torch.equal(keys, key_cache[scattered]) and torch.equal(values, apart[scattered])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, q_len", [(300, 300), (300, 37), (45, 45), (33, 2)])
@pytest.mark.parametrize("consecutive", [True, False])
def test_dense_causal_equals_the_reference(dtype, n, q_len, consecutive):
    key_cache, value_cache, g = caches(dtype)
    blocks = table(n, consecutive, g)
    query = torch.randn(q_len, Q_HEADS, DIM, generator=g).to(dtype)
    keys = cpu_attention.sequence_tokens(key_cache, blocks, n)
    values = cpu_attention.sequence_tokens(value_cache, blocks, n)
    got = cpu_attention.dense_causal(query, keys, values, SCALE).float()
    want = causal_attention_reference(query, key_cache, value_cache, blocks, n, SCALE)
    assert got.shape == want.shape
    magnitude = float(value_cache.float().abs().max())
    assert (got - want).abs().max() <= tolerance(dtype, n, magnitude) + torch.finfo(dtype).eps * magnitude


@pytest.mark.parametrize("n", [1, 31, 32, 300])
@pytest.mark.parametrize("consecutive", [True, False])
def test_dense_decode_equals_the_reference(n, consecutive):
    key_cache, value_cache, g = caches()
    blocks = table(n, consecutive, g)
    query = torch.randn(Q_HEADS, DIM, generator=g)
    got = cpu_attention.dense_decode(query, key_cache, value_cache, blocks, n, SCALE)
    want = dense_decode_reference(query[None], key_cache, value_cache, blocks[None], torch.tensor([n]), SCALE)[0]
    assert (got - want).abs().max() <= tolerance(torch.float32, n, float(value_cache.abs().max()))


def peaked_sequence(n: int, consecutive: bool, seed: int = 0):
    """A sequence of ``n`` tokens whose keys at positions 0 and 200 align with the queries (logits ~30 above the
    rest): DIPR keeps them and the window and prunes most other blocks at small beta."""
    key_cache, value_cache, g = caches(seed=seed, peaked=True)
    blocks = table(n, consecutive, g)
    direction = torch.randn(KV_HEADS, DIM, generator=g)
    direction /= direction.norm(dim=-1, keepdim=True)
    for pos in (0, 200):
        if pos < n:
            key_cache[blocks[pos // BLOCK], pos % BLOCK] = 3 * direction
    query = 16 * direction.repeat_interleave(Q_HEADS // KV_HEADS, 0) + 0.5 * torch.randn(Q_HEADS, DIM, generator=g)
    return query, key_cache, value_cache, sketch_of(key_cache), blocks


@pytest.mark.parametrize("beta", [float("inf"), 8.0, 2.0, 0.5])
@pytest.mark.parametrize("consecutive", [True, False])
@pytest.mark.parametrize("n", [300, 700])
def test_dipr_decode_attends_the_references_set_and_computes_its_output(beta, consecutive, n):
    query, key_cache, value_cache, sketch, blocks = peaked_sequence(n, consecutive)
    got = cpu_attention.dipr_decode(
        query,
        key_cache,
        value_cache,
        sketch,
        blocks,
        n,
        beta,
        SCALE,
        SINK,
        LOCAL,
    )
    lens = torch.tensor([n])
    sel = dipr_selection_reference(query[None], key_cache, sketch, blocks[None], lens, beta, SCALE, SINK, LOCAL)
    want = masked_decode_reference(value_cache, blocks[None], lens, sel.logits, sel.attended)[0]
    assert got.blocks_read.tolist() == sel.blocks_read[0].sum(1).tolist()
    assert got.tokens_attended.tolist() == sel.attended[0].sum(1).tolist()
    assert (got.out - want).abs().max() <= tolerance(torch.float32, n, float(value_cache.abs().max()))
    if beta <= 2.0:  # the peaked keys make small betas prune: most blocks are never read
        assert got.blocks_read.max() <= -(-n // BLOCK) // 2


def estimates_against_reference(query: torch.Tensor, key_cache: torch.Tensor, blocks: torch.Tensor, scale: float):
    """``sketch_estimates`` of ``query[q_heads, d]`` over ``blocks`` (``upper``, ``lower``, ``width``) and the
    reference's fp32 bounds of the same keys, all ``[kv, g, n]``."""
    from kvreuse.kernels.key_sketch import logit_bounds_reference

    sketch = sketch_of(key_cache)
    kv = key_cache.shape[2]
    q = query.float().view(kv, -1, query.shape[-1]) * scale
    estimates = cpu_attention.sketch_estimates(q, sketch, blocks.long())
    codes = sketch.codes[blocks.long()].flatten(0, 1)  # [n, kv, d]
    scales = sketch.scales[blocks.long()].flatten(0, 1)  # [n, kv]
    upper, lower = zip(*(logit_bounds_reference(q[h], codes[:, h], scales[:, h]) for h in range(kv)))
    return *estimates, torch.stack(upper), torch.stack(lower)


@pytest.mark.parametrize("seed", range(4))
def test_sketch_estimates_bracket_the_references_bounds_within_their_width(seed):
    """The int8 estimates bracket each bound as the reference computes it (``upper <= U_j <= upper + width``, the
    same for ``L_j``), also for queries and keys with outlier channels and keys of very different sizes, and the
    width is under 1% of the bound's half-width, so few decisions are left to evaluate exactly."""
    key_cache, _, g = caches(seed=seed)
    key_cache[..., :3] *= 40  # outlier key channels
    key_cache[7] *= 1e-3  # a block of small keys: scales spanning decades
    blocks = table(700, consecutive=False, g=g)
    query = torch.randn(Q_HEADS, DIM, generator=g)
    query[:, 5] *= 60  # an outlier query channel
    upper, lower, width, want_upper, want_lower = estimates_against_reference(query, key_cache, blocks, SCALE)
    assert bool(((upper <= want_upper) & (want_upper <= upper + width)).all())
    assert bool(((lower <= want_lower) & (want_lower <= lower + width)).all())
    half = (want_upper - want_lower) / 2
    assert bool((width <= 0.01 * half).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_and_sketch_writes_what_the_references_write(dtype):
    """The CPU path's one-pass write stores and sketches exactly what ``store_kv_reference`` then
    ``sketch_written_reference`` do (the same roundings in the same order: compared with ``torch.equal``), padding
    slots (-1) skipped."""
    from kvreuse.kernels.key_sketch import sketch_written_reference
    from kvreuse.kernels.paged_write import store_kv_reference

    g = torch.Generator().manual_seed(3)
    key = torch.randn(7, KV_HEADS, DIM, generator=g)
    value = torch.randn(7, KV_HEADS, DIM, generator=g)
    slots = torch.tensor([5, 40, -1, 33, 200, -1, 71])
    got_k, got_v, _ = caches(dtype)
    want_k, want_v = got_k.clone(), got_v.clone()
    got_sketch, want_sketch = sketch_of(got_k), sketch_of(want_k)
    cpu_attention.store_and_sketch(key, value, got_k, got_v, got_sketch, slots)
    store_kv_reference(key, value, want_k, want_v, slots)
    sketch_written_reference(want_k, want_sketch, slots)
    for got, want in ((got_k, want_k), (got_v, want_v), (got_sketch.codes, want_sketch.codes)):
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert torch.equal(got_sketch.scales, want_sketch.scales)


def stale_tail(n: int, consecutive: bool, garbage: float):
    """A sequence of ``n`` tokens whose last block's slots past ``n`` hold ``garbage`` (what a freed block keeps of
    the request that used it before: NaN or inf where that request's arithmetic overflowed), and the same sequence
    with those slots clean."""
    clean_k, clean_v, g = caches()
    blocks = table(n, consecutive, g)
    query = torch.randn(Q_HEADS, DIM, generator=g)
    stale_k, stale_v = clean_k.clone(), clean_v.clone()
    last = int(blocks[(n - 1) // BLOCK])
    stale_k[last, n % BLOCK :] = garbage
    stale_v[last, n % BLOCK :] = garbage
    return query, blocks, (clean_k, clean_v), (stale_k, stale_v)


@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("beta", [float("inf"), 2.0])
@pytest.mark.parametrize("n", [1, 45, 300])
def test_a_decode_never_reads_the_stale_slots_of_its_last_block(garbage, beta, n):
    """The cross-request corruption of issue 26: a request whose arithmetic overflowed left NaN/inf K/V in its
    blocks; freed, a block goes to another request, which overwrites only the slots it fills. Its decode must give
    what it gives over a clean block: a zero softmax weight times a NaN value is NaN, so the stale slots must never
    enter the value product."""
    query, blocks, (clean_k, clean_v), (stale_k, stale_v) = stale_tail(n, consecutive=False, garbage=garbage)
    want = cpu_attention.dipr_decode(
        query, clean_k, clean_v, sketch_of(clean_k), blocks, n, beta, SCALE, SINK, LOCAL
    ).out
    got = cpu_attention.dipr_decode(query, stale_k, stale_v, sketch_of(stale_k), blocks, n, beta, SCALE, SINK, LOCAL)
    assert bool(torch.isfinite(got.out).all())
    assert torch.equal(got.out, want)
