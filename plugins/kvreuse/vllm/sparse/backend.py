"""vLLM attention backend of the ``sparse`` plugin: dense causal prefill, DIPR decode, over vLLM's plain layout.

Selected on a GPU with vLLM's own flag ``--attention-backend CUSTOM`` (``register()`` registers this class as
``AttentionBackendEnum.CUSTOM``). vLLM's CPU platform ignores ``--attention-backend`` and always picks CPU_ATTN, so
on CPU the backend is opt-in through ``KVREUSE_SPARSE_CPU_BACKEND=1``, with which ``register()`` puts it in place
of CPU_ATTN in that process (and in vLLM's workers, which inherit the variable).

The classes here are thin: the cache write, the key sketch and the attention live in ``kvreuse.sparse.paged``.
Settings come from ``--additional-config '{"kvreuse": {"sparse": {...}}}'`` or ``KVREUSE_SPARSE_*``. The attended
fractions per layer reach vLLM's metrics through a kvreuse KV connector (``kvreuse.vllm.sparse.connector``), are
logged (logger ``vllm.plugins.kvreuse``) every ``LOG_EVERY_STEPS`` engine steps and at shutdown, and are read in
the worker process with ``kvreuse.vllm.runtime.sparse_figures()`` (e.g. through ``LLM.collective_rpc``).

The key sketch (``kvreuse.kernels.key_sketch``: an int8 code per key channel and an fp32 scale per token and KV
head) is inside vLLM's KV cache budget: ``customize_spec`` pads each block's page by the token rows the block's
sketch needs (``sketch_rows``), so vLLM sizes the cache, and so the number of blocks, with the sketch counted. The
backend does not keep the sketch in those rows, though: ``layer_cache`` lays the memory vLLM allocates for a layer
out as every block's K and V packed together, then every block's sketch together, so that DIPR's decision streams
the sketches instead of reading a short stretch at the end of every page. A block's sketch is addressed by its block
id, so it lives and dies with the block (and is kept with it by the prefix cache). Whatever reads or writes a
layer's K/V other than the backend goes through ``plain_kv`` (the module cache's worker), never vLLM's per-layer
view, whose pages no longer hold K/V where vLLM's strides say.
"""

from __future__ import annotations

import atexit
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.config import VllmConfig
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from kvreuse.errors import ConfigError
from kvreuse.kernels.key_sketch import KeySketch, sketch_strides
from kvreuse.patches import vllm_0_32
from kvreuse.sparse import sketch_scan
from kvreuse.sparse.ape import ApeSpans
from kvreuse.sparse.config import SparseConfig
from kvreuse.sparse.paged import PagedBatch, SparseAttention
from kvreuse.vllm.names import SPARSE_CPU_SWITCH, ConnectorName
from kvreuse.vllm.runtime import runtime, sparse_attention, sparse_figures
from kvreuse.vllm.settings import kvreuse_flags
from kvreuse.vllm.sparse.cpu_kernel import CPUAttentionKernel

logger = logging.getLogger("vllm.plugins.kvreuse")

LOG_EVERY_STEPS = 1000  # engine steps between two log lines of the figures


@atexit.register
def log_sparse_figures() -> None:
    for row in sparse_figures():
        recovery = (
            ""
            if not row["samples"]
            else (
                f", kept {row['recovery_mean']:.4f} of the attention mass (min {row['recovery_min']:.4f}, "
                f"{row['samples']} samples)"
            )
        )
        logger.info(
            "kvreuse sparse: layer %d attended %.3f of blocks, %.3f of tokens%s",
            row["layer"],
            row["block_fraction"] or 0.0,
            row["token_fraction"] or 0.0,
            recovery,
        )


def runs_engine_kernel(vllm_config: VllmConfig, config: SparseConfig, knows_key_tiles: bool) -> bool:
    """Whether the backend runs DIPR as a filter in front of vLLM's own CPU attention ops, on CPU_ATTN's cache
    layout: on vLLM's CPU build with ``sparse.engine_kernel`` (the default). With the module cache's connector on,
    only where kvreuse knows how the ops pack keys for this CPU (``knows_key_tiles``,
    ``CPUAttentionKernel.knows_key_tiles``): the connector reads and writes K/V through plain views of the tiles
    (``plain_kv``), and its requests that attend by position or with APE run kvreuse's PyTorch attention over them.
    Elsewhere the backend keeps the plain layout and its own PyTorch attention (``kvreuse.sparse.cpu_attention``),
    as it does with ``engine_kernel`` false."""
    return (
        config.engine_kernel
        and vllm_0_32.device_type(vllm_config) == "cpu"
        and (knows_key_tiles or not module_cache_on(vllm_config))
    )


def runs_flash_attention(vllm_config: VllmConfig, config: SparseConfig) -> bool:
    """Whether the backend runs DIPR as a filter in front of vLLM's own FlashAttention: on a CUDA engine with
    ``sparse.engine_kernel`` (the default), unless the module cache's connector is on (that pairing has not run on a
    GPU yet, so it keeps kvreuse's own kernels, on which the module cache's tests run).
    The cache keeps vLLM's GPU layout (LBNHC, FlashAttention's own view of it) either way; prefill and dense steps
    are one FlashAttention call, as the stock backend makes them, and DIPR decodes read only the blocks the Triton
    sketch scan keeps (``kvreuse.sparse.filtered_decode``)."""
    return config.engine_kernel and vllm_0_32.device_type(vllm_config) == "cuda" and not module_cache_on(vllm_config)


def module_cache_on(vllm_config: VllmConfig) -> bool:
    """Whether the module cache's connector runs (see ``runs_engine_kernel``)."""
    transfer = vllm_config.kv_transfer_config
    return transfer is not None and transfer.kv_connector == ConnectorName.MODULE_CACHE


def check_kv_connector(vllm_config: VllmConfig) -> None:
    """Refuse a KV connector other than kvreuse's: it would read and write K/V through vLLM's per-layer view, where
    this backend does not keep them (``layer_cache``), and load blocks without their key sketches. kvreuse's module
    cache reads through ``plain_kv`` and writes through the backend's cache write."""
    transfer = vllm_config.kv_transfer_config
    if transfer is None or transfer.kv_connector is None:
        return
    connectors = [transfer.kv_connector]
    if transfer.kv_connector == "MultiConnector":  # vLLM's: its connectors are listed in its extra config
        extra = getattr(transfer, "kv_connector_extra_config", None) or {}
        connectors = [part.get("kv_connector") for part in extra.get("connectors", [])]
    for connector in connectors:
        if connector in set(ConnectorName):
            continue
        raise ConfigError(
            f"the kvreuse sparse attention backend keeps K/V and key sketches in its own layout, which KV connector "
            f"{connector!r} does not know; use it without the backend (unset {SPARSE_CPU_SWITCH} / --attention-backend "
            f"CUSTOM), or one of kvreuse's connectors ({', '.join(ConnectorName)})"
        )


def _shared_attention(num_heads: int, num_kv_heads: int, head_size: int, scale: float) -> SparseAttention:
    """The process's ``SparseAttention`` for the engine being built (see ``ProcessRuntime.sparse_attention_for``)."""
    vllm_config = vllm_0_32.current_vllm_config()
    check_kv_connector(vllm_config)

    def build() -> SparseAttention:
        config = SparseConfig.load(
            kvreuse_flags(vllm_config.additional_config, "sparse"), cpu=vllm_0_32.device_type(vllm_config) == "cpu"
        )
        block_size = vllm_config.cache_config.block_size
        kernel = None
        if config.engine_kernel and vllm_0_32.device_type(vllm_config) == "cpu":
            kernel = CPUAttentionKernel(vllm_config.model_config.dtype, block_size, head_size, scale)
            if not runs_engine_kernel(vllm_config, config, kernel.knows_key_tiles):
                logger.warning(
                    "kvreuse sparse attention: vLLM's CPU attention packs keys for instruction set %r in a layout "
                    "the module cache cannot read, so with its connector on the backend runs kvreuse's own (slower) "
                    "attention",
                    kernel.isa,
                )
                kernel = None
        flash = runs_flash_attention(vllm_config, config)
        attention = SparseAttention(
            num_heads,
            num_kv_heads,
            head_size,
            block_size,
            scale,
            config,
            paged_kernel=kernel,
            decode_kernel=vllm_0_32.flash_attention if flash else None,
            max_seqs=vllm_config.scheduler_config.max_num_seqs,
            max_context=vllm_config.model_config.max_model_len,
        )
        attention.log = logger
        if kernel is not None:
            sketch_scan.warm_up(num_kv_heads, head_size, block_size)
        logger.info(
            "kvreuse sparse attention: %s, exact attention by %s",
            config,
            "vLLM's CPU attention ops"
            if kernel is not None
            else "vLLM's FlashAttention (DIPR decodes over pruned block tables)"
            if flash
            else "kvreuse's own kernels",
        )
        return attention

    return runtime().sparse_attention_for(vllm_config, build)


class SparseAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        # vLLM looks the name up in AttentionBackendEnum; CUSTOM is the member this class is registered under.
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[SparseAttentionImpl]:
        return SparseAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[SparseAttentionMetadataBuilder]:
        return SparseAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: AttentionSpec | None = None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """Pad each page by the token rows of the block's key sketch, so that vLLM counts it in the KV cache budget
        (and so sizes the number of blocks with it; ``layer_cache`` says where the sketch is kept). A page someone
        already padded enough is kept as it is."""
        unpadded, padded = vllm_0_32.page_sizes(spec)
        needed = unpadded + sketch_rows(spec) * row_bytes(spec)
        if padded is None:
            return vllm_0_32.with_padded_page(spec, needed)
        if padded < needed:
            raise ConfigError(
                f"the kvreuse sparse attention backend needs {needed} bytes per KV page (the block "
                f"plus its key sketch) but vLLM padded the page to {padded}"
            )
        return spec

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # vLLM asks the process that built the model's layers (and so the SparseAttention). In front of vLLM's CPU
        # ops: CPU_ATTN's block, head, token, channel. Else block, token, head, channel: the per-layer view [B, H,
        # N, 2D] transposed is [B, N, H, 2D], whose key and value halves are the kernels' key_cache/value_cache
        # [num_blocks, block_size, num_kv_heads, head_dim].
        attention = sparse_attention()
        if attention is not None and attention.paged_kernel is not None:
            return (KVCacheLayout.LBHNC,)
        return (KVCacheLayout.LBNHC,)


def row_bytes(spec: AttentionSpec) -> int:
    """Bytes of one token row of a page: K and V of every KV head."""
    return spec.num_kv_heads * 2 * spec.head_size * torch.empty((), dtype=spec.dtype).element_size()


def sketch_bytes(block_size: int, num_kv_heads: int, head_size: int) -> int:
    """Bytes of one block's key sketch (an int8 code per channel and an fp32 scale, per token and KV head) as
    ``sketch_strides`` lays it out on a CPU, whose rows of whole ``TOKEN_ROW``s make it the larger layout: pages
    sized for it hold either."""
    return sketch_strides(block_size, num_kv_heads, head_size, "cpu").block_bytes


def sketch_rows(spec: AttentionSpec) -> int:
    """Token rows one block's key sketch takes (rounded up): e.g. 5 rows for a float32 block of 32 tokens, 3 KV
    heads of 64 channels (+16% of the block), 9 for the same block in bfloat16 (+28%)."""
    return -(-sketch_bytes(spec.block_size, spec.num_kv_heads, spec.head_size) // row_bytes(spec))


@dataclass(frozen=True)
class LayerCache:
    """One layer's cache as the backend lays it out in the memory vLLM allocates for the layer.

    vLLM allocates ``num_blocks`` pages of ``customize_spec``'s padded size and hands the backend a per-layer view
    ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` whose blocks are a page apart. The backend reads that
    memory as two regions instead (``layer_cache``):

    - K/V, from the view's first element: block ``b``'s K and V at ``b * kv_span`` elements (``kv_span = block_size *
      num_kv_heads * 2 * head_size``), inside a block in the view's own order (LBNHC or CPU_ATTN's LBHNC, then
      ``tiles``); ``key_cache``/``value_cache`` are the kernels' views of them (``[blocks, tokens, heads,
      head_size]`` on LBNHC, CPU_ATTN's ``[blocks, heads, tokens, head_size]`` tiles on LBHNC).
    - the key sketch, right after the last block's K/V: every block's int8 codes, then every block's fp32 scales,
      each block's KV head by KV head (the order DIPR's scan walks them, ``kvreuse.sparse.sketch_scan``; inside a
      KV head as ``kvreuse.kernels.key_sketch.sketch_strides`` lays it out for the device: on a CPU channel by
      channel, a channel's tokens side by side), so the scan reads one contiguous stretch per region. ``sketch``
      views them as ``codes [num_blocks, block_size, num_kv_heads, head_size]`` and ``scales [num_blocks,
      block_size, num_kv_heads]``.

    Both regions together take ``num_blocks * (kv_span + sketch)`` bytes, within the ``num_blocks`` padded pages.
    vLLM itself never reads or writes K/V through its view of them (vLLM 0.32): it zeroes new blocks through it only
    for caches with Mamba layers or mixed precisions (``KVCacheConfig.needs_kv_cache_zeroing``), whose page sizes it
    unifies, which ``layer_cache`` refuses (pages of another size than the backend's); and it copies a block through
    it only for copy-on-write of a block a prefix-cache hit ends inside, which needs prefix hashes finer than a block,
    so several KV cache groups (``resolve_kv_cache_block_sizes``), never the one group of full-attention layers this
    backend serves (it refuses sliding windows and KV sharing between layers).
    """

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    sketch: KeySketch
    tiles: bool


def layer_cache(kv_cache: torch.Tensor) -> LayerCache:
    """The backend's views of a layer's memory (see ``LayerCache``), from vLLM's per-layer view ``kv_cache`` of
    pages ``customize_spec`` padded, in either layout the backend asks for (``supported_kv_cache_layouts``: LBNHC,
    or CPU_ATTN's LBHNC); both are layer-major, so the layer's pages are one stretch of memory of ``num_blocks``
    pages from the view's first element. The views reinterpret that memory (no copy)."""
    num_blocks, num_kv_heads, block_size, width = kv_cache.shape
    page, head_stride, token_stride, channel_stride = kv_cache.stride()
    head_size = width // 2
    element = kv_cache.element_size()
    kv_span = block_size * num_kv_heads * width  # elements of a block's K and V
    head_major = (head_stride, token_stride) == (block_size * width, width)  # LBHNC
    token_major = (head_stride, token_stride) == (width, num_kv_heads * width)  # LBNHC
    row = num_kv_heads * width * element  # bytes of a token row
    padded = kv_span * element + -(-sketch_bytes(block_size, num_kv_heads, head_size) // row) * row
    start = kv_cache.storage_offset() * element  # bytes
    codes_at = start + num_blocks * kv_span * element
    strides = sketch_strides(block_size, num_kv_heads, head_size, kv_cache.device)
    codes_bytes = num_blocks * strides.block_codes
    scales_at = codes_at + -(-codes_bytes // 4) * 4
    end = scales_at + num_blocks * strides.block_scales * 4
    if (
        width % 2
        or channel_stride != 1
        or not (head_major or token_major)
        or start % 4
        or page * element != padded
        or end > start + num_blocks * padded
        or start + num_blocks * padded > kv_cache.untyped_storage().nbytes()
    ):
        raise ConfigError(
            f"the kvreuse sparse attention backend keeps every block's K/V and then every block's key sketch in the "
            f"pages vLLM allocates for a layer, but this KV cache view (shape {list(kv_cache.shape)}, strides "
            f"{list(kv_cache.stride())}) is not laid out in pages of the backend's size ({padded} bytes): vLLM did "
            f"not use the backend's page size (a hybrid model, whose pages vLLM unifies and zeroes through its own "
            f"view) or its layout (LBNHC/LBHNC)"
        )
    kv = kv_cache.as_strided(kv_cache.shape, (kv_span, head_stride, token_stride, 1), kv_cache.storage_offset())
    if head_major:  # CPU_ATTN's view: per block and KV head a key tile then a value tile, [tokens, head_size] each
        key_cache, value_cache = kv.view(num_blocks, num_kv_heads, 2 * block_size, head_size).chunk(2, dim=2)
    else:
        key_cache, value_cache = kv.transpose(1, 2).split(head_size, dim=-1)
    storage = kv_cache.untyped_storage()
    codes = torch.empty(0, dtype=torch.int8, device=kv_cache.device).set_(storage)
    scales = torch.empty(0, dtype=torch.float32, device=kv_cache.device).set_(storage)
    sketch = KeySketch(
        codes.as_strided((num_blocks, block_size, num_kv_heads, head_size), strides.codes, codes_at),
        scales.as_strided((num_blocks, block_size, num_kv_heads), strides.scales, scales_at // 4),
    )
    return LayerCache(key_cache, value_cache, sketch, tiles=head_major)


def plain_kv(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a layer this backend serves, from vLLM's per-layer view ``kv_cache``, as ``[num_blocks,
    block_size, num_kv_heads, head_size]`` views of where the backend keeps them (``LayerCache``; no copy): what a
    reader or writer of K/V other than the backend (the module cache's worker) uses instead of vLLM's view, whose
    block stride is the padded page's and whose rows are not K|V in CPU_ATTN's tiles."""
    cache = layer_cache(kv_cache)
    if not cache.tiles:  # the plain layout: the kernels' views are plain already
        return cache.key_cache, cache.value_cache
    attention = sparse_attention()
    if attention is None or attention.paged_kernel is None:
        raise ConfigError("a KV cache in CPU_ATTN's tiles without the sparse backend's CPU kernel to read them")
    return attention.paged_kernel.plain_keys(cache.key_cache), attention.paged_kernel.plain_values(cache.value_cache)


@dataclass
class SparseAttentionMetadata:
    batch: PagedBatch


class SparseAttentionMetadataBuilder(AttentionMetadataBuilder[SparseAttentionMetadata]):
    def __init__(
        self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig, device: torch.device
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> SparseAttentionMetadata:
        m = common_attn_metadata
        # The host lengths (see host_seq_lens: an upper bound for decode rows under asynchronous speculative
        # decoding) only choose dense or DIPR per request and count the figures of dense decodes; the kernels read
        # the device lengths.
        seq_lens_cpu = vllm_0_32.host_seq_lens(m)
        return SparseAttentionMetadata(
            PagedBatch(
                query_start_loc=m.query_start_loc[: m.num_reqs + 1],
                query_start_loc_cpu=m.query_start_loc_cpu[: m.num_reqs + 1],
                seq_lens=m.seq_lens[: m.num_reqs],
                seq_lens_cpu=seq_lens_cpu,
                block_table=m.block_table_tensor[: m.num_reqs],
                slot_mapping=m.slot_mapping,
                num_actual_tokens=m.num_actual_tokens,
                max_seq_len=m.max_seq_len,
                query_positions=step_positions(m.num_actual_tokens),
                ape=step_ape(m.num_reqs),
            )
        )


def step_positions(num_tokens: int) -> torch.Tensor | None:
    """The positions the module connector gave this step's tokens (module recompute), if it moved any; checked
    against the step's token count, so a step built without vLLM's input preparation (a dummy run) never gets
    another step's."""
    positions = runtime().step_positions
    return positions if positions is not None and len(positions) == num_tokens else None


def step_ape(num_reqs: int) -> tuple[ApeSpans | None, ...] | None:
    """The APE spans the module connector gave this step's requests (modules spliced with APE), if any; checked
    against the step's request count, as ``step_positions`` is."""
    spans = runtime().step_ape
    return spans if spans is not None and len(spans) == num_reqs else None


class SparseAttentionImpl(AttentionImpl[SparseAttentionMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **unsupported: Any,
    ) -> None:
        problems = [
            name
            for name, given in (
                ("ALiBi", alibi_slopes is not None),
                ("sliding window", sliding_window is not None),
                ("logits soft cap", bool(logits_soft_cap)),
                (f"attention type {attn_type}", attn_type != AttentionType.DECODER),
                (f"kv_cache_dtype {kv_cache_dtype}", kv_cache_dtype != "auto"),
                (
                    "KV cache sharing between layers (the key sketch is per layer)",
                    kv_sharing_target_layer_name is not None,
                ),
                ("attention sinks", unsupported.get("sinks") is not None),
            )
            if given
        ]
        if problems:
            raise ConfigError(
                f"the kvreuse sparse attention backend does not support {', '.join(problems)}; "
                f"unset {SPARSE_CPU_SWITCH} / --attention-backend CUSTOM for this model"
            )
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type
        self.attention = _shared_attention(num_heads, self.num_kv_heads, head_size, scale)
        self._views: tuple[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor, KeySketch]] | None = None
        self._layer: int | None = None
        self._steps = 0

    def _caches(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, KeySketch]:
        """Key and value caches and the key sketch in the memory under ``kv_cache`` (vLLM's per-layer view; see
        ``layer_cache``). Made once per cache memory; every write sketches the keys it stores, so the sketch needs
        no setting up."""
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.stride())
        if self._views is None or self._views[0] != key:
            _, _, block_size, width = kv_cache.shape
            if self.attention.paged_kernel is not None and kv_cache.stride(1) != block_size * width:
                raise ConfigError(
                    f"the kvreuse sparse attention backend runs vLLM's CPU attention ops, which need the LBHNC "
                    f"KV cache layout, but vLLM gave this layer strides {list(kv_cache.stride())} (another "
                    f"layout was requested, e.g. VLLM_KV_CACHE_LAYOUT)"
                )
            cache = layer_cache(kv_cache)
            self.attention.block_size = block_size  # the kernel block size vLLM chose (a multiple of 16)
            self._views = (key, (cache.key_cache, cache.value_cache, cache.sketch))
        return self._views[1]

    def _layer_index(self, layer: Any) -> int:
        if self._layer is None:
            self._layer = vllm_0_32.layer_index(layer.layer_name)
        return self._layer

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        key_cache, value_cache, sketch = self._caches(kv_cache)
        self.attention.write(key, value, key_cache, value_cache, sketch, slot_mapping)

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: SparseAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the kvreuse sparse backend")
        if attn_metadata is None:  # profiling run
            return output.fill_(0)
        batch = attn_metadata.batch
        n = batch.num_actual_tokens
        key_cache, value_cache, sketch = self._caches(kv_cache)
        layer_index = self._layer_index(layer)
        self.attention.attend(layer_index, query[:n], key_cache, value_cache, sketch, batch, output[:n])
        if layer_index == 0:  # one engine step per call of the first layer
            self._steps += 1
            if self._steps % LOG_EVERY_STEPS == 0:
                log_sparse_figures()
        return output
