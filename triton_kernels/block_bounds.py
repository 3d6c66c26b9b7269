"""Per-block key bounds for DIPR: the channel-wise maximum and minimum of the keys in each KV block.

Layouts (the ones FlashAttention-style vLLM backends use; a view such as ``kv_cache[0]`` with any strides works,
as long as the last dimension is contiguous):

- ``key_cache[num_blocks, block_size, num_kv_heads, head_dim]``: vLLM's plain paged layout; token ``i`` of a
  sequence lives at ``key_cache[block_table[seq, i // block_size], i % block_size]``. A *slot* is
  ``block * block_size + offset``, as in vLLM's ``slot_mapping`` (negative slots are padding and are skipped).
- ``bounds[num_blocks, num_kv_heads, 2, head_dim]``, same dtype as the cache (max and min of stored values are
  stored values, so nothing is rounded): ``bounds[b, h, 0]`` is the channel-wise maximum and ``bounds[b, h, 1]``
  the channel-wise minimum of the keys of head ``h`` in block ``b``. An empty block holds ``-inf`` / ``+inf``
  (``BlockBounds.allocate``), so empty slots never widen a bound.

With these, Quest's bound (Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference",
ICML 2024) limits every score in block ``b``: ``q . k <= sum_i max(q_i M_i, q_i m_i)`` for each key ``k``
of the block, where ``M = bounds[b, h, 0]`` and ``m = bounds[b, h, 1]``.

Keeping bounds current: ``BlockBounds.run`` is called after each cache write (once per layer, with the step's
``slot_mapping``) and merges the written keys into their blocks' bounds. A write that starts a block (offset 0)
resets that block's bounds first, so a freed and re-used block does not keep its previous owner's bounds.
``BlockBounds.recompute`` rebuilds given blocks from the cache (e.g. after a block was loaded from elsewhere).
Stale entries (a speculative token that was rolled back and never overwritten) can only widen a bound, never
narrow it, so pruning stays exact; only the block-start reset relies on blocks being filled from offset 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvreuse.errors import check_kernel_argument as _check
from kvreuse.kernels import SUPPORTED_DTYPES


def check_cache_shape(name: str, cache: torch.Tensor, block_size: int, num_kv_heads: int, head_dim: int) -> None:
    """A paged cache is ``[num_blocks, block_size, num_kv_heads, head_dim]``; the message names the tensor."""
    _check(
        cache.dim() == 4 and tuple(cache.shape[1:]) == (block_size, num_kv_heads, head_dim),
        f"{name} must be [num_blocks, block_size={block_size}, num_kv_heads={num_kv_heads}, "
        f"head_dim={head_dim}], got {list(cache.shape)}",
    )


def check_paged_kv(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
) -> None:
    """The checks every attention launcher makes of its query and caches: the caches are
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the query's (supported) dtype, and all three are on
    ``device`` with a contiguous last dimension. Each message names the tensor."""
    _check(query.dtype in SUPPORTED_DTYPES, f"query dtype must be one of {SUPPORTED_DTYPES}, got {query.dtype}")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        check_cache_shape(name, cache, block_size, num_kv_heads, head_dim)
        _check(cache.dtype == query.dtype, f"{name} dtype {cache.dtype} differs from query dtype {query.dtype}")
    for name, tensor in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        _check(tensor.device == device, f"{name} is on {tensor.device} but seq_lens is on {device}")
        _check(tensor.stride(-1) == 1, f"{name} must be contiguous in its last (head_dim) dimension")


@triton.jit
def _merge_written_keys_kernel(
    key_ptr,
    bounds_ptr,
    slot_ptr,
    num_tokens,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_bb,
    stride_bh,
    stride_bs,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block (vLLM's page size)
    RUN: tl.constexpr,  # next power of two >= BLOCK_SIZE: a run of writes into one block is at most a block long
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM: one tile holds a whole key row
):
    # One program per (written token, KV head). The first token of each run of consecutive slot_mapping entries
    # that write the same block (the run's "leader") merges the whole run; the others do nothing, so no two
    # programs ever write the same block and no atomics are needed.
    t = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    prev = tl.load(slot_ptr + t - 1, mask=t > 0, other=-1).to(tl.int64)
    block = slot // BLOCK_SIZE
    leader = (slot >= 0) & ((prev < 0) | (prev // BLOCK_SIZE != block))
    if leader:
        idx = t + tl.arange(0, RUN)
        slots = tl.load(slot_ptr + idx, mask=idx < num_tokens, other=-1).to(tl.int64)
        in_run = (slots >= 0) & (slots // BLOCK_SIZE == block)
        offsets = slots % BLOCK_SIZE
        d = tl.arange(0, BLOCK_D)
        mask = in_run[:, None] & (d < HEAD_DIM)[None, :]
        keys = tl.load(
            key_ptr + block * stride_kb + offsets[:, None] * stride_kt + head * stride_kh + d[None, :],
            mask=mask,
            other=0.0,
        ).to(tl.float32)
        run_max = tl.max(tl.where(mask, keys, float("-inf")), axis=0)
        run_min = tl.min(tl.where(mask, keys, float("inf")), axis=0)
        starts_block = tl.min(tl.where(in_run, offsets, BLOCK_SIZE), axis=0) == 0
        out = bounds_ptr + block * stride_bb + head * stride_bh + d
        if starts_block == 0:
            run_max = tl.maximum(run_max, tl.load(out, mask=d < HEAD_DIM, other=0.0).to(tl.float32))
            run_min = tl.minimum(run_min, tl.load(out + stride_bs, mask=d < HEAD_DIM, other=0.0).to(tl.float32))
        tl.store(out, run_max.to(bounds_ptr.dtype.element_ty), mask=d < HEAD_DIM)
        tl.store(out + stride_bs, run_min.to(bounds_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit
def _recompute_bounds_kernel(
    key_ptr,
    bounds_ptr,
    block_ids_ptr,
    num_filled_ptr,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_bb,
    stride_bh,
    stride_bs,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block (vLLM's page size)
    RUN: tl.constexpr,  # next power of two >= BLOCK_SIZE: one tile holds every slot of the block
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM: one tile holds a whole key row
):
    # One program per (listed block, KV head): bounds over slots [0, num_filled) of the block.
    i = tl.program_id(0)
    head = tl.program_id(1)
    block = tl.load(block_ids_ptr + i).to(tl.int64)
    filled = tl.minimum(tl.load(num_filled_ptr + i), BLOCK_SIZE)
    offsets = tl.arange(0, RUN)
    d = tl.arange(0, BLOCK_D)
    mask = (offsets < filled)[:, None] & (d < HEAD_DIM)[None, :]
    keys = tl.load(
        key_ptr + block * stride_kb + offsets[:, None] * stride_kt + head * stride_kh + d[None, :], mask=mask, other=0.0
    ).to(tl.float32)
    out = bounds_ptr + block * stride_bb + head * stride_bh + d
    tl.store(
        out, tl.max(tl.where(mask, keys, float("-inf")), axis=0).to(bounds_ptr.dtype.element_ty), mask=d < HEAD_DIM
    )
    tl.store(
        out + stride_bs,
        tl.min(tl.where(mask, keys, float("inf")), axis=0).to(bounds_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


# ----------------------------------------------------------------------------------------------------------------
# PyTorch references


def recompute_bounds_reference(
    key_cache: torch.Tensor, block_ids: torch.Tensor, num_filled: torch.Tensor
) -> torch.Tensor:
    """Bounds ``[len(block_ids), num_kv_heads, 2, head_dim]`` of slots ``[0, num_filled[i])`` of each block."""
    block_size = key_cache.shape[1]
    keys = key_cache[block_ids.long()].float()  # [n, block_size, heads, dim]
    valid = torch.arange(block_size, device=keys.device)[None, :] < num_filled[:, None].to(keys.device)
    valid = valid[:, :, None, None]
    hi = torch.where(valid, keys, float("-inf")).amax(dim=1)
    lo = torch.where(valid, keys, float("inf")).amin(dim=1)
    return torch.stack([hi, lo], dim=2).to(key_cache.dtype)


def merge_written_keys_reference(bounds: torch.Tensor, key_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """What ``BlockBounds.run`` does, written plainly: merge each written key into its block, in place."""
    block_size = key_cache.shape[1]
    slots = [int(s) for s in slot_mapping.tolist() if s >= 0]
    for block in dict.fromkeys(s // block_size for s in slots):
        offsets = torch.tensor([s % block_size for s in slots if s // block_size == block])
        keys = key_cache[block, offsets.to(key_cache.device)].float()  # [n, heads, dim]
        hi, lo = keys.amax(dim=0), keys.amin(dim=0)
        if int(offsets.min()) != 0:
            hi = torch.maximum(hi, bounds[block, :, 0].float())
            lo = torch.minimum(lo, bounds[block, :, 1].float())
        bounds[block, :, 0] = hi.to(bounds.dtype)
        bounds[block, :, 1] = lo.to(bounds.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Launcher


class BlockBounds:
    """Keeps ``bounds`` (see the module docstring for layouts) in step with a paged key cache.

    ``plan(slot_mapping)`` once per engine step (all layers share the slot mapping), then ``run(key_cache,
    bounds)`` per layer right after the layer's keys were written to the cache.
    """

    def __init__(self, block_size: int, num_kv_heads: int, head_dim: int):
        _check(
            block_size >= 1 and num_kv_heads >= 1 and head_dim >= 1,
            f"block_size, num_kv_heads and head_dim must be >= 1, got {block_size}, {num_kv_heads}, {head_dim}",
        )
        self.block_size, self.num_kv_heads, self.head_dim = block_size, num_kv_heads, head_dim
        self._slot_mapping: torch.Tensor | None = None

    def allocate(self, num_blocks: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """Empty bounds for ``num_blocks`` blocks: maxima ``-inf`` and minima ``+inf``."""
        _check(dtype in SUPPORTED_DTYPES, f"bounds dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
        bounds = torch.empty(num_blocks, self.num_kv_heads, 2, self.head_dim, dtype=dtype, device=device)
        bounds[:, :, 0] = float("-inf")
        bounds[:, :, 1] = float("inf")
        return bounds

    def plan(self, slot_mapping: torch.Tensor) -> None:
        """Record the slots written this step: ``slot_mapping[num_tokens]``, int32/int64, negative = padding.

        Entries that write one block must be consecutive (true in vLLM: a request's new tokens are contiguous and
        a block being written belongs to one request).
        """
        _check(
            slot_mapping.dim() == 1 and slot_mapping.dtype in (torch.int32, torch.int64),
            f"slot_mapping must be a 1-D int32/int64 tensor, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}",
        )
        self._slot_mapping = slot_mapping

    def run(self, key_cache: torch.Tensor, bounds: torch.Tensor) -> None:
        """Merge the keys written at the planned slots into ``bounds``, in place."""
        _check(self._slot_mapping is not None, "BlockBounds.run called before plan(slot_mapping)")
        slots = self._slot_mapping
        self._check_cache(key_cache, bounds)
        _check(
            slots.device == key_cache.device,
            f"slot_mapping is on {slots.device} but key_cache is on {key_cache.device}",
        )
        if slots.numel() == 0:
            return
        _merge_written_keys_kernel[(slots.numel(), self.num_kv_heads)](
            key_cache,
            bounds,
            slots,
            slots.numel(),
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            bounds.stride(0),
            bounds.stride(1),
            bounds.stride(2),
            BLOCK_SIZE=self.block_size,
            RUN=triton.next_power_of_2(self.block_size),
            HEAD_DIM=self.head_dim,
            BLOCK_D=triton.next_power_of_2(self.head_dim),
        )

    def recompute(
        self, key_cache: torch.Tensor, bounds: torch.Tensor, block_ids: torch.Tensor, num_filled: torch.Tensor
    ) -> None:
        """Rebuild the bounds of ``block_ids`` from slots ``[0, num_filled[i])`` of each block (0 = empty; values
        above ``block_size`` count as a full block)."""
        self._check_cache(key_cache, bounds)
        _check(
            block_ids.dim() == 1 and block_ids.dtype in (torch.int32, torch.int64),
            f"block_ids must be a 1-D int32/int64 tensor, got {tuple(block_ids.shape)} {block_ids.dtype}",
        )
        _check(
            num_filled.shape == block_ids.shape and num_filled.dtype in (torch.int32, torch.int64),
            f"num_filled must be an int32/int64 tensor of shape {tuple(block_ids.shape)}, "
            f"got {tuple(num_filled.shape)} {num_filled.dtype}",
        )
        if block_ids.numel() == 0:
            return
        _recompute_bounds_kernel[(block_ids.numel(), self.num_kv_heads)](
            key_cache,
            bounds,
            block_ids,
            num_filled,
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            bounds.stride(0),
            bounds.stride(1),
            bounds.stride(2),
            BLOCK_SIZE=self.block_size,
            RUN=triton.next_power_of_2(self.block_size),
            HEAD_DIM=self.head_dim,
            BLOCK_D=triton.next_power_of_2(self.head_dim),
        )

    def _check_cache(self, key_cache: torch.Tensor, bounds: torch.Tensor) -> None:
        _check(
            key_cache.dim() == 4 and tuple(key_cache.shape[1:]) == (self.block_size, self.num_kv_heads, self.head_dim),
            f"key_cache must be [num_blocks, {self.block_size}, {self.num_kv_heads}, {self.head_dim}] "
            f"(block_size, num_kv_heads, head_dim), got {tuple(key_cache.shape)}",
        )
        _check(
            key_cache.dtype in SUPPORTED_DTYPES,
            f"key_cache dtype must be one of {SUPPORTED_DTYPES}, got {key_cache.dtype}",
        )
        _check(key_cache.stride(-1) == 1, "key_cache must be contiguous in its last (head_dim) dimension")
        expected = (key_cache.shape[0], self.num_kv_heads, 2, self.head_dim)
        _check(
            tuple(bounds.shape) == expected,
            f"bounds must be [num_blocks, num_kv_heads, 2, head_dim] = {list(expected)}, got {list(bounds.shape)}",
        )
        _check(
            bounds.dtype == key_cache.dtype and bounds.device == key_cache.device,
            f"bounds must have key_cache's dtype and device ({key_cache.dtype}, {key_cache.device}), "
            f"got {bounds.dtype}, {bounds.device}",
        )
        _check(bounds.stride(-1) == 1, "bounds must be contiguous in its last (head_dim) dimension")
