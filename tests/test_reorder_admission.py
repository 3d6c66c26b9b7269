"""Admission orders for engines that sort their waiting list (``kvreuse.reorder.admission``), engine-free: the
prefix-affinity order as a sort, the module-set order, and the log line every engine's scheduler prints."""

from __future__ import annotations

from kvreuse.reorder.admission import AffinityOrder, counters_summary, order_by_module_sets
from kvreuse.reorder.affinity import PrefixProbe, ReorderCounters
from kvreuse.reorder.config import ReorderConfig


def test_the_module_set_order_starts_from_the_oldest_and_keeps_the_rest_in_arrival_order():
    modules = {"a": [0, 1], "b": [5, 6], "c": [0, 1, 2], "d": [5, 6, 7], "late": [0, 1]}
    arrival = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0, "late": 5.0}
    order = order_by_module_sets(["late", "d", "c", "b", "a"], modules.__getitem__, arrival.__getitem__, None, 4)
    assert order == ["a", "c", "b", "d", "late"]  # a's nearest is c (1 module apart), then b, then d; late waits


def test_the_module_set_order_keeps_priority_classes_apart_best_first():
    modules = {"a": [0], "b": [1], "c": [0], "urgent": [1]}
    arrival = {"a": 1.0, "b": 2.0, "c": 3.0, "urgent": 4.0}
    priority = {"a": 1, "b": 1, "c": 1, "urgent": 0}
    order = order_by_module_sets(list(modules), modules.__getitem__, arrival.__getitem__, priority.__getitem__, 10)
    assert order == ["urgent", "a", "c", "b"]


def test_the_affinity_order_puts_cached_prefixes_first_and_counts_admissions_at_the_next_plan():
    cached = {"cold": 0, "warm": 3}
    config = ReorderConfig.load({"max_skips": 8, "max_wait_s": 3600.0, "lookahead": 8}, environ={})
    arrival = {"cold": 1.0, "warm": 2.0}
    order = AffinityOrder(config, lambda r: PrefixProbe(cached[r], None), arrival.__getitem__, clock=lambda: 3.0)
    assert order.plan(["cold", "warm"]) == ["warm", "cold"]
    assert order.plan(["cold"]) == ["cold"]  # "warm" left the list: it was admitted, passing over "cold" once
    assert (order.counters.admissions, order.counters.out_of_order, order.counters.cached_blocks) == (1, 1, 3)


def test_one_log_line_of_the_counters_names_the_engines_unit():
    counters = ReorderCounters(admissions=10, out_of_order=4, cached_prefix=6, cached_blocks=12, forced=1, max_skips=3)
    assert counters_summary(counters, "pages") == (
        "kvreuse reorder: 10 admissions, 4 out of arrival order, 6 with a cached prefix (12 cached pages), "
        "1 forced by bounded waiting, at most 3 skips of one request, 0 passes held for room to finish"
    )
