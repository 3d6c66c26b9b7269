"""Routing batches to replicas: load is unfinished work, and the prefix-aware router keeps prefixes together."""

from __future__ import annotations

import pytest

from kvreuse.errors import ConfigError
from kvreuse.reorder.routing import (
    ROUTERS,
    LeastLoadedRouter,
    PrefixAwareRouter,
    RandomRouter,
    RoundRobinRouter,
    make_router,
    prefix_keys,
)


def test_load_counts_unfinished_requests_not_requests_sent():
    router = LeastLoadedRouter(2)
    assert router.route([], 10) == 0
    assert router.route([], 3) == 1
    router.finish(0, 10)
    assert router.loads == {0: 0, 1: 3}
    assert router.route([], 1) == 0  # replica 0 was sent more, but has nothing left to do


def test_prefix_aware_sends_a_shared_prefix_back_to_the_replica_that_saw_it():
    router = PrefixAwareRouter(4, slack=8)
    a, b = prefix_keys("A" * 64, 16), prefix_keys("B" * 64, 16)
    first_a, first_b = router.route(a, 2), router.route(b, 2)
    assert first_a != first_b
    assert [router.route(a, 1) for _ in range(3)] == [first_a] * 3
    assert router.route(b, 1) == first_b


def test_prefix_aware_prefers_the_longest_matching_prefix_over_the_least_loaded():
    router = PrefixAwareRouter(2, slack=1)
    xa = prefix_keys("X" * 16 + "a" * 48, 16)  # shares only its first block with xb
    xb = prefix_keys("X" * 16 + "b" * 48, 16)
    assert router.route(xa, 2) == 0
    assert router.route(xb, 1) == 1  # replica 0 matches "X" but its load 2 exceeds 0 + slack 1
    assert router.route(xb, 1) == 1
    assert router.loads == {0: 2, 1: 2}
    router.finish(1, 1)
    # Replica 1 is less loaded and matches the first block; replica 0 matches all four and is within the slack.
    assert router.route(xa, 1) == 0


def test_prefix_aware_gives_up_locality_beyond_the_slack():
    router = PrefixAwareRouter(2, slack=4)
    keys = prefix_keys("P" * 32, 16)
    home = router.route(keys, 5)
    assert router.route(keys, 1) != home  # home's load 5 exceeds min 0 + slack 4
    router.finish(home, 5)
    assert router.route(keys, 1) == home


def test_prefix_aware_memory_is_bounded_by_recent_keys():
    router = PrefixAwareRouter(1, recent_keys=3)
    for i in range(100):
        router.route([f"k{i}"], 1)
    assert list(router._recent[0]) == ["k97", "k98", "k99"]
    assert set(router._holders) == {"k97", "k98", "k99"}


def test_removed_replica_gets_nothing_and_its_late_completions_are_ignored():
    for name in ROUTERS:
        router = make_router(name, 3)
        router.route(["k"], 2)
        router.remove(1)
        assert all(router.route(["k"], 1) != 1 for _ in range(20)), name
        router.finish(1, 5)  # no error: the replica is gone
    router = LeastLoadedRouter(1)
    router.remove(0)
    with pytest.raises(ConfigError, match="no live replica"):
        router.route([], 1)


def test_round_robin_and_random_spread_batches_evenly():
    rr = RoundRobinRouter(4)
    assert [rr.route([], 1) for _ in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    counts = [0] * 4
    rnd = RandomRouter(4, seed=1)
    for _ in range(4000):
        counts[rnd.route([], 1)] += 1
    assert min(counts) > 900 and max(counts) < 1100


def test_prefix_keys_are_chained_block_hashes():
    assert len(prefix_keys("a" * 70, 16)) == 4  # 4 full blocks; the partial one is not a key
    assert prefix_keys("ab" * 32, 16)[:2] == prefix_keys("ab" * 16 + "zz" * 16, 16)[:2]
    assert prefix_keys("ab" * 32, 16)[2] != prefix_keys("ab" * 16 + "zz" * 16, 16)[2]
    assert prefix_keys([1, 2, 3, 4], 2) == prefix_keys((1, 2, 3, 4), 2)
    assert len(prefix_keys("a" * 1000, 10, limit=5)) == 5


def test_bad_settings_are_config_errors_naming_them():
    with pytest.raises(ConfigError, match="unknown router 'fastest'"):
        make_router("fastest", 2)
    with pytest.raises(ConfigError, match="slack"):
        PrefixAwareRouter(2, slack=-1)
    with pytest.raises(ConfigError, match="replicas"):
        LeastLoadedRouter(0)
    with pytest.raises(ConfigError, match="finished 2 request"):
        LeastLoadedRouter(1).finish(0, 2)
