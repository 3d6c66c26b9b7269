"""The paged KV cache layout every kvreuse kernel reads, and the checks its launchers make of it.

Layouts (the ones FlashAttention-style vLLM backends use; a view such as ``kv_cache[0]`` with any strides works, as
long as the last dimension is contiguous): ``key_cache``/``value_cache[num_blocks, block_size, num_kv_heads,
head_dim]``, vLLM's plain paged layout. Token ``i`` of a sequence lives at ``key_cache[block_table[seq, i //
block_size], i % block_size]``; a *slot* is ``block * block_size + offset``, as in vLLM's ``slot_mapping``
(negative slots are padding and are skipped).
"""

from __future__ import annotations

import torch

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
