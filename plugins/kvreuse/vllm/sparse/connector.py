"""vLLM KV connector ``KVReuseSparseFigures``: the sparse backend's figures into vLLM's metrics, and nothing else.

A KV connector's per-step stats are vLLM 0.32's only channel from a worker to the front end's stat loggers (see
``kvreuse.vllm.metrics``), so this connector moves no KV at all: it matches no tokens, sends no metadata, and in
each worker returns what the sparse attention's figures grew by since the last step. Switched on next to the sparse
backend with vLLM's own flag::

    --attention-backend CUSTOM --kv-transfer-config '{"kv_connector": "KVReuseSparseFigures", "kv_role": "kv_both"}'

With the module cache on as well, its connector ``KVReuseModuleCache`` already sends these figures; the two are not
to be combined (in a ``MultiConnector`` the figures would count twice, so this one refuses to start there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

from kvreuse.errors import ConfigError
from kvreuse.sparse.figures import FigureIncrements
from kvreuse.vllm.metrics import KVReuseMetrics, KVReuseStats
from kvreuse.vllm.names import SPARSE_CPU_SWITCH, ConnectorName
from kvreuse.vllm.runtime import runtime
from kvreuse.vllm.sparse.metrics import sparse_increments

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class KVReuseSparseFigures(KVReuseMetrics, KVConnectorBase_V1):
    """A connector with no KV transfers; its worker side reports the figures of this process's sparse backend."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._increments = FigureIncrements()

    # ------------------------------------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        return

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    # ---------------------------------------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Called once the model is built: refuse a worker whose figures would be missing or counted twice."""
        handle = runtime()
        if handle.sparse_attention is None:
            raise ConfigError(
                f"{ConnectorName.SPARSE_FIGURES} reports the figures of kvreuse's sparse attention backend, which "
                f"this engine does not run: select it with --attention-backend CUSTOM (GPU) or {SPARSE_CPU_SWITCH}=1 "
                f"(CPU), or drop the connector"
            )
        if handle.module_worker is not None:
            raise ConfigError(
                f"{ConnectorName.MODULE_CACHE} already reports the sparse figures; drop "
                f"{ConnectorName.SPARSE_FIGURES} from the MultiConnector"
            )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_kv_connector_stats(self) -> KVReuseStats | None:
        if self.role != KVConnectorRole.WORKER:
            return None
        data = sparse_increments(runtime().sparse_attention, self._increments)
        return KVReuseStats(data=data) if data else None
