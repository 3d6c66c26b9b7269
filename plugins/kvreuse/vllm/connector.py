"""vLLM KV connector of the ``modules`` plugin: cached prompt modules spliced into requests at any position.

Switched on with vLLM's own flag (``register()`` puts the name in vLLM's connector registry)::

    --kv-transfer-config '{"kv_connector": "KVReuseModuleCache", "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute"}'

Store settings come from ``--additional-config '{"kvreuse": {"modules": {...}}}'`` or ``KVREUSE_MODULES_*``. Its
per-step stats carry the module cache's counters into vLLM's metrics and, where the sparse attention backend runs,
the sparse figures too (``kvreuse.vllm.connector_metrics``).

How a module gets in. An *encode request* is an ordinary request whose ``kv_transfer_params`` are
``{"kvreuse_module": NAME, "kvreuse_context": N}``: its prompt is ``N`` context tokens followed by the module's
tokens (``kvreuse.vllm.modules`` builds them). The engine computes it like any prompt; the worker then copies the
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

Layout: the worker reads keys and values through vLLM's per-layer ``[blocks, kv_heads, block_size, 2 * head_dim]``
view (keys first), the plain layout of vLLM's GPU backends and of kvreuse's attention backend. The stock CPU_ATTN
backend packs KV in an ISA-specific layout, so on CPU the connector refuses to start unless kvreuse's backend is
in its place (``KVREUSE_SPARSE_CPU_BACKEND=1``; with ``beta = inf`` it is dense attention).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvreuse.modules.splice import Piece
from kvreuse.modules.store import ModuleKey
from kvreuse.vllm.connector_metrics import KVReuseMetrics

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# The keys of an encode request's kv_transfer_params.
ENCODE_MODULE = "kvreuse_module"
ENCODE_CONTEXT = "kvreuse_context"


@dataclass(frozen=True)
class LoadSpec:
    """Write these pieces (``Piece.name`` is a :class:`ModuleKey`) into request ``req_id``'s slots."""

    req_id: str
    pieces: tuple[Piece, ...]
    slots: tuple[tuple[int, ...], ...]  # per piece, the slot of each of its tokens
    blocks: tuple[tuple[int, ...], ...]  # per piece, the blocks its tokens lie in (reported if it fails)


@dataclass(frozen=True)
class SaveSpec:
    """After this step, copy tokens at ``slots`` of request ``req_id`` into the store as module ``name``."""

    req_id: str
    name: Hashable
    token_ids: tuple[int, ...]
    start: int  # position of the module's first token (the context's length)
    slots: tuple[int, ...]


@dataclass
class ModuleCacheMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    prefetch: list[ModuleKey] = field(default_factory=list)  # modules waiting requests will load, in order


@dataclass
class ModuleCacheWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per step: what entered and left the store.

    With tensor parallelism each worker stores its own heads' share; a module is usable once every worker stored
    it, and unusable as soon as one lost it, so aggregation intersects ``stored`` and unites ``dropped``.
    """

    stored: dict[ModuleKey, tuple[int, ...]] = field(default_factory=dict)
    dropped: set[ModuleKey] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)  # module name -> why its encoding was not stored

    def aggregate(self, other: ModuleCacheWorkerMeta) -> ModuleCacheWorkerMeta:
        return ModuleCacheWorkerMeta(
            stored={key: ids for key, ids in self.stored.items() if key in other.stored},
            dropped=self.dropped | other.dropped,
            failed={**self.failed, **other.failed},
        )


class KVReuseModuleCache(KVReuseMetrics, KVConnectorBase_V1):
    """The connector vLLM builds in its scheduler (``role=SCHEDULER``) and in each worker (``role=WORKER``).

    It only routes vLLM's calls to :class:`~kvreuse.vllm.module_scheduler.ModuleScheduler` or
    :class:`~kvreuse.vllm.module_worker.ModuleWorker`.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            from kvreuse.vllm.module_scheduler import ModuleScheduler

            self._scheduler = ModuleScheduler(vllm_config)
        else:
            from kvreuse.vllm.module_worker import ModuleWorker

            self._worker = ModuleWorker(vllm_config)

    # ------------------------------------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return self._scheduler.matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        self._scheduler.allocated(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ModuleCacheMetadata:
        return self._scheduler.build_metadata(scheduler_output, self._kv_cache_manager)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, ModuleCacheWorkerMeta):
            self._scheduler.worker_reported(meta)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler.finished(request.request_id)
        return False, None

    # ---------------------------------------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ModuleCacheMetadata)
        self._worker.load(meta, forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # every layer was written in start_load_kv (see the module docstring)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ModuleCacheMetadata)
        self._worker.copy_layer(meta, layer_name, kv_layer)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ModuleCacheMetadata)
        self._worker.store_saved(meta)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def build_connector_worker_meta(self) -> ModuleCacheWorkerMeta | None:
        return self._worker.take_report()

    def get_kv_connector_stats(self):
        # vLLM asks both sides; the figures live in the workers (the store's, and the sparse backend's if it runs).
        return self._worker.take_stats() if self._role == KVConnectorRole.WORKER else None

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.WORKER:
            self._worker.close()
