"""The sparse backend's attention in PyTorch, for CPUs: what the Triton kernels compute, and no more work than
they do.

``SparseAttention`` runs these where the kernels do not (vLLM's CPU build). They attend exactly the tokens the
kernels attend (the kernels' PyTorch references in ``kvreuse.kernels`` are the specification, and the tests hold
these functions to them), but are written for a CPU:

- ``store_and_sketch``: the cache write and the key sketch in one pass;
- ``dense_causal``: dense causal attention of one request's new tokens through PyTorch's fused
  ``scaled_dot_product_attention`` (a FlashAttention-style CPU kernel that never holds the whole logit matrix);
- ``dense_decode`` and ``dipr_decode``: one decode token per sequence, over the paged cache block by block. DIPR
  brackets every key's sketch bounds with an int8 matrix product over the codes (``sketch_estimates``: a quarter
  of the keys' bytes, and exact integer arithmetic with a proven error bound), settles the kernel's decisions from
  them (evaluating the reference's bounds for the few they leave open), and computes exact logits and values only
  for the blocks it reads.

Reading the paged cache: ``key_cache[num_blocks, block_size, kv_heads, head_dim]`` is a strided view (in the vLLM
backend's layout a block holds K and V of every token; the key sketches lie apart), and PyTorch's gathers and
matrix products on such views fall back to slow element-wise copies. So ``gather_blocks``/``gather_kv`` copy whole
pages (one contiguous ``index_select``, K and V together) or, for consecutive blocks, take the view as it is; and the
matrix products run as one batched product over (token slot, KV head) (``head_logits``), whose operands are plain
strided matrices of the page view that BLAS takes without a copy. The number of PyTorch calls per layer does not
grow with the context: on a CPU shared by several processes each call that spawns threads may wait for a core, so
fewer calls matter as much as fewer bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # the kernels' modules import Triton; the CPU path needs only their constants, at call time
    from kvreuse.kernels.key_sketch import KeySketch

NEG_INF = float("-inf")
LEVELS = 3  # int8 levels of the query in sketch_estimates: each leaves a rest 254 times smaller


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``cache[blocks]`` for a paged tensor ``cache[num_blocks, ...]`` (last dimension contiguous): a view when the
    blocks are consecutive, else one copy of each block's span of memory (with ``cache``'s strides within a block)."""
    blocks = blocks.long()
    if len(blocks) == 0 or (len(blocks) == 1 or bool((blocks[1:] - blocks[:-1] == 1).all())):
        first = int(blocks[0]) if len(blocks) else 0
        return cache[first : first + len(blocks)]
    inner = cache.shape[1:]
    span = 1 + sum((size - 1) * stride for size, stride in zip(inner, cache.stride()[1:]))
    rows = cache.as_strided((cache.shape[0], span), (cache.stride(0), 1), cache.storage_offset())
    return rows.index_select(0, blocks).as_strided((len(blocks), *inner), (span, *cache.stride()[1:]))


def gather_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, blocks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gather_blocks`` of both caches; where they are views of the same pages (vLLM's: a page holds each token's K
    then V), scattered blocks are copied once for both: one ``index_select`` of each page's span from its first key
    element to its last value element."""
    blocks = blocks.long()
    delta = value_cache.storage_offset() - key_cache.storage_offset()
    shared = (
        key_cache.untyped_storage().data_ptr() == value_cache.untyped_storage().data_ptr()
        and key_cache.shape == value_cache.shape
        and key_cache.stride() == value_cache.stride()
        and 0 <= delta < key_cache.stride(0)
    )
    if not shared or len(blocks) <= 1 or bool((blocks[1:] - blocks[:-1] == 1).all()):
        return gather_blocks(key_cache, blocks), gather_blocks(value_cache, blocks)
    inner, strides = key_cache.shape[1:], key_cache.stride()[1:]
    span = delta + 1 + sum((size - 1) * stride for size, stride in zip(inner, strides))
    rows = key_cache.as_strided((key_cache.shape[0], span), (key_cache.stride(0), 1), key_cache.storage_offset())
    pages = rows.index_select(0, blocks)
    shape = (len(blocks), *inner)
    return pages.as_strided(shape, (span, *strides), 0), pages.as_strided(shape, (span, *strides), delta)


def sequence_tokens(cache: torch.Tensor, blocks: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` tokens of a sequence held in ``blocks``: ``[seq_len, kv_heads, head_dim]``."""
    block_size = cache.shape[1]
    return gather_blocks(cache, blocks[: -(-seq_len // block_size)]).reshape(-1, *cache.shape[2:])[:seq_len]


def head_logits(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``q[kv, g, d] . k`` for the keys of ``keys[blocks, block_size, kv, d]``: ``[kv, g, blocks * block_size]``.

    One batched product over (token slot, KV head): for slot ``t`` of every block and KV head ``h``, the ``[g, d]``
    query times the ``[d, blocks]`` keys of that slot, which is a plain strided matrix of the page view (rows a block
    apart), so BLAS reads the keys where they lie and the call count does not grow with the context."""
    blocks, block_size, kv, dim = keys.shape
    group = q.shape[1]
    by_slot = keys.permute(1, 2, 0, 3).reshape(block_size * kv, blocks, dim)  # a view when tokens hold all heads
    q_slots = q.expand(block_size, kv, group, dim).reshape(block_size * kv, group, dim)
    logits = torch.bmm(q_slots, by_slot.transpose(1, 2).to(q.dtype))  # [block_size * kv, g, blocks]
    return logits.view(block_size, kv, group, blocks).permute(1, 2, 3, 0).reshape(kv, group, blocks * block_size)


def head_values(weights: torch.Tensor, values: torch.Tensor, last_block_tokens: int | None = None) -> torch.Tensor:
    """``sum_j weights[kv, g, j] v_j`` for the values of ``values[blocks, block_size, kv, d]``: ``[kv, g, d]``, one
    batched product over (token slot, KV head) as in ``head_logits``, then a sum over the slots.

    ``last_block_tokens``: only that many slots of the last block hold the sequence's tokens. The slots after them
    are never read, not even with a zero weight: a freed block keeps what its last request wrote there, NaN or inf
    where that request's arithmetic overflowed, and ``0 * nan`` is NaN (issue 26: one request's overflow corrupted
    other tenants' decodes through the blocks it left behind)."""
    blocks, block_size, kv, dim = values.shape
    group = weights.shape[1]
    w = weights.reshape(kv, group, blocks, block_size).permute(3, 0, 1, 2)  # [block_size, kv, g, blocks]
    by_slot = values.permute(1, 2, 0, 3)  # [block_size, kv, blocks, d]: a view when tokens hold all heads
    live = block_size if last_block_tokens is None else last_block_tokens
    out = _slot_products(w[:live], by_slot[:live])
    if live < block_size and blocks > 1:  # the later slots: every block but the last
        out = out + _slot_products(w[live:, ..., :-1], by_slot[live:, :, :-1])
    return out


def _slot_products(w: torch.Tensor, by_slot: torch.Tensor) -> torch.Tensor:
    """``w[slots, kv, g, blocks] @ by_slot[slots, kv, blocks, d]`` summed over the slots: ``[kv, g, d]``."""
    slots, kv, group, blocks = w.shape
    dim = by_slot.shape[-1]
    products = torch.bmm(w.reshape(slots * kv, group, blocks), by_slot.reshape(slots * kv, blocks, dim).to(w.dtype))
    return products.view(slots, kv, group, dim).sum(0)


def softmax_attend(
    logits: torch.Tensor, keep: torch.Tensor, values: torch.Tensor, last_block_tokens: int | None = None
) -> torch.Tensor:
    """Softmax of ``logits[kv, g, m]`` over the tokens where ``keep`` (broadcast to it), applied to ``values``
    (``head_values``, with ``last_block_tokens``). Every row keeps a token (a decode's window is never empty)."""
    weights = torch.softmax(logits.masked_fill(~keep, NEG_INF), dim=-1)
    return head_values(weights, values, last_block_tokens)


def store_and_sketch(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    sketch: KeySketch,
    slot_mapping: torch.Tensor,
) -> None:
    """``store_kv_reference`` then ``sketch_written_reference`` (``kvreuse.kernels``), in one pass: the tokens with
    a non-negative slot are stored, and their keys, as stored (in the cache's dtype), sketched from the step's
    tensor instead of read back from the cache."""
    n = min(len(slot_mapping), len(key))
    slots = slot_mapping[:n].long()
    valid = slots >= 0
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[:n][valid], value[:n][valid]
    else:
        key, value = key[:n], value[:n]
    if len(slots) == 0:
        return
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    stored = key.to(key_cache.dtype)
    key_cache[blocks, offsets] = stored
    value_cache[blocks, offsets] = value.to(value_cache.dtype)
    _sketch_at(stored, sketch, blocks, offsets)


def _sketch_at(stored: torch.Tensor, sketch: KeySketch, blocks: torch.Tensor, offsets: torch.Tensor) -> None:
    from kvreuse.kernels.key_sketch import sketch_reference

    codes, scales = sketch_reference(stored)
    sketch.codes[blocks, offsets] = codes
    sketch.scales[blocks, offsets] = scales


# ---------------------------------------------------------------------------------------------------- prefill


def dense_causal(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """``query[q_len, q_heads, d]`` (the last ``q_len`` tokens of the sequence) attending causally to
    ``keys``/``values[seq_len, kv_heads, d]``: ``[q_len, q_heads, d]`` in the query's dtype.

    A fresh prompt (``q_len == seq_len``) takes the fused kernel's causal mode; a chunk after cached context
    passes its bottom-right causal mask.
    """
    q_len, seq_len = query.shape[0], keys.shape[0]
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, keys.to(query.dtype), values.to(query.dtype)))
    if q_len == seq_len:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril(seq_len - q_len)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def dense_at(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """``query[q_len, q_heads, d]``, the tokens at sequence ``positions[q_len]`` (any order, gaps allowed),
    attending to ``keys``/``values[seq_len, kv_heads, d]`` at or before their own position: ``[q_len, q_heads,
    d]`` in the query's dtype. What a step computes for tokens spread over a spliced run (module recompute)."""
    seq_len = keys.shape[0]
    mask = torch.arange(seq_len, device=positions.device)[None, :] <= positions[:, None]
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, keys.to(query.dtype), values.to(query.dtype)))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.device), scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


# ----------------------------------------------------------------------------------------------------- decode


@dataclass(frozen=True)
class DecodeResult:
    """One sequence's decode: ``out[q_heads, d]`` fp32, ``blocks_read[kv_heads]`` and ``tokens_attended
    [q_heads]`` (int64)."""

    out: torch.Tensor
    blocks_read: torch.Tensor
    tokens_attended: torch.Tensor


def dense_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    blocks: torch.Tensor,
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    """Dense decode attention of ``query[q_heads, d]`` over a sequence of ``seq_len`` tokens in ``blocks``:
    ``[q_heads, d]`` fp32."""
    block_size, kv = key_cache.shape[1], key_cache.shape[2]
    n_blocks = -(-seq_len // block_size)
    q = query.float().view(kv, -1, query.shape[-1]) * scale
    keys, values = gather_kv(key_cache, value_cache, blocks[:n_blocks])
    logits = head_logits(q, keys)
    logits[..., seq_len:] = NEG_INF  # the last block's slots past the sequence
    tail = seq_len - (n_blocks - 1) * block_size
    return head_values(torch.softmax(logits, dim=-1), values, tail).flatten(0, 1)


def window_positions(seq_len: int, sink: int, local: int) -> torch.Tensor:
    """Positions of the always-kept window: the first ``sink`` and the last ``local`` tokens (int64)."""
    sink_end = min(sink, seq_len)
    return torch.cat([torch.arange(sink_end), torch.arange(max(seq_len - local, sink_end), seq_len)])


def sketch_bounds_at(
    q: torch.Tensor, sketch: KeySketch, blocks: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sketch's upper and lower bounds ``[kv, g, len(positions)]`` on ``q[kv, g, d] . k`` for the keys at
    ``positions`` of a sequence (``blocks`` its block-table row), as ``logit_bounds_reference`` computes them."""
    from kvreuse.kernels.key_sketch import CODE_SLACK

    block_size = sketch.codes.shape[1]
    used, local = torch.unique(positions // block_size, return_inverse=True)
    offset = positions % block_size
    codes = gather_blocks(sketch.codes, blocks[used])[local, offset].float()  # [c, kv, d]
    scales = gather_blocks(sketch.scales, blocks[used])[local, offset].T[:, None, :]  # [kv, 1, c]
    approx = torch.einsum("kgd,ckd->kgc", q, codes) * scales
    half = q.abs().sum(-1, keepdim=True) * scales * (0.5 + CODE_SLACK)
    return approx + half, approx - half


def sketch_estimates(
    q: torch.Tensor, sketch: KeySketch, blocks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sketch's bounds ``U_j``, ``L_j`` on ``q[kv, g, d] . k_j`` for every key of ``blocks``, estimated with
    integer arithmetic: ``(upper, lower, width)``, each ``[kv, g, n]`` (``n = blocks * block_size``),
    such that ``upper <= U_j <= upper + width`` and ``lower <= L_j <= lower + width`` for the bounds *as the reference
    computes them in fp32* (``logit_bounds_reference``).

    The bounds are ``s_j (q . u_j) +- s_j ||q||_1 (1/2 + CODE_SLACK)`` for the codes ``u_j`` and scale ``s_j``. The
    codes are int8, a quarter of the fp32 keys' bytes; an int8 matrix product (``torch._int_mm``, exact in int32)
    reads them as they are, where a float product would first widen them to the keys' size. The query, fp32, is
    written in ``LEVELS`` int8 levels: ``q = s1 q1 + s2 q2 + s3 q3 + e`` with ``q1 = round(q / s1)``, ``s1 = max_c
    |q_c| / 127``, and each further level the same of the rest, so ``|e_c| <= max_c |q_c| / (2 * 254**2 * 127)``.
    Then, as ``|u_jc| <= 127``,

        q . u_j = s1 (q1 . u_j) + s2 (q2 . u_j) + s3 (q3 . u_j) + e . u_j,   |e . u_j| <= 127 ||e||_1,

    and the integer products are exact (``|q1 . u_j| <= 127**2 d < 2**24``, so exact in fp32 too). The fp32
    arithmetic on top (the levels' weighted sum, the rest ``e`` itself computed in fp32, adding the half-width,
    the product with ``s_j``, the width) rounds a few times, each within ``u = 2**-24`` of terms at most ``127 (1 +
    d / 254) ||q||_1`` (times ``s_j``); the reference's own evaluation (a ``d``-term fp32 dot product, then ``*
    s_j``, plus its half-width) lands within ``(d + 4) u 127 s_j ||q||_1`` of the real bound. So an estimate ``s_j
    (I +- h)`` of the levels' sum ``I`` is within ``127 s_j (||e||_1 + (2 d + 16) u ||q||_1) = s_j m / 2`` of the
    reference's bound; ``upper`` and ``lower`` are those estimates less ``s_j m`` and ``width = 2 s_j m``, which
    leaves the other half of the margin ``m`` for the roundings of these two steps. ``m`` comes to ~0.1% of the
    half-width; it only chooses which keys ``dipr_decode`` evaluates exactly, so a wider one would cost a few
    evaluations and a narrower one could change a decision.
    """
    from kvreuse.kernels.key_sketch import CODE_MAX, CODE_SLACK

    kv, group, dim = q.shape
    block_size = sketch.codes.shape[1]
    n = len(blocks) * block_size
    codes = gather_blocks(sketch.codes, blocks).reshape(n, kv * dim)  # tokens x (head, channel), int8
    scales = gather_blocks(sketch.scales, blocks).reshape(n, kv).T[:, None, :]  # [kv, 1, n]
    # Block-diagonal int8 [LEVELS * kv * g, kv * d]: row (level, h, i) holds query head (h, i) on KV head h's
    # columns; and the fp32 [kv * g, LEVELS * kv * g] that weighs each level's row by its step.
    matrix = torch.zeros(LEVELS, kv, group, kv, dim, dtype=torch.int8)
    weigh = torch.zeros(kv * group, LEVELS, kv * group)
    heads, rows = torch.arange(kv), torch.arange(kv * group)
    rest = q
    for i in range(LEVELS):
        step = rest.abs().amax(-1, keepdim=True) / CODE_MAX  # [kv, g, 1]
        level = torch.where(step > 0, torch.round(rest / torch.where(step > 0, step, 1.0)), 0.0).clamp_(-127, 127)
        rest = rest - step * level
        matrix[i, heads, :, heads] = level.to(torch.int8)
        weigh[rows, i, rows] = step.flatten()
    # Head-major ([rows, tokens]): the int8 product runs ~2x and the fp32 ops after it ~4x faster than token-major.
    dots = torch._int_mm(matrix.view(LEVELS * kv * group, kv * dim), codes.T)  # exact
    estimate = torch.mm(weigh.view(kv * group, LEVELS * kv * group), dots.float()).view(kv, group, n)
    unit = torch.finfo(torch.float32).eps / 2
    q_norm = q.abs().sum(-1, keepdim=True)  # [kv, g, 1]
    margin = 2 * CODE_MAX * (rest.abs().sum(-1, keepdim=True) + (2 * dim + 16) * unit * q_norm)
    half = q_norm * (0.5 + CODE_SLACK)
    return (estimate + (half - margin)) * scales, (estimate - (half + margin)) * scales, 2 * margin * scales


def dipr_read_blocks(
    q: torch.Tensor, sketch: KeySketch, blocks: torch.Tensor, seq_len: int, beta: float, sink: int, local: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks DIPR reads for the scaled query ``q[kv, g, d]`` over a sequence of ``seq_len`` tokens in
    ``blocks`` (its first ``ceil(seq_len / block_size)`` block ids, int64), decided from the key sketch alone:
    ``(read[kv, n_blocks] bool, tau[kv, g, 1])``, the kernel's decisions (see ``dipr_decode``).

    ``tau = max_j L_j - beta``; a block is read by a KV head if it holds a window token or a key whose upper bound
    ``U_j`` reaches ``tau`` for one of the head's queries. Every bound is first bracketed by ``sketch_estimates``
    within a width ``w_j``; the few decisions the brackets leave open are taken on the bounds as the reference
    computes them (``sketch_bounds_at``). No key is read: this is the filter a paged attention kernel can run
    behind (``kvreuse.sparse.pruned``), and every key whose logit is within ``beta`` of the largest lies in a read
    block of its KV head."""
    kv, group = q.shape[0], q.shape[1]
    block_size = sketch.codes.shape[1]
    n_blocks = len(blocks)
    upper, lower, width = sketch_estimates(q, sketch, blocks)  # [kv, g, n]
    upper[..., seq_len:] = lower[..., seq_len:] = NEG_INF  # the last block's slots past the sequence: anything
    width[..., seq_len:] = 0.0  # (their sketch may be a NaN a freed block kept)
    width = width.amax(-1, keepdim=True)  # [kv, g, 1]: the widest bracket, which settles as much as each token's
    # tau: the largest lower bound, attained among the tokens whose estimated lower bound may be the largest
    near = lower >= lower.amax(-1, keepdim=True) - width
    at = near.any(1).any(0).nonzero().flatten()
    tau = sketch_bounds_at(q, sketch, blocks, at)[1].masked_fill_(~near[..., at], NEG_INF).amax(-1, keepdim=True)
    tau = tau - beta  # [kv, g, 1]
    # blocks read: an upper bound that reaches tau; a block whose estimates leave it open (its largest upper - tau
    # within the widest bracket below 0) is decided on the bounds of its tokens
    reach = (upper - tau).view(kv, group, n_blocks, block_size).amax(-1).amax(1)  # [kv, n_blocks]
    read = reach >= 0
    open_ = (reach + width.amax(1) >= 0) & ~read
    undecided = open_.any(0).nonzero().flatten()
    if len(undecided):
        at = (undecided[:, None] * block_size + torch.arange(block_size)).flatten()
        hit = (sketch_bounds_at(q, sketch, blocks, at)[0] >= tau).any(1) & (at < seq_len)  # [kv, len(at)]
        read[:, undecided] |= hit.view(kv, len(undecided), block_size).any(-1) & open_[:, undecided]
    read[:, window_positions(seq_len, sink, local) // block_size] = True
    return read, tau


def dipr_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    sketch: KeySketch,
    blocks: torch.Tensor,
    seq_len: int,
    beta: float,
    scale: float,
    sink: int,
    local: int,
) -> DecodeResult:
    """DIPR decode of ``query[q_heads, d]`` over a sequence of ``seq_len`` tokens in ``blocks``: the output, blocks
    read and tokens attended of ``DIPRDecode`` (see ``kvreuse.kernels.dipr_decode``), computed the CPU's way.

    The kernel's decisions come from the sketch's bounds ``U_j``, ``L_j``: ``tau = max_j L_j - beta``, a block is
    read if it holds a window token or a ``U_j >= tau``, and a read block's token is attended if it is in the window
    or ``l_j >= tau``. Here every bound is first bracketed by ``sketch_estimates`` (an int8 product over the
    codes, a quarter of the keys' bytes) within a width ``w_j`` (~0.2% of the bound's half-width); a decision the
    brackets settle is the kernel's, and the few they leave open are taken on the bounds computed as the reference
    does (``sketch_bounds_at``): for ``tau``, the tokens whose lower bound may be the largest; for the blocks, the
    tokens whose upper bound's bracket holds ``tau``. Exact logits and values are then computed
    only for the blocks some KV head reads, so a smaller beta reads and computes less; a token is attended where
    the reference attends it (its KV head reads its block, and it is in the window or ``l_j >= tau``).
    ``beta = inf`` is dense decode.
    """
    block_size, kv = key_cache.shape[1], key_cache.shape[2]
    n_blocks = -(-seq_len // block_size)
    blocks = blocks[:n_blocks].long()
    q = query.float().view(kv, -1, query.shape[-1]) * scale  # [kv, g, d]
    group = q.shape[1]
    if beta == float("inf"):
        out = dense_decode(query, key_cache, value_cache, blocks, seq_len, scale)
        return DecodeResult(
            out, torch.full((kv,), n_blocks, dtype=torch.int64), torch.full((kv * group,), seq_len, dtype=torch.int64)
        )
    read, tau = dipr_read_blocks(q, sketch, blocks, seq_len, beta, sink, local)
    # exact logits and values of the blocks some KV head reads
    needed = read.any(0).nonzero().flatten()
    keys, values = gather_kv(key_cache, value_cache, blocks[needed])
    logits = head_logits(q, keys)  # [kv, g, m]
    pos = (needed[:, None] * block_size + torch.arange(block_size)).flatten()
    is_window = (pos < sink) | (pos >= seq_len - local)
    reads = read[:, needed].repeat_interleave(block_size, dim=1)[:, None, :]  # [kv, 1, m]
    keep = reads & (pos < seq_len) & (is_window | (logits >= tau))
    tail = seq_len - (n_blocks - 1) * block_size if int(needed[-1]) == n_blocks - 1 else block_size
    out = softmax_attend(logits, keep, values, tail)
    return DecodeResult(out.flatten(0, 1), read.sum(1), keep.sum(-1).flatten())
