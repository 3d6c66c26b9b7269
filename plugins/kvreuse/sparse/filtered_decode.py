"""DIPR as a filter in front of an engine's own GPU paged attention kernel (FlashAttention's varlen paged call, as
vLLM's FLASH_ATTN backend makes it), engine-free.

Per step and layer, one launch path of three launches: the sketch scan bounds every token's logit, one kernel
turns the bounds into the blocks each (sequence, KV head) reads and into one block-table row per (sequence, KV
head) (``kvreuse.kernels.block_filter.DIPRBlockFilter``), over a one-KV-head view of the cache (``one_head_view``:
vLLM's GPU layout keeps a token's KV heads in one row, so KV head ``h`` of block ``b`` is the view's block ``b *
per_block + h``), and the engine's kernel attends, in one call, the ``n * kv`` rows, each with the ``group`` query
heads of its KV head and its own pruned block table. Every buffer is made once (for the engine's largest batch and
context) and filled in place on the device; no step reads anything back to the host, so the whole path can be
captured in a CUDA graph.

The kernel is a ``PagedDecodeKernel``: vLLM's FlashAttention on a CUDA build (``kvreuse.patches.vllm_0_32``), or,
where no CUDA kernel exists, ``paged_attention_reference`` (PyTorch, same arguments), which tests use on CPU tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from kvreuse.errors import check_kernel_argument as _check
from kvreuse.sparse.pruned import one_head_view

if TYPE_CHECKING:  # the kernels' modules import Triton, needed only at call time
    from kvreuse.kernels.block_filter import DIPRBlockFilter
    from kvreuse.kernels.key_sketch import KeySketch

INT32_MAX = 2**31 - 1


class PagedDecodeKernel(Protocol):
    """Causal paged attention with FlashAttention's varlen arguments: ``query[tokens, heads, d]`` (each sequence's
    tokens contiguous, ``cu_seqlens_q[n + 1]`` int32), caches ``[num_blocks, block_size, kv_heads, d]`` (last
    dimension contiguous, any other strides), each sequence's keys the first ``seqused_k[i]`` slots of its
    ``block_table[i]`` blocks (int32), the queries aligned to the end of their sequence. Writes ``out``."""

    def __call__(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        out: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        seqused_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        block_table: torch.Tensor,
        scale: float,
    ) -> None: ...


def paged_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    block_table: torch.Tensor,
    scale: float,
) -> None:
    """``PagedDecodeKernel`` in PyTorch (fp32, sequence by sequence, reads the host): what FlashAttention computes,
    for CPU tensors and tests: each sequence's queries through the project's causal reference over the blocks its
    table lists, read exactly as the kernel reads them."""
    from kvreuse.kernels.paged_causal import causal_attention_reference

    starts, lens = cu_seqlens_q.tolist(), seqused_k.tolist()
    for i, seq_len in enumerate(lens):
        first, last = starts[i], starts[i + 1]
        out[first:last] = causal_attention_reference(
            query[first:last], key_cache, value_cache, block_table[i], seq_len, scale
        ).to(out.dtype)


@dataclass(frozen=True)
class FilteredCounts:
    """What one filtered decode read: ``blocks_read[n, kv]`` (blocks each KV head read) and ``tokens_attended[n,
    kv]`` (the tokens of those blocks: the kernel attends every one), int32 on the device; views of the filter's
    buffers, valid until its next run."""

    blocks_read: torch.Tensor
    tokens_attended: torch.Tensor


class FilteredDecode:
    """DIPR decodes through ``kernel`` over pruned block tables, for one model shape; buffers for up to ``max_seqs``
    decodes of up to ``max_blocks`` blocks, made on the first call's device and kept."""

    def __init__(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        scale: float,
        *,
        max_seqs: int,
        max_blocks: int,
        kernel: PagedDecodeKernel,
    ) -> None:
        self.num_q_heads, self.num_kv_heads, self.head_dim, self.block_size = (
            num_q_heads,
            num_kv_heads,
            head_dim,
            block_size,
        )
        self.group = num_q_heads // num_kv_heads
        self.scale = float(scale)
        self.max_seqs, self.max_blocks = max_seqs, max_blocks
        self.kernel = kernel
        self.filter: DIPRBlockFilter | None = None

    def _filter(self, device: torch.device) -> DIPRBlockFilter:
        if self.filter is None:
            from kvreuse.kernels.block_filter import DIPRBlockFilter

            self.filter = DIPRBlockFilter(
                self.num_q_heads,
                self.num_kv_heads,
                self.head_dim,
                self.block_size,
                scale=self.scale,
                max_seqs=self.max_seqs,
                max_blocks=self.max_blocks,
                device=device,
            )
        return self.filter

    def run(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        sketch: KeySketch,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        max_seq_len: int,
        beta: float,
        sink: int,
        local: int,
        out: torch.Tensor,
    ) -> FilteredCounts:
        """Attention of ``query[n, num_q_heads, d]`` (contiguous; one decode token per sequence) over the blocks the
        sketch keeps, into ``out`` (contiguous, like the query). ``max_seq_len`` (a host int, vLLM's metadata) bounds
        every pruned length."""
        _check(
            query.is_contiguous() and out.is_contiguous() and out.shape == query.shape,
            f"query {list(query.shape)} and out {list(out.shape)} must be contiguous and alike",
        )
        keys, per_block = one_head_view(key_cache)
        values, value_per_block = one_head_view(value_cache)
        _check(
            per_block == value_per_block and keys.shape[0] <= INT32_MAX,
            f"key and value caches (strides {list(key_cache.stride())}, {list(value_cache.stride())}) must have the "
            f"same page layout, with fewer than 2^31 one-head blocks",
        )
        # the engine's table may be wider than any sequence of the step (and than the buffers): its first columns
        # hold every block a sequence has
        block_table = block_table[:, : min(block_table.shape[1], -(-max_seq_len // self.block_size))]
        tables = self._filter(query.device).run(query, sketch, seq_lens, block_table, beta, sink, local, per_block)
        n = len(seq_lens)
        rows = n * self.num_kv_heads
        self.kernel(
            query.view(rows, self.group, self.head_dim),
            keys,
            values,
            out.view(rows, self.group, self.head_dim),
            tables.query_start_loc,
            tables.seq_lens,
            1,
            max_seq_len,
            tables.block_table,
            self.scale,
        )
        return FilteredCounts(tables.kept.view(n, self.num_kv_heads), tables.seq_lens.view(n, self.num_kv_heads))
