"""Routing batches of requests to engine replicas: prefix-aware, after Daft's router, and three baselines.

Engine-free. A router holds a :class:`LoadBoard` — per replica, the number of requests routed to it that have
not finished yet (its *load*: unfinished requests, not requests ever sent) — and picks a replica for each batch.
The caller reports completions with :meth:`Router.finish` and dead replicas with :meth:`Router.remove`.

``prefix-aware`` (:class:`PrefixAwareRouter`): the candidates are the live replicas whose load is at most the
smallest load plus ``slack``; among them, the one that recently received the longest run of the batch's
leading prefix keys (a bounded LRU of keys per replica) wins, ties to the least loaded; with no match, the
least loaded. Prefix keys are chained hashes of a prompt's leading blocks (:func:`prefix_keys`), so batches
that share a longer prefix match on more keys. Invariant: a batch never goes to a replica whose load exceeds
the least-loaded replica's by more than ``slack``, so locality never buys more than ``slack`` of imbalance.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from enum import StrEnum

from kvreuse.errors import ConfigError


class Router(StrEnum):
    """How batches are routed to replicas (``--router``); see :func:`make_router`."""

    RANDOM = "random"
    ROUND_ROBIN = "round-robin"
    LEAST_LOADED = "least-loaded"
    PREFIX_AWARE = "prefix-aware"


ROUTERS = tuple(Router)


class LoadBoard:
    """Unfinished requests per live replica, with the least-loaded replica found in O(1) amortised.

    Replicas are integers ``0..n-1``; among equally loaded replicas the one that reached that load first is
    "least loaded" (deterministic ties).
    """

    def __init__(self, replicas: int) -> None:
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ConfigError(f"replicas must be a positive integer, got {replicas!r}")
        self.loads: dict[int, int] = dict.fromkeys(range(replicas), 0)
        self._by_load: dict[int, dict[int, None]] = {0: dict.fromkeys(range(replicas))}
        self._min = 0

    @property
    def live(self) -> list[int]:
        return list(self.loads)

    def min_load(self) -> int:
        self._check_live()
        while not self._by_load.get(self._min):
            self._min += 1
        return self._min

    def least_loaded(self) -> int:
        return next(iter(self._by_load[self.min_load()]))

    def add(self, replica: int, requests: int) -> None:
        if replica not in self.loads:
            raise ConfigError(f"replica {replica} is not live")
        self._move(replica, self.loads[replica] + requests)

    def finish(self, replica: int, requests: int = 1) -> None:
        if replica not in self.loads:  # a removed replica's late completions count for nothing
            return
        load = self.loads[replica]
        if requests > load:
            raise ConfigError(f"replica {replica} finished {requests} request(s) but had {load} unfinished")
        self._move(replica, load - requests)

    def remove(self, replica: int) -> None:
        load = self.loads.pop(replica)
        del self._by_load[load][replica]

    def _move(self, replica: int, load: int) -> None:
        del self._by_load[self.loads[replica]][replica]
        self._by_load.setdefault(load, {})[replica] = None
        self.loads[replica] = load
        self._min = min(self._min, load)

    def _check_live(self) -> None:
        if not self.loads:
            raise ConfigError("no live replica left to route to")


class Router:
    """Base of the routing policies: picks a replica for a batch and counts the batch as its load."""

    name = ""

    def __init__(self, replicas: int) -> None:
        self.board = LoadBoard(replicas)

    def route(self, keys: Sequence[Hashable], requests: int = 1) -> int:
        """The replica for a batch of ``requests`` requests whose prompts start with prefix keys ``keys``
        (shortest prefix first); the batch is counted as unfinished work of that replica."""
        if isinstance(requests, bool) or not isinstance(requests, int) or requests < 1:
            raise ConfigError(f"a batch must hold a positive number of requests, got {requests!r}")
        replica = self._pick(keys)
        self.board.add(replica, requests)
        return replica

    def finish(self, replica: int, requests: int = 1) -> None:
        """``requests`` of ``replica``'s requests have finished."""
        self.board.finish(replica, requests)

    def remove(self, replica: int) -> None:
        """``replica`` is gone (dead or drained): route nothing more to it."""
        self.board.remove(replica)

    @property
    def loads(self) -> dict[int, int]:
        return dict(self.board.loads)

    def _pick(self, keys: Sequence[Hashable]) -> int:
        raise NotImplementedError


class RandomRouter(Router):
    """A live replica chosen uniformly at random (seeded)."""

    name = "random"

    def __init__(self, replicas: int, *, seed: int = 0) -> None:
        super().__init__(replicas)
        self._random = random.Random(seed)

    def _pick(self, keys: Sequence[Hashable]) -> int:
        self.board._check_live()
        return self._random.choice(self.board.live)


class RoundRobinRouter(Router):
    """Live replicas in turn, skipping removed ones."""

    name = "round-robin"

    def __init__(self, replicas: int) -> None:
        super().__init__(replicas)
        self._next = 0
        self._replicas = replicas

    def _pick(self, keys: Sequence[Hashable]) -> int:
        self.board._check_live()
        while self._next % self._replicas not in self.board.loads:
            self._next += 1
        replica = self._next % self._replicas
        self._next += 1
        return replica


class LeastLoadedRouter(Router):
    """The replica with the fewest unfinished requests."""

    name = "least-loaded"

    def _pick(self, keys: Sequence[Hashable]) -> int:
        return self.board.least_loaded()


class PrefixAwareRouter(Router):
    """Least-loaded candidates within ``slack``; among them the longest recent prefix match (module docstring).

    ``recent_keys`` bounds each replica's LRU of prefix keys it was sent, so memory is
    ``O(replicas * recent_keys)`` however long the job.
    """

    name = "prefix-aware"

    def __init__(self, replicas: int, *, slack: int = 16, recent_keys: int = 1024) -> None:
        super().__init__(replicas)
        if isinstance(slack, bool) or not isinstance(slack, int) or slack < 0:
            raise ConfigError(f"slack must be a non-negative integer, got {slack!r}")
        if isinstance(recent_keys, bool) or not isinstance(recent_keys, int) or recent_keys < 1:
            raise ConfigError(f"recent_keys must be a positive integer, got {recent_keys!r}")
        self.slack = slack
        self.recent_keys = recent_keys
        self._recent: dict[int, OrderedDict[Hashable, None]] = {r: OrderedDict() for r in range(replicas)}
        self._holders: dict[Hashable, dict[int, None]] = {}
        self.matched = 0  # batches sent to a replica that had seen their prefix

    def route(self, keys: Sequence[Hashable], requests: int = 1) -> int:
        replica = super().route(keys, requests)
        self._remember(replica, keys)
        return replica

    def remove(self, replica: int) -> None:
        super().remove(replica)
        for key in self._recent.pop(replica):
            self._forget(replica, key)

    def _pick(self, keys: Sequence[Hashable]) -> int:
        board = self.board
        ceiling = board.min_load() + self.slack
        for key in reversed(keys):  # longest prefix first
            holders = self._holders.get(key)
            if not holders:
                continue
            best = min((r for r in holders if board.loads[r] <= ceiling), key=board.loads.__getitem__, default=None)
            if best is not None:
                self.matched += 1
                return best
        return board.least_loaded()

    def _remember(self, replica: int, keys: Sequence[Hashable]) -> None:
        recent = self._recent[replica]
        for key in keys:
            if key in recent:
                recent.move_to_end(key)
                continue
            recent[key] = None
            self._holders.setdefault(key, {})[replica] = None
            if len(recent) > self.recent_keys:
                old, _ = recent.popitem(last=False)
                self._forget(replica, old)

    def _forget(self, replica: int, key: Hashable) -> None:
        holders = self._holders[key]
        del holders[replica]
        if not holders:
            del self._holders[key]


def make_router(name: str, replicas: int, **options) -> Router:
    """The router named ``name`` (one of :data:`ROUTERS`); ``options`` go to its constructor."""
    classes = {cls.name: cls for cls in (RandomRouter, RoundRobinRouter, LeastLoadedRouter, PrefixAwareRouter)}
    if name not in classes:
        raise ConfigError(f"unknown router {name!r}; routers: {', '.join(ROUTERS)}")
    return classes[name](replicas, **options)


def prefix_keys(prompt: str | Sequence[int], block: int, *, limit: int = 16) -> list[bytes]:
    """Chained hashes of ``prompt``'s first ``limit`` full blocks of ``block`` characters (or token ids),
    shortest prefix first: two prompts share key ``k`` exactly when they share their first ``k + 1`` blocks."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ConfigError(f"block must be a positive integer, got {block!r}")
    keys: list[bytes] = []
    digest = b""
    for start in range(0, min(len(prompt) // block, limit) * block, block):
        chunk = prompt[start : start + block]
        data = chunk.encode() if isinstance(chunk, str) else repr(tuple(chunk)).encode()
        digest = hashlib.blake2b(digest + data, digest_size=8).digest()
        keys.append(digest)
    return keys
