"""The KV cache write kernel against its PyTorch reference (Triton's interpreter on CPU).

Awkward shapes (3 KV heads, head_dim 48, block size 24), keys as a strided view of a fused projection (as vLLM
passes them) and values contiguous, a key cache that is one half of vLLM's K|V page and a value cache with other
strides (so no stride is taken for another), padding slots, a slot mapping longer than the tokens, and a cache of
another dtype than the projection (the kernel rounds on store as the reference does). Every slot the step does not
write is NaN before and must still be NaN after. Caches compare bitwise: a store is a copy, or one conversion
rounded to nearest even in both (no arithmetic, so no order to differ).
"""

from __future__ import annotations

import pytest
import torch
from numerics import DEVICE

from kvreuse.errors import KernelArgumentError
from kvreuse.kernels.paged_write import PagedKVWrite, store_kv_reference

KV_HEADS, DIM, BLOCK, POOL = 3, 48, 24, 7


def step(source_dtype, seed=0):
    """Keys, values (views of a [tokens, q | k | v] projection) and a slot mapping with padding and extra entries."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(POOL * BLOCK, generator=g)[:29]
    slots[[3, 17]] = -1
    slots = torch.cat([slots, torch.tensor([5, 6])])  # entries past the tokens are not used
    qkv = torch.randn(29, 4 * KV_HEADS * DIM, generator=g).to(source_dtype).to(DEVICE)
    key = qkv[:, 2 * KV_HEADS * DIM : 3 * KV_HEADS * DIM].view(29, KV_HEADS, DIM)
    value = qkv[:, 3 * KV_HEADS * DIM :].reshape(29, KV_HEADS, DIM).contiguous()
    return key, value, slots.to(DEVICE)


def nan_caches(dtype):
    """A key cache that is the K half of vLLM's [blocks, tokens, heads, K|V] page, and a value cache with rows padded
    to 64 channels: the two have different strides in every dimension."""
    pages = torch.full((POOL, BLOCK, KV_HEADS, 2 * DIM), float("nan"), dtype=dtype, device=DEVICE)
    padded = torch.full((POOL, BLOCK, KV_HEADS, 64), float("nan"), dtype=dtype, device=DEVICE)
    return pages[..., :DIM], padded[..., :DIM]


@pytest.mark.parametrize(
    "source_dtype,cache_dtype",
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float16),
    ],
)
def test_the_kernel_stores_what_the_reference_stores_and_nothing_else(source_dtype, cache_dtype):
    key, value, slots = step(source_dtype)
    assert key.stride(0) == 4 * KV_HEADS * DIM != value.stride(0)  # a strided view, not a copy
    ours, theirs = nan_caches(cache_dtype), nan_caches(cache_dtype)
    PagedKVWrite(BLOCK, KV_HEADS, DIM).run(key, value, *ours, slots)
    store_kv_reference(key, value, *theirs, slots)
    for mine, ref in zip(ours, theirs):
        assert torch.equal(mine.isnan(), ref.isnan())
        assert torch.equal(mine.nan_to_num(), ref.nan_to_num())
    written = ~ours[0].isnan().all(-1).all(-1)  # [blocks, slots] that hold a token
    assert (
        torch.equal(written, ~ours[1].isnan().all(-1).all(-1)) and int(written.sum()) == 27
    )  # 29 tokens, 2 of them padding; the 2 extra slot entries unused


def test_int32_slots_and_an_empty_step():
    key, value, slots = step(torch.float32)
    ours, theirs = nan_caches(torch.float32), nan_caches(torch.float32)
    PagedKVWrite(BLOCK, KV_HEADS, DIM).run(key, value, *ours, slots.to(torch.int32))
    store_kv_reference(key, value, *theirs, slots)
    assert torch.equal(ours[1].nan_to_num(), theirs[1].nan_to_num())
    before = ours[0].clone()
    PagedKVWrite(BLOCK, KV_HEADS, DIM).run(key[:0], value[:0], *ours, slots)
    assert torch.equal(ours[0].nan_to_num(), before.nan_to_num())


def test_bad_arguments_name_the_tensor():
    key, value, slots = step(torch.float32)
    caches = nan_caches(torch.float32)
    write = PagedKVWrite(BLOCK, KV_HEADS, DIM)
    with pytest.raises(KernelArgumentError, match=r"value must be \[num_tokens=29, num_kv_heads=3, head_dim=48\]"):
        write.run(key, value[:, :2], *caches, slots)
    with pytest.raises(KernelArgumentError, match="value_cache must be .*block_size=24"):
        write.run(key, value, caches[0], caches[1][:, :8], slots)
    with pytest.raises(KernelArgumentError, match="slot_mapping must be a 1-D int32/int64"):
        write.run(key, value, *caches, slots.float())
    with pytest.raises(KernelArgumentError, match="key_cache dtype must be one of"):
        write.run(key, value, caches[0].double(), caches[1], slots)
    with pytest.raises(KernelArgumentError, match="key must be contiguous in its last dimension"):
        write.run(key.transpose(1, 2).contiguous().transpose(1, 2), value, *caches, slots)
