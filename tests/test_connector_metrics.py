"""kvreuse's figures on their way into vLLM's metrics through its connectors' stats: the module cache's counters,
the sparse backend's per-layer figures (read from the device without waiting), their log line and Prometheus."""

from __future__ import annotations

import functools

import pytest
import torch

from kvreuse.kernels.dipr_decode import DIPRCounters
from kvreuse.modules.store import StoreFigures
from kvreuse.sparse import figures as figures_module
from kvreuse.sparse.figures import FIGURES, AttendedFractions, FigureIncrements
from kvreuse.vllm.metrics import KVReusePromMetrics, KVReuseStats
from kvreuse.vllm.modules.metrics import module_counter_values
from kvreuse.vllm.modules.worker import ModuleFigures
from kvreuse.vllm.sparse.metrics import PREFIX, SPARSE_COUNTERS, sparse_fractions


def _step(blocks_read: int, blocks_total: int, tokens: int = 10, context: int = 40) -> DIPRCounters:
    """Counters of one decode of one sequence, 1 KV head, 2 query heads."""
    return DIPRCounters(
        blocks_read=torch.tensor([[blocks_read]]),
        blocks_total=torch.tensor([blocks_total]),
        tokens_attended=torch.tensor([[tokens, tokens]]),
        tokens_total=torch.tensor([context]),
    )


def test_module_stats_flatten_the_counters_and_sum_across_steps_and_workers():
    store = StoreFigures()
    store.hits["gpu"] += 3
    store.bytes_moved["cpu->gpu"] += 4096
    store.evictions["gpu"] += 1
    store.misses = 2
    values = module_counter_values(ModuleFigures(tokens_loaded=100, pieces_loaded=2), store)
    assert values["tokens_loaded"] == 100 and values["hits:gpu"] == 3 and values["bytes_moved:cpu->gpu"] == 4096
    assert values["evictions:gpu"] == 1 and values["misses"] == 2
    total = KVReuseStats(data={"tokens_loaded": 5}).aggregate(KVReuseStats(data={"tokens_loaded": 7, "hits:cpu": 1}))
    assert total.reduce() == {"hits:cpu": 1, "tokens_loaded": 12}
    assert KVReuseStats(data={"misses": 0}).is_empty() and not total.is_empty()


def test_each_sparse_figure_has_one_prometheus_counter_per_layer_in_vllms_namespace():
    sent = {PREFIX + ("recovery_kept_ppm" if name == "recovery_kept" else name) for name in FIGURES}
    assert set(SPARSE_COUNTERS) == sent
    assert all(
        label == "layer" and prom.startswith("vllm:kvreuse_sparse_") and prom.endswith("_total")
        for prom, _, label in SPARSE_COUNTERS.values()
    )


def test_increments_are_what_grew_since_the_last_call_and_restart_with_new_figures():
    figures, increments = AttendedFractions(), FigureIncrements()
    assert increments.take(figures) == {}
    figures.add(3, _step(2, 8))
    figures.add(3, _step(1, 8))
    figures.add_recovery(3, torch.tensor([0.5, 1.0]))
    assert increments.take(figures) == {
        ("blocks_read", 3): 3,
        ("blocks_total", 3): 16,
        ("tokens_attended", 3): 40,
        ("tokens_total", 3): 160,
        ("dipr_decodes", 3): 2,
        ("recovery_kept", 3): 1.5,
        ("recovery_samples", 3): 2,
    }
    figures.add(3, _step(4, 8))
    figures.add(0, _step(1, 1))
    assert increments.take(figures) == {
        ("blocks_read", 3): 4,
        ("blocks_total", 3): 8,
        ("tokens_attended", 3): 20,
        ("tokens_total", 3): 80,
        ("dipr_decodes", 3): 1,
        ("blocks_read", 0): 1,
        ("blocks_total", 0): 1,
        ("tokens_attended", 0): 20,
        ("tokens_total", 0): 80,
        ("dipr_decodes", 0): 1,
    }
    assert increments.take(figures) == {}
    fresh = AttendedFractions()  # the figures were reset: counting starts again from zero
    fresh.add(3, _step(1, 2))
    assert increments.take(fresh)[("blocks_read", 3)] == 1


def test_dense_decodes_count_as_reading_everything_next_to_the_device_sums_that_lag(monkeypatch):
    landed = {"now": False}
    monkeypatch.setattr(figures_module._HostCopy, "done", lambda self: landed["now"])
    figures, increments = AttendedFractions(), FigureIncrements()
    figures.add(2, _step(1, 4))
    figures.add_dense(2, blocks=6, tokens=90, decodes=3)
    assert increments.take(figures) == {
        ("blocks_read", 2): 6,
        ("blocks_total", 2): 6,
        ("tokens_attended", 2): 90,
        ("tokens_total", 2): 90,
        ("dipr_decodes", 2): 1,  # counted on the host: no device wait
        ("dense_decodes", 2): 3,
    }
    landed["now"] = True
    assert increments.take(figures) == {
        ("blocks_read", 2): 1,
        ("blocks_total", 2): 4,
        ("tokens_attended", 2): 20,
        ("tokens_total", 2): 80,
    }
    assert figures.rows()[0]["block_fraction"] == pytest.approx(7 / 10)


def test_decodes_counted_on_the_host_are_reported_at_once_beside_device_sums_that_lag(monkeypatch):
    """A CPU engine's DIPR decodes (``add_read``: the pruned tables are host arrays) need no copy to land."""
    monkeypatch.setattr(figures_module._HostCopy, "done", lambda self: False)
    figures, increments = AttendedFractions(), FigureIncrements()
    figures.add(4, _step(1, 4))
    figures.add_read(4, blocks_read=5, blocks_total=12, tokens_attended=150, tokens_total=360, decodes=2)
    figures.add_full(4, blocks=3, tokens=90, decodes=1)
    assert increments.take(figures) == {
        ("blocks_read", 4): 8,
        ("blocks_total", 4): 15,
        ("tokens_attended", 4): 240,
        ("tokens_total", 4): 450,
        ("dipr_decodes", 4): 4,
    }
    (row,) = figures.rows()  # the rows read the device sums too
    assert row["blocks_read"] == 9 and row["blocks_total"] == 19 and row["dipr_decodes"] == 4


def test_increments_wait_for_copies_still_in_flight_and_lose_nothing(monkeypatch):
    """As on a GPU: a copy that has not landed is not read; the next call reports what it and later ones carry."""
    landed = {"now": False}
    monkeypatch.setattr(figures_module._HostCopy, "done", lambda self: landed["now"])
    figures, increments = AttendedFractions(), FigureIncrements()
    figures.add(1, _step(2, 4))
    assert increments.take(figures) == {("dipr_decodes", 1): 1}  # counted on the host, current
    figures.add(1, _step(3, 4))
    assert increments.take(figures) == {("dipr_decodes", 1): 1}
    for _ in range(FigureIncrements.MAX_IN_FLIGHT + 2):  # a device far behind: at most MAX_IN_FLIGHT copies queue
        assert increments.take(figures) == {}
    landed["now"] = True
    got = increments.take(figures)
    assert got[("blocks_read", 1)] == 5 and got[("blocks_total", 1)] == 8


def test_stats_sum_sparse_figures_over_workers_and_log_them_as_fractions_over_layers():
    one = KVReuseStats(
        data={
            f"{PREFIX}blocks_read:0": 2,
            f"{PREFIX}blocks_total:0": 10,
            f"{PREFIX}blocks_read:1": 3,
            f"{PREFIX}blocks_total:1": 10,
            "tokens_loaded": 4,
        }
    )
    two = KVReuseStats(
        data={
            f"{PREFIX}blocks_read:0": 5,
            f"{PREFIX}blocks_total:0": 20,
            f"{PREFIX}recovery_kept_ppm:1": 1_800_000,
            f"{PREFIX}recovery_samples:1": 2,
            f"{PREFIX}dipr_decodes:1": 30,
            f"{PREFIX}dense_decodes:0": 30,
        }
    )
    both = one.aggregate(two)
    assert both.data[f"{PREFIX}blocks_read:0"] == 7
    assert both.reduce() == {
        "tokens_loaded": 4,
        "sparse_block_fraction": 0.25,
        "sparse_recovery": 0.9,
        "sparse_dipr_decodes": 30,
        "sparse_dense_decodes": 30,
    }
    assert sparse_fractions({}) == {}


def test_prometheus_counters_take_the_stats_with_their_labels():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.config import VllmConfig

    registry = CollectorRegistry()
    types = {kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    metrics = KVReusePromMetrics(VllmConfig(), types, ["engine"], {0: ["0"]})
    metrics.observe(
        {
            "tokens_loaded": 64,
            "bytes_moved:cpu->gpu": 4096,
            "hits:gpu": 2,
            "unknown": 1,
            f"{PREFIX}blocks_read:1": 3,
            f"{PREFIX}recovery_kept_ppm:1": 750_000,
            "splice_skipped:token_boundary": 2,
        },
        0,
    )
    metrics.observe({"tokens_loaded": 36, f"{PREFIX}blocks_read:1": 2}, 0)
    get = registry.get_sample_value
    assert get("kvreuse:module_tokens_loaded_total", {"engine": "0"}) == 100
    assert get("kvreuse:module_bytes_moved_total", {"engine": "0", "move": "cpu->gpu"}) == 4096
    assert get("kvreuse:module_hits_total", {"engine": "0", "tier": "gpu"}) == 2
    assert get("vllm:kvreuse_sparse_blocks_read_total", {"engine": "0", "layer": "1"}) == 5
    assert get("vllm:kvreuse_sparse_recovery_kept_ppm_total", {"engine": "0", "layer": "1"}) == 750_000
    assert get("kvreuse:module_splice_skipped_total", {"engine": "0", "reason": "token_boundary"}) == 2


def test_sparse_counters_are_listed_by_vllms_metrics_snapshot_the_reader_of_llm_get_metrics():
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram
    from vllm.config import VllmConfig
    from vllm.v1.metrics.reader import get_metrics_snapshot

    metrics = KVReusePromMetrics(
        VllmConfig(), {Counter: Counter, Gauge: Gauge, Histogram: Histogram}, ["engine"], {0: ["0"]}
    )
    try:
        metrics.observe({f"{PREFIX}blocks_read:4": 3, f"{PREFIX}blocks_total:4": 12, f"{PREFIX}dense_decodes:0": 2}, 0)
        listed = {(m.name, m.labels.get("layer")): m.value for m in get_metrics_snapshot() if "kvreuse" in m.name}
        assert listed[("vllm:kvreuse_sparse_blocks_read", "4")] == 3
        assert listed[("vllm:kvreuse_sparse_blocks", "4")] == 12
        assert listed[("vllm:kvreuse_sparse_dense_decodes", "0")] == 2
    finally:
        for counter in metrics._counters.values():
            REGISTRY.unregister(counter)


def _figures_connector(role):
    from vllm.config import KVTransferConfig, VllmConfig

    from kvreuse.vllm import register
    from kvreuse.vllm.sparse.connector import KVReuseSparseFigures

    register()  # names the connector for vLLM's config check, as vLLM's plugin loader does
    config = VllmConfig(kv_transfer_config=KVTransferConfig(kv_connector="KVReuseSparseFigures", kv_role="kv_both"))
    return KVReuseSparseFigures(config, role, None)


def test_figures_connector_moves_no_kv_and_refuses_workers_whose_figures_would_be_missing_or_doubled(monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvreuse.errors import ConfigError
    from kvreuse.vllm.runtime import runtime

    scheduler = _figures_connector(KVConnectorRole.SCHEDULER)
    assert scheduler.get_num_new_matched_tokens(None, 0) == (0, False)
    assert scheduler.get_kv_connector_stats() is None
    worker = _figures_connector(KVConnectorRole.WORKER)
    monkeypatch.setattr(runtime(), "sparse_attention", None)
    with pytest.raises(ConfigError, match="--attention-backend CUSTOM .* KVREUSE_SPARSE_CPU_BACKEND=1"):
        worker.register_kv_caches({})
    assert worker.get_kv_connector_stats() is None
    monkeypatch.setattr(runtime(), "sparse_attention", object())
    monkeypatch.setattr(runtime(), "module_worker", object())
    with pytest.raises(ConfigError, match="KVReuseModuleCache already reports the sparse figures"):
        worker.register_kv_caches({})


def test_the_module_counters_show_at_0_from_start_up():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.config import KVTransferConfig, VllmConfig

    from kvreuse.vllm import register

    register()  # names the connector for vLLM's config check, as vLLM's plugin loader does
    config = VllmConfig(kv_transfer_config=KVTransferConfig(kv_connector="KVReuseModuleCache", kv_role="kv_both"))
    registry = CollectorRegistry()
    types = {kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    KVReusePromMetrics(config, types, ["engine"], {0: ["0"]})
    get = registry.get_sample_value
    assert get("kvreuse:module_tokens_loaded_total", {"engine": "0"}) == 0
    assert get("kvreuse:module_misses_total", {"engine": "0"}) == 0
    assert get("kvreuse:module_splice_skipped_total", {"engine": "0", "reason": "not_stored"}) == 0
    other = CollectorRegistry()  # another connector's engine (the sparse figures alone): no module counter shows
    types = {kind: functools.partial(kind, registry=other) for kind in (Counter, Gauge, Histogram)}
    KVReusePromMetrics(VllmConfig(), types, ["engine"], {0: ["0"]})
    assert other.get_sample_value("kvreuse:module_tokens_loaded_total", {"engine": "0"}) is None
