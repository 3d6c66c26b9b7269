"""DIPR's block choice alone: which KV blocks each (sequence, KV head) of a decode batch must read, for an engine's own
paged attention kernel to attend over (DIPR as a filter in front of it, ``kvreuse.sparse.filtered_decode``).

The decision is ``dipr_decode.py``'s, from its ``_sketch_scan_kernel``: the scan bounds every token's logit from the
key sketch, ``tau = max_j L_j - beta``, and a block is read if it holds a window token (the first ``sink`` and last
``local`` tokens) or its largest upper bound reaches ``tau`` for at least one query head of the KV head's group. Every
key within beta of the largest logit is then in a read block (``dipr_decode.py`` proves it); a kernel that attends
every token of the read blocks attends a superset of ``DIPRDecode``'s set, over the same bytes.

``DIPRBlockFilter`` allocates its buffers once, for at most ``max_seqs`` sequences of ``max_blocks`` blocks, and its
``run`` launches the scan, then ``_pruned_tables_kernel``, which writes the read mask and, per (sequence, KV head),
the block-table row of the blocks read (as blocks of a one-KV-head view of the cache) and their token count: no
allocation, nothing read back to the host, so a step can be captured in a CUDA graph.

PyTorch references: the mask is ``dipr_selection_reference(...).blocks_read`` (``dipr_decode.py``), the rows are
``kvreuse.sparse.pruned.prune_block_table`` of it (``tests/test_sparse_gpu_filter.py`` compares both).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvreuse.errors import check_kernel_argument as _check
from kvreuse.kernels.dipr_decode import PROGRAMS_PER_SM, SCAN_LANES, _sketch_scan_kernel
from kvreuse.kernels.key_sketch import CODE_SLACK, KeySketch

# Blocks per iteration of the table kernel: a tile of the scan's upper bounds per query head of the group, a row of
# 64 fp32 bounds per head (one program walks a whole row; the tables are tiny next to the scan's reads).
TABLE_TILE = 64


@triton.jit
def _pruned_tables_kernel(
    upper_ptr,
    lower_ptr,
    block_table_ptr,
    seq_lens_ptr,
    beta_ptr,
    read_ptr,
    table_ptr,
    lens_ptr,
    kept_ptr,
    sink,
    local,
    per_block,
    num_splits,
    upper_width,
    width,
    row_stride,
    stride_bt,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,  # next power of two >= GROUP
    BLOCK_S: tl.constexpr,  # next power of two >= num_splits: a head's lower bounds in one tile
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,  # blocks per iteration (TABLE_TILE)
):
    # One program per (sequence, KV head) = one row of the flat tables: tau per query head of the group from the
    # scan's split maxima, then, TILE blocks at a time, which blocks are read (window, or an upper bound reaching tau
    # for some query head; all at beta = inf) and their one-head view indices, packed in order by a prefix sum.
    seq, kv_head = tl.program_id(0), tl.program_id(1)
    row = seq * tl.num_programs(1) + kv_head
    num_q_heads = GROUP * tl.num_programs(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    n_blocks = tl.cdiv(seq_len, BLOCK_SIZE)
    beta = tl.load(beta_ptr + seq)
    prune = beta < float("inf")
    g, s = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_S)
    heads = seq * num_q_heads + kv_head * GROUP + g
    lower = tl.load(
        lower_ptr + heads[:, None] * num_splits + s[None, :],
        mask=(g < GROUP)[:, None] & (s < num_splits)[None, :],
        other=float("-inf"),
    )
    tau = tl.max(lower, axis=1) - tl.where(prune, beta, 0.0)  # [BLOCK_G]; unused at beta = inf
    tau = tl.where(g < GROUP, tau, float("inf"))  # padding rows of the group (GROUP not a power of two) ask nothing
    sink_blocks = tl.cdiv(tl.minimum(sink, seq_len), BLOCK_SIZE)
    first_local = tl.where(local > 0, tl.maximum(seq_len - local, 0) // BLOCK_SIZE, 1 << 30)
    kept = tl.zeros([], tl.int32)
    last_read = tl.zeros([], tl.int32)
    for b0 in range(0, width, TILE):  # the step's whole table width: the mask is cleared past the sequence
        b = b0 + tl.arange(0, TILE)
        live = b < n_blocks
        window = (b < sink_blocks) | (b >= first_local) | (prune == 0)  # read whatever the bounds say
        upper = tl.load(
            upper_ptr + heads[:, None] * upper_width + b[None, :],
            mask=(g < GROUP)[:, None] & (live & (window == 0))[None, :],
            other=float("-inf"),
        )
        hit = tl.max((upper >= tau[:, None]).to(tl.int32), axis=0) > 0
        r = (live & (window | hit)).to(tl.int32)
        read = r > 0
        position = kept + tl.cumsum(r, axis=0) - r  # where a read block goes in the row: after those before it
        block = tl.load(block_table_ptr + seq * stride_bt + b, mask=read, other=0).to(tl.int64)
        view_block = (block * per_block + kv_head).to(tl.int32)
        tl.store(table_ptr + row.to(tl.int64) * row_stride + position, view_block, mask=read)
        tl.store(read_ptr + row.to(tl.int64) * row_stride + b, r.to(tl.int8), mask=b < width)
        kept += tl.sum(r, axis=0)
        last_read += tl.sum(tl.where(b == n_blocks - 1, r, 0), axis=0)
    # only the last block may be partly filled: its empty slots are not the sequence's
    tl.store(lens_ptr + row, kept * BLOCK_SIZE - last_read * (n_blocks * BLOCK_SIZE - seq_len))
    tl.store(kept_ptr + row, kept)


@dataclass(frozen=True)
class FilterTables:
    """One step's filter output, views of ``DIPRBlockFilter``'s buffers (valid until its next ``run``): ``read[n,
    kv, width]`` bool, the blocks each (sequence, KV head) reads; for the ``n * kv`` rows ``i * kv + h`` of one
    kernel call over a one-KV-head cache view, ``block_table[rows, width]`` int32 (the view's blocks ``b *
    per_block + h`` of the blocks read, in order; entries past ``kept`` are stale), ``seq_lens[rows]`` int32 (their
    tokens), ``query_start_loc[rows + 1]`` int32 (``0, 1, ..., rows``: one query token per row) and ``kept[rows]``
    int32 (blocks read)."""

    read: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    kept: torch.Tensor


class DIPRBlockFilter:
    """The blocks a decode batch reads and their (sequence, KV head) tables, in buffers made once for up to
    ``max_seqs`` sequences of ``max_blocks`` blocks: two launches per call (the sketch scan, then
    ``_pruned_tables_kernel``), nothing read back to the host.

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
        rows = max_seqs * num_kv_heads
        self.upper = torch.full((max_seqs, num_q_heads, width), float("-inf"), device=device)
        self.lower = torch.full((max_seqs, num_q_heads, self.num_splits), float("-inf"), device=device)
        self.betas = torch.zeros(max_seqs, device=device)
        self.read = torch.zeros(rows, max_blocks, dtype=torch.int8, device=device)
        self.block_table = torch.zeros(rows, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.kept = torch.zeros(rows, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)

    def run(
        self,
        query: torch.Tensor,
        sketch: KeySketch,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        beta: float,
        sink: int,
        local: int,
        per_block: int,
    ) -> FilterTables:
        """The blocks to read and the flat tables (``FilterTables``) for ``query[n, num_q_heads, head_dim]`` (one
        decode token per sequence), ``seq_lens[n]`` int32 and ``block_table[n, width]`` int32 with contiguous rows,
        as vLLM's decode metadata (``width <= max_blocks``), the view's block of KV head ``h`` of block ``b`` being
        ``b * per_block + h`` (``kvreuse.sparse.pruned.one_head_view``). Every block at ``beta = inf``."""
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
        _check(per_block >= self.num_kv_heads, f"per_block ({per_block}) must be at least the KV heads")
        self.betas[:n].fill_(beta)
        if beta != float("inf"):  # known on the host: at beta = inf no sketch is read
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
                *sketch.codes.stride(),
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
        _pruned_tables_kernel[(n, self.num_kv_heads)](
            self.upper,
            self.lower,
            block_table,
            seq_lens,
            self.betas,
            self.read,
            self.block_table,
            self.seq_lens,
            self.kept,
            sink,
            local,
            per_block,
            self.num_splits,
            self.upper.shape[2],
            width,
            self.max_blocks,
            block_table.stride(0),
            GROUP=self.group,
            BLOCK_G=max(2, triton.next_power_of_2(self.group)),
            BLOCK_S=triton.next_power_of_2(self.num_splits),
            BLOCK_SIZE=self.block_size,
            TILE=TABLE_TILE,
        )
        rows = n * self.num_kv_heads
        return FilterTables(
            self.read[:rows, :width].view(torch.bool).view(n, self.num_kv_heads, width),
            self.block_table[:rows, :width],
            self.seq_lens[:rows],
            self.query_start_loc[: rows + 1],
            self.kept[:rows],
        )
