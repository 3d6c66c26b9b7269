"""``RayVLLMReplicas``: a :class:`~kvreuse.batch.ray_replicas.RayReplicas` pool whose actors each hold one in-process
``vllm.LLM``.

Each actor runs vLLM's engine core inside the actor's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so
killing the actor kills its engine and nothing is left behind; kvreuse's plugins are switched on by the engine
arguments as anywhere else (``scheduler_cls="kvreuse.vllm.PrefixAffinityScheduler"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from kvreuse.batch.ray_replicas import RayReplicas
from kvreuse.vllm.backend import vllm_backend


class RayVLLMReplicas(RayReplicas):
    """``replicas`` Ray actors, each a ``vllm.LLM`` on ``engine_args`` (as for ``started_vllm``, prompts sent as chats
    where the model has a chat template unless ``chat=False``); use as a context manager (kills the actors). See
    :class:`RayReplicas` for Ray's set-up and the other arguments."""

    def __init__(
        self,
        replicas: int,
        engine_args: Mapping[str, Any],
        *,
        num_cpus: float = 1,
        num_gpus: float = 0,
        env: Mapping[str, str] | None = None,
        chat: bool | None = None,
        system: str | None = None,
    ) -> None:
        super().__init__(
            replicas,
            partial(vllm_backend, dict(engine_args), chat=chat, system=system),
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})},
        )
