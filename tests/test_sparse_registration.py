"""Sparse settings that would change nothing are said, not silently dropped: on vLLM's CPU build without
``KVREUSE_SPARSE_CPU_BACKEND=1``, vLLM runs its stock CPU_ATTN and no ``KVREUSE_SPARSE_*`` setting is read."""

from __future__ import annotations

import logging
import os

import pytest


@pytest.fixture
def cpu_attn_untouched():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    overridden = AttentionBackendEnum.CPU_ATTN.is_overridden()
    yield
    if not overridden:
        AttentionBackendEnum.CPU_ATTN.clear_override()


def _warnings(caplog) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "KVREUSE_SPARSE_" in r.getMessage()
    ]


def test_sparse_variables_without_the_switch_are_said_to_be_ignored_with_the_fix(
    monkeypatch, caplog, cpu_attn_untouched
):
    from kvreuse.vllm.registration import _register_sparse_backend

    monkeypatch.delenv("KVREUSE_SPARSE_CPU_BACKEND", raising=False)
    monkeypatch.setenv("KVREUSE_SPARSE_BETA", "4")
    monkeypatch.setenv("KVREUSE_SPARSE_MIN_CONTEXT", "512")
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.kvreuse"):
        _register_sparse_backend()
    (said,) = _warnings(caplog)
    assert "KVREUSE_SPARSE_BETA, KVREUSE_SPARSE_MIN_CONTEXT are set" in said
    assert "set KVREUSE_SPARSE_CPU_BACKEND=1" in said


def test_nothing_is_said_with_the_switch_or_without_sparse_variables(monkeypatch, caplog, cpu_attn_untouched):
    from kvreuse.vllm.registration import _register_sparse_backend

    for name in [n for n in os.environ if n.startswith("KVREUSE_SPARSE_")]:
        monkeypatch.delenv(name)
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.kvreuse"):
        _register_sparse_backend()
        monkeypatch.setenv("KVREUSE_SPARSE_BETA", "4")
        monkeypatch.setenv("KVREUSE_SPARSE_CPU_BACKEND", "1")
        _register_sparse_backend()
    assert _warnings(caplog) == []


@pytest.mark.parametrize(
    ("device", "engine_kernel", "connector", "expected", "knows_key_tiles"),
    [
        ("cpu", True, None, "cpu ops", True),
        ("cuda", True, None, "flash", True),
        ("cuda", True, "KVReuseSparseFigures", "flash", True),
        ("cuda", False, None, "own", True),
        ("cuda", True, "KVReuseModuleCache", "own", True),  # not yet run together on a GPU
        ("cpu", True, "KVReuseModuleCache", "cpu ops", True),  # the module cache reads the op's key tiles
        ("cpu", True, "KVReuseModuleCache", "own", False),  # ... where kvreuse knows how the op packs them
        ("cpu", True, None, "cpu ops", False),  # without the module cache nothing else reads them
        ("cpu", False, "KVReuseModuleCache", "own", True),
    ],
)
def test_the_backend_runs_the_engines_own_kernel_on_each_device_unless_told_or_the_module_cache_needs_its_own(
    device, engine_kernel, connector, expected, knows_key_tiles
):
    from types import SimpleNamespace

    from kvreuse.sparse.config import SparseConfig
    from kvreuse.vllm.sparse.backend import runs_engine_kernel, runs_flash_attention

    vllm_config = SimpleNamespace(
        device_config=SimpleNamespace(device_type=device),
        kv_transfer_config=None if connector is None else SimpleNamespace(kv_connector=connector),
    )
    config = SparseConfig(engine_kernel=engine_kernel)
    cpu_ops = runs_engine_kernel(vllm_config, config, knows_key_tiles)
    flash = runs_flash_attention(vllm_config, config)
    assert {(True, False): "cpu ops", (False, True): "flash", (False, False): "own"}[(cpu_ops, flash)] == expected


@pytest.mark.parametrize(
    ("connector", "parts", "refused"),
    [
        (None, [], None),
        ("KVReuseSparseFigures", [], None),
        ("KVReuseModuleCache", [], None),
        ("MultiConnector", ["KVReuseModuleCache", "KVReuseSparseFigures"], None),  # the figures' connector says more
        ("OffloadingConnector", [], "OffloadingConnector"),
        ("MultiConnector", ["KVReuseModuleCache", "OffloadingConnector"], "OffloadingConnector"),
    ],
)
def test_the_backend_refuses_a_kv_connector_that_would_read_kv_through_vllms_page_view(connector, parts, refused):
    from types import SimpleNamespace

    from kvreuse.errors import ConfigError
    from kvreuse.vllm.sparse.backend import check_kv_connector

    extra = {"connectors": [{"kv_connector": part, "kv_role": "kv_both"} for part in parts]}
    transfer = SimpleNamespace(kv_connector=connector, kv_connector_extra_config=extra)
    vllm_config = SimpleNamespace(kv_transfer_config=None if connector is None else transfer)
    if refused:
        with pytest.raises(ConfigError, match=f"KV connector '{refused}' does not know"):
            check_kv_connector(vllm_config)
    else:
        check_kv_connector(vllm_config)  # kvreuse's own connectors, or none
