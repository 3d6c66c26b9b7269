"""The scheduler's Prometheus metrics: the gauge named after the ``max_skips`` setting reports the setting, and the
most skips any request has had so far is its own gauge."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from prometheus_client import REGISTRY
from vllm.v1.metrics.stats import SchedulerStats

from kvreuse.reorder.affinity import ReorderCounters
from kvreuse.vllm.reorder.metrics import ReorderStatLogger, attach_reorder_counters

LABELS = {"model_name": "m", "engine": "0"}


def engine_config(additional_config: dict) -> SimpleNamespace:
    return SimpleNamespace(model_config=SimpleNamespace(served_model_name="m"), additional_config=additional_config)


def test_the_max_skips_gauge_is_the_setting_before_any_request_and_most_skips_the_high_water_mark():
    config = engine_config({"kvreuse": {"reorder": {"max_skips": 64}}})
    stat_logger = ReorderStatLogger(config, [0])  # type: ignore[arg-type]
    assert REGISTRY.get_sample_value("kvreuse:reorder_max_skips", LABELS) == 64
    stats = SchedulerStats()
    attach_reorder_counters(stats, ReorderCounters(admissions=5, max_skips=3))
    stat_logger.record(stats, None)
    assert REGISTRY.get_sample_value("kvreuse:reorder_max_skips", LABELS) == 64
    assert REGISTRY.get_sample_value("kvreuse:reorder_most_skips", LABELS) == 3


def test_without_a_setting_the_gauge_reports_the_default_bound(monkeypatch):
    monkeypatch.delenv("KVREUSE_REORDER_MAX_SKIPS", raising=False)
    ReorderStatLogger(engine_config({}), [0])  # type: ignore[arg-type]
    assert REGISTRY.get_sample_value("kvreuse:reorder_max_skips", LABELS) == 64


def test_the_front_ends_log_carries_the_schedulers_summary_once_per_change(caplog):
    stat_logger = ReorderStatLogger(engine_config({}), [0])  # type: ignore[arg-type]
    stats = SchedulerStats()
    attach_reorder_counters(stats, ReorderCounters(admissions=80, out_of_order=12, cached_prefix=70, cached_blocks=140))
    stat_logger.record(stats, None)
    with caplog.at_level(logging.INFO, logger="vllm.plugins.kvreuse.scheduler"):
        stat_logger.log()
        stat_logger.log()  # nothing moved since: no second line
    lines = [r.getMessage() for r in caplog.records if "kvreuse reorder" in r.getMessage()]
    assert lines == [
        "Engine 000: kvreuse reorder: 80 admissions, 12 out of arrival order, 70 with a cached prefix (140 cached "
        "blocks), 0 forced by bounded waiting, at most 0 skips of one request, 0 passes held for room to finish"
    ]
