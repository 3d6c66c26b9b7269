"""kvreuse's figures in vLLM's metrics, through the per-step stats of its KV connectors.

vLLM 0.32 has one channel from its workers to the front end's stat loggers: a KV connector's stats. Each worker's
connector returns the change of its counters every step (``get_kv_connector_stats``); vLLM sums them across
workers and steps (:meth:`KVReuseStats.aggregate`), logs the sum with its other KV-transfer figures
(``KV Transfer metrics: ...``, :meth:`KVReuseStats.reduce`) and adds it to the Prometheus counters of
:data:`COUNTERS` (:class:`KVReusePromMetrics`): on ``/metrics`` under ``vllm serve``; offline, in the
process's ``prometheus_client.REGISTRY`` (``LLM.get_metrics()`` lists only vLLM's own ``vllm:`` metrics).

Both of kvreuse's connectors use these classes. ``KVReuseModuleCache`` sends the module cache's counters
(``kvreuse.vllm.module_metrics``) and, where the sparse backend runs, the sparse figures
(``kvreuse.vllm.sparse_metrics``); ``KVReuseSparseFigures`` sends the sparse figures alone. Stats keys are
``<name>`` or ``<name>:<label value>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvreuse.vllm.module_metrics import MODULE_COUNTERS
from kvreuse.vllm.sparse_metrics import PREFIX as SPARSE_PREFIX
from kvreuse.vllm.sparse_metrics import SPARSE_COUNTERS, summarise

COUNTERS = {**MODULE_COUNTERS, **SPARSE_COUNTERS}


@dataclass
class KVReuseStats(KVConnectorStats):
    """Counter increments (``data``: stats key -> amount) since the last time vLLM collected them."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVReuseStats:
        merged = dict(self.data)
        for key, value in other.data.items():
            merged[key] = merged.get(key, 0) + value
        return KVReuseStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        """The module counters as they are, the sparse figures as fractions over all layers (one log line)."""
        modules = {key: value for key, value in self.data.items() if not key.startswith(SPARSE_PREFIX)}
        return {**dict(sorted(modules.items())), **summarise(self.data)}

    def is_empty(self) -> bool:
        return not any(self.data.values())


def _unregister_previous() -> None:
    """Drop the counters of an earlier engine in this process (vLLM does the same for its ``vllm:`` metrics),
    so a second engine, e.g. a second ``LLM`` in one script, can register its own."""
    from prometheus_client import REGISTRY

    names = {prom for prom, _, _ in COUNTERS.values()}
    for collector in list(REGISTRY._collector_to_names):
        if f"{getattr(collector, '_name', '')}_total" in names:
            REGISTRY.unregister(collector)


class KVReusePromMetrics(KVConnectorPromMetrics):
    """Prometheus counters of :data:`COUNTERS`, one child per engine (and per label value, made on first use)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _unregister_previous()
        self._counters = {
            name: self._counter_cls(
                name=prom, documentation=doc, labelnames=list(labelnames) + ([label] if label else [])
            )
            for name, (prom, doc, label) in COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = list(self.per_engine_labelvalues.get(engine_idx, []))
        for key, value in transfer_stats_data.items():
            name, _, label = key.partition(":")
            counter = self._counters.get(name)
            if counter is None or not value:
                continue
            counter.labels(*labels, *([label] if label else [])).inc(value)


class KVReuseMetrics:
    """The metrics half of a kvreuse connector: vLLM asks the connector class for its stats class and its Prometheus
    metrics (in the front end, where the stats arrive)."""

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVReuseStats:
        return KVReuseStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> KVReusePromMetrics:
        return KVReusePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
