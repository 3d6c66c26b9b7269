"""The sparse backend's attention in PyTorch, for CPUs: what the Triton kernels compute, and no more work than
they do.

``SparseAttention`` runs these where the kernels do not (vLLM's CPU build). They attend exactly the tokens the
kernels attend (the kernels' PyTorch references in ``kvreuse.kernels`` are the specification, and the tests hold
these functions to them), but are written for a CPU:

- ``dense_causal``: dense causal attention of one request's new tokens through PyTorch's fused
  ``scaled_dot_product_attention`` (a FlashAttention-style CPU kernel that never holds the whole logit matrix);
- ``dense_decode`` and ``dipr_decode``: one decode token per sequence, over the paged cache *in place*. A run of
  consecutive blocks is a strided view of the cache (no copy; vLLM usually hands a sequence such runs), and DIPR
  computes logits only for the blocks its bounds cannot exclude, gathering just those.

Paged cache access: ``token_rows`` views ``key_cache[num_blocks, block_size, kv_heads, head_dim]`` as one row per
token slot, ``[num_blocks * rows_per_page, kv_heads, head_dim]``. In vLLM's page (``block_size`` token rows plus
the bounds row that kvreuse's vLLM backend adds) ``rows_per_page = block_size + 1``; the extra rows are never
attended (masked), only sometimes computed as part of a view, which costs one row in ``rows_per_page``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")


@dataclass(frozen=True)
class TokenRows:
    """A paged cache viewed as token rows: ``rows[num_blocks * per_page, kv_heads, head_dim]``; the token at
    ``offset`` of block ``b`` is row ``b * per_page + offset`` (``offset < block_size``)."""

    rows: torch.Tensor
    per_page: int
    block_size: int


def token_rows(cache: torch.Tensor) -> TokenRows:
    """``cache`` as ``TokenRows``: a view if its block stride is a whole number of token strides, else a copy
    (a cache that does not fit that view is gathered once per call)."""
    num_blocks, block_size, heads, dim = cache.shape
    block_stride, token_stride, head_stride, _ = cache.stride()
    if cache.stride(-1) == 1 and token_stride > 0 and block_stride % token_stride == 0:
        per_page = block_stride // token_stride
        if per_page >= block_size:
            needed = (
                cache.storage_offset() + (num_blocks * per_page - 1) * token_stride + (heads - 1) * head_stride + dim
            )
            if needed <= cache.untyped_storage().nbytes() // cache.element_size():
                rows = cache.as_strided(
                    (num_blocks * per_page, heads, dim), (token_stride, head_stride, 1), cache.storage_offset()
                )
                return TokenRows(rows, per_page, block_size)
    return TokenRows(cache.reshape(num_blocks * block_size, heads, dim), block_size, block_size)


def block_rows(blocks: torch.Tensor, pages: TokenRows) -> torch.Tensor:
    """Row indices ``[len(blocks) * block_size]`` of the token slots of ``blocks`` (int64), in block order."""
    offsets = torch.arange(pages.block_size, dtype=torch.int64)
    return (blocks.long()[:, None] * pages.per_page + offsets[None, :]).flatten()


def gather_sequence(pages: TokenRows, blocks: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` tokens of a sequence (its ``blocks``, in order), ``[seq_len, kv_heads, head_dim]``:
    a view when the blocks are consecutive, else a gather."""
    first = int(blocks[0]) if len(blocks) else 0
    if len(blocks) == 1 or (len(blocks) > 1 and bool((blocks[1:] - blocks[:-1] == 1).all())):
        if pages.per_page == pages.block_size:
            start = first * pages.per_page
            return pages.rows[start : start + seq_len]
    return pages.rows.index_select(0, block_rows(blocks, pages)[:seq_len])


# ---------------------------------------------------------------------------------------------------- prefill


def dense_causal(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
) -> torch.Tensor:
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


# ----------------------------------------------------------------------------------------------------- decode


@dataclass(frozen=True)
class DecodeResult:
    """One sequence's decode: ``out[q_heads, d]`` fp32, ``blocks_read[kv_heads]`` and ``tokens_attended
    [q_heads]`` (int64)."""

    out: torch.Tensor
    blocks_read: torch.Tensor
    tokens_attended: torch.Tensor


def _sequence_rows(pages: TokenRows, blocks: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows to read for a sequence's ``blocks`` and each row's position in the sequence (``-1``: not a token of
    it). Consecutive blocks give a range of rows (read as a view, padding rows included and masked); others give
    the exact rows, to be gathered."""
    n = len(blocks)
    if n and bool((blocks[1:] - blocks[:-1] == 1).all()):
        start = int(blocks[0]) * pages.per_page
        offset = torch.arange(n * pages.per_page)
        pos = (offset // pages.per_page) * pages.block_size + offset % pages.per_page
        valid = (offset % pages.per_page < pages.block_size) & (pos < seq_len)
        return torch.arange(start, start + n * pages.per_page), torch.where(valid, pos, -1)
    rows = block_rows(blocks, pages)[:seq_len]
    return rows, torch.arange(len(rows))


def _read(pages: TokenRows, rows: torch.Tensor) -> torch.Tensor:
    """``pages.rows[rows]``: a view for a range of consecutive rows, else a gather."""
    if len(rows) and int(rows[-1]) - int(rows[0]) == len(rows) - 1:
        return pages.rows[int(rows[0]) : int(rows[-1]) + 1]
    return pages.rows.index_select(0, rows)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor | None, logits=None):
    """Softmax attention of ``q[kv, g, d]`` (already scaled) over ``keys``/``values[m, kv, d]`` where ``keep
    [kv, g, m]`` (``None``: everywhere): ``[kv, g, d]`` fp32."""
    if logits is None:
        logits = torch.matmul(q, keys.permute(1, 2, 0).to(q.dtype))
    if keep is not None:
        logits = logits.masked_fill(~keep, NEG_INF)
    weights = torch.softmax(logits, dim=-1).nan_to_num_(0.0)
    return torch.matmul(weights, values.transpose(0, 1).to(q.dtype))


def dense_decode(
    query: torch.Tensor, key_pages: TokenRows, value_pages: TokenRows, blocks: torch.Tensor, seq_len: int, scale: float
) -> torch.Tensor:
    """Dense decode attention of ``query[q_heads, d]`` over a sequence of ``seq_len`` tokens in ``blocks``:
    ``[q_heads, d]`` fp32."""
    kv = key_pages.rows.shape[1]
    q = query.float().view(kv, -1, query.shape[-1]) * scale
    rows, pos = _sequence_rows(key_pages, blocks[: -(-seq_len // key_pages.block_size)], seq_len)
    keys, values = _read(key_pages, rows), _read(value_pages, rows)
    valid = pos >= 0
    keep = None if bool(valid.all()) else valid.expand(q.shape[0], q.shape[1], -1)
    return _attend(q, keys, values, keep).flatten(0, 1)


def window_positions(seq_len: int, sink: int, local: int) -> torch.Tensor:
    """Positions of the always-kept window: the first ``sink`` and the last ``local`` tokens (int64)."""
    sink_end = min(sink, seq_len)
    return torch.cat([torch.arange(sink_end), torch.arange(max(seq_len - local, sink_end), seq_len)])


def dipr_decode(
    query: torch.Tensor,
    key_pages: TokenRows,
    value_pages: TokenRows,
    bounds: torch.Tensor,
    blocks: torch.Tensor,
    seq_len: int,
    beta: float,
    scale: float,
    sink: int,
    local: int,
    slack: float,
) -> DecodeResult:
    """DIPR decode of ``query[q_heads, d]`` over a sequence of ``seq_len`` tokens in ``blocks``, attending what
    ``DIPRDecode`` attends (see ``kvreuse.kernels.dipr_decode``): the window, and in the blocks whose bound
    reaches ``tau = s - beta`` for a query head of the KV head's group, the tokens at or above ``tau``.

    Work: the window's logits, one bound per block (two small matrix products over ``bounds[blocks]``), and logits
    and values only for the blocks read (the union over KV heads, gathered; a KV head ignores blocks it does not
    read). ``beta = inf`` reads everything, as dense decode, without the window or the bounds.
    """
    block_size = key_pages.block_size
    n_blocks = -(-seq_len // block_size)
    blocks = blocks[:n_blocks]
    kv = key_pages.rows.shape[1]
    q = query.float().view(kv, -1, query.shape[-1]) * scale  # [kv, g, d]
    group = q.shape[1]
    if beta == float("inf"):
        out = dense_decode(query, key_pages, value_pages, blocks, seq_len, scale)
        return DecodeResult(
            out, torch.full((kv,), n_blocks, dtype=torch.int64), torch.full((kv * group,), seq_len, dtype=torch.int64)
        )
    window = window_positions(seq_len, sink, local)
    window_rows = blocks[window // block_size].long() * key_pages.per_page + window % block_size
    window_logits = torch.matmul(q, key_pages.rows.index_select(0, window_rows).permute(1, 2, 0).float())
    tau = window_logits.amax(-1, keepdim=True) - beta  # [kv, g, 1]
    b = bounds.index_select(0, blocks.long()).float()  # [n_blocks, kv, 2, d]
    hi, lo = b[:, :, 0].permute(1, 2, 0), b[:, :, 1].permute(1, 2, 0)  # [kv, d, n_blocks]
    upper = torch.matmul(q.clamp(min=0), hi) + torch.matmul(q.clamp(max=0), lo)  # Quest's bound, [kv, g, n_blocks]
    size = torch.matmul(q.abs(), torch.maximum(hi.abs(), lo.abs()))
    read = (upper + slack * size >= tau).any(1)  # [kv, n_blocks]
    in_window = torch.zeros(n_blocks, dtype=torch.bool)
    in_window[window // block_size] = True
    read |= in_window
    union = read.any(0).nonzero().flatten()
    rows = block_rows(blocks[union], key_pages)
    pos = (union[:, None] * block_size + torch.arange(block_size)).flatten()
    keys, values = _read(key_pages, rows), _read(value_pages, rows)
    logits = torch.matmul(q, keys.permute(1, 2, 0).float())  # [kv, g, m]
    head_reads = read[:, union].repeat_interleave(block_size, dim=1)[:, None, :]  # [kv, 1, m]
    in_seq = pos < seq_len
    is_window = (pos < sink) | (pos >= seq_len - local)
    keep = head_reads & in_seq & (is_window | (logits >= tau))
    out = _attend(q, keys, values, keep, logits)
    return DecodeResult(out.flatten(0, 1), read.sum(1), keep.sum(-1).flatten())
