"""vLLM adapter: thin classes that translate between vLLM's interfaces and kvreuse's engine-free cores.

vLLM loads ``register`` (entry point group ``vllm.general_plugins``) in every one of its processes, so this
module imports nothing heavy; the scheduler class is imported only when vLLM resolves ``--scheduler-cls``.
"""

from __future__ import annotations

from typing import Any

from kvreuse.vllm.registration import register, registered_pids

__all__ = ["PrefixAffinityScheduler", "register", "registered_pids"]


def __getattr__(name: str) -> Any:
    # `--scheduler-cls kvreuse.vllm.PrefixAffinityScheduler` resolves here; importing vLLM's scheduler eagerly
    # would slow down every process that merely loads the plugin.
    if name == "PrefixAffinityScheduler":
        from kvreuse.vllm.scheduler import PrefixAffinityScheduler

        return PrefixAffinityScheduler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
