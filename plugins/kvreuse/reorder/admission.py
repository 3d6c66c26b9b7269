"""Admission orders for engines that sort their whole waiting list before each pass and admit a prefix of it
(SGLang's ``SchedulePolicy.calc_priority``), where vLLM pops one request at a time from a queue.

* :class:`AffinityOrder`: the prefix-affinity order of :class:`~kvreuse.reorder.affinity.PrefixAffinityQueue` as a
  sort of the list, with exactly the queue's picks and skips;
* :func:`order_by_module_sets`: neighbours share modules (:func:`~kvreuse.reorder.rerank.rerank_by_module_sets`),
  per priority class, from the oldest request on;
* :func:`counters_summary`: the log line of the reorder counters, the same for every engine.

Engine-free: the engine is reached only through the callbacks.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

from kvreuse.reorder.affinity import PrefixAffinityQueue, PrefixProbe, ReorderCounters
from kvreuse.reorder.config import ReorderConfig
from kvreuse.reorder.rerank import rerank_by_module_sets

T = TypeVar("T", bound=Hashable)


class AffinityOrder(Generic[T]):
    """A :class:`PrefixAffinityQueue` for an engine that re-sorts its waiting list before each pass and admits a
    prefix of it (engine-free; the engine is reached only through the callbacks).

    :meth:`plan` is called once per pass with the current waiting list and returns its new order:

    1. it first commits the previous plan: the leading requests of the last order that have since left the list
       were admitted, in that order. They are popped from the queue with the probes and the clock the plan saw, so
       the queue makes the same picks again and counts exactly the skips of requests passed over by an admission.
       Requests that left otherwise (aborted, or admitted behind one that was not) are removed without counting.
    2. it adds the requests that joined the list;
    3. it plans: on a copy of the queue (the requests shared, the bookkeeping copied) it pops up to ``lookahead``
       requests with fresh probes; those picks, then the rest in queue order, are the new order.

    A request's identity is the object (SGLang's ``Req`` hashes by identity).
    """

    def __init__(
        self,
        config: ReorderConfig,
        probe: Callable[[T], PrefixProbe],
        arrival_time: Callable[[T], float],
        priority: Callable[[T], int] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.config = config
        self._live_probe = probe
        self._clock = clock
        self._now = clock()
        self._replaying = False
        self._seen: dict[T, PrefixProbe] = {}  # the probes of the last plan, replayed by the commit
        self._planned: list[T] = []
        # The queue gets plain functions (and methods of this object): planning deep-copies the queue with this
        # object and the requests memoised, and a bound method of anything else would copy its owner.
        self.queue: PrefixAffinityQueue[T] = PrefixAffinityQueue(
            config,
            self._probe,
            lambda request: arrival_time(request),
            None if priority is None else (lambda request: priority(request)),
            clock=self._plan_time,
        )

    @property
    def counters(self) -> ReorderCounters:
        return self.queue.counters

    def plan(self, waiting: Sequence[T]) -> list[T]:
        """The order to put ``waiting`` in for this pass (every request of ``waiting`` exactly once)."""
        present = set(waiting)
        self._commit(present)
        known = set(self.queue)
        for request in waiting:
            if request not in known:
                self.queue.add_request(request)
        self._now = self._clock()
        self._seen = {}
        trial = copy.deepcopy(self.queue, {id(self): self, **{id(r): r for r in self.queue}})
        picks = [trial.pop_request() for _ in range(min(len(trial), self.config.lookahead))]
        self._planned = picks
        return picks + list(trial)

    def _commit(self, present: set[T]) -> None:
        admitted = 0
        while admitted < len(self._planned) and self._planned[admitted] not in present:
            admitted += 1
        self._replaying = True
        try:
            for expected in self._planned[:admitted]:
                got = self.queue.pop_request()
                if got is not expected:  # cannot happen: same state, probes and clock as the plan
                    raise RuntimeError("kvreuse: the affinity queue did not replay its plan")
        finally:
            self._replaying = False
        self.queue.close_step(lambda request: True)
        gone = [request for request in self.queue if request not in present]
        if gone:
            self.queue.remove_requests(gone)
        self._planned = []

    def _probe(self, request: T) -> PrefixProbe:
        if self._replaying and request in self._seen:
            return self._seen[request]
        probe = self._seen[request] = self._live_probe(request)
        return probe

    def _plan_time(self) -> float:
        return self._now


def order_by_module_sets(
    waiting: Sequence[T],
    module_set: Callable[[T], list[int]],
    arrival_time: Callable[[T], float],
    priority: Callable[[T], int] | None,
    lookahead: int,
) -> list[T]:
    """``waiting`` with its ``lookahead`` oldest requests (by priority class, best first, then arrival) ordered by
    :func:`rerank_by_module_sets` within each priority class, and the rest after them in arrival order.

    Within a class the oldest request comes first and then each time the one whose module set differs least from
    the last one's, so no request waits behind more than the requests older than it of its class and better ones.
    """
    key: Callable[[T], object] = (lambda r: (priority(r), arrival_time(r))) if priority is not None else arrival_time
    ordered = sorted(waiting, key=key)
    head, rest = ordered[:lookahead], ordered[lookahead:]
    out: list[T] = []
    start = 0
    while start < len(head):
        stop = start + 1
        if priority is not None:
            while stop < len(head) and priority(head[stop]) == priority(head[start]):
                stop += 1
        else:
            stop = len(head)
        group = head[start:stop]
        order = rerank_by_module_sets([module_set(r) for r in group])
        out += [group[i] for i in order]
        start = stop
    return out + rest


def counters_summary(counters: ReorderCounters, unit: str = "blocks") -> str:
    """One log line of what prefix-affinity admission did (``unit``: what the engine caches prefixes in)."""
    c = counters
    return (
        f"kvreuse reorder: {c.admissions} admissions, {c.out_of_order} out of arrival order, {c.cached_prefix} with "
        f"a cached prefix ({c.cached_blocks} cached {unit}), {c.forced} forced by bounded waiting, at most "
        f"{c.max_skips} skips of one request, {c.held} passes held for room to finish"
    )
