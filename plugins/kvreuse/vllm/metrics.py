"""kvreuse's one metrics channel in vLLM: every plugin's counters reach vLLM's stat loggers and Prometheus here.

vLLM 0.32 offers two ways from the engine's processes to the front end's stat loggers, and kvreuse uses each where
vLLM gives no other:

* the workers' KV connectors return their counters' increments every step (``get_kv_connector_stats``); vLLM sums
  them across workers and steps (:meth:`KVReuseStats.aggregate`), logs the sum with its other KV-transfer figures
  (``KV Transfer metrics: ...``, :meth:`KVReuseStats.reduce`) and adds it to the Prometheus counters of
  :data:`CONNECTOR_COUNTERS` (:class:`KVReusePromMetrics`). Both of kvreuse's connectors use these classes:
  ``KVReuseModuleCache`` sends the module cache's counters (``kvreuse.vllm.modules.metrics``) and, where the sparse
  backend runs, the sparse figures (``kvreuse.vllm.sparse.metrics``); ``KVReuseSparseFigures`` sends the sparse
  figures alone. Stats keys are ``<name>`` or ``<name>:<label value>``;
* the scheduler's cumulative counters ride in ``SchedulerStats`` to the stat logger
  ``kvreuse.vllm.reorder.metrics.ReorderStatLogger`` (the reorder plugin runs without a connector).

Either way the counters land in the front end's Prometheus registry under the names ``kvreuse:<plugin>_*``: on
``/metrics`` under ``vllm serve``; offline, in the process's ``prometheus_client.REGISTRY`` (``LLM.get_metrics()``
lists only vLLM's own ``vllm:`` metrics). :func:`replace_metrics` drops an earlier engine's in one process.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvreuse.patches import vllm_0_32
from kvreuse.vllm.modules.metrics import MODULE_COUNTERS, STARTUP_KEYS
from kvreuse.vllm.names import ConnectorName
from kvreuse.vllm.sparse.metrics import PREFIX as SPARSE_PREFIX
from kvreuse.vllm.sparse.metrics import SPARSE_COUNTERS, sparse_fractions

# Stats name -> (Prometheus name, documentation, label name or None): the counters kvreuse's connectors carry.
CONNECTOR_COUNTERS: Mapping[str, tuple[str, str, str | None]] = {**MODULE_COUNTERS, **SPARSE_COUNTERS}


def replace_metrics(names: Collection[str]) -> None:
    """Drop the Prometheus collectors of an earlier engine in this process (vLLM does the same for its ``vllm:``
    metrics), so a second engine, e.g. a second ``LLM`` in one script, can register its own under ``names``."""
    vllm_0_32.unregister_collectors(names)


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
        return {**dict(sorted(modules.items())), **sparse_fractions(self.data)}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVReusePromMetrics(KVConnectorPromMetrics):
    """Prometheus counters of :data:`CONNECTOR_COUNTERS`, one child per engine (and per label value, made on first
    use)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        replace_metrics([prom for prom, _, _ in CONNECTOR_COUNTERS.values()])
        counter_cls = vllm_0_32.prometheus_counter_class(self)
        self._counters = {
            name: counter_cls(name=prom, documentation=doc, labelnames=list(labelnames) + ([label] if label else []))
            for name, (prom, doc, label) in CONNECTOR_COUNTERS.items()
        }
        transfer = getattr(vllm_config, "kv_transfer_config", None)
        if transfer is not None and transfer.kv_connector == ConnectorName.MODULE_CACHE:
            for labels in per_engine_labelvalues.values():  # the module counters show at 0 from start-up
                for key in STARTUP_KEYS:
                    name, _, label = key.partition(":")
                    self._counters[name].labels(*labels, *([label] if label else []))  # a child made at 0

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
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVReusePromMetrics:
        return KVReusePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
