"""A :class:`~kvreuse.batch.distributed.ReplicaPool` of Ray actors, each holding one backend.

Ray is an extra (``kvreuse[ray]``) and imported only here. Each actor builds its backend in its own process from a
picklable factory, so the pool knows no engine: ``kvreuse.vllm.ray_replicas.RayVLLMReplicas`` gives each actor
one in-process ``vllm.LLM``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Protocol

from kvreuse.batch.backend import Backend, Completion
from kvreuse.batch.distributed import ReplicaDied
from kvreuse.errors import ConfigError


class ResettableBackend(Backend, Protocol):
    """A backend whose engine's prefix cache can be emptied (between benchmark arms)."""

    def reset_prefix_cache(self) -> bool: ...


class ReplicaActor:
    """The actor's body: a backend, built in the actor's process, answering greedy batches."""

    def __init__(self, make_backend: Callable[[], ResettableBackend]) -> None:
        self.backend = make_backend()

    def pid(self) -> int:
        return os.getpid()

    def generate(self, prompts: Sequence[str], max_tokens: int) -> list[Completion]:
        """Completions in prompt order; a prompt the engine refuses is a completion with its error."""
        return self.backend.generate(prompts, max_tokens=max_tokens)

    def reset_prefix_cache(self) -> bool:
        return self.backend.reset_prefix_cache()


class RayReplicas:
    """``replicas`` Ray actors, each with the backend ``make_backend()`` builds in it; use as a context manager
    (kills the actors).

    Ray must be initialised by the caller (``ray.init(...)``) or it is started locally with defaults. Each actor
    asks for ``num_cpus`` CPUs (and ``num_gpus`` GPUs) from Ray. ``env`` sets environment variables in each
    actor's process.
    """

    def __init__(
        self,
        replicas: int,
        make_backend: Callable[[], ResettableBackend],
        *,
        num_cpus: float = 1,
        num_gpus: float = 0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ConfigError(f"replicas must be a positive integer, got {replicas!r}")
        try:
            import ray
        except ImportError:
            raise ConfigError(
                "more than one replica runs on Ray, which is not installed here; install "
                "kvreuse[ray], or run with --replicas 1"
            ) from None
        self._ray = ray
        if not ray.is_initialized():
            ray.init()
        actor = ray.remote(ReplicaActor).options(
            num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0, runtime_env={"env_vars": dict(env or {})}
        )
        self.size = replicas
        self.actors = [actor.remote(make_backend) for _ in range(replicas)]
        self._refs: dict[Hashable, Any] = {}
        self._next = 0
        ray.get([a.pid.remote() for a in self.actors])  # wait until every engine has started

    def submit(self, replica: int, prompts: Sequence[str], *, max_tokens: int) -> int:
        self._next += 1
        self._refs[self._next] = self.actors[replica].generate.remote(list(prompts), max_tokens)
        return self._next

    def wait(self, handles: Sequence[Hashable]) -> list[tuple[Hashable, list[Completion] | ReplicaDied]]:
        ray = self._ray
        by_ref = {self._refs[h]: h for h in handles}
        ready, _ = ray.wait(list(by_ref), num_returns=1)
        results = []
        for ref in ready:
            handle = by_ref[ref]
            del self._refs[handle]
            try:
                results.append((handle, ray.get(ref)))
            except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as error:
                results.append((handle, ReplicaDied(str(error).splitlines()[0])))
        return results

    def reset_prefix_cache(self) -> None:
        """Empty every replica's prefix cache (between benchmark arms)."""
        self._ray.get([a.reset_prefix_cache.remote() for a in self.actors])

    def kill(self, replica: int) -> None:
        """Kill one replica's actor (its engine dies with it); its batches then come back as deaths."""
        self._ray.kill(self.actors[replica], no_restart=True)

    def close(self) -> None:
        for actor in self.actors:
            self._ray.kill(actor, no_restart=True)

    def __enter__(self) -> RayReplicas:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
