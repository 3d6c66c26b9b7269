"""The ``vllm.general_plugins`` entry point.

vLLM calls ``register()`` once in each of its processes (API server, engine core, workers) before it builds
the engine, and only if the plugin is allowed by ``VLLM_PLUGINS`` (unset = all plugins). It must stay cheap:
it only adds names to vLLM's registries (the sparse attention backend, the module-cache KV connector
``KVReuseModuleCache`` and the sparse figures' connector ``KVReuseSparseFigures``); choosing a plugin is left to
the user's own engine flags.

The sparse attention backend (``kvreuse.vllm.attention``) is registered as ``AttentionBackendEnum.CUSTOM``, which
``--attention-backend CUSTOM`` selects on a GPU. vLLM's CPU platform ignores ``--attention-backend`` and always
returns CPU_ATTN, so with ``KVREUSE_SPARSE_CPU_BACKEND=1`` (and only then) the backend also takes CPU_ATTN's place;
without it every stock engine is left as it is.
"""

from __future__ import annotations

import logging
import os

from kvreuse.config import TRUE_WORDS

# Under vLLM's logger namespace so the line is printed in vLLM's format, tagged with the process it runs in.
logger = logging.getLogger("vllm.plugins.kvreuse")

_REGISTERED_PIDS: set[int] = set()

SPARSE_BACKEND = "kvreuse.vllm.attention.SparseAttentionBackend"
SPARSE_CPU_SWITCH = "KVREUSE_SPARSE_CPU_BACKEND"
MODULE_CONNECTOR = "KVReuseModuleCache"
SPARSE_FIGURES_CONNECTOR = "KVReuseSparseFigures"


def register() -> None:
    """Register kvreuse's names with vLLM. Idempotent: vLLM may call it more than once per process."""
    if os.getpid() in _REGISTERED_PIDS:
        return
    _REGISTERED_PIDS.add(os.getpid())
    _register_sparse_backend()
    _register_connectors()
    logger.info("kvreuse plugin registered in pid %d", os.getpid())


def registered_pids() -> frozenset[int]:
    """The processes in which vLLM has called ``register`` (lets tests prove the plugin reached the workers)."""
    return frozenset(_REGISTERED_PIDS)


def _register_sparse_backend() -> None:
    """Name the sparse backend CUSTOM (unless another plugin did) and, if switched on, put it in CPU_ATTN's place.

    Only class paths are registered; the backend module (which imports vLLM's attention stack) loads when vLLM
    selects it.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    custom = AttentionBackendEnum.CUSTOM
    if custom.is_overridden() and custom.get_path() != SPARSE_BACKEND:
        logger.warning(
            "kvreuse: attention backend CUSTOM is already registered as %s; the sparse backend is not "
            "registered under that name",
            custom.get_path(),
        )
    else:
        register_backend(custom, SPARSE_BACKEND)
    if os.environ.get(SPARSE_CPU_SWITCH, "").lower() in TRUE_WORDS:
        register_backend(AttentionBackendEnum.CPU_ATTN, SPARSE_BACKEND)
        logger.info(
            "kvreuse: %s is set, the sparse attention backend replaces CPU_ATTN in pid %d",
            SPARSE_CPU_SWITCH,
            os.getpid(),
        )
    else:
        _warn_unused_sparse_settings()


def _warn_unused_sparse_settings() -> None:
    """On vLLM's CPU build without the switch, ``KVREUSE_SPARSE_*`` settings reach no code: say so, and how to
    switch the backend on. (Settings in ``--additional-config`` cannot be seen here: vLLM gives a general plugin
    no configuration.)"""
    from vllm.platforms import current_platform

    settings = sorted(name for name in os.environ if name.startswith("KVREUSE_SPARSE_") and name != SPARSE_CPU_SWITCH)
    if settings and current_platform.is_cpu():
        logger.warning(
            "kvreuse: %s %s set, but vLLM's CPU engine runs its stock CPU_ATTN backend, which ignores them; set "
            "%s=1 to run kvreuse's sparse attention backend",
            ", ".join(settings),
            "is" if len(settings) == 1 else "are",
            SPARSE_CPU_SWITCH,
        )


def _register_connectors() -> None:
    """Name kvreuse's KV connectors for ``--kv-transfer-config '{"kv_connector": NAME, ...}'``."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for name, module in (
        (MODULE_CONNECTOR, "kvreuse.vllm.connector"),
        (SPARSE_FIGURES_CONNECTOR, "kvreuse.vllm.sparse_connector"),
    ):
        if name not in KVConnectorFactory._registry:  # vLLM has no public "is registered" query
            KVConnectorFactory.register_connector(name, module, name)
