"""``KVREUSE_SGLANG_SCHEDULE_POLICY``: kvreuse's orders as SGLang's ``SchedulePolicy``, on SGLang's real classes.

Requests are real ``Req`` objects; the cache is a real ``RadixCache`` (page size 1) holding one 40-token prefix
``P``. A pass is what SGLang's scheduler does: ``calc_priority`` sorts the waiting list, then the first ``admit``
requests leave it (as after ``PrefillAdder`` admitted them).
"""

from __future__ import annotations

from array import array

import pytest
import torch
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.schedule_policy import SchedulePolicy
from sglang.srt.mem_cache.base_prefix_cache import InsertParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.sampling.sampling_params import SamplingParams

from kvreuse.errors import ConfigError
from kvreuse.reorder.config import ReorderConfig
from kvreuse.reorder.rerank import total_hamming_distance
from kvreuse.sglang.scheduler import KVReuseSchedulePolicy
from kvreuse.sglang.settings import SGLangConfig

P = list(range(1000, 1040))  # the cached prefix
A = list(range(2000, 2032))  # an uncached prefix shared by the A requests
B = list(range(3000, 3032))  # another


class Clock:
    def __init__(self, now: float = 6.0):  # every request below arrived less than max_wait_s (10 s) ago
        self.now = now

    def __call__(self) -> float:
        return self.now


def radix_cache(*prefixes: list[int]) -> RadixCache:
    cache = RadixCache(
        CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None, page_size=1)
    )
    for ids in prefixes:
        cache.insert(InsertParams(key=RadixKey(array("q", ids)), value=torch.arange(len(ids), dtype=torch.int64)))
    return cache


def req(rid: str, ids: list[int], arrival: float, priority: int | None = None) -> Req:
    r = Req(rid, "", array("q", ids), SamplingParams(max_new_tokens=8), priority=priority)
    r.time_stats.wait_queue_entry_time = arrival
    return r


def policy(cache, order="prefix-affinity", *, clock=None, priority=False, low_first=False, **reorder):
    cls = type("Policy", (KVReuseSchedulePolicy,), {"clock": staticmethod(clock or Clock())})
    return cls(
        "fcfs",
        cache,
        False,
        priority,
        low_first,
        settings=SGLangConfig(schedule_policy=order),
        reorder=ReorderConfig(**reorder),
    )


def run_pass(p: SchedulePolicy, waiting: list[Req], admit: int) -> list[str]:
    """One scheduling pass: sort, then admit the first ``admit`` requests. Returns the admitted rids."""
    p.calc_priority(waiting)
    admitted = waiting[:admit]
    del waiting[:admit]
    return [r.rid for r in admitted]


def test_requests_with_a_cached_prefix_go_first_longest_first():
    cache = radix_cache(P)
    waiting = [
        req("cold1", A + [1], 1.0),
        req("hit20", P[:20] + [7] * 30, 2.0),
        req("cold2", B + [2], 3.0),
        req("hit40", P + [9] * 10, 4.0),
    ]
    p = policy(cache)
    p.calc_priority(waiting)
    assert [r.rid for r in waiting] == ["hit40", "hit20", "cold1", "cold2"]
    assert [r.prefix_len for r in waiting] == [40, 20, 0, 0]  # SGLang's own match, recorded on the request


def test_requests_sharing_an_uncached_prefix_send_one_ahead_and_the_rest_after():
    # Nothing cached: one request of each group computes its prefix first (groups of three before groups of two),
    # the others follow and find it cached once those ran; SGLang computes a prefix twice if two requests that
    # share it are in one prefill batch.
    waiting = [
        req("b1", B + [1], 1.0),
        req("a1", A + [1], 2.0),
        req("b2", B + [2], 3.0),
        req("a2", A + [2], 4.0),
        req("a3", A + [3], 5.0),
    ]
    p = policy(radix_cache())
    p.calc_priority(waiting)
    assert [r.rid for r in waiting][:2] == ["a1", "b1"]


def test_the_next_pass_admits_the_group_once_its_prefix_is_cached():
    cache = radix_cache()
    waiting = [
        req("b1", B + [1], 1.0),
        req("a1", A + [1], 2.0),
        req("b2", B + [2], 3.0),
        req("a2", A + [2], 4.0),
        req("a3", A + [3], 5.0),
    ]
    p = policy(cache)
    assert run_pass(p, waiting, admit=1) == ["a1"]
    cache.insert(InsertParams(key=RadixKey(array("q", A + [1])), value=torch.arange(33)))  # a1's prefill ran
    assert run_pass(p, waiting, admit=2) == ["a2", "a3"]
    assert run_pass(p, waiting, admit=2) == ["b1", "b2"]
    p.calc_priority(waiting)  # a pass's admissions are counted when the next pass starts
    counters = p.reorder_counters()
    assert counters.admissions == 5
    assert counters.cached_prefix == 2 and counters.cached_blocks == 2 * 32  # a2 and a3 hit 32 tokens each
    assert counters.out_of_order == 3  # a1 over b1; a2 over b1, b2; a3 over b1, b2 (b1, b2 went in order)


def test_a_request_passed_over_max_skips_times_is_admitted_next():
    cache = radix_cache(P)
    waiting = [req("old", A + [1], 1.0)] + [req(f"hit{i}", P + [i] * 5, 2.0 + i) for i in range(5)]
    p = policy(cache, max_skips=2)
    admitted = [run_pass(p, waiting, admit=1)[0] for _ in range(4)]
    assert admitted == ["hit0", "hit1", "old", "hit2"]
    counters = p.reorder_counters()
    assert counters.max_skips == 2 and counters.forced == 1


def test_a_request_waiting_max_wait_s_is_admitted_next():
    clock = Clock(now=10.0)
    cache = radix_cache(P)
    waiting = [req("old", A + [1], 1.0), req("hit", P + [5], 9.0), req("hit2", P + [6], 9.5)]
    p = policy(cache, clock=clock, max_wait_s=10.0)
    assert run_pass(p, waiting, admit=1) == ["hit"]  # old has waited 9 s
    clock.now = 11.0  # now 10 s
    assert run_pass(p, waiting, admit=1) == ["old"]
    p.calc_priority(waiting)
    assert p.reorder_counters().forced == 1


def test_priority_wins_over_a_cached_prefix():
    cache = radix_cache(P)
    waiting = [
        req("hit-low", P + [5], 1.0, priority=1),
        req("cold-high", A + [1], 2.0, priority=5),
        req("hit-high", P + [6], 3.0, priority=5),
    ]
    p = policy(cache, priority=True)  # SGLang's default: larger priority values first
    p.calc_priority(waiting)
    assert [r.rid for r in waiting] == ["hit-high", "cold-high", "hit-low"]
    p = policy(cache, priority=True, low_first=True)
    waiting.sort(key=lambda r: r.rid)
    p.calc_priority(waiting)
    assert [r.rid for r in waiting] == ["hit-low", "hit-high", "cold-high"]


def test_requests_joining_and_leaving_between_passes_are_followed():
    cache = radix_cache(P)
    waiting = [req("cold", A + [1], 1.0), req("hit", P + [1], 2.0)]
    p = policy(cache)
    p.calc_priority(waiting)
    waiting.remove(waiting[1])  # "cold" aborted; nothing admitted
    waiting.append(req("hit2", P + [2], 3.0))
    p.calc_priority(waiting)
    assert [r.rid for r in waiting] == ["hit", "hit2"]
    assert len(p.order.queue) == 2 and p.reorder_counters().admissions == 0


def test_only_lookahead_requests_are_picked_the_rest_follow_in_arrival_order():
    cache = radix_cache(P)
    waiting = [req(f"cold{i}", A + [i], float(i)) for i in range(4)] + [req("hit", P + [1], 9.0)]
    p = policy(cache, lookahead=2)
    p.calc_priority(waiting)
    assert [r.rid for r in waiting] == ["cold0", "cold1", "cold2", "cold3", "hit"]


def test_without_the_setting_it_is_sglangs_own_policy():
    cache = radix_cache(P)

    def make():
        return [req("cold", A + [1], 1.0), req("hit20", P[:20] + [7] * 30, 2.0), req("hit40", P + [9], 3.0)]

    stock, ours = make(), make()
    SchedulePolicy("lpm", cache, False, False, False).calc_priority(stock)
    p = KVReuseSchedulePolicy("lpm", cache, False, False, False, settings=SGLangConfig())
    p.calc_priority(ours)
    assert [r.rid for r in ours] == [r.rid for r in stock] == ["hit40", "hit20", "cold"]
    assert p.reorder_counters() is None


def test_the_setting_is_read_from_its_variable_and_checked():
    assert (
        SGLangConfig.load(environ={"KVREUSE_SGLANG_SCHEDULE_POLICY": "prefix-affinity"}).schedule_policy
        == "prefix-affinity"
    )
    with pytest.raises(ConfigError, match="KVREUSE_SGLANG_SCHEDULE_POLICY"):
        SGLangConfig.load(environ={"KVREUSE_SGLANG_SCHEDULE_POLICY": "lpm"})


# -- module-sets ----------------------------------------------------------------------------------------------------

T1, T2, T3 = [list(range(5000 + 100 * k, 5000 + 100 * k + 12)) for k in range(3)]  # three table modules


@pytest.fixture
def modules_file(tmp_path):
    path = tmp_path / "modules.json"
    path.write_text(f'{{"t1": {T1}, "t2": {T2}, "t3": {T3}}}')
    return str(path)


def test_module_sets_puts_requests_sharing_modules_next_to_each_other(modules_file):
    waiting = [
        req("t1t2", T1 + T2 + [1], 1.0),
        req("t3", T3 + [2], 2.0),
        req("t1", T1 + [3], 3.0),
        req("t3b", T3 + [4], 4.0),
        req("t2", T2 + [5], 5.0),
    ]
    p = KVReuseSchedulePolicy(
        "fcfs",
        radix_cache(),
        False,
        False,
        False,
        settings=SGLangConfig(schedule_policy="module-sets", modules_file=modules_file),
        reorder=ReorderConfig(),
    )
    arrival = [frozenset(p._module_set(r)) for r in waiting]
    p.calc_priority(waiting)
    # The oldest first; then each time the request whose module set differs least from the last one's (ties: the
    # older): t1 (1 module apart), then t3, t3b, t2 (2, 0, 2 apart).
    assert [r.rid for r in waiting] == ["t1t2", "t1", "t3", "t3b", "t2"]
    sets = [frozenset(p._module_set(r)) for r in waiting]
    assert total_hamming_distance(arrival, range(5)) == 9 and total_hamming_distance(sets, range(5)) == 5


def test_module_sets_without_modules_is_refused():
    with pytest.raises(ConfigError, match="KVREUSE_SGLANG_MODULES_FILE"):
        KVReuseSchedulePolicy(
            "fcfs", radix_cache(), False, False, False, settings=SGLangConfig(schedule_policy="module-sets")
        )


def test_a_malformed_modules_file_names_the_module(tmp_path):
    path = tmp_path / "modules.json"
    path.write_text('{"t1": [1, 2], "t2": "CREATE TABLE"}')
    with pytest.raises(ConfigError, match="'t2'"):
        KVReuseSchedulePolicy(
            "fcfs",
            radix_cache(),
            False,
            False,
            False,
            settings=SGLangConfig(schedule_policy="module-sets", modules_file=str(path)),
        )
