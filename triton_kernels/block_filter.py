"""DIPR's block choice alone: which KV blocks each (sequence, KV head) of a decode batch must read, for an engine's own
paged attention kernel to attend over (DIPR as a filter in front of it, ``kvreuse.sparse.filtered_decode``).

The decision is ``dipr_decode.py``'s, from its ``_sketch_scan_kernel``: the scan bounds every token's logit from the
key sketch, ``tau = max_j L_j - beta``, and a block is read if it holds a window token (the first ``sink`` and last
``local`` tokens) or its largest upper bound reaches ``tau`` for at least one query head of the KV head's group. Every
key within beta of the largest logit is then in a read block (``dipr_decode.py`` proves it); a kernel that attends
every token of the read blocks attends a superset of ``DIPRDecode``'s set, over the same bytes.

``DIPRBlockFilter`` allocates its buffers once, for at most ``max_seqs`` sequences of ``max_blocks`` blocks, and its
``run`` launches the scan and finishes the mask with whole-tensor operations on the device: no allocation that
depends on the batch, nothing read back to the host, so a step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton

from kvreuse.errors import check_kernel_argument as _check
from kvreuse.kernels.dipr_decode import PROGRAMS_PER_SM, SCAN_LANES, _sketch_scan_kernel, dipr_selection_reference
from kvreuse.kernels.key_sketch import CODE_SLACK, KeySketch


class DIPRBlockFilter:
    """The read mask ``[num_seqs, num_kv_heads, max_blocks]`` of a decode batch, in buffers made once.

    ``max_splits`` caps the scan's programs per (sequence, KV head); the split count is fixed at construction from the
    device's SMs, so the launch grid depends only on the batch's size.
    """

    def __init__(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        *,
        scale: float,
        max_seqs: int,
        max_blocks: int,
        device: torch.device | str,
        max_splits: int = 128,
    ) -> None:
        _check(
            num_kv_heads >= 1 and num_q_heads % num_kv_heads == 0,
            f"num_q_heads ({num_q_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})",
        )
        _check(max_seqs >= 1 and max_blocks >= 1, f"max_seqs and max_blocks must be >= 1, got {max_seqs}, {max_blocks}")
        self.num_q_heads, self.num_kv_heads, self.head_dim, self.block_size = (
            num_q_heads,
            num_kv_heads,
            head_dim,
            block_size,
        )
        self.group = num_q_heads // num_kv_heads
        self.scale = float(scale)
        self.max_seqs, self.max_blocks = max_seqs, max_blocks
        device = torch.device(device)
        self.scan_pages = max(1, SCAN_LANES // triton.next_power_of_2(block_size))
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        wanted = -(-PROGRAMS_PER_SM * sms // num_kv_heads)  # every SM busy even for one sequence
        self.num_splits = max(1, min(wanted, max_splits, -(-max_blocks // self.scan_pages)))
        self.blocks_per_split = -(-max_blocks // self.num_splits)
        width = self.num_splits * self.blocks_per_split  # the scan's row of upper bounds, >= max_blocks
        self.upper = torch.full((max_seqs, num_q_heads, width), float("-inf"), device=device)
        self.lower = torch.full((max_seqs, num_q_heads, self.num_splits), float("-inf"), device=device)
        self.betas = torch.zeros(max_seqs, device=device)
        self.read = torch.zeros(max_seqs, num_kv_heads, max_blocks, dtype=torch.bool, device=device)
        self.block_index = torch.arange(max_blocks, device=device)

    def run(
        self,
        query: torch.Tensor,
        sketch: KeySketch,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        beta: float,
        sink: int,
        local: int,
    ) -> torch.Tensor:
        """The blocks to read, ``read[n, kv, block_table.shape[1]]`` (a view of the persistent buffer): false past
        each sequence's ``ceil(seq_lens[i] / block_size)`` blocks; every block at ``beta = inf``.

        ``query[n, num_q_heads, head_dim]`` (one decode token per sequence), ``seq_lens[n]`` int32 and
        ``block_table[n, width]`` int32 with contiguous rows, as vLLM's decode metadata; ``width <= max_blocks``."""
        n, width = len(seq_lens), block_table.shape[1] if block_table.dim() == 2 else -1
        _check(1 <= n <= self.max_seqs, f"the batch has {n} sequences; the filter was made for 1 to {self.max_seqs}")
        _check(
            block_table.dtype == torch.int32 and block_table.shape[0] == n and block_table.stride(-1) == 1,
            f"block_table must be int32 [num_seqs={n}, max_blocks] with contiguous rows, got "
            f"{block_table.dtype} {list(block_table.shape)}",
        )
        _check(width <= self.max_blocks, f"block_table has {width} columns; the filter was made for {self.max_blocks}")
        _check(seq_lens.dtype == torch.int32, f"seq_lens must be int32, got {seq_lens.dtype}")
        _check(
            tuple(query.shape) == (n, self.num_q_heads, self.head_dim) and query.stride(-1) == 1,
            f"query must be [{n}, {self.num_q_heads}, {self.head_dim}] with contiguous rows, got {list(query.shape)}",
        )
        _check(sink >= 0 and local >= 0 and sink + local >= 1, f"sink ({sink}) + local ({local}) must be >= 1")
        _check(beta >= 0, f"beta must be >= 0 (inf: read every block), got {beta}")
        read = self.read[:n, :, :width]
        lens = seq_lens.long()
        n_blocks = (lens + self.block_size - 1) // self.block_size  # [n]
        index = self.block_index[:width]
        live = index[None, :] < n_blocks[:, None]  # [n, width]
        if beta == float("inf"):
            read.copy_(live[:, None, :].expand(n, self.num_kv_heads, width))
            return read
        self.betas[:n].fill_(beta)
        _sketch_scan_kernel[(n, self.num_kv_heads, self.num_splits)](
            query,
            sketch.codes,
            sketch.scales,
            block_table,
            seq_lens,
            self.betas,
            self.upper,
            self.lower,
            self.scale,
            self.blocks_per_split,
            self.num_splits,
            self.upper.shape[2],
            query.stride(0),
            query.stride(1),
            *sketch.codes.stride()[:3],
            *sketch.scales.stride(),
            block_table.stride(0),
            GROUP=self.group,
            BLOCK_G=max(2, triton.next_power_of_2(self.group)),
            HEAD_DIM=self.head_dim,
            BLOCK_D=triton.next_power_of_2(self.head_dim),
            BLOCK_SIZE=self.block_size,
            BLOCK_T=triton.next_power_of_2(self.block_size),
            PAGES=self.scan_pages,
            HALF=0.5 + CODE_SLACK,
        )
        tau = self.lower[:n].amax(-1) - beta  # [n, num_q_heads]
        upper = self.upper[:n, :, :width].view(n, self.num_kv_heads, self.group, width)
        hit = (upper >= tau.view(n, self.num_kv_heads, self.group, 1)).any(dim=2)  # [n, kv, width]
        sink_blocks = (lens.clamp(max=sink) + self.block_size - 1) // self.block_size
        first_local = (lens - local).clamp(min=0) // self.block_size if local > 0 else lens.new_full((n,), 1 << 30)
        window = (index[None, :] < sink_blocks[:, None]) | (index[None, :] >= first_local[:, None])
        torch.logical_and(hit | window[:, None, :], live[:, None, :], out=read)
        return read


def block_filter_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    sketch: KeySketch,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    beta: float,
    scale: float,
    sink: int,
    local: int,
) -> torch.Tensor:
    """``DIPRBlockFilter.run``'s mask, ``[n, kv, block_table.shape[1]]`` bool, from ``dipr_selection_reference``."""
    selection = dipr_selection_reference(query, key_cache, sketch, block_table, seq_lens, beta, scale, sink, local)
    read = torch.zeros(len(seq_lens), key_cache.shape[2], block_table.shape[1], dtype=torch.bool, device=query.device)
    for i, blocks in enumerate(selection.blocks_read):
        read[i, :, : blocks.shape[1]] = blocks
    return read
