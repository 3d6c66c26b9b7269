"""Export the prefix-affinity scheduler's counters as Prometheus metrics ``kvreuse:reorder_*``.

The scheduler runs in vLLM's engine-core process; metrics live in the front-end process, which receives one
``SchedulerStats`` per step. The scheduler carries its cumulative counters there, under keys
``kvreuse:reorder_<counter>`` (:func:`attach_reorder_counters`, only with LoRA off: see
``kvreuse.patches.vllm_0_32.carry_in_scheduler_stats`` why), and :class:`ReorderStatLogger` reads them back.
The gauge ``kvreuse:reorder_max_skips`` is the setting of that name (the bound on skips, read from the engine's
``additional_config`` and ``KVREUSE_REORDER_*`` as the scheduler reads it); the most skips any request has had so
far, the counters' ``max_skips``, is the gauge ``kvreuse:reorder_most_skips``.
vLLM loads it from the entry point group ``vllm.stat_logger_plugins``, which its ``AsyncLLM`` front end
(``vllm serve``) honours and the offline ``LLM`` does not; it also logs the scheduler's summary line there with
vLLM's periodic figures (:meth:`ReorderStatLogger.log`). Offline, read the scheduler's ``reorder_counters()``
or its INFO log lines instead. The other plugins' counters take the connectors' way (``kvreuse.vllm.metrics``).
"""

from __future__ import annotations

import dataclasses
import logging

from prometheus_client import Counter, Gauge
from vllm.config import VllmConfig
from vllm.v1.metrics.loggers import AggregateStatLoggerBase
from vllm.v1.metrics.stats import IterationStats, MultiModalCacheStats, SchedulerStats

from kvreuse.patches import vllm_0_32
from kvreuse.reorder.admission import counters_summary
from kvreuse.reorder.affinity import ReorderCounters
from kvreuse.reorder.config import ReorderConfig
from kvreuse.vllm.metrics import replace_metrics
from kvreuse.vllm.settings import kvreuse_flags

logger = logging.getLogger("vllm.plugins.kvreuse.scheduler")

PREFIX = "kvreuse:reorder_"
_FIELDS = tuple(f.name for f in dataclasses.fields(ReorderCounters))
SETTING = PREFIX + "max_skips"
# ReorderCounters field -> (Prometheus name, kind, documentation). ``max_skips`` is a high-water mark, not a count of
# events; exported as the gauge ``most_skips``, since the metric named ``max_skips`` is the setting.
REORDER_METRICS: dict[str, tuple[str, str, str]] = {
    "admissions": (PREFIX + "admissions_total", "counter", "Requests admitted (left the waiting queue and started)"),
    "out_of_order": (
        PREFIX + "out_of_order_total",
        "counter",
        "Admissions that passed over an earlier arrival of equal priority",
    ),
    "cached_prefix": (
        PREFIX + "cached_prefix_total",
        "counter",
        "Admissions whose leading blocks were in the prefix cache when they were picked",
    ),
    "cached_blocks": (PREFIX + "cached_blocks_total", "counter", "Cached leading blocks of those admissions, summed"),
    "forced": (
        PREFIX + "forced_total",
        "counter",
        "Admissions bounded waiting (max_skips, max_wait_s) made in place of the affinity pick",
    ),
    "held": (
        PREFIX + "held_total",
        "counter",
        "Scheduling passes that stopped admitting because the pick would not fit to completion",
    ),
    "max_skips": (PREFIX + "most_skips", "gauge", "Most times any request has been passed over so far"),
    "setting": (SETTING, "gauge", "The setting reorder.max_skips: most times a waiting request may be passed over"),
}


def attach_reorder_counters(stats: SchedulerStats, counters: ReorderCounters) -> None:
    """Put ``counters`` into ``stats`` for the front end (only when LoRA is off; see the module docstring)."""
    vllm_0_32.carry_in_scheduler_stats(stats, {PREFIX + name: getattr(counters, name) for name in _FIELDS})


def read_reorder_counters(stats: SchedulerStats) -> ReorderCounters | None:
    """The counters :func:`attach_reorder_counters` put into ``stats``, or ``None`` if there are none."""
    carried = vllm_0_32.carried_in_scheduler_stats(stats)
    if PREFIX + _FIELDS[0] not in carried:
        return None
    return ReorderCounters(**{name: int(carried[PREFIX + name]) for name in _FIELDS})


class ReorderStatLogger(AggregateStatLoggerBase):
    """Prometheus counters ``kvreuse:reorder_*`` (and the gauge ``kvreuse:reorder_max_skips``), per engine."""

    def __init__(self, vllm_config: VllmConfig, engine_indexes: list[int] | None = None) -> None:
        engine_indexes = engine_indexes or [0]
        # A second front end in one process (tests, restarts) must replace, not duplicate, the collectors.
        replace_metrics([name for name, _, _ in REORDER_METRICS.values()])
        labels = ["model_name", "engine"]
        self._metrics: dict[str, Counter | Gauge] = {
            field: (
                Gauge(name, doc, labels, multiprocess_mode="max") if kind == "gauge" else Counter(name, doc, labels)
            )
            for field, (name, kind, doc) in REORDER_METRICS.items()
            if field in _FIELDS
        }
        model = vllm_config.model_config.served_model_name
        self._labels = {idx: (model, str(idx)) for idx in engine_indexes}
        setting_name, _, setting_doc = REORDER_METRICS["setting"]
        setting = Gauge(setting_name, setting_doc, labels)
        bound = ReorderConfig.load(kvreuse_flags(vllm_config.additional_config, "reorder")).max_skips
        for idx in engine_indexes:
            setting.labels(*self._labels[idx]).set(bound)
        self._last = {idx: ReorderCounters() for idx in engine_indexes}
        self._logged = dict(self._last)

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        mm_cache_stats: MultiModalCacheStats | None = None,
        engine_idx: int = 0,
    ) -> None:
        counters = read_reorder_counters(scheduler_stats) if scheduler_stats is not None else None
        if counters is None:
            return
        last = self._last[engine_idx]
        for name in _FIELDS:
            metric = self._metrics[name].labels(*self._labels[engine_idx])
            value = getattr(counters, name)
            if REORDER_METRICS[name][1] == "gauge":
                metric.set(value)
            else:
                # Totals only grow while an engine lives; a smaller one is a restarted engine counting afresh.
                before = getattr(last, name)
                metric.inc(value - before if value >= before else value)
        self._last[engine_idx] = counters

    def log(self) -> None:
        """The scheduler's summary line, per engine whose counters moved since the last one: vLLM calls this with its
        own periodic figures (every ``VLLM_LOG_STATS_INTERVAL`` seconds under ``vllm serve``), in the front end's
        process, whose log is the one a server's user reads; the scheduler's own lines are the engine core's."""
        for idx, counters in self._last.items():
            if counters != self._logged[idx]:
                logger.info("Engine %03d: %s", idx, counters_summary(counters, "blocks"))
                self._logged[idx] = counters

    def log_engine_initialized(self) -> None:
        """Nothing to say at start-up: the scheduler logs its own settings."""
