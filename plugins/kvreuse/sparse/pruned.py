"""DIPR as a filter in front of an engine's own paged attention kernel: pruned block tables, engine-free.

The sketch scan decides which blocks each (sequence, KV head) must read (``read[n, kv, max_blocks]``); a stock
paged-attention kernel then computes exact attention over just those blocks when it is given, per KV head, a block
table that lists them in order and a sequence length that counts their tokens. Attention does not depend on where
a key sits in the sequence (RoPE is already in the cached keys), so leaving blocks out of the table is the same as
masking their tokens. Only the sequence's last block may be partly filled; it is kept last, so the pruned
sequence's length is ``(kept blocks) * block_size`` less the last block's empty slots when it is kept (the
window's last tokens are in it, so DIPR always keeps it when ``local > 0``).

Everything here is whole-tensor arithmetic on the tensors' own device (no host sync), so a CPU engine and a GPU
one build the tables the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvreuse.errors import check_kernel_argument as _check


@dataclass(frozen=True)
class PrunedTables:
    """Per KV head, the block table and sequence lengths of a batch of decodes that read only some blocks:
    ``block_table[kv, n, max_blocks]`` int32 (the kept blocks first, in sequence order; the rest of a row repeats
    block 0 of the engine's row, which no length reaches), ``seq_lens[kv, n]`` int32 and ``kept[kv, n]`` int64,
    the blocks each (KV head, sequence) reads."""

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    kept: torch.Tensor


def prune_block_table(
    read: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int
) -> PrunedTables:
    """The per-KV-head block tables that list, for each sequence ``i`` and KV head ``h``, the blocks of
    ``block_table[i]`` where ``read[i, h]`` is set, in order, and the lengths that count their tokens.

    ``read[n, kv, max_blocks]`` bool must be false past each sequence's ``ceil(seq_lens[i] / block_size)`` blocks
    (the engine's table may be longer); ``block_table[n, max_blocks]`` (int32 or int64) and ``seq_lens[n]`` are the
    engine's.
    """
    n, kv, width = read.shape
    _check(block_table.shape == (n, width), f"block_table {tuple(block_table.shape)} must be [{n}, {width}] like read")
    _check(seq_lens.shape == (n,), f"seq_lens {tuple(seq_lens.shape)} must be [{n}]")
    lens = seq_lens.long()
    n_blocks = (lens + block_size - 1) // block_size  # [n]
    # stable sort of "not read" moves the read blocks to the front, each group in its original order
    order = torch.sort((~read).to(torch.uint8), dim=-1, stable=True).indices  # [n, kv, width]
    tables = block_table.long()[:, None, :].expand(n, kv, width).gather(-1, order)
    kept = read.sum(-1)  # [n, kv]
    unused = torch.arange(width, device=read.device)[None, None, :] >= kept[..., None]
    tables = tables.masked_fill(unused, 0) + unused * block_table.long()[:, None, :1]
    last = (n_blocks - 1).clamp(min=0)  # [n]
    last_read = read.gather(-1, last[:, None, None].expand(n, kv, 1))[..., 0]  # [n, kv]
    empty_slots = n_blocks * block_size - lens  # [n]: unused slots of the last block
    pruned = kept * block_size - last_read * empty_slots[:, None]
    return PrunedTables(
        tables.to(torch.int32).permute(1, 0, 2).contiguous(), pruned.T.to(torch.int32).contiguous(), kept.T
    )


def one_head_view(cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``cache[num_blocks, block_size, kv_heads, head_dim]`` as a one-KV-head cache ``[view_blocks, block_size, 1,
    head_dim]`` whose block ``b * per_block + h`` is KV head ``h`` of block ``b`` (no copy), and ``per_block``.

    A kernel that takes a block table then reads each (sequence, KV head) pair as a sequence of its own, with its own
    blocks, in one call: ``view[b * per_block + h, t, 0] = cache[b, t, h]`` because ``per_block = cache.stride(0) //
    cache.stride(2)`` (a page is a whole number of head strides: vLLM's GPU layout keeps every KV head of a token in
    one row, and a page is a whole number of rows). The size-1 head dimension gets the canonical stride
    ``head_dim``, as vLLM gives a one-KV-head cache to FlashAttention."""
    _check(cache.dim() == 4 and cache.stride(-1) == 1, f"cache {list(cache.shape)} must be 4-D, last dim contiguous")
    num_blocks, block_size, kv_heads, head_dim = cache.shape
    page, row, head = cache.stride(0), cache.stride(1), cache.stride(2)
    _check(
        head > 0 and page % head == 0 and row % head == 0 and row >= kv_heads * head,
        f"cache strides {list(cache.stride())}: the page and token strides must be whole multiples of the head stride",
    )
    per_block = page // head
    view = cache.as_strided(
        ((num_blocks - 1) * per_block + kv_heads, block_size, 1, head_dim),
        (head, row, head_dim, 1),
        cache.storage_offset(),
    )
    return view, per_block
