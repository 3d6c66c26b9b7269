"""vLLM's own CPU attention (CPU_ATTN's C++ ops) as the sparse backend's ``PagedKernel`` on vLLM's CPU build.

The backend then keeps K and V in CPU_ATTN's layout (``KVCacheLayout.LBHNC``: per block and KV head a key tile
packed for the CPU's instruction set, then a ``[block_size, head_dim]`` value tile) and every exact attention is
CPU_ATTN's kernel: prefill, dense decodes and beta = inf run it exactly as the stock backend does; a layer's DIPR
decodes run it once, every (KV head, sequence) pair a sequence of its own on a one-head view of the cache
(``head_tiles``) with a block table pruned to the blocks the key sketch keeps
(``kvreuse.sparse.paged.SparseAttention._pruned_decode``). The ops are reached through ``kvreuse.patches.vllm_0_32``
(``cpu_cache_write``, ``cpu_attention_schedule``, ``cpu_attention``).
"""

from __future__ import annotations

import numpy as np
import torch

from kvreuse.errors import ConfigError
from kvreuse.patches import vllm_0_32
from kvreuse.sparse.per_tensor import PerTensor
from kvreuse.sparse.pruned import PrunedTables

# Instruction-set variants whose key tile layout is known (tested against the op in test_sparse_cpu_kernel.py):
# "vec" stores each (block, KV head) key tile transposed, [head_dim, block_size].
TRANSPOSED_KEY_TILES = ("vec",)


class CPUAttentionKernel:
    """CPU_ATTN's cache write and paged attention for one model shape (``isa`` as vLLM picks it)."""

    def __init__(self, dtype: torch.dtype, block_size: int, head_size: int, scale: float) -> None:
        self.dtype, self.block_size, self.head_size, self.scale = dtype, block_size, head_size, float(scale)
        self.isa = vllm_0_32.cpu_attention_isa(dtype, block_size, head_size)
        # per number of (KV head, sequence) pairs, the op's query starts: made once, not per layer and step
        self._starts: dict[int, torch.Tensor] = {}

    def write(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        clear: torch.Tensor,
    ) -> None:
        # CPU_ATTN's kernel weighs a block's value rows past the sequence with 0, and 0 * NaN is NaN, so a request
        # whose arithmetic overflowed would reach the next one through the slots it left in a block (issue 26): what
        # is not finite in the blocks a write starts without filling is zeroed first (0 * a finite value is 0, and
        # any tile packing holds zeros as zeros). Finite entries stay: the module cache writes a block's slots out of
        # order (a spliced module, then the tokens it recomputes), so such a block may hold this request's own K/V.
        if clear.shape[0]:
            for cache in (key_cache, value_cache):
                tiles = cache[clear]
                cache[clear] = tiles.masked_fill(~tiles.isfinite(), 0)
        vllm_0_32.cpu_cache_write(key, value, key_cache, value_cache, slot_mapping, self.isa)

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

    def attend_pruned(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        out: torch.Tensor,
        tables: PrunedTables,
    ) -> None:
        """One call of the op for every (KV head, sequence) pair of a decode batch, each a sequence of its own over
        a one-head view of the cache: in ``head_tiles`` every (block, KV head) tile is a block of its own, so a
        pair's pruned table lists its head's tiles and the op reads only those. The same arithmetic as one call per
        head on ``key_cache[:, h : h + 1]``, with one plan and one call per layer instead of one per KV head
        (0.86-0.94x the time of those on SmolLM2's shape at 2K-8K tokens, one thread, cold caches)."""
        kv, n, width = tables.block_table.shape
        group = query.shape[1] // kv
        keys, values = _head_tiles(key_cache), _head_tiles(value_cache)
        # the tables' small integer arithmetic in numpy: a few microseconds per layer less than as tensor ops
        table = torch.from_numpy(
            (tables.block_table.numpy() * kv + np.arange(kv, dtype=np.int32)[:, None, None]).reshape(kv * n, width)
        )
        seq_lens = tables.seq_lens.view(kv * n)
        starts = self._starts.get(kv * n)
        if starts is None:
            starts = self._starts[kv * n] = torch.from_numpy(np.arange(kv * n + 1, dtype=np.int32))
        schedule = self.schedule(starts, seq_lens, group, 1)
        if n == 1:  # one decode (a single sequence's steps): its heads are already grouped by KV head, no copies
            head_dim = query.shape[-1]
            self.attend(query.view(kv, group, head_dim), keys, values, out.view(kv, group, head_dim), starts,
                        seq_lens, table, schedule)  # fmt: skip
            return
        by_head = query.view(n, kv, group, -1).transpose(0, 1).reshape(kv * n, group, query.shape[-1])
        result = torch.empty_like(by_head)
        self.attend(by_head, keys, values, result, starts, seq_lens, table, schedule)
        out.view(n, kv, group, -1).copy_(result.view(kv, n, group, -1).transpose(0, 1))

    @property
    def knows_key_tiles(self) -> bool:
        """Whether ``plain_keys`` can read this instruction set's key tiles."""
        return self.isa in TRANSPOSED_KEY_TILES

    def plain_keys(self, key_cache: torch.Tensor) -> torch.Tensor:
        """``key_cache`` (``[num_blocks, kv_heads, block_size, head_dim]``, tiles packed for ``isa``) as the
        kernels' ``[num_blocks, block_size, kv_heads, head_dim]`` view (no copy), for whatever reads keys besides
        the op: the sampled recovery ratio, the module cache's steps that attend by position, its encoder."""
        self._check_tiles_known()
        num_blocks, kv_heads, block_size, head_dim = key_cache.shape
        return key_cache.as_strided(
            (num_blocks, block_size, kv_heads, head_dim),
            (key_cache.stride(0), 1, key_cache.stride(1), block_size),
            key_cache.storage_offset(),
        )

    def plain_values(self, value_cache: torch.Tensor) -> torch.Tensor:
        """``value_cache`` (``[num_blocks, kv_heads, block_size, head_dim]``, plain ``[block_size, head_dim]`` tiles
        in the variants ``plain_keys`` knows) as the kernels' ``[num_blocks, block_size, kv_heads, head_dim]`` view
        (no copy)."""
        self._check_tiles_known()
        return value_cache.transpose(1, 2)

    def _check_tiles_known(self) -> None:
        if not self.knows_key_tiles:
            raise ConfigError(
                f"sparse.sample_recovery reads keys, but CPU_ATTN packs them for instruction set {self.isa!r} in a "
                f"layout kvreuse does not know; set sparse.sample_recovery 0"
            )


def head_tiles(cache: torch.Tensor) -> torch.Tensor:
    """``cache[num_blocks, kv_heads, block_size, head_dim]`` (CPU_ATTN's tiles: each (block, KV head) tile contiguous,
    a block's tiles one after another, blocks packed as the backend lays them out, ``layer_cache``) as a one-head
    cache ``[num_blocks * kv_heads, 1, block_size, head_dim]`` whose tile ``b * kv_heads + h`` is block ``b``'s head
    ``h`` (no copy)."""
    num_blocks, kv_heads, block_size, head_dim = cache.shape
    tile = cache.stride(1)
    if cache.stride(0) != kv_heads * tile:
        raise ConfigError(
            f"the KV cache's blocks are not packed tile after tile (strides {list(cache.stride())}): the sparse "
            f"backend's layout of CPU_ATTN's cache was not used"
        )
    if num_blocks * kv_heads > 2**31:
        raise ConfigError(
            f"the KV cache's {num_blocks} blocks of {kv_heads} KV heads are too many for vLLM's CPU attention's int32 "
            f"block tables once each (block, KV head) tile is a block of its own: set sparse.engine_kernel false or "
            f"give the cache fewer blocks"
        )
    return cache.as_strided(
        (num_blocks * kv_heads, 1, block_size, head_dim), (tile, tile, cache.stride(2), cache.stride(3)),
        cache.storage_offset(),
    )  # fmt: skip


# a layer's caches live as long as the engine: their one-head views are made once, not per layer and step
_head_tiles = PerTensor(head_tiles)
