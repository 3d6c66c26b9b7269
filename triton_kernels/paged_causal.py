"""Dense causal attention of a batch of requests over vLLM's paged KV cache: prefill, chunked prefill and decode.

The sparse backend's dense path. Every request in the batch has ``q_len >= 1`` new tokens (the last ``q_len`` of its
``seq_len`` tokens, whose keys and values are already in the cache) and each new token at position ``p`` attends to
positions ``0..p`` of its own request: a prefill chunk attends to the request's cached context and to itself, a
decode token (``q_len = 1``) to everything. One launch covers the whole batch, any mix of those.

The kernel is FlashAttention's forward pass (Dao et al., "FlashAttention: Fast and Memory-Efficient Exact Attention
with IO-Awareness", NeurIPS 2022) over pages: a program holds a tile of one request's query tokens, for all query
heads of one KV head (grouped-query attention: each K/V page is loaded once for the whole group), walks the
request's pages up to the tile's last causal position with an online softmax (Milakov and Gimelshein, "Online
normalizer calculation for softmax", 2018), and writes the normalised output. Keys and values past that position
are never loaded (masked loads), so slots beyond a request's length may hold anything.

Layouts: ``query``/``out[num_tokens, num_q_heads, head_dim]`` (query head ``h`` uses KV head ``h // (num_q_heads //
num_kv_heads)``, as in vLLM); ``key_cache``/``value_cache[num_blocks, block_size, num_kv_heads, head_dim]`` (any
strides, last dimension contiguous) as in ``paged_layout.py``; per request ``i`` of the batch: its new tokens are
rows ``query_starts[i] .. query_ends[i] - 1`` of ``query``, ``seq_lens[i]`` counts all its tokens (context and new),
``block_table[i]`` lists its blocks (int32). A sub-batch is given by picking entries of these per-request tensors.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvreuse.errors import check_kernel_argument as _check
from kvreuse.kernels.paged_layout import check_paged_kv
from kvreuse.kernels.tile_math import dot_fp32, interpreter_upcast, online_softmax_step

# Query rows (query tokens x query heads of one KV head) per program. 64 rows fill a tensor-core tile of an
# H100 with a 64-wide head and keep the fp32 accumulator (64 x head_dim) in registers.
ROWS_PER_TILE = 64


@triton.jit
def _paged_causal_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    q_starts_ptr,
    q_ends_ptr,
    seq_lens_ptr,
    block_table_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_P2: tl.constexpr,  # next power of two >= GROUP: row r is query token r // GROUP_P2, head r % GROUP_P2
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # rows per program, max(16, BLOCK_Q * GROUP_P2): tl.dot needs 16 rows
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM: one tile holds a whole key row
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    BLOCK_T: tl.constexpr,  # next power of two >= BLOCK_SIZE: one tile is one KV block
    UPCAST: tl.constexpr,  # see dot_fp32
):
    # One program per (request, tile of BLOCK_Q new tokens, KV head); tiles past a request's new tokens do nothing.
    req, tile, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(q_starts_ptr + req)
    q_len = tl.load(q_ends_ptr + req) - q_start
    if tile * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + req)
        r, d, t = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_T)
        tok = tile * BLOCK_Q + r // GROUP_P2  # index among the request's new tokens
        head = kv_head * GROUP + r % GROUP_P2
        rows = (r % GROUP_P2 < GROUP) & (r // GROUP_P2 < BLOCK_Q) & (tok < q_len)
        q = tl.load(
            q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
            mask=rows[:, None] & (d < HEAD_DIM)[None, :],
            other=0.0,
        )
        pos_q = seq_len - q_len + tok  # each row's position in the sequence
        kv_end = tl.minimum(seq_len - q_len + (tile + 1) * BLOCK_Q, seq_len)  # past the tile's last position
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for b in range(0, tl.cdiv(kv_end, BLOCK_SIZE)):
            block = tl.load(block_table_ptr + req * stride_bt + b).to(tl.int64)
            pos = b * BLOCK_SIZE + t
            kv_mask = ((t < BLOCK_SIZE) & (pos < kv_end))[:, None] & (d < HEAD_DIM)[None, :]
            k = tl.load(
                k_ptr + block * stride_kb + t[:, None] * stride_kt + kv_head * stride_kh + d[None, :],
                mask=kv_mask,
                other=0.0,
            )
            v = tl.load(
                v_ptr + block * stride_vb + t[:, None] * stride_vt + kv_head * stride_vh + d[None, :],
                mask=kv_mask,
                other=0.0,
            )
            logits = dot_fp32(q, tl.trans(k), UPCAST) * scale  # [BLOCK_M, BLOCK_T]
            keep = rows[:, None] & ((t < BLOCK_SIZE)[None, :] & (pos[None, :] <= pos_q[:, None]))
            logits = tl.where(keep, logits, float("-inf"))
            m_i, l_i, acc = online_softmax_step(logits, v, m_i, l_i, acc, UPCAST)
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=rows[:, None] & (d < HEAD_DIM)[None, :],
        )


# ----------------------------------------------------------------------------------------------------------------
# PyTorch reference

# Most logits the reference holds at once (fp32): 2**24 = 64 MiB, so a long prompt is taken in query chunks instead
# of materialising [heads, q_len, seq_len] at once (32 GiB for 8K new tokens of a 32K context with 32 heads).
REFERENCE_LOGITS = 1 << 24


def causal_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    blocks: torch.Tensor,
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    """One request's new tokens ``query[q_len, num_q_heads, head_dim]`` attending causally to its first ``seq_len``
    cached tokens (in ``blocks``, its block-table row): ``[q_len, num_q_heads, head_dim]`` fp32 (float64 for float64
    inputs, the exact yardstick tests compare with)."""
    q_len, num_q_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    group = num_q_heads // num_kv_heads
    working = torch.promote_types(query.dtype, torch.float32)
    used = blocks[: -(-seq_len // block_size)].long()
    keys = key_cache[used].flatten(0, 1)[:seq_len].to(working)  # [n, kv_heads, dim]
    values = value_cache[used].flatten(0, 1)[:seq_len].to(working)
    grouped = query.to(working).view(q_len, num_kv_heads, group, head_dim)
    out = torch.empty(q_len, num_kv_heads, group, head_dim, dtype=working, device=query.device)
    chunk = max(1, REFERENCE_LOGITS // (num_q_heads * max(seq_len, 1)))
    for first in range(0, q_len, chunk):
        last = min(first + chunk, q_len)
        logits = torch.einsum("qkgd,nkd->kgqn", grouped[first:last], keys) * scale
        positions = torch.arange(seq_len - q_len + first, seq_len - q_len + last, device=query.device)
        future = torch.arange(seq_len, device=query.device)[None, :] > positions[:, None]  # [q, n]
        weights = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)
        out[first:last] = torch.einsum("kgqn,nkd->qkgd", weights, values)
    return out.view(q_len, num_q_heads, head_dim)


def paged_causal_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_starts: torch.Tensor,
    query_ends: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """What ``PagedCausalAttention.run`` computes, request by request, into the requests' rows of ``out``."""
    for i, (first, last, seq_len) in enumerate(zip(query_starts.tolist(), query_ends.tolist(), seq_lens.tolist())):
        if last > first:
            out[first:last] = causal_attention_reference(
                query[first:last], key_cache, value_cache, block_table[i], seq_len, scale
            ).to(out.dtype)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Launcher


class PagedCausalAttention:
    """Dense causal attention for one model's attention shape, called with vLLM's batch metadata.

    ``plan(query_starts, query_ends, seq_lens, block_table, max_query_len)`` once per engine step (all layers share
    it), then ``run(query, key_cache, value_cache, out)`` per layer. Rows of ``out`` outside the planned requests
    are left as they are.
    """

    def __init__(
        self, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int, *, scale: float | None = None
    ):
        _check(
            num_kv_heads >= 1 and num_q_heads % num_kv_heads == 0,
            f"num_q_heads ({num_q_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})",
        )
        _check(head_dim >= 1 and block_size >= 1, f"head_dim and block_size must be >= 1, got {head_dim}, {block_size}")
        self.num_q_heads, self.num_kv_heads, self.head_dim, self.block_size = (
            num_q_heads,
            num_kv_heads,
            head_dim,
            block_size,
        )
        self.group = num_q_heads // num_kv_heads
        self.scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
        self._plan: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None

    def plan(
        self,
        query_starts: torch.Tensor,
        query_ends: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        max_query_len: int,
    ) -> None:
        """Fix the step's requests. ``max_query_len`` (a host int, as in vLLM's metadata) sizes the grid without
        reading the lengths back from the device."""
        n = len(seq_lens)
        for name, tensor in (("query_starts", query_starts), ("query_ends", query_ends), ("seq_lens", seq_lens)):
            _check(
                tensor.dim() == 1 and tensor.dtype == torch.int32 and len(tensor) == n,
                f"{name} must be a 1-D int32 tensor of {n} requests, got {tuple(tensor.shape)} {tensor.dtype}",
            )
            _check(tensor.device == seq_lens.device, f"{name} is on {tensor.device} but seq_lens on {seq_lens.device}")
        _check(
            block_table.dim() == 2
            and block_table.dtype == torch.int32
            and block_table.shape[0] == n
            and block_table.stride(1) == 1
            and block_table.device == seq_lens.device,
            f"block_table must be an int32 [num_requests={n}, max_blocks] tensor with contiguous rows on "
            f"{seq_lens.device}, got {tuple(block_table.shape)} {block_table.dtype} on {block_table.device}",
        )
        _check(max_query_len >= 0, f"max_query_len must be >= 0, got {max_query_len}")
        self._plan = (query_starts, query_ends, seq_lens, block_table, max_query_len)

    def run(
        self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Attention of the planned requests' tokens, written into their rows of ``out`` (made if not given)."""
        _check(self._plan is not None, "PagedCausalAttention.run called before plan(...)")
        query_starts, query_ends, seq_lens, block_table, max_query_len = self._plan
        self._check_inputs(query, key_cache, value_cache, seq_lens.device)
        if out is None:
            out = torch.empty_like(query)
        _check(
            out.shape == query.shape and out.dtype == query.dtype and out.stride(-1) == 1,
            f"out must be {list(query.shape)} {query.dtype} with contiguous rows, got {list(out.shape)} {out.dtype}",
        )
        if len(seq_lens) == 0 or max_query_len == 0:
            return out
        group_p2 = triton.next_power_of_2(self.group)
        block_q = max(1, min(ROWS_PER_TILE // group_p2, triton.next_power_of_2(max_query_len)))
        _paged_causal_kernel[(len(seq_lens), triton.cdiv(max_query_len, block_q), self.num_kv_heads)](
            query,
            key_cache,
            value_cache,
            out,
            query_starts,
            query_ends,
            seq_lens,
            block_table,
            self.scale,
            query.stride(0),
            query.stride(1),
            *key_cache.stride()[:3],
            *value_cache.stride()[:3],
            out.stride(0),
            out.stride(1),
            block_table.stride(0),
            GROUP=self.group,
            GROUP_P2=group_p2,
            BLOCK_Q=block_q,
            BLOCK_M=max(16, block_q * group_p2),
            HEAD_DIM=self.head_dim,
            BLOCK_D=triton.next_power_of_2(self.head_dim),
            BLOCK_SIZE=self.block_size,
            BLOCK_T=triton.next_power_of_2(self.block_size),
            UPCAST=interpreter_upcast(query.dtype),
        )
        return out

    def _check_inputs(self, query, key_cache, value_cache, device) -> None:
        _check(
            query.dim() == 3 and tuple(query.shape[1:]) == (self.num_q_heads, self.head_dim),
            f"query must be [num_tokens, num_q_heads={self.num_q_heads}, head_dim={self.head_dim}], "
            f"got {list(query.shape)}",
        )
        check_paged_kv(query, key_cache, value_cache, self.block_size, self.num_kv_heads, self.head_dim, device)
