"""vLLM KV connector of the ``modules`` plugin: cached prompt modules spliced into requests at any position.

Switched on with vLLM's own flag (``register()`` puts the name in vLLM's connector registry)::

    --kv-transfer-config '{"kv_connector": "KVReuseModuleCache", "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute"}'

Store settings come from ``--additional-config '{"kvreuse": {"modules": {...}}}'`` or ``KVREUSE_MODULES_*``. Its
per-step stats carry the module cache's counters into vLLM's metrics and, where the sparse attention backend runs,
the sparse figures too (``kvreuse.vllm.metrics``).

Layout, as vLLM's own ``OffloadingConnector``: this class is a thin facade that routes vLLM's calls to the scheduler
side (``kvreuse.vllm.modules.scheduler``) or the worker side (``kvreuse.vllm.modules.worker``); what crosses between
them is in ``kvreuse.vllm.modules.common``, the counters in ``kvreuse.vllm.modules.metrics``.

How a module gets in. An *encode request* is an ordinary request whose ``kv_transfer_params`` are
``{"kvreuse_module": NAME, "kvreuse_context": N}``: its prompt is ``N`` context tokens followed by the module's
tokens (``kvreuse.vllm.modules.encode`` builds them). The engine computes it like any prompt; the worker then copies the
module's keys and values out of the paged cache, every layer, into the store (``kvreuse.modules.store``), keys
as encoded at position ``N``. The context lets a table's module attend to the tables it references (TableCache);
for a plain module it is empty. The scheduler learns of the module from the worker's per-step metadata and adds
its tokens to a :class:`~kvreuse.modules.trie.ModuleTrie`.

How a module gets used. For every new request, after vLLM's own prefix hit, the scheduler side finds the
registered modules in the prompt's tokens (no markup needed) and claims the run of prompt tokens they cover
from where the hit ends (``kvreuse.modules.splice.plan_splice``). vLLM counts those tokens as computed; before
the forward pass the worker writes the stored keys, re-rotated to the positions they take
(``kvreuse.kernels.rerotate.move_keys``), and values into the request's blocks through the attention backend's own
``do_kv_cache_update``, so a backend that keeps more than KV (the sparse backend's key sketch) stays right.
All layers are written in ``start_load_kv``, before the forward: the attention layer writes its own new tokens
before it calls ``wait_for_layer_load``, so a per-layer load there would land after them, out of order with
blocks they share. On a GPU the copies and rotations are kernels queued ahead of the forward on the same stream;
the host-to-GPU promotion of modules that waiting requests will need is started earlier, in the background
(``ModuleStore.prefetch``, the TableCache load pipeline).

Failures. A module the store no longer has (evicted since the scheduler planned, a corrupt disk file) is
reported through ``get_block_ids_with_load_errors``; with ``kv_load_failure_policy="recompute"`` (required, checked
at start) vLLM discards that step's output for the request and computes the tokens instead. Loaded blocks enter
vLLM's prefix cache like computed ones, so a later request with the same tokens reuses the same spliced KV.

Layout: the worker reads keys and values through ``[blocks, block_size, kv_heads, head_dim]`` views
(``ModuleWorker.kv_of``): the halves of vLLM's per-layer ``[blocks, kv_heads, block_size, 2 * head_dim]`` view on
vLLM's GPU backends (keys first), and kvreuse's attention backend's own views where it serves the layers
(``kvreuse.vllm.sparse.backend.plain_kv``: on a CPU, of CPU_ATTN's tiles, which it keeps). The stock CPU_ATTN
backend packs KV in an ISA-specific layout the worker does not read, so on CPU the connector refuses to start
unless kvreuse's backend is in its place (``KVREUSE_SPARSE_CPU_BACKEND=1``; with ``beta = inf`` it is dense
attention); it writes through the layer's backend (``vllm_0_32.write_kv``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from kvreuse.patches import vllm_0_32
from kvreuse.vllm.metrics import KVReuseMetrics, KVReuseStats
from kvreuse.vllm.modules.common import ModuleCacheMetadata, ModuleCacheWorkerMeta
from kvreuse.vllm.modules.scheduler import ModuleScheduler
from kvreuse.vllm.modules.worker import ModuleWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class KVReuseModuleCache(KVReuseMetrics, KVConnectorBase_V1):
    """The connector vLLM builds in its scheduler (``role=SCHEDULER``) and in each worker (``role=WORKER``).

    It only routes vLLM's calls to :class:`~kvreuse.vllm.modules.scheduler.ModuleScheduler` or
    :class:`~kvreuse.vllm.modules.worker.ModuleWorker`.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = ModuleScheduler(vllm_config)
        else:
            self._worker = ModuleWorker(vllm_config)

    def _metadata(self) -> ModuleCacheMetadata:
        meta = vllm_0_32.connector_metadata(self)
        assert isinstance(meta, ModuleCacheMetadata)
        return meta

    # ------------------------------------------------------------------------------------------- scheduler side
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler.kv_cache_manager = kv_cache_manager

    def on_new_request(self, request: Request) -> None:
        self._scheduler.arrived(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler.allocated(request, vllm_0_32.allocated_block_ids(blocks), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ModuleCacheMetadata:
        return self._scheduler.build_metadata(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, ModuleCacheWorkerMeta):
            self._scheduler.worker_reported(meta)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler.shadow_finished(request)
        report = self._scheduler.finished_params(request.request_id)
        self._scheduler.finished(request.request_id)
        return False, report

    # ---------------------------------------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker.load(self._metadata(), forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # every layer was written in start_load_kv (see the module docstring)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self._worker.copy_layer(self._metadata(), layer_name, kv_layer)

    def wait_for_save(self) -> None:
        self._worker.store_saved(self._metadata())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def build_connector_worker_meta(self) -> ModuleCacheWorkerMeta | None:
        return self._worker.take_report()

    def get_kv_connector_stats(self) -> KVReuseStats | None:
        # vLLM asks both sides: the workers hold the store's (and the sparse backend's) figures, the scheduler side
        # the modules it found but did not splice, the writes it refused and the shadow checks.
        if self.role == KVConnectorRole.WORKER:
            return self._worker.take_increments()
        skipped = self._scheduler.take_stats()
        return self.build_kv_connector_stats(skipped) if skipped else None

    def shutdown(self) -> None:
        if self.role == KVConnectorRole.WORKER:
            self._worker.close()
