"""The KV cache write of kvreuse's attention backends: a step's keys and values into their slots of a paged cache.

Layouts as in ``kvreuse.kernels.paged_layout``: ``key``/``value[num_tokens, num_kv_heads, head_dim]`` (any strides,
last dimension contiguous, e.g. views of a fused QKV projection) are stored at ``key_cache``/``value_cache
[num_blocks, block_size, num_kv_heads, head_dim]``, token ``t`` at slot ``slot_mapping[t]`` = ``block * block_size
+ offset``; a negative slot is padding and is skipped.

Why a kernel: in PyTorch, skipping the padding takes a boolean mask, and indexing with it sizes a tensor from data
on the device, which makes the host wait for the device in every layer of every step. One program per token and
KV head that returns on a negative slot needs no such read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvreuse.errors import check_kernel_argument as _check
from kvreuse.kernels import SUPPORTED_DTYPES
from kvreuse.kernels.paged_layout import check_cache_shape


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block (vLLM's page size)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM: one tile holds a whole row
):
    # One program per (token, KV head): copy its key and value rows into the token's slot.
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        d = tl.arange(0, BLOCK_D)
        in_row = d < HEAD_DIM
        k = tl.load(key_ptr + t * stride_kt + head * stride_kh + d, mask=in_row)
        v = tl.load(value_ptr + t * stride_vt + head * stride_vh + d, mask=in_row)
        tl.store(
            key_cache_ptr + block * stride_kcb + offset * stride_kct + head * stride_kch + d,
            k.to(key_cache_ptr.dtype.element_ty),
            mask=in_row,
        )
        tl.store(
            value_cache_ptr + block * stride_vcb + offset * stride_vct + head * stride_vch + d,
            v.to(value_cache_ptr.dtype.element_ty),
            mask=in_row,
        )


def store_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """What ``PagedKVWrite.run`` does, in PyTorch (the CPU path): store each token with a non-negative slot."""
    n = min(len(slot_mapping), len(key))
    slots = slot_mapping[:n].long()
    valid = slots >= 0
    slots, key, value = slots[valid], key[:n][valid], value[:n][valid]
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key.to(key_cache.dtype)
    value_cache[blocks, offsets] = value.to(value_cache.dtype)


class PagedKVWrite:
    """Stores a step's keys and values in a paged cache (layouts in the module docstring), once per layer."""

    def __init__(self, block_size: int, num_kv_heads: int, head_dim: int):
        _check(
            block_size >= 1 and num_kv_heads >= 1 and head_dim >= 1,
            f"block_size, num_kv_heads and head_dim must be >= 1, got {block_size}, {num_kv_heads}, {head_dim}",
        )
        self.block_size, self.num_kv_heads, self.head_dim = block_size, num_kv_heads, head_dim

    def run(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store ``key``/``value`` at ``slot_mapping`` (int32/int64; its first ``len(key)`` entries are used)."""
        rows = (self.num_kv_heads, self.head_dim)
        for name, tensor in (("key", key), ("value", value)):
            _check(
                tensor.dim() == 3 and tuple(tensor.shape[1:]) == rows and tensor.shape[0] == key.shape[0],
                f"{name} must be [num_tokens={key.shape[0]}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}], got {list(tensor.shape)}",
            )
        for name, tensor in (("key_cache", key_cache), ("value_cache", value_cache)):
            check_cache_shape(name, tensor, self.block_size, self.num_kv_heads, self.head_dim)
            _check(
                tensor.dtype in SUPPORTED_DTYPES, f"{name} dtype must be one of {SUPPORTED_DTYPES}, got {tensor.dtype}"
            )
        _check(
            slot_mapping.dim() == 1 and slot_mapping.dtype in (torch.int32, torch.int64),
            f"slot_mapping must be a 1-D int32/int64 tensor, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}",
        )
        for name, tensor in (
            ("key", key),
            ("value", value),
            ("key_cache", key_cache),
            ("value_cache", value_cache),
            ("slot_mapping", slot_mapping),
        ):
            _check(
                tensor.device == key_cache.device, f"{name} is on {tensor.device} but key_cache on {key_cache.device}"
            )
            _check(tensor.stride(-1) == 1, f"{name} must be contiguous in its last dimension")
        n = min(len(slot_mapping), key.shape[0])
        if n == 0:
            return
        _store_kv_kernel[(n, self.num_kv_heads)](
            key,
            value,
            key_cache,
            value_cache,
            slot_mapping,
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            *key_cache.stride()[:3],
            *value_cache.stride()[:3],
            BLOCK_SIZE=self.block_size,
            HEAD_DIM=self.head_dim,
            BLOCK_D=triton.next_power_of_2(self.head_dim),
        )
