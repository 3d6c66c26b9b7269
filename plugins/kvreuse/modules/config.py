"""Settings of the ``modules`` plugin (the tiered store of encoded prompt modules, :mod:`kvreuse.modules.store`).

Capacities count the bytes of the stored KV tensors (``EncodedModule.nbytes``); a tier with capacity 0 is off.
The default keeps 2 GiB of modules on the GPU and 8 GiB in host memory, with the disk tier off (it needs a size
chosen for the machine's disk).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from kvreuse import config


class EvictionPolicy(StrEnum):
    """Which module a full tier moves down first (``modules.eviction``)."""

    LRU = "lru"  # least recently used
    LFU = "lfu"  # least frequently used
    FIFO = "fifo"  # first in


EVICTION_POLICIES = tuple(EvictionPolicy)


@dataclass(frozen=True)
class ModulesConfig:
    """Settings of the module store; see the README's table of flags.

    In vLLM they are read from ``--additional-config '{"kvreuse": {"modules": {...}}}'`` or ``KVREUSE_MODULES_*``.
    """

    gpu_bytes: int = config.setting(2 * 1024**3, "store: bytes of module KV kept on the GPU tier (0 = tier off)", low=0)
    cpu_bytes: int = config.setting(8 * 1024**3, "store: bytes of module KV kept in host memory (0 = tier off)", low=0)
    disk_bytes: int = config.setting(
        0, "store: bytes of module KV kept as safetensors files in disk_dir (0 = tier off)", low=0
    )
    disk_dir: str = config.setting(
        "", "store: folder of the disk tier's files; empty = a fresh temporary folder removed on close"
    )
    eviction: EvictionPolicy = config.setting(
        EvictionPolicy.LRU,
        "store: which module a full tier moves down first: least recently used, least frequently used, or first in",
    )
    pin_cpu_memory: bool = config.setting(
        True, "store: pin the host tier's tensors (only when CUDA is available) for faster copies to the GPU"
    )
    prefetch_depth: int = config.setting(
        8, "store: most modules one prefetch call promotes, in the order given (0 = prefetch off)", low=0
    )
    gpu_device: str = config.setting(
        "cuda", "store: torch device of the fastest tier; a cuda device falls back to cpu when CUDA is absent"
    )

    @classmethod
    def load(cls, flags: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> ModulesConfig:
        return config.load(cls, "modules", flags, environ)
