"""Prefix-affinity admission: which waiting request a scheduler admits next.

An engine caches a prompt's KV in full blocks keyed by a chained hash, so a request whose leading blocks are
cached skips their prefill. Admitting waiting requests in arrival order wastes that on a shuffled workload:
with a small cache, a shared prefix is evicted between two requests that use it. The engine adapter describes
each waiting request with a :class:`PrefixProbe` (how many leading blocks are cached right now, and the key of
the first block it would compute) and this module picks, among requests of the best priority:

1. a request that has been passed over ``max_skips`` times (or has waited ``max_wait_s`` since arrival, off by
   default), in arrival order (bounded waiting: no request waits more than ``max_skips`` admissions of later
   arrivals beyond its place in arrival order, however long the backlog);
2. otherwise the request with the most cached leading blocks, so it reuses them before they are evicted;
3. among requests with equally many, one whose next block is shared by the most waiting requests: the engine
   caches a block as soon as it is allocated, so once this one is admitted the others hit it, even later in
   the same step (they then rank first by rule 2);
4. ties go to the earliest arrival.

Priority (smaller value first) wins over all of this; affinity orders only requests of equal priority.

Admission to completion (``admit_to_completion``): admitting a request whose prefix is cached takes few new
blocks, so affinity packs more requests into the cache than arrival order does, and their decodes then run out
of blocks and preempt each other. With a ``room`` callback the queue hands out its pick only while the cache can
hold it and every running request up to their ``max_tokens`` (:func:`room_to_finish`); otherwise it reads as
empty until the pass ends, and the engine runs what it has.

Everything here is plain Python: the engine is reached only through the ``probe`` and ``room`` callbacks.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Generic, NamedTuple, TypeVar

from kvreuse.reorder.config import ReorderConfig

T = TypeVar("T", bound=Hashable)


@dataclass(frozen=True)
class PrefixProbe:
    """What the engine's prefix cache says about a waiting request's prompt now, without allocating anything.

    ``next_block_key`` identifies the first full block the request would compute (``None`` if none: the
    prompt is shorter than a block, or entirely cached). Keys of chained block hashes are equal only if the
    whole prefix up to that block is equal, so requests with the same key compute the same block.
    """

    cached_blocks: int
    next_block_key: Hashable | None


def room_to_finish(free_blocks: int, request_blocks: int, running_growth_blocks: int) -> bool:
    """Whether a request needing ``request_blocks`` new blocks to finish fits beside the running requests, which
    need ``running_growth_blocks`` more to finish, in ``free_blocks``: admitted so, no one is preempted for it."""
    return free_blocks - request_blocks >= running_growth_blocks


class Candidate(NamedTuple):
    """A waiting request as :func:`choose` sees it (a tuple: the queue builds one per request per pick)."""

    arrival_time: float
    skips: int
    cached_blocks: int
    next_block_key: Hashable | None


@dataclass(frozen=True)
class Choice:
    """The candidate to admit; ``forced`` when bounded waiting overrode the affinity pick."""

    index: int
    forced: bool


def choose(candidates: Sequence[Candidate], config: ReorderConfig, now: float) -> Choice:
    """Pick the candidate to admit from ``candidates`` (non-empty, equal priority, in arrival order)."""
    group_sizes = Counter(c.next_block_key for c in candidates if c.next_block_key is not None)
    best, best_rank, due = 0, (-1, -1), None
    for i, c in enumerate(candidates):
        if due is None and (c.skips >= config.max_skips or now - c.arrival_time >= config.max_wait_s):
            due = i
        rank = (c.cached_blocks, group_sizes[c.next_block_key] if c.next_block_key is not None else 1)
        if rank > best_rank:  # strictly: ties stay with the earlier arrival
            best, best_rank = i, rank
    if due is not None:
        return Choice(due, forced=due != best)
    return Choice(best, forced=False)


@dataclass
class ReorderCounters:
    """What the queue did, cumulative; an admission is a request that left the queue and started running."""

    admissions: int = 0
    out_of_order: int = 0  # admissions that passed over an earlier arrival of equal priority
    cached_prefix: int = 0  # admissions whose leading blocks were cached when they were picked
    cached_blocks: int = 0  # cached leading blocks of those admissions, summed
    forced: int = 0  # admissions bounded waiting made in place of the affinity pick
    max_skips: int = 0  # most times any request has been passed over
    held: int = 0  # scheduling passes that stopped admitting because the pick would not fit to completion


@dataclass(slots=True, eq=False)  # identity-hashed: entries key the probe memo
class _Entry(Generic[T]):
    item: T
    priority: int
    arrival_time: float
    order: tuple[float, ...]
    skips: int = 0


@dataclass(frozen=True)
class _Pick(Generic[T]):
    """A peeked decision, kept so the following pop returns the same request."""

    item: T
    window: list[_Entry[T]]  # empty for a request taken from the front
    probes: list[PrefixProbe]
    choice: Choice | None


class PrefixAffinityQueue(Generic[T]):
    """A waiting queue that hands out requests by prefix affinity (see the module docstring).

    It has the interface of vLLM's ``RequestQueue`` (``add_request``, ``peek_request``, ``pop_request``,
    ``prepend_request(s)``, ``remove_request(s)``), and keeps two of its contracts: a pop right after a peek
    returns the peeked request, even though admitting it changes what is cached; and, without ``priority``
    (first-come-first-served), prepended requests (preempted, or skipped by the engine this step) sit at the
    front in deque order and go first, while with ``priority`` a prepended request is simply re-added, as in
    a priority heap. Each pick scans the ``lookahead`` earliest requests of the best priority.

    Call :meth:`close_step` after each scheduling pass: it counts which picks were admitted and forgets the
    probes, which are memoised within a pass (the engine is probed once per request per pass, and again only
    after a request with the same next block was picked and has made that block cached).
    """

    def __init__(
        self,
        config: ReorderConfig,
        probe: Callable[[T], PrefixProbe],
        arrival_time: Callable[[T], float],
        priority: Callable[[T], int] | None = None,
        clock: Callable[[], float] = time.time,
        room: Callable[[T, PrefixProbe], bool] | None = None,
    ) -> None:
        self.config = config
        self._probe = probe
        self._arrival_time = arrival_time
        self._priority = priority
        self._clock = clock
        self._room = room
        self._held = False  # the pick did not fit: read as empty until close_step
        self._front: deque[T] = deque()
        self._entries: dict[T, _Entry[T]] = {}
        self._classes: dict[int, list[_Entry[T]]] = {}  # priority -> entries sorted by order
        self._seq = 0
        self._probes: dict[_Entry[T], PrefixProbe] = {}
        self._peeked: _Pick[T] | None = None
        self._picked: list[tuple[T, Choice | None, PrefixProbe | None]] = []
        self._counters = ReorderCounters()

    @property
    def counters(self) -> ReorderCounters:
        """A snapshot of the cumulative counters."""
        return replace(self._counters)

    def add_request(self, request: T) -> None:
        self._peeked = None
        priority = self._priority(request) if self._priority is not None else 0
        arrival = self._arrival_time(request)
        self._seq += 1
        # First-come-first-served keeps insertion order, like vLLM's deque; a priority queue orders equal
        # priorities by arrival time, like vLLM's heap.
        order = (self._seq,) if self._priority is None else (arrival, self._seq)
        entry = _Entry(request, priority, arrival, order)
        self._entries[request] = entry
        bisect.insort(self._classes.setdefault(priority, []), entry, key=_order)

    def prepend_request(self, request: T) -> None:
        self.prepend_requests((request,))

    def prepend_requests(self, requests: Iterable[T]) -> None:
        if self._priority is not None:
            for request in requests:
                self.add_request(request)
            return
        self._peeked = None
        self._front.extendleft(requests)

    def remove_request(self, request: T) -> None:
        self._peeked = None
        entry = self._entries.pop(request, None)
        if entry is None:
            self._front.remove(request)
        else:
            self._unlink(entry)

    def remove_requests(self, requests: Iterable[T]) -> None:
        doomed = set(requests)
        if any(r in doomed for r in self._front):
            self._front = deque(r for r in self._front if r not in doomed)
        for request in doomed:
            if request in self._entries:
                self._unlink(self._entries.pop(request))
        self._peeked = None

    def peek_request(self) -> T:
        if self._peeked is None:
            self._peeked = self._pick()
        return self._peeked.item

    def pop_request(self) -> T:
        pick = self._peeked if self._peeked is not None else self._pick()
        self._peeked = None
        if pick.choice is None:
            self._front.popleft()
            self._picked.append((pick.item, None, None))
            return pick.item
        self._unlink(self._entries.pop(pick.item))
        for passed in pick.window[: pick.choice.index]:
            passed.skips += 1
            self._counters.max_skips = max(self._counters.max_skips, passed.skips)
        probe = pick.probes[pick.choice.index]
        if probe.next_block_key is not None:
            # Admitting this request caches its next block; requests waiting for the same block now hit it.
            for entry in [e for e, p in self._probes.items() if p.next_block_key == probe.next_block_key]:
                del self._probes[entry]
        self._picked.append((pick.item, pick.choice, probe))
        return pick.item

    def close_step(self, admitted: Callable[[T], bool]) -> None:
        """End a scheduling pass: count the picks that ``admitted`` says started running, forget the probes.

        A pick is not always an admission: the engine may pop a request only to defer it (and prepend it
        back), or stop before popping; such picks are not counted.
        """
        c = self._counters
        for item, choice, probe in self._picked:
            if not admitted(item):
                continue
            c.admissions += 1
            if choice is None or probe is None:
                continue
            c.out_of_order += choice.index > 0
            c.forced += choice.forced
            if probe.cached_blocks:
                c.cached_prefix += 1
                c.cached_blocks += probe.cached_blocks
        self._picked.clear()
        self._probes.clear()
        self._held = False

    def __len__(self) -> int:
        return len(self._front) + len(self._entries)

    def __bool__(self) -> bool:
        """Whether the engine should peek: requests wait and, with ``room``, the next pick fits to completion.

        Requests at the front (preempted, or skipped by the engine) are never held back: they go first, as in
        vLLM. A pass that holds back a pick stays held back until :meth:`close_step`.
        """
        if not len(self):
            return False
        if self._room is None or self._front:
            return True
        if self._held:
            return False
        if self._peeked is None:
            self._peeked = self._pick()
        pick = self._peeked
        assert pick.choice is not None
        if self._room(pick.item, pick.probes[pick.choice.index]):
            return True
        self._held = True
        self._counters.held += 1
        return False

    def __iter__(self) -> Iterator[T]:
        """Front requests, then by priority and arrival (not the affinity order, which depends on the cache)."""
        yield from list(self._front)
        for priority in sorted(self._classes):
            yield from [e.item for e in self._classes[priority]]

    def _pick(self) -> _Pick[T]:
        if self._front:
            return _Pick(self._front[0], [], [], None)
        if not self._entries:
            raise IndexError("peek from an empty queue")
        window = self._classes[min(self._classes)][: self.config.lookahead]
        probes = [self._probe_once(e) for e in window]
        candidates = [
            Candidate(e.arrival_time, e.skips, p.cached_blocks, p.next_block_key) for e, p in zip(window, probes)
        ]
        choice = choose(candidates, self.config, self._clock())
        return _Pick(window[choice.index].item, window, probes, choice)

    def _probe_once(self, entry: _Entry[T]) -> PrefixProbe:
        probe = self._probes.get(entry)
        if probe is None:
            probe = self._probes[entry] = self._probe(entry.item)
        return probe

    def _unlink(self, entry: _Entry[T]) -> None:
        entries = self._classes[entry.priority]
        del entries[bisect.bisect_left(entries, entry.order, key=_order)]
        if not entries:
            del self._classes[entry.priority]
        self._probes.pop(entry, None)


def _order(entry: _Entry) -> tuple[float, ...]:
    return entry.order
