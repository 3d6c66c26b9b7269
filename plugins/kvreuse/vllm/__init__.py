"""vLLM adapter: thin classes that translate between vLLM's interfaces and kvreuse's engine-free cores.

One folder per plugin (``reorder/``, ``modules/``, ``sparse/``, each with its metrics), beside what they share: the
entry point (``registration``), the names users type (``names``), the settings section (``settings``), the
per-process handle the plugins meet in (``runtime``), the metrics channel (``metrics``) and the batch front ends'
backend (``backend``, ``ray_replicas``). Every vLLM internal they need goes through ``kvreuse.patches.vllm_0_32``.

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
        from kvreuse.vllm.reorder.scheduler import PrefixAffinityScheduler

        return PrefixAffinityScheduler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
