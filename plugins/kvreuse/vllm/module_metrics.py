"""The module cache's figures in vLLM's metrics: the per-step stats workers send, their log line and Prometheus.

Each worker sends the change of its counters every step (``ModuleWorker.take_stats``); vLLM sums them across
workers and steps (:meth:`ModuleCacheStats.aggregate`), logs them with its other KV-transfer figures
(``KV Transfer metrics: module_hits=..., tokens_loaded=...``) and, under ``vllm serve``, adds them to the
Prometheus counters below (:class:`ModuleCachePromMetrics`):

* ``kvreuse:module_hits_total`` (label ``tier``), ``kvreuse:module_misses_total``;
* ``kvreuse:module_tokens_loaded_total``, ``kvreuse:module_pieces_loaded_total``,
  ``kvreuse:module_load_failures_total``;
* ``kvreuse:module_encoded_total``, ``kvreuse:module_encode_failures_total``;
* ``kvreuse:module_bytes_moved_total`` (label ``move``, e.g. ``cpu->gpu``), ``kvreuse:module_evictions_total``
  (label ``tier``), ``kvreuse:module_drops_total``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvreuse.modules.store import StoreFigures

PREFIX = "kvreuse:module_"
# Flat counter names -> (Prometheus name, documentation, label name or None). A labelled counter's stats keys are
# "<name>:<label value>".
COUNTERS = {
    "hits": ("hits_total", "Module look-ups answered, by the tier that held the module", "tier"),
    "misses": ("misses_total", "Module look-ups of modules the store did not hold", None),
    "tokens_loaded": ("tokens_loaded_total", "Prompt tokens whose KV was written from cached modules", None),
    "pieces_loaded": ("pieces_loaded_total", "Module pieces written into requests", None),
    "load_failures": ("load_failures_total", "Module pieces that could not be loaded (recomputed)", None),
    "modules_encoded": ("encoded_total", "Modules encoded and stored", None),
    "encode_failures": ("encode_failures_total", "Encoded modules the store refused", None),
    "bytes_moved": ("bytes_moved_total", "Bytes of module KV moved between tiers", "move"),
    "evictions": ("evictions_total", "Modules moved out of a full tier", "tier"),
    "drops": ("drops_total", "Modules that left the store to make room", None),
}


def counter_values(figures: Any, store: StoreFigures) -> dict[str, int]:
    """The worker's and its store's counters as flat stats keys (see :data:`COUNTERS`)."""
    out = {name: value for name, value in asdict(figures).items() if name in COUNTERS}
    out.update(misses=store.misses, drops=store.drops)
    for name in ("hits", "bytes_moved", "evictions"):
        for label, value in getattr(store, name).items():
            out[f"{name}:{label}"] = value
    return out


@dataclass
class ModuleCacheStats(KVConnectorStats):
    """Counter increments (``data``: stats key -> count) since the last time vLLM collected them."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "ModuleCacheStats":
        merged = dict(self.data)
        for key, value in other.data.items():
            merged[key] = merged.get(key, 0) + value
        return ModuleCacheStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        return dict(sorted(self.data.items()))

    def is_empty(self) -> bool:
        return not any(self.data.values())


def _unregister_previous() -> None:
    """Drop the counters of an earlier engine in this process (vLLM does the same for its ``vllm:`` metrics),
    so a second engine, e.g. a second ``LLM`` in one script, can register its own."""
    from prometheus_client import REGISTRY

    for collector in list(REGISTRY._collector_to_names):
        if getattr(collector, "_name", "").startswith(PREFIX):
            REGISTRY.unregister(collector)


class ModuleCachePromMetrics(KVConnectorPromMetrics):
    """Prometheus counters of :data:`COUNTERS`, one child per engine (and per label value, made on first use)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _unregister_previous()
        self._counters = {
            name: self._counter_cls(name=PREFIX + prom, documentation=doc,
                                    labelnames=list(labelnames) + ([label] if label else []))
            for name, (prom, doc, label) in COUNTERS.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = list(self.per_engine_labelvalues.get(engine_idx, []))
        for key, value in transfer_stats_data.items():
            name, _, label = key.partition(":")
            counter = self._counters.get(name)
            if counter is None or not value:
                continue
            counter.labels(*labels, *([label] if label else [])).inc(value)
