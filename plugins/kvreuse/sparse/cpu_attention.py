"""The sparse backend's attention in PyTorch, for CPUs: what the Triton kernels compute, and no more work than
they do.

``SparseAttention`` runs these where the kernels do not (vLLM's CPU build). They attend exactly the tokens the
kernels attend (the kernels' PyTorch references in ``kvreuse.kernels`` are the specification, and the tests hold
these functions to them), but are written for a CPU:

- ``dense_causal``: dense causal attention of one request's new tokens through PyTorch's fused
  ``scaled_dot_product_attention`` (a FlashAttention-style CPU kernel that never holds the whole logit matrix);
- ``dense_decode`` and ``dipr_decode``: one decode token per sequence, over the paged cache block by block. DIPR
  computes every exact logit (on a CPU as cheap as the sketch's bounds) and reads values only for the blocks
  holding an attended token; what the kernel would read, it works out from the sketch of a few tokens.

Reading the paged cache: ``key_cache[num_blocks, block_size, kv_heads, head_dim]`` is a strided view (in vLLM one
page holds K and V of every token, then the key sketch), and PyTorch's gathers and matrix products on such views
fall back to slow element-wise copies. So ``gather_blocks`` copies whole pages (one contiguous ``index_select``,
tens of microseconds) or, for consecutive blocks, takes the view as it is; and the matrix products run per KV head
as batched products over blocks (``torch.bmm`` of ``[blocks, block_size, head_dim]`` matrices), whose strides
BLAS takes without a copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # the kernels' modules import Triton; the CPU path needs only their constants, at call time
    from kvreuse.kernels.key_sketch import KeySketch

NEG_INF = float("-inf")


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


def sequence_tokens(cache: torch.Tensor, blocks: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` tokens of a sequence held in ``blocks``: ``[seq_len, kv_heads, head_dim]``."""
    block_size = cache.shape[1]
    return gather_blocks(cache, blocks[: -(-seq_len // block_size)]).reshape(-1, *cache.shape[2:])[:seq_len]


def head_logits(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``q[kv, g, d] . k`` for the keys of ``keys[blocks, block_size, kv, d]``: ``[kv, g, blocks * block_size]``,
    one batched product per KV head."""
    blocks, block_size, kv, dim = keys.shape
    group = q.shape[1]
    per_head = [
        torch.bmm(q[h].expand(blocks, group, dim), keys[:, :, h].transpose(1, 2).to(q.dtype)) for h in range(kv)
    ]
    return torch.stack(per_head).transpose(1, 2).reshape(kv, group, blocks * block_size)


def head_values(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``sum_j weights[kv, g, j] v_j`` for the values of ``values[blocks, block_size, kv, d]``: ``[kv, g, d]``."""
    blocks, block_size, kv, _ = values.shape
    w = weights.view(kv, weights.shape[1], blocks, block_size).transpose(1, 2)  # [kv, blocks, g, block_size]
    return torch.stack([torch.bmm(w[h], values[:, :, h].to(w.dtype)).sum(0) for h in range(kv)])


def softmax_attend(logits: torch.Tensor, keep: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Softmax of ``logits[kv, g, m]`` over the tokens where ``keep`` (broadcast to it), applied to ``values``
    (``head_values``). Every row keeps a token (a decode's window is never empty)."""
    weights = torch.softmax(logits.masked_fill(~keep, NEG_INF), dim=-1)
    return head_values(weights, values)


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
    keys, values = gather_blocks(key_cache, blocks[:n_blocks]), gather_blocks(value_cache, blocks[:n_blocks])
    in_seq = torch.arange(n_blocks * block_size) < seq_len
    return softmax_attend(head_logits(q, keys), in_seq, values).flatten(0, 1)


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

    On a CPU the sketch saves nothing: turning int8 codes into floats costs what reading the fp32 keys does (in
    the engine the sketch pass took 63% of DIPR's time, more than dense attention). So this computes every exact
    logit (one batched product per KV head over the blocks, in place) and reads values only for the blocks
    holding an attended token. The kernel's decisions come out the same because the sketch's bounds lie within
    ``2 w_j`` of the exact logit (``w_j`` the bound's half-width): ``tau`` (the largest lower bound, minus
    ``beta``) is attained among the tokens whose logit is within ``2 max_j w_j`` of the largest, and a block's
    read decision is open only for tokens with ``tau - 2 w_j <= l_j < tau``; the sketch is evaluated for those
    few tokens only. The attended set ``W ∪ {j : l_j >= tau}`` needs no bound. ``beta = inf`` is dense decode.
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
    from kvreuse.kernels.key_sketch import CODE_SLACK

    n = n_blocks * block_size
    in_seq = torch.arange(n) < seq_len
    logits = head_logits(q, gather_blocks(key_cache, blocks)).masked_fill_(~in_seq, NEG_INF)  # [kv, g, n]
    scales = gather_blocks(sketch.scales, blocks).reshape(n, kv).T[:, None, :]  # [kv, 1, n]
    reach = 2 * (0.5 + CODE_SLACK) * q.abs().sum(-1, keepdim=True) * scales  # 2 w_j: |bound - l_j| <= 2 w_j
    reach.masked_fill_(~in_seq, 0.0)  # slots past the sequence may hold anything
    # tau: the largest lower bound, attained among the tokens within 2 max_j w_j of the largest logit
    near = logits >= logits.amax(-1, keepdim=True) - reach.amax(-1, keepdim=True)
    at = near.any(1).any(0).nonzero().flatten()
    lower = sketch_bounds_at(q, sketch, blocks, at)[1].masked_fill_(~near[..., at], NEG_INF)
    tau = lower.amax(-1, keepdim=True) - beta  # [kv, g, 1]
    # blocks read: a logit at or above tau, or an upper bound that reaches it (open only within 2 w_j below tau)
    sure = logits >= tau
    open_ = (logits + reach >= tau) & ~sure
    at = open_.any(1).any(0).nonzero().flatten()
    reached = (sketch_bounds_at(q, sketch, blocks, at)[0] >= tau) & open_[..., at]
    hit = sure.any(1)  # [kv, n]
    hit[:, at] |= reached.any(1)
    read = hit.view(kv, n_blocks, block_size).any(-1)
    read[:, window_positions(seq_len, sink, local) // block_size] = True
    pos = torch.arange(n)
    is_window = (pos < sink) | (pos >= seq_len - local)
    keep = in_seq & (is_window | (logits >= tau))  # [kv, g, n]
    needed = keep.any(1).any(0).view(n_blocks, block_size).any(-1).nonzero().flatten()  # blocks holding a kept token
    logits = logits.view(kv, group, n_blocks, block_size)[:, :, needed].flatten(2)
    keep = keep.view(kv, group, n_blocks, block_size)[:, :, needed].flatten(2)
    out = softmax_attend(logits, keep, gather_blocks(value_cache, blocks[needed]))
    return DecodeResult(out.flatten(0, 1), read.sum(1), keep.sum(-1).flatten())
