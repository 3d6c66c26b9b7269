"""The names a user types to switch kvreuse's plugins on in vLLM, and the classes they stand for.

Imported in every vLLM process by ``register()``, so it imports nothing.
"""

from __future__ import annotations

from enum import StrEnum


class ConnectorName(StrEnum):
    """``--kv-transfer-config '{"kv_connector": NAME, ...}'`` values kvreuse registers."""

    MODULE_CACHE = "KVReuseModuleCache"  # the modules plugin (kvreuse.vllm.modules.connector)
    SPARSE_FIGURES = "KVReuseSparseFigures"  # the sparse backend's figures alone (kvreuse.vllm.sparse.connector)

    @property
    def module(self) -> str:
        """The module that defines the connector class (named like the connector)."""
        return {
            ConnectorName.MODULE_CACHE: "kvreuse.vllm.modules.connector",
            ConnectorName.SPARSE_FIGURES: "kvreuse.vllm.sparse.connector",
        }[self]


class SchedulerName(StrEnum):
    """``scheduler = NAME`` values of ``kvreuse serve`` config files."""

    PREFIX_AFFINITY = "prefix-affinity"

    @property
    def class_path(self) -> str:
        """What ``--scheduler-cls`` gets for it."""
        return {SchedulerName.PREFIX_AFFINITY: "kvreuse.vllm.PrefixAffinityScheduler"}[self]


# The sparse attention backend's class, registered as vLLM's AttentionBackendEnum.CUSTOM (``--attention-backend
# CUSTOM``) and, with SPARSE_CPU_SWITCH set, in place of CPU_ATTN.
SPARSE_BACKEND = "kvreuse.vllm.sparse.backend.SparseAttentionBackend"
SPARSE_CPU_SWITCH = "KVREUSE_SPARSE_CPU_BACKEND"
