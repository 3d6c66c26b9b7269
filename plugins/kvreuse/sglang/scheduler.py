"""kvreuse's waiting-queue orders as an SGLang schedule policy (``KVREUSE_SGLANG_SCHEDULE_POLICY``).

SGLang's scheduler asks its ``SchedulePolicy`` to sort the waiting list in place (``calc_priority``) before every
prefill pass, then admits requests from the front of the list until a budget runs out and drops them from the
list. :class:`KVReuseSchedulePolicy` is that class with two more orders; ``register()`` puts it in place of
SGLang's ``SchedulePolicy`` through SGLang's ``HookRegistry`` (a class REPLACE), and it behaves exactly like
SGLang's own class unless ``KVREUSE_SGLANG_SCHEDULE_POLICY`` names one of kvreuse's orders:

* ``prefix-affinity``: :class:`~kvreuse.reorder.affinity.PrefixAffinityQueue` (cached prefixes first, requests
  that share an uncached prefix together, bounded waiting by ``max_skips``/``max_wait_s``, priority first), probing
  SGLang's radix cache for each waiting request with ``match_kv_cache``, as SGLang's own ``lpm`` does;
* ``module-sets``: :func:`~kvreuse.reorder.rerank.rerank_by_module_sets` over the modules each request uses,
  starting from the oldest request of the best priority.

The queue hands requests out one pick at a time, where SGLang sorts a list and admits a prefix of it;
:class:`AffinityOrder` bridges the two without changing what a pick or a skip means. Settings:
``KVREUSE_REORDER_*`` (``ReorderConfig``) and ``KVREUSE_SGLANG_*`` (``SGLangConfig``).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, TypeVar

from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.schedule_policy import SchedulePolicy
from sglang.srt.mem_cache.common import match_kv_cache

from kvreuse.errors import ConfigError
from kvreuse.modules.trie import ModuleTrie
from kvreuse.reorder.affinity import PrefixAffinityQueue, PrefixProbe, ReorderCounters
from kvreuse.reorder.config import ReorderConfig
from kvreuse.reorder.rerank import rerank_by_module_sets
from kvreuse.sglang.settings import AFFINITY_POLICY, SGLangConfig, read_modules_file

logger = logging.getLogger("sglang.plugins.kvreuse.scheduler")

LOG_EVERY_ADMISSIONS = 1000

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


def _token_bytes(ids: Any) -> bytes | tuple:
    return ids.tobytes() if hasattr(ids, "tobytes") else tuple(ids)  # SGLang keeps token ids in array("q")


def _arrival_time(req: Req) -> float:
    # perf_counter seconds, set when the request enters (or, retracted, re-enters) the waiting queue.
    return req.time_stats.wait_queue_entry_time


class KVReuseSchedulePolicy(SchedulePolicy):
    """SGLang's ``SchedulePolicy`` with kvreuse's orders; SGLang's own unless ``KVREUSE_SGLANG_SCHEDULE_POLICY``
    names one (it then takes the place of ``--schedule-policy``, which still decides nothing else)."""

    # Seconds clock of the bounded wait, the one SGLang stamps ``wait_queue_entry_time`` with.
    clock: Callable[[], float] = staticmethod(time.perf_counter)

    def __init__(
        self,
        policy: str,
        tree_cache: Any,
        enable_hierarchical_cache: bool,
        enable_priority_scheduling: bool,
        schedule_low_priority_values_first: bool,
        *,
        settings: SGLangConfig | None = None,
        reorder: ReorderConfig | None = None,
    ) -> None:
        self.settings = settings or SGLangConfig.load()
        self.kvreuse_policy = self.settings.schedule_policy or None
        # SGLang's own policy state is built for fcfs when kvreuse orders the queue: the rest of SGLang asks the
        # policy object only for the chunk limit of shortest-prefill-first and whether the queue was matched.
        super().__init__(
            "fcfs" if self.kvreuse_policy else policy,
            tree_cache,
            enable_hierarchical_cache,
            enable_priority_scheduling,
            schedule_low_priority_values_first,
        )
        self.order: AffinityOrder[Req] | None = None
        if self.kvreuse_policy is None:
            return
        self.reorder_config = reorder or ReorderConfig.load()
        self._priority = self._signed_priority if enable_priority_scheduling else None
        self._next_log_at = LOG_EVERY_ADMISSIONS
        if getattr(tree_cache, "disable", True):
            logger.warning(
                "kvreuse %s without the radix cache (--disable-radix-cache) orders requests as they arrived",
                self.kvreuse_policy,
            )
        if self.kvreuse_policy == AFFINITY_POLICY:
            self.order = AffinityOrder(
                self.reorder_config, self._probe_prefix, _arrival_time, self._priority, clock=type(self).clock
            )
            page = getattr(tree_cache, "page_size", 1) or 1
            self.block_tokens = -(-self.settings.affinity_block // page) * page
        else:
            self.module_trie = self._module_trie(tree_cache)
            self._module_ids: dict[Hashable, int] = {}
        logger.info(
            "kvreuse schedule policy %s (in place of --schedule-policy %s): lookahead %d, max_skips %d, max_wait_s %g",
            self.kvreuse_policy,
            policy,
            self.reorder_config.lookahead,
            self.reorder_config.max_skips,
            self.reorder_config.max_wait_s,
        )

    def calc_priority(
        self, waiting_queue: list[Req], running_batch: ScheduleBatch | None = None, processed_tokens: int = 0
    ) -> None:
        if self.kvreuse_policy is None:
            return super().calc_priority(waiting_queue, running_batch, processed_tokens)
        if self.order is not None:
            waiting_queue[:] = self.order.plan(waiting_queue)
            counters = self.order.counters
            if counters.admissions >= self._next_log_at:
                self._next_log_at = (counters.admissions // LOG_EVERY_ADMISSIONS + 1) * LOG_EVERY_ADMISSIONS
                log_counters(counters)
        elif waiting_queue:
            waiting_queue[:] = self._rerank_by_modules(waiting_queue)
        return None

    def reorder_counters(self) -> ReorderCounters | None:
        """What the prefix-affinity queue has done so far (``None`` under another order). A pass's admissions are
        counted when the next pass starts (they are seen leaving the waiting list)."""
        return None if self.order is None else self.order.counters

    # -- prefix-affinity ------------------------------------------------------------------------------------------

    def _signed_priority(self, req: Req) -> int:
        # SGLang admits higher priority values first unless --schedule-low-priority-values-first; the queue
        # admits smaller values first.
        return (req.priority or 0) * self.priority_sign

    def _probe_prefix(self, req: Req) -> PrefixProbe:
        """SGLang's radix-cache look-up for ``req`` (``match_kv_cache``, as its ``lpm`` policy does before each
        pass; it only records the hit on the request), as the queue's :class:`PrefixProbe`.

        The 'next block' is the ``block_tokens`` tokens after the cached prefix: requests with the same prefix up
        to its end (and the same ``extra_key``/``cache_salt``, which partition SGLang's tree) get the same key.
        """
        match_kv_cache(req, self.tree_cache)
        page = getattr(self.tree_cache, "page_size", 1) or 1
        cached = req.prefix_len
        end = cached + self.block_tokens
        ids = req.origin_input_ids
        key = None
        if end <= len(ids) + len(req.output_ids):
            head = ids[:end] if end <= len(ids) else ids + req.output_ids[: end - len(ids)]
            key = hash((req.extra_key, req.cache_salt, _token_bytes(head)))
        return PrefixProbe(cached // page, key)

    # -- module-sets ----------------------------------------------------------------------------------------------

    def _module_trie(self, tree_cache: Any) -> ModuleTrie:
        trie = getattr(tree_cache, "module_trie", None)  # the kvreuse module cache shares what it learns
        if trie is None:
            trie = ModuleTrie()
        if self.settings.modules_file:
            for name, ids in read_modules_file(self.settings.modules_file):
                trie.add(name, ids)
        if not len(trie) and getattr(tree_cache, "module_trie", None) is None:
            raise ConfigError(
                "KVREUSE_SGLANG_SCHEDULE_POLICY=module-sets needs modules to compare: set "
                "KVREUSE_SGLANG_MODULES_FILE, or use --radix-cache-backend kvreuse_modules"
            )
        return trie

    def _module_set(self, req: Req) -> list[int]:
        ids = req.origin_input_ids
        return [self._module_ids.setdefault(match.name, len(self._module_ids)) for match in self.module_trie.find(ids)]

    def _rerank_by_modules(self, waiting: list[Req]) -> list[Req]:
        """Per priority class (best first), the oldest request then its nearest neighbours by module set, for the
        first ``lookahead`` requests; the rest after them in arrival order. The oldest request of the best
        priority always comes first, so no request waits behind more than the requests older than it."""
        key = (lambda r: (self._priority(r), _arrival_time(r))) if self._priority else _arrival_time
        ordered = sorted(waiting, key=key)
        head, rest = ordered[: self.reorder_config.lookahead], ordered[self.reorder_config.lookahead :]
        out: list[Req] = []
        start = 0
        while start < len(head):
            stop = start + 1
            if self._priority is not None:
                while stop < len(head) and self._priority(head[stop]) == self._priority(head[start]):
                    stop += 1
            else:
                stop = len(head)
            group = head[start:stop]
            order = rerank_by_module_sets([self._module_set(r) for r in group])
            out += [group[i] for i in order]
            start = stop
        return out + rest


def log_counters(c: ReorderCounters) -> None:
    logger.info(
        "kvreuse reorder: %d admissions, %d out of arrival order, %d with a cached prefix "
        "(%d cached pages), %d forced by bounded waiting, at most %d skips of one request",
        c.admissions,
        c.out_of_order,
        c.cached_prefix,
        c.cached_blocks,
        c.forced,
        c.max_skips,
    )
