"""The ``sglang.srt.plugins`` entry point.

SGLang calls ``register()`` through ``load_plugins()`` in each of its processes (the server or ``Engine``, before it
parses its arguments; the scheduler processes, before they build the scheduler), if the plugin is allowed by
``SGLANG_PLUGINS`` (unset = all plugins), and then applies the hooks registered with its ``HookRegistry``. It first
imports kvreuse's boundary with SGLang (``kvreuse.patches.sglang_0_5``), which refuses an SGLang version kvreuse was
not tested with; then it only adds names to SGLang's registries, and choosing a plugin is left to the user's own
flags:

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

from kvreuse.errors import EngineVersionError
from kvreuse.sglang.names import BackendName

logger = logging.getLogger("sglang.plugins.kvreuse")

_REGISTERED_PIDS: set[int] = set()


def register() -> None:
    """Register kvreuse's names with SGLang. Idempotent: SGLang may call it more than once per process.

    An untested SGLang version stops the process with the one-line ``EngineVersionError`` message (``SystemExit``,
    unless ``KVREUSE_ALLOW_UNTESTED_ENGINE`` is set): SGLang's plugin loader logs and ignores any ``Exception`` a
    plugin raises, and running on would silently leave out kvreuse's schedule policy.
    """
    if os.getpid() in _REGISTERED_PIDS:
        return
    try:
        from kvreuse.patches import sglang_0_5  # noqa: F401  (the version check)
    except EngineVersionError as refusal:
        raise SystemExit(str(refusal)) from None
    _REGISTERED_PIDS.add(os.getpid())
    # Each name on its own: one that fails to register still leaves the others.
    for what, step in (
        ("schedule policy", _register_schedule_policy),
        (f"attention backend {BackendName.SPARSE_ATTENTION}", _register_sparse_backend),
        (f"radix cache backend {BackendName.MODULE_CACHE}", _register_module_cache),
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
    from kvreuse.patches import sglang_0_5
    from kvreuse.sglang.scheduler import KVReuseSchedulePolicy

    sglang_0_5.replace_schedule_policy(KVReuseSchedulePolicy)


def create_sparse_backend(model_runner: Any) -> Any:
    """SGLang's attention factory for ``--attention-backend kvreuse_sparse``."""
    from kvreuse.sglang.attention import SparseAttnBackend

    return SparseAttnBackend(model_runner)


def _register_sparse_backend() -> None:
    from kvreuse.patches import sglang_0_5

    existing = sglang_0_5.add_attention_backend(BackendName.SPARSE_ATTENTION, create_sparse_backend)
    if existing is not None:
        logger.warning(
            "kvreuse: attention backend %s is already registered as %r; not replaced",
            BackendName.SPARSE_ATTENTION,
            existing,
        )


def create_module_cache(ctx: Any) -> Any:
    """SGLang's radix-cache factory for ``--radix-cache-backend kvreuse_modules``."""
    from kvreuse.sglang.module_cache import create_module_radix_cache

    return create_module_radix_cache(ctx)


def _register_module_cache() -> None:
    from kvreuse.patches import sglang_0_5

    sglang_0_5.add_radix_cache_backend(BackendName.MODULE_CACHE, create_module_cache)
