"""The ``vllm.general_plugins`` entry point.

vLLM calls ``register()`` once in each of its processes (API server, engine core, workers) before it builds
the engine, and only if the plugin is allowed by ``VLLM_PLUGINS`` (unset = all plugins). It must stay cheap:
it only adds names to vLLM's registries (the module-cache KV connector and the sparse attention backend, once
those plugins exist); choosing a plugin is left to the user's own engine flags.
"""

from __future__ import annotations

import logging
import os

# Under vLLM's logger namespace so the line is printed in vLLM's format, tagged with the process it runs in.
logger = logging.getLogger("vllm.plugins.kvreuse")

_REGISTERED_PIDS: set[int] = set()


def register() -> None:
    """Register kvreuse's names with vLLM. Idempotent: vLLM may call it more than once per process."""
    if os.getpid() in _REGISTERED_PIDS:
        return
    _REGISTERED_PIDS.add(os.getpid())
    logger.info("kvreuse plugin registered in pid %d", os.getpid())


def registered_pids() -> frozenset[int]:
    """The processes in which vLLM has called ``register`` (lets tests prove the plugin reached the workers)."""
    return frozenset(_REGISTERED_PIDS)
