"""vLLM's own CPU attention (CPU_ATTN's C++ ops) as the sparse backend's ``PagedKernel`` on vLLM's CPU build.

The backend then keeps K and V in CPU_ATTN's layout (``KVCacheLayout.LBHNC``: per block and KV head a key tile
packed for the CPU's instruction set, then a ``[block_size, head_dim]`` value tile) and every exact attention is
CPU_ATTN's kernel: prefill, dense decodes and beta = inf run it exactly as the stock backend does; a DIPR decode runs
it once per KV head on that head's own view of the cache, with a block table pruned to the blocks the key sketch
keeps (``kvreuse.sparse.paged.SparseAttention._attend_filtered``). The ops are reached through
``kvreuse.patches.vllm_0_32`` (``cpu_cache_write``, ``cpu_attention_schedule``, ``cpu_attention``).
"""

from __future__ import annotations

import torch

from kvreuse.errors import ConfigError
from kvreuse.patches import vllm_0_32

# Instruction-set variants whose key tile layout is known (tested against the op in test_sparse_cpu_kernel.py):
# "vec" stores each (block, KV head) key tile transposed, [head_dim, block_size].
TRANSPOSED_KEY_TILES = ("vec",)


class CPUAttentionKernel:
    """CPU_ATTN's cache write and paged attention for one model shape (``isa`` as vLLM picks it)."""

    def __init__(self, dtype: torch.dtype, block_size: int, head_size: int, scale: float) -> None:
        self.dtype, self.block_size, self.head_size, self.scale = dtype, block_size, head_size, float(scale)
        self.isa = vllm_0_32.cpu_attention_isa(dtype, block_size, head_size)

    def write(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        slots = slot_mapping.long()
        fresh = fresh_partial_blocks(slots, self.block_size)
        if len(fresh):
            key_cache[fresh] = 0
            value_cache[fresh] = 0
        vllm_0_32.cpu_cache_write(key, value, key_cache, value_cache, slots, self.isa)

    def schedule(
        self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_heads: int, num_kv_heads: int
    ) -> object:
        return vllm_0_32.cpu_attention_schedule(
            num_heads, num_kv_heads, self.head_size, seq_lens, query_start_loc, self.dtype, self.isa
        )

    def attend(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        out: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        schedule: object,
    ) -> None:
        assert isinstance(schedule, torch.Tensor)
        vllm_0_32.cpu_attention(
            query, key_cache, value_cache, out, query_start_loc, seq_lens, block_table, self.scale, schedule
        )

    def plain_keys(self, key_cache: torch.Tensor) -> torch.Tensor:
        """``key_cache`` (``[num_blocks, kv_heads, block_size, head_dim]``, tiles packed for ``isa``) as the
        kernels' ``[num_blocks, block_size, kv_heads, head_dim]`` view, for the sampled recovery ratio."""
        if self.isa not in TRANSPOSED_KEY_TILES:
            raise ConfigError(
                f"sparse.sample_recovery reads keys, but CPU_ATTN packs them for instruction set {self.isa!r} in a "
                f"layout kvreuse does not know; set sparse.sample_recovery 0"
            )
        num_blocks, kv_heads, block_size, head_dim = key_cache.shape
        return key_cache.as_strided(
            (num_blocks, block_size, kv_heads, head_dim),
            (key_cache.stride(0), 1, key_cache.stride(1), block_size),
            key_cache.storage_offset(),
        )


def fresh_partial_blocks(slot_mapping: torch.Tensor, block_size: int) -> torch.Tensor:
    """The blocks a step starts (writes slot 0 of) without filling them: their slots after the step's last token
    still hold what the block's previous request wrote. CPU_ATTN's kernel weighs a block's value rows past the
    sequence with 0, and ``0 * NaN`` is NaN, so a request whose arithmetic overflowed would reach the next one
    through them (issue 26): such blocks are zeroed before the write (any tile packing holds zeros as zeros)."""
    slots = slot_mapping[slot_mapping >= 0]
    blocks, counts = torch.unique(slots // block_size, return_counts=True)
    started = torch.unique(slots[slots % block_size == 0] // block_size)
    return blocks[(counts < block_size) & torch.isin(blocks, started)]
