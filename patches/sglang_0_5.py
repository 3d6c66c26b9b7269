"""kvreuse's boundary with SGLang 0.5: every touch of an SGLang internal, as one small function each.

Importing this module checks the installed SGLang (:data:`TESTED`) and raises ``EngineVersionError`` for any other
version (see ``kvreuse.patches.versions``); ``kvreuse.sglang.register`` imports it first thing in every SGLang
process. It stays cheap to import: SGLang's modules are imported inside the functions.

The adapters in ``kvreuse.sglang`` use SGLang's plugin interfaces directly (the classes its registries and hooks
take, the methods SGLang calls on them, the data it hands them: :data:`MANIFEST`'s ``interface`` list) and reach
everything else through the functions below, each of which records the internal symbols it touches in
:data:`MANIFEST`; ``tests/sglang/test_engine_symbols.py`` checks both lists against the installed SGLang. Every
function was tested with SGLang 0.5.23, against its real classes on CPU (``make test-sglang``); no SGLang engine has
run with them (SGLang's engine needs a GPU).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvreuse.patches import versions
from kvreuse.patches.symbols import Manifest, attribute, call, value

if TYPE_CHECKING:
    import torch

TESTED = versions.SGLANG
VERSION = versions.check_engine(TESTED)

MANIFEST = Manifest("sglang", tested="SGLang 0.5.23 (its classes on CPU)")

SCHEDULE_POLICY_TARGET = "sglang.srt.managers.schedule_policy.SchedulePolicy"

_RADIX = "sglang.srt.mem_cache.radix_cache:RadixCache"
_POOL = "sglang.srt.mem_cache.memory_pool:MHATokenToKVPool"
_ALLOCATOR = "sglang.srt.mem_cache.allocator.base:BaseTokenToKVPoolAllocator"
_RUNNER = "sglang.srt.model_executor.model_runner:ModelRunner"


# -- registries -------------------------------------------------------------------------------------------------------


@MANIFEST.touches(
    call("sglang.srt.plugins.hook_registry:HookRegistry.register", "target", "hook", "hook_type"),
    value("sglang.srt.plugins.hook_registry:HookType.REPLACE"),
)
def replace_schedule_policy(cls: type) -> None:
    """Put ``cls`` in place of SGLang's ``SchedulePolicy`` class, everywhere SGLang's ``HookRegistry`` applies hooks
    (also where a module bound it with ``from ... import`` before the plugins loaded).

    SGLang 0.5.23 has no registry of schedule policies and rebuilds ``--schedule-policy``'s choices from a fixed
    annotation, so the class is replaced. Tested: SGLang 0.5.23.
    """
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(SCHEDULE_POLICY_TARGET, cls, HookType.REPLACE)


@MANIFEST.touches(
    value("sglang.srt.layers.attention.attention_registry:ATTENTION_BACKENDS"),
    call("sglang.srt.layers.attention.attention_registry:register_attention_backend", "name"),
    value("sglang.srt.arg_groups.choices:ATTENTION_BACKEND_CHOICES"),
    call("sglang.srt.arg_groups.choices:add_attention_backend_choices", "iterable"),
)
def add_attention_backend(name: str, factory: Callable[[Any], Any]) -> Any:
    """Register ``factory`` as ``--attention-backend name`` and add the name to the flag's choices; returns the
    factory another plugin registered under that name (then left in place, the choice still added), else ``None``.

    SGLang's attention registry is a module-level dict without a query function. Tested: SGLang 0.5.23.
    """
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.layers.attention.attention_registry import register_attention_backend as register

    existing = ATTENTION_BACKENDS.get(name)
    taken = existing is not None and existing is not factory
    if not taken:
        register(name)(factory)
    if name not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([name])
    return existing if taken else None


@MANIFEST.touches(
    call("sglang.srt.mem_cache.registry:register_radix_cache_backend", "name", "factory"),
    call("sglang.srt.mem_cache.registry:registered_radix_cache_backends"),
)
def add_radix_cache_backend(name: str, factory: Callable[[Any], Any]) -> None:
    """Register ``factory`` as ``--radix-cache-backend name`` unless the name is taken. Tested: SGLang 0.5.23."""
    from sglang.srt.mem_cache.registry import register_radix_cache_backend as register
    from sglang.srt.mem_cache.registry import registered_radix_cache_backends

    if name not in registered_radix_cache_backends():
        register(name, factory)


# -- the schedule policy (reorder plugin) ----------------------------------------------------------------------------


@MANIFEST.touches(
    call("sglang.srt.mem_cache.common:match_kv_cache", "req", "tree_cache"),
    attribute("sglang.srt.managers.schedule_batch:Req.prefix_len"),
)
def cached_prefix_tokens(req: Any, tree_cache: Any) -> int:
    """The tokens of ``req`` that SGLang's prefix cache holds, looked up as its ``lpm`` policy does before each
    prefill pass (``match_kv_cache`` only records the hit on the request). Tested: SGLang 0.5.23."""
    from sglang.srt.mem_cache.common import match_kv_cache

    match_kv_cache(req, tree_cache)
    return int(req.prefix_len)


@MANIFEST.touches(
    attribute("sglang.srt.managers.schedule_batch:Req.time_stats"),
    attribute("sglang.srt.observability.req_time_stats:SchedulerReqTimeStats.wait_queue_entry_time"),
)
def arrival_time(req: Any) -> float:
    """When ``req`` entered (or, retracted, re-entered) the waiting queue, in ``time.perf_counter`` seconds.
    Tested: SGLang 0.5.23."""
    return float(req.time_stats.wait_queue_entry_time)


@MANIFEST.touches(attribute("sglang.srt.managers.schedule_policy:SchedulePolicy.priority_sign"))
def priority_direction(policy: Any) -> int:
    """+1 when SGLang admits low priority values first (``--schedule-low-priority-values-first``), else -1.
    Tested: SGLang 0.5.23."""
    return int(policy.priority_sign)


@MANIFEST.touches(attribute(f"{_RADIX}.page_size"))
def cache_page_size(tree_cache: Any) -> int:
    """The tokens per page of a prefix cache (1 for a cache without pages). Tested: SGLang 0.5.23."""
    return int(getattr(tree_cache, "page_size", 1) or 1)


@MANIFEST.touches(attribute(f"{_RADIX}.disable"))
def cache_disabled(tree_cache: Any) -> bool:
    """Whether the prefix cache is off (``--disable-radix-cache``; a cache without the flag counts as off).
    Tested: SGLang 0.5.23."""
    return bool(getattr(tree_cache, "disable", True))


# -- the KV pool (modules and sparse plugins) ------------------------------------------------------------------------


@MANIFEST.touches(attribute(f"{_RADIX}.token_to_kv_pool_allocator"), call(f"{_ALLOCATOR}.get_kvcache", "self"))
def cache_kv_pool(tree_cache: Any) -> Any:
    """The KV pool behind a radix cache's slot allocator. Tested: SGLang 0.5.23."""
    return tree_cache.token_to_kv_pool_allocator.get_kvcache()


@MANIFEST.touches(attribute(f"{_RADIX}.token_to_kv_pool_allocator"), call(f"{_ALLOCATOR}.alloc", "self", "need_size"))
def allocate_slots(tree_cache: Any, count: int) -> torch.Tensor | None:
    """``count`` free KV slots from the radix cache's allocator (``None`` if the pool is full).
    Tested: SGLang 0.5.23."""
    slots: torch.Tensor | None = tree_cache.token_to_kv_pool_allocator.alloc(count)
    return slots


@MANIFEST.touches(attribute(f"{_RADIX}.token_to_kv_pool_allocator"), call(f"{_ALLOCATOR}.free", "self", "free_index"))
def free_slots(tree_cache: Any, slots: torch.Tensor) -> None:
    """Give KV slots back to the radix cache's allocator. Tested: SGLang 0.5.23."""
    tree_cache.token_to_kv_pool_allocator.free(slots)


@MANIFEST.touches(call(f"{_RADIX}.path_device_indices", "self", "node"))
def node_slots(tree_cache: Any, node: Any) -> torch.Tensor:
    """The KV slots of the tokens on the path from the root to ``node``. Tested: SGLang 0.5.23."""
    slots: torch.Tensor = tree_cache.path_device_indices(node)
    return slots


@MANIFEST.touches(attribute(f"{_POOL}.start_layer"), attribute(f"{_POOL}.layer_num"))
def pool_layers(pool: Any) -> range:
    """The layer ids a (pipeline stage's) KV pool holds. Tested: SGLang 0.5.23."""
    return range(pool.start_layer, pool.start_layer + pool.layer_num)


@MANIFEST.touches(
    call(f"{_POOL}.get_key_buffer", "self", "layer_id"), call(f"{_POOL}.get_value_buffer", "self", "layer_id")
)
def layer_kv_buffers(pool: Any, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's key and value buffers, ``[slots, kv_heads, head_dim]`` each. Tested: SGLang 0.5.23."""
    return pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)


@MANIFEST.touches(
    call(f"{_POOL}.get_key_buffer", "self", "layer_id"), call(f"{_POOL}.get_value_buffer", "self", "layer_id")
)
def write_pool_kv(pool: Any, layer_id: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Write keys and values straight into a layer's KV buffers at ``slots`` (cast to the pool's dtype).

    SGLang has no hook for a prefix cache to hand KV to the attention backend, so the buffers are written directly:
    an attention backend that keeps more than K and V per slot would not see these writes. Tested: SGLang 0.5.23.
    """
    key_buffer, value_buffer = pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)
    key_buffer[slots] = keys.to(key_buffer.dtype)
    value_buffer[slots] = values.to(value_buffer.dtype)


@MANIFEST.touches(
    attribute(f"{_RUNNER}.device"),
    attribute(f"{_RUNNER}.page_size"),
    attribute(f"{_RUNNER}.req_to_token_pool"),
    attribute(f"{_RUNNER}.token_to_kv_pool"),
    attribute(f"{_RUNNER}.use_mla_backend"),
)
def runner_kv(model_runner: Any) -> tuple[Any, int, Any, Any, bool]:
    """What an attention backend needs of the model runner SGLang hands its factory: the device, the page size,
    the request-to-token pool, the KV pool, and whether the model uses MLA. Tested: SGLang 0.5.23."""
    return (
        model_runner.device,
        int(model_runner.page_size),
        model_runner.req_to_token_pool,
        model_runner.token_to_kv_pool,
        bool(getattr(model_runner, "use_mla_backend", False)),
    )


@MANIFEST.touches(attribute("sglang.srt.mem_cache.memory_pool:ReqToTokenPool.req_to_token"))
def token_slot_table(req_to_token_pool: Any) -> torch.Tensor:
    """The ``[requests, max context]`` map from a request's token positions to KV slots. Tested: SGLang 0.5.23."""
    table: torch.Tensor = req_to_token_pool.req_to_token
    return table


@MANIFEST.touches(
    call("sglang.kernels.ops.attention.flash_attention:flash_attn_with_kvcache", "q", "k_cache", "v_cache"),
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
    """Causal paged attention through SGLang's own FlashAttention (``flash_attn_with_kvcache``, the kernel of its
    ``fa3`` backend, from ``sgl_kernel``), as ``FlashAttentionBackend`` calls it for a decoder without window, soft
    cap, sinks or a quantized KV cache; ``kvreuse.sparse.filtered_decode.PagedDecodeKernel``'s arguments. The caches
    are ``[pages, page_size, kv_heads, head_dim]`` views with a contiguous last dimension (SGLang's token-major pool
    viewed by pages, or its one-KV-head view). ``max_seqlen_k`` is not needed (the kernel reads ``seqused_k``). The
    call returns a new tensor, copied into ``out``. Needs SGLang's CUDA kernels (not in its CPU test environment).
    Tested: written against SGLang 0.5.23's sources; not yet run on a GPU."""
    from sglang.kernels.ops.attention.flash_attention import flash_attn_with_kvcache

    result = flash_attn_with_kvcache(
        q=query,
        k_cache=key_cache,
        v_cache=value_cache,
        cache_seqlens=seqused_k,
        page_table=block_table,
        cu_seqlens_q=cu_seqlens_q,
        max_seqlen_q=max_seqlen_q,
        softmax_scale=scale,
        causal=True,
    )
    out.copy_(result)


# -- the in-process engine (batch front ends) -----------------------------------------------------------------------


@MANIFEST.touches(
    attribute("sglang.srt.entrypoints.engine:Engine.tokenizer_manager"),
    attribute("sglang.srt.managers.tokenizer_manager:TokenizerManager.tokenizer"),
)
def engine_tokenizer(engine: Any) -> Any | None:
    """The Hugging Face tokenizer of a running ``sglang.Engine`` (``None`` if it has none, e.g. skipped).
    Tested: SGLang 0.5.23."""
    return getattr(getattr(engine, "tokenizer_manager", None), "tokenizer", None)


@MANIFEST.touches(
    attribute("sglang.srt.entrypoints.engine:Engine.server_args"),
    attribute("sglang.srt.server_args:ServerArgs.page_size"),
)
def engine_page_size(engine: Any) -> int:
    """The tokens per page of a running ``sglang.Engine``'s radix cache (``--page-size``, 1 by default).
    Tested: SGLang 0.5.23."""
    return int(getattr(engine.server_args, "page_size", None) or 1)


# -- the interface the adapters use directly -----------------------------------------------------------------------

_BATCH = "sglang.srt.model_executor.forward_batch_info"
_PREFIX = "sglang.srt.mem_cache.base_prefix_cache"
_LAYER_CLS = "sglang.srt.layers.radix_attention:RadixAttention"

MANIFEST.declare_interface(
    value("sglang.srt.plugins:load_plugins"),
    # the schedule policy
    value("sglang.srt.managers.schedule_policy:SchedulePolicy"),
    call(
        "sglang.srt.managers.schedule_policy:SchedulePolicy.__init__",
        "self",
        "policy",
        "tree_cache",
        "enable_hierarchical_cache",
        "enable_priority_scheduling",
        "schedule_low_priority_values_first",
    ),
    call(
        "sglang.srt.managers.schedule_policy:SchedulePolicy.calc_priority",
        "self",
        "waiting_queue",
        "running_batch",
        "processed_tokens",
    ),
    attribute("sglang.srt.managers.schedule_policy:SchedulePolicy.tree_cache"),
    attribute("sglang.srt.managers.schedule_batch:Req.origin_input_ids"),
    attribute("sglang.srt.managers.schedule_batch:Req.output_ids"),
    attribute("sglang.srt.managers.schedule_batch:Req.extra_key"),
    attribute("sglang.srt.managers.schedule_batch:Req.cache_salt"),
    attribute("sglang.srt.managers.schedule_batch:Req.priority"),
    value("sglang.srt.managers.schedule_batch:ScheduleBatch"),
    # the radix cache (--radix-cache-backend)
    call(f"{_RADIX}.__init__", "self", "params"),
    call(f"{_RADIX}.insert", "self", "params"),
    call(f"{_RADIX}.match_prefix", "self", "params"),
    value("sglang.srt.mem_cache.radix_cache:RadixKey"),
    call("sglang.srt.mem_cache.radix_cache:RadixKey.__init__", "self", "token_ids", "extra_key"),
    attribute("sglang.srt.mem_cache.radix_cache:RadixKey.token_ids"),
    attribute("sglang.srt.mem_cache.radix_cache:RadixKey.extra_key"),
    attribute("sglang.srt.mem_cache.radix_cache:RadixKey.cache_salt"),
    attribute(f"{_PREFIX}:InsertParams.key"),
    attribute(f"{_PREFIX}:InsertParams.value"),
    attribute(f"{_PREFIX}:InsertResult.prefix_len"),
    attribute(f"{_PREFIX}:MatchPrefixParams.key"),
    attribute(f"{_PREFIX}:MatchResult.device_prefix_len"),
    attribute(f"{_PREFIX}:MatchResult.last_device_node"),
    value("sglang.srt.mem_cache.cache_init_params:CacheInitParams"),
    attribute("sglang.srt.mem_cache.registry:TreeCacheBuildContext.server_args"),
    attribute("sglang.srt.mem_cache.registry:TreeCacheBuildContext.params"),
    attribute("sglang.srt.mem_cache.registry:TreeCacheBuildContext.is_hybrid_swa"),
    attribute("sglang.srt.mem_cache.registry:TreeCacheBuildContext.is_hybrid_ssm"),
    attribute("sglang.srt.mem_cache.registry:TreeCacheBuildContext.enable_hierarchical_cache"),
    attribute("sglang.srt.mem_cache.registry:TreeCacheBuildContext.disable_radix_cache"),
    attribute("sglang.srt.mem_cache.registry:TreeCacheBuildContext.model_config"),
    attribute("sglang.srt.mem_cache.registry:TreeCacheBuildContext.tp_size"),
    attribute("sglang.srt.mem_cache.cache_init_params:CacheInitParams.is_eagle"),
    attribute("sglang.srt.server_args:ServerArgs.model_path"),
    attribute("sglang.srt.server_args:ServerArgs.tokenizer_path"),
    attribute("sglang.srt.server_args:ServerArgs.attention_backend"),
    attribute("sglang.srt.server_args:ServerArgs.decode_attention_backend"),
    # the attention backend (--attention-backend)
    value("sglang.srt.layers.attention.base_attn_backend:AttentionBackend"),
    call(
        "sglang.srt.layers.attention.base_attn_backend:AttentionBackend.init_forward_metadata", "self", "forward_batch"
    ),
    call(
        "sglang.srt.layers.attention.base_attn_backend:AttentionBackend.init_cuda_graph_state",
        "self",
        "max_bs",
        "max_num_tokens",
    ),
    call(
        "sglang.srt.layers.attention.base_attn_backend:AttentionBackend.forward_extend",
        "self",
        "q",
        "k",
        "v",
        "layer",
        "forward_batch",
        "save_kv_cache",
    ),
    call(
        "sglang.srt.layers.attention.base_attn_backend:AttentionBackend.forward_decode",
        "self",
        "q",
        "k",
        "v",
        "layer",
        "forward_batch",
        "save_kv_cache",
    ),
    value(_POOL),
    value("sglang.srt.layers.radix_attention:AttentionType.DECODER"),
    attribute(f"{_LAYER_CLS}.layer_id"),
    attribute(f"{_LAYER_CLS}.tp_q_head_num"),
    attribute(f"{_LAYER_CLS}.tp_k_head_num"),
    attribute(f"{_LAYER_CLS}.qk_head_dim"),
    attribute(f"{_LAYER_CLS}.v_head_dim"),
    attribute(f"{_LAYER_CLS}.scaling"),
    attribute(f"{_LAYER_CLS}.is_cross_attention"),
    attribute(f"{_LAYER_CLS}.attn_type"),
    attribute(f"{_LAYER_CLS}.sliding_window_size"),
    attribute(f"{_LAYER_CLS}.logit_cap"),
    attribute(f"{_BATCH}:ForwardBatch.batch_size"),
    attribute(f"{_BATCH}:ForwardBatch.forward_mode"),
    attribute(f"{_BATCH}:ForwardBatch.seq_lens"),
    attribute(f"{_BATCH}:ForwardBatch.seq_lens_cpu"),
    attribute(f"{_BATCH}:ForwardBatch.extend_seq_lens"),
    attribute(f"{_BATCH}:ForwardBatch.extend_seq_lens_cpu"),
    attribute(f"{_BATCH}:ForwardBatch.req_pool_indices"),
    attribute(f"{_BATCH}:ForwardBatch.out_cache_loc"),
    call(f"{_BATCH}:ForwardMode.is_decode", "self"),
    call(f"{_BATCH}:ForwardMode.is_extend", "self"),
    call(f"{_BATCH}:ForwardMode.is_idle", "self"),
)
