"""The ``sglang.srt.plugins`` entry point.

SGLang calls ``register()`` through ``load_plugins()`` in each of its processes (the server or ``Engine``, before it
parses its arguments; the scheduler processes, before they build the scheduler), if the plugin is allowed by
``SGLANG_PLUGINS`` (unset = all plugins), and then applies the hooks registered with its ``HookRegistry``. It only
adds names to SGLang's registries; choosing a plugin is left to the user's own flags:

* the schedule policy: ``sglang.srt.managers.schedule_policy.SchedulePolicy`` is replaced (a ``HookType.REPLACE``
  of the class) by :class:`kvreuse.sglang.scheduler.KVReuseSchedulePolicy`, which is SGLang's own class unless
  ``KVREUSE_SGLANG_SCHEDULE_POLICY`` names one of kvreuse's orders;
* ``--attention-backend kvreuse_sparse``: a factory in SGLang's attention registry, and the name added to the flag's
  choices (``add_attention_backend_choices``, SGLang's extension point for that list);
* ``--radix-cache-backend kvreuse_modules``: a factory in SGLang's radix-cache registry.

The attention backend and the module cache are imported only when SGLang builds them.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from kvreuse.sglang.settings import MODULE_CACHE_BACKEND, SPARSE_ATTENTION_BACKEND

logger = logging.getLogger("sglang.plugins.kvreuse")

_REGISTERED_PIDS: set[int] = set()

SCHEDULE_POLICY_TARGET = "sglang.srt.managers.schedule_policy.SchedulePolicy"


def register() -> None:
    """Register kvreuse's names with SGLang. Idempotent: SGLang may call it more than once per process."""
    if os.getpid() in _REGISTERED_PIDS:
        return
    _REGISTERED_PIDS.add(os.getpid())
    # Each name on its own: an SGLang version that moved one extension point still gets the others.
    for what, step in (
        ("schedule policy", _register_schedule_policy),
        (f"attention backend {SPARSE_ATTENTION_BACKEND}", _register_sparse_backend),
        (f"radix cache backend {MODULE_CACHE_BACKEND}", _register_module_cache),
    ):
        try:
            step()
        except Exception:
            logger.exception("kvreuse: could not register the %s with this SGLang version", what)
    logger.info("kvreuse plugin registered in pid %d", os.getpid())


def registered_pids() -> frozenset[int]:
    """The processes in which SGLang has called ``register``."""
    return frozenset(_REGISTERED_PIDS)


def _register_schedule_policy() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from kvreuse.sglang.scheduler import KVReuseSchedulePolicy

    HookRegistry.register(SCHEDULE_POLICY_TARGET, KVReuseSchedulePolicy, HookType.REPLACE)


def create_sparse_backend(model_runner: Any):
    """SGLang's attention factory for ``--attention-backend kvreuse_sparse``."""
    from kvreuse.sglang.attention import SparseAttnBackend

    return SparseAttnBackend(model_runner)


def _register_sparse_backend() -> None:
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend

    existing = ATTENTION_BACKENDS.get(SPARSE_ATTENTION_BACKEND)
    if existing is not None and existing is not create_sparse_backend:
        logger.warning(
            "kvreuse: attention backend %s is already registered as %r; not replaced",
            SPARSE_ATTENTION_BACKEND,
            existing,
        )
    else:
        register_attention_backend(SPARSE_ATTENTION_BACKEND)(create_sparse_backend)
    if SPARSE_ATTENTION_BACKEND not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([SPARSE_ATTENTION_BACKEND])


def create_module_cache(ctx: Any):
    """SGLang's radix-cache factory for ``--radix-cache-backend kvreuse_modules``."""
    from kvreuse.sglang.module_cache import create_module_radix_cache

    return create_module_radix_cache(ctx)


def _register_module_cache() -> None:
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends

    if MODULE_CACHE_BACKEND not in registered_radix_cache_backends():
        register_radix_cache_backend(MODULE_CACHE_BACKEND, create_module_cache)
