"""The ``vllm.general_plugins`` entry point.

vLLM calls ``register()`` once in each of its processes (API server, engine core, workers) before it builds
the engine, and only if the plugin is allowed by ``VLLM_PLUGINS`` (unset = all plugins). It first imports kvreuse's
boundary with vLLM (``kvreuse.patches.vllm_0_32``), which refuses a vLLM version kvreuse was not tested with
(``EngineVersionError``, one line): in the front-end process that happens while vLLM reads its arguments, before any
engine process starts. It must stay cheap: it only adds names to vLLM's registries (the sparse attention backend, the
module-cache KV connector ``KVReuseModuleCache`` and the sparse figures' connector ``KVReuseSparseFigures``) and
makes sure the process tree has the local secret the offline module API signs its writes with
(``kvreuse.config.share_local_secret``), and has vLLM's front end bound every request's free-form arguments in shape
and check its ``kvreuse_*`` parameters (``extra_args_refusal``: a 400 naming the field and the limit, before the
engine sees the request); choosing a plugin is left
to the user's own engine flags.

The sparse attention backend (``kvreuse.vllm.sparse.backend``) is registered as ``AttentionBackendEnum.CUSTOM``,
which ``--attention-backend CUSTOM`` selects on a GPU. vLLM's CPU platform ignores ``--attention-backend`` and always
returns CPU_ATTN, so with ``KVREUSE_SPARSE_CPU_BACKEND=1`` (and only then) the backend also takes CPU_ATTN's place;
without it every stock engine is left as it is.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from kvreuse.config import TRUE_WORDS, check_environment, share_local_secret
from kvreuse.shape import shape_problem
from kvreuse.vllm.names import SPARSE_BACKEND, SPARSE_CPU_SWITCH, ConnectorName

# Under vLLM's logger namespace so the line is printed in vLLM's format, tagged with the process it runs in.
logger = logging.getLogger("vllm.plugins.kvreuse")

_REGISTERED_PIDS: set[int] = set()


def register() -> None:
    """Register kvreuse's names with vLLM. Idempotent: vLLM may call it more than once per process.

    Raises ``EngineVersionError`` for an untested vLLM (unless ``KVREUSE_ALLOW_UNTESTED_ENGINE`` is set).
    """
    from kvreuse.patches import vllm_0_32  # the version check; an untested vLLM stops here

    # Before every engine start in this process, not only the first: numba may have been imported since.
    if _on_cpu():
        vllm_0_32.shield_llvmlite_from_kernel_scan()
    if os.getpid() in _REGISTERED_PIDS:
        return

    # vLLM calls this first in the process the user started (while it parses its arguments): a misspelt or
    # out-of-range KVREUSE_* variable stops it there, before any engine process starts.
    check_environment()
    # Before any engine process starts, so they inherit it: the key the offline module API signs writes with.
    share_local_secret()
    _register_sparse_backend()
    # Every request's free-form arguments are bounded in shape, and its kvreuse parameters checked, in vLLM's front
    # end (a 400 naming the field and the limit), before the engine.
    vllm_0_32.validate_extra_args(extra_args_refusal)
    # modules.shadow_every: the API server sends every Nth request's full-prefill copy (read on its first request).
    vllm_0_32.shadow_requests(shadow_halves)
    for name in ConnectorName:
        vllm_0_32.register_kv_connector(name, name.module, name)
    _REGISTERED_PIDS.add(os.getpid())
    logger.info("kvreuse plugin registered in pid %d", os.getpid())


# The entries of a request's extra_args that vLLM's OpenAI server fills from fields of their own; every other
# entry came from its vllm_xargs.
_OWN_FIELDS = ("kv_transfer_params", "ec_transfer_params")


def extra_args_refusal(extra_args: object) -> tuple[str, str] | None:
    """Why a request's ``SamplingParams.extra_args`` are refused (``(field, message)``), or ``None``.

    Each field vLLM passes on in them (``kv_transfer_params`` and ``ec_transfer_params`` each as a whole, the
    rest as ``vllm_xargs``) is bounded in depth, elements and text (:mod:`kvreuse.shape`: an object nested 600 deep
    ends the engine when vLLM pickles it). Then ``kv_transfer_params`` with a ``kvreuse_`` key is checked by the
    module cache's adapter (``kvreuse.vllm.modules.common.check_transfer_params``), imported only for such a
    request, so that registering stays cheap and imports none of the module cache."""
    if not isinstance(extra_args, Mapping):
        return None
    fields = {name: extra_args[name] for name in _OWN_FIELDS if name in extra_args}
    fields["vllm_xargs"] = {key: value for key, value in extra_args.items() if key not in _OWN_FIELDS}
    for name, value in fields.items():
        problem = shape_problem(value, name)
        if problem is not None:
            return problem
    params = extra_args.get("kv_transfer_params")
    if not isinstance(params, Mapping) or not any(
        isinstance(key, str) and key.startswith("kvreuse_") for key in params
    ):
        return None
    from kvreuse.vllm.modules.common import transfer_params_refusal

    return transfer_params_refusal(params)


_SHADOW_EVERY: dict[int, int] = {}  # id of a vLLM config -> its modules.shadow_every


def shadow_halves(vllm_config: Any, params: Any) -> tuple[Any, Any] | None:
    """The served and full-prefill halves of a shadow check for a request of the API server whose engine has
    ``modules.shadow_every`` N (``kvreuse.vllm.modules.shadow.server_halves``), else ``None``; the setting is read
    once per engine configuration, and the module cache imported only where it is on."""
    every = _SHADOW_EVERY.get(id(vllm_config))
    if every is None:
        from kvreuse.modules.config import ModulesConfig
        from kvreuse.vllm.settings import kvreuse_flags

        every = _SHADOW_EVERY[id(vllm_config)] = ModulesConfig.load(
            kvreuse_flags(vllm_config.additional_config, "modules")
        ).shadow_every
    if not every:
        return None
    from kvreuse.vllm.modules.shadow import server_halves

    return server_halves(params, every)


def _on_cpu() -> bool:
    """Whether this is vLLM's CPU platform (where vLLM scans every module for kernel overrides at engine start)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def registered_pids() -> frozenset[int]:
    """The processes in which vLLM has called ``register`` (lets tests prove the plugin reached the workers)."""
    return frozenset(_REGISTERED_PIDS)


def _register_sparse_backend() -> None:
    """Name the sparse backend CUSTOM (unless another plugin did) and, if switched on, put it in CPU_ATTN's place.

    Only class paths are registered; the backend module (which imports vLLM's attention stack) loads when vLLM
    selects it.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from kvreuse.patches import vllm_0_32

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
        vllm_0_32.replace_cpu_attention(SPARSE_BACKEND)
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
