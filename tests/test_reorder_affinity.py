"""Prefix-affinity admission (kvreuse.reorder.affinity), without an engine: a dict stands in for the KV cache."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvreuse.reorder.affinity import Candidate, Choice, PrefixAffinityQueue, PrefixProbe, choose, room_to_finish
from kvreuse.reorder.config import ReorderConfig

NOW = 100.0
RELAXED = ReorderConfig(max_skips=1000, max_wait_s=1e9)


def cand(cached: int = 0, key: str | None = None, skips: int = 0, arrival: float = NOW) -> Candidate:
    return Candidate(arrival_time=arrival, skips=skips, cached_blocks=cached, next_block_key=key)


@dataclass(frozen=True)
class Req:
    name: str
    prefix: str | None = None  # the request's first block; None: shorter than a block
    arrival: float = NOW
    priority: int = 0


class FakeCache:
    """Cached prefixes -> number of cached leading blocks; counts the probes the queue makes."""

    def __init__(self, cached: dict[str, int] | None = None) -> None:
        self.cached = dict(cached or {})
        self.probes = 0

    def probe(self, req: Req) -> PrefixProbe:
        self.probes += 1
        if req.prefix in self.cached:
            return PrefixProbe(self.cached[req.prefix], None)
        return PrefixProbe(0, req.prefix)


def queue(
    cache: FakeCache, config: ReorderConfig = RELAXED, *, priority: bool = False, now: float = NOW
) -> PrefixAffinityQueue[Req]:
    return PrefixAffinityQueue(
        config,
        cache.probe,
        arrival_time=lambda r: r.arrival,
        priority=(lambda r: r.priority) if priority else None,
        clock=lambda: now,
    )


def drain(q: PrefixAffinityQueue[Req]) -> list[str]:
    return [q.pop_request().name for _ in range(len(q))]


# choose(): one decision among requests of equal priority, in arrival order.


def test_a_request_with_cached_leading_blocks_goes_before_earlier_uncached_ones():
    assert choose([cand(key="a"), cand(key="b"), cand(cached=3)], RELAXED, NOW) == Choice(2, forced=False)


def test_more_cached_leading_blocks_win_over_fewer():
    assert choose([cand(cached=1, key="x"), cand(cached=5), cand(cached=2)], RELAXED, NOW).index == 1


def test_among_uncached_requests_the_earliest_of_the_largest_group_sharing_a_next_block_goes_first():
    candidates = [cand(key="a"), cand(key="b"), cand(key="a"), cand(key="b"), cand(key="b"), cand(key=None)]
    assert choose(candidates, RELAXED, NOW).index == 1


def test_without_cached_blocks_or_shared_blocks_the_earliest_arrival_goes_first():
    assert choose([cand(key="a"), cand(key=None), cand(key="c")], RELAXED, NOW).index == 0


def test_a_request_passed_over_max_skips_times_is_admitted_before_the_affinity_pick():
    config = ReorderConfig(max_skips=4, max_wait_s=1e9)
    candidates = [cand(key="a", skips=3), cand(key="b", skips=4), cand(cached=6)]
    assert choose(candidates, config, NOW) == Choice(1, forced=True)


def test_a_request_waiting_max_wait_s_since_arrival_is_admitted_before_the_affinity_pick():
    config = ReorderConfig(max_skips=1000, max_wait_s=2.0)
    candidates = [cand(key="a", arrival=NOW - 1.9), cand(key="b", arrival=NOW - 2.0), cand(cached=6)]
    assert choose(candidates, config, NOW) == Choice(1, forced=True)


def test_a_due_request_that_affinity_would_pick_anyway_is_not_counted_as_forced():
    config = ReorderConfig(max_skips=2, max_wait_s=1e9)
    assert choose([cand(key="a"), cand(cached=4, skips=2)], config, NOW) == Choice(1, forced=False)


def test_max_skips_zero_admits_in_arrival_order():
    config = ReorderConfig(max_skips=0, max_wait_s=1e9)
    assert choose([cand(key="a"), cand(cached=9)], config, NOW) == Choice(0, forced=True)


# PrefixAffinityQueue: vLLM's RequestQueue contract around choose().


def test_pop_after_peek_returns_the_peeked_request_although_admitting_it_changed_the_cache():
    cache = FakeCache()
    q = queue(cache)
    for name, prefix in [("a1", "a"), ("b1", "b"), ("b2", "b")]:
        q.add_request(Req(name, prefix))
    peeked = q.peek_request()
    cache.cached["a"] = 7  # as if allocating the peeked request had cached blocks that favour another one
    assert peeked.name == "b1"
    assert q.pop_request() is peeked


def test_a_later_arrival_with_a_cached_prefix_goes_before_earlier_waiting_requests():
    cache = FakeCache({"hot": 6})
    q = queue(cache)
    q.add_request(Req("cold1", "x"))
    q.add_request(Req("cold2", "y"))
    assert q.pop_request().name == "cold1"
    q.close_step(lambda r: True)
    q.add_request(Req("late", "hot"))
    assert q.peek_request().name == "late"


def test_without_priority_prepended_requests_go_first_in_the_order_of_vllms_deque():
    q, reference = queue(FakeCache({"hot": 6})), deque()
    w1, w2, p1, s1, s2 = Req("w1", "x"), Req("w2", "hot"), Req("p1"), Req("s1"), Req("s2")
    for r in (w1, w2):
        q.add_request(r)
        reference.append(r)
    q.prepend_request(p1)
    reference.appendleft(p1)
    q.prepend_requests([s1, s2])
    reference.extendleft([s1, s2])
    assert list(q) == list(reference) == [s2, s1, p1, w1, w2]
    # The front goes first, as in vLLM; behind it, the cached prefix before the earlier cold request.
    assert drain(q) == ["s2", "s1", "p1", "w2", "w1"]


def test_with_priority_a_higher_priority_request_goes_before_requests_with_a_cached_prefix():
    q = queue(FakeCache({"hot": 6}), priority=True)
    for i in range(3):
        q.add_request(Req(f"low{i}", "hot", priority=1))
    q.add_request(Req("urgent", "cold", priority=0))
    assert drain(q) == ["urgent", "low0", "low1", "low2"]


def test_with_priority_a_prepended_request_is_reinserted_by_arrival_time_like_vllms_heap():
    q = queue(FakeCache(), priority=True)
    q.add_request(Req("second", "x", arrival=2.0))
    q.prepend_request(Req("third", "y", arrival=3.0))
    q.prepend_request(Req("first", "z", arrival=1.0))
    assert [r.name for r in q] == ["first", "second", "third"]


def test_only_the_lookahead_earliest_requests_are_scanned():
    q = queue(FakeCache({"hot": 6}), ReorderConfig(max_skips=1000, max_wait_s=1e9, lookahead=3))
    for i in range(3):
        q.add_request(Req(f"cold{i}", f"c{i}"))
    q.add_request(Req("hot", "hot"))
    assert q.peek_request().name == "cold0"


def test_passed_over_requests_count_their_skips_and_the_bound_then_admits_them():
    cache = FakeCache({"hot": 6})
    q = queue(cache, ReorderConfig(max_skips=2, max_wait_s=1e9))
    q.add_request(Req("cold", "c"))
    for i in range(4):
        q.add_request(Req(f"hot{i}", "hot"))
    assert drain(q) == ["hot0", "hot1", "cold", "hot2", "hot3"]
    q.close_step(lambda r: True)
    c = q.counters
    assert (c.admissions, c.out_of_order, c.forced, c.max_skips) == (5, 2, 1, 2)
    assert (c.cached_prefix, c.cached_blocks) == (4, 24)


def test_picks_the_engine_did_not_admit_are_not_counted():
    q = queue(FakeCache({"hot": 6}))
    q.add_request(Req("cold", "c"))
    q.add_request(Req("hot", "hot"))
    deferred = q.pop_request()
    admitted = q.pop_request()
    q.close_step(lambda r: r is admitted)
    c = q.counters
    assert (deferred.name, admitted.name) == ("hot", "cold")
    assert (c.admissions, c.out_of_order, c.cached_prefix) == (1, 0, 0)


def test_probes_are_reused_within_a_step_and_renewed_for_requests_waiting_for_the_admitted_block():
    cache = FakeCache()
    q = queue(cache)
    for name, prefix in [("a1", "a"), ("b1", "b"), ("b2", "b"), ("c1", "c")]:
        q.add_request(Req(name, prefix))
    assert q.pop_request().name == "b1" and cache.probes == 4
    cache.cached["b"] = 6  # admitting b1 cached its blocks
    assert q.pop_request().name == "b2" and cache.probes == 5  # only b2 shared b1's next block
    q.close_step(lambda r: True)
    q.pop_request()
    assert cache.probes == 7  # a new step probes afresh


def test_removed_requests_leave_the_queue_wherever_they_wait():
    q = queue(FakeCache())
    a, b, c = Req("a", "x"), Req("b", "y"), Req("c", "z")
    q.add_request(a)
    q.add_request(b)
    q.prepend_request(c)
    q.remove_requests([a, c, Req("never queued")])
    assert list(q) == [b] and len(q) == 1 and q
    q.remove_request(b)
    assert not q and len(q) == 0
    with pytest.raises(IndexError):
        q.peek_request()


def test_on_a_shuffled_workload_each_shared_prefix_is_computed_once():
    """A cache that holds one prefix: arrival order recomputes prefixes, affinity computes each once."""
    rng = random.Random(0)
    requests = [Req(f"{p}{i}", p) for p in "abcd" for i in range(5)]
    rng.shuffle(requests)

    def computed_prefixes(config: ReorderConfig) -> int:
        cache = FakeCache()
        q = queue(cache, config)
        for r in requests:
            q.add_request(r)
        computed = 0
        while q:
            r = q.pop_request()
            q.close_step(lambda _: True)
            if r.prefix not in cache.cached:
                computed += 1
                cache.cached = {r.prefix: 6}
        return computed

    assert computed_prefixes(RELAXED) == 4
    assert computed_prefixes(ReorderConfig(max_skips=0)) > 10


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 5),
    st.lists(st.tuples(st.sampled_from("abc"), st.booleans(), st.integers(1, 3)), min_size=1, max_size=40),
    st.randoms(use_true_random=False),
)
def test_no_request_is_passed_over_more_than_max_skips_times(max_skips, arrivals, rng):
    """Requests arrive in waves and leave one or more at a time while a random cache changes under them."""
    cache = FakeCache()
    q = queue(cache, ReorderConfig(max_skips=max_skips, max_wait_s=1e9))
    waiting: list[Req] = []
    passed_over: dict[Req, int] = {}
    for n, (prefix, hot, pops) in enumerate(arrivals):
        r = Req(f"r{n}", prefix)
        q.add_request(r)
        waiting.append(r)
        cache.cached = {prefix: 4} if hot else {}
        for _ in range(min(pops, len(waiting)) if rng.random() < 0.5 else 0):
            popped = q.pop_request()
            for earlier in waiting[: waiting.index(popped)]:
                passed_over[earlier] = passed_over.get(earlier, 0) + 1
            waiting.remove(popped)
        q.close_step(lambda _: True)
    assert max(passed_over.values(), default=0) <= max_skips
    assert q.counters.max_skips == max(passed_over.values(), default=0)


# Admission to completion: the room callback.


def test_a_pick_without_room_to_finish_holds_the_queue_until_the_pass_ends():
    cache = FakeCache({"hot": 6})
    room = {"fits": False}
    q = PrefixAffinityQueue(
        RELAXED, cache.probe, arrival_time=lambda r: r.arrival, clock=lambda: NOW, room=lambda r, p: room["fits"]
    )
    q.add_request(Req("cold", "c"))
    q.add_request(Req("hot", "hot"))
    assert len(q) == 2 and not q  # waiting, but nothing the engine should admit now
    room["fits"] = True
    assert not q  # held for the rest of the pass
    q.close_step(lambda r: True)
    assert q and q.peek_request().name == "hot" and q.pop_request().name == "hot"
    assert q.counters.held == 1


def test_requests_at_the_front_are_never_held_back():
    q = PrefixAffinityQueue(
        RELAXED, FakeCache().probe, arrival_time=lambda r: r.arrival, clock=lambda: NOW, room=lambda r, p: False
    )
    q.add_request(Req("waiting", "x"))
    q.prepend_request(Req("preempted", "y"))
    assert q and q.pop_request().name == "preempted"
    assert not q


def test_the_room_callback_sees_the_picks_probe():
    seen = []
    q = PrefixAffinityQueue(
        RELAXED,
        FakeCache({"hot": 6}).probe,
        arrival_time=lambda r: r.arrival,
        clock=lambda: NOW,
        room=lambda r, p: seen.append((r.name, p.cached_blocks)) or True,
    )
    q.add_request(Req("cold", "c"))
    q.add_request(Req("hot", "hot"))
    assert bool(q)
    assert seen == [("hot", 6)]


def test_room_to_finish_counts_the_running_requests_growth():
    assert room_to_finish(free_blocks=10, request_blocks=4, running_growth_blocks=6)
    assert not room_to_finish(free_blocks=10, request_blocks=5, running_growth_blocks=6)


def test_by_default_waiting_is_bounded_by_skips_not_seconds():
    config = ReorderConfig()
    assert config.max_wait_s == float("inf")
    old = cand(key="a", arrival=NOW - 1e6)
    assert choose([old, cand(cached=6)], config, NOW) == Choice(1, forced=False)
