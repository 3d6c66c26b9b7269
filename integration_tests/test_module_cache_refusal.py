"""The module cache refuses vLLM's CPU_ATTN backend at start, naming the fix (its own module: the engine of
``test_module_cache.py`` runs with kvreuse's backend in CPU_ATTN's place, which a worker forked from it would keep)."""

from __future__ import annotations

import pytest
from real_engine import start_llm, stop_llm

pytestmark = pytest.mark.engine


def test_the_connector_refuses_cpu_attn_and_names_the_switch_that_fixes_it(small_model, capfd):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    assert not AttentionBackendEnum.CPU_ATTN.is_overridden()
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("KVREUSE_SPARSE_CPU_BACKEND", raising=False)
        with pytest.raises(Exception) as failure:
            llm = start_llm(
                small_model,
                kv_transfer_config={
                    "kv_connector": "KVReuseModuleCache",
                    "kv_role": "kv_both",
                    "kv_load_failure_policy": "recompute",
                },
            )
            stop_llm(llm)
    logs = capfd.readouterr()
    message = str(failure.value) + logs.out + logs.err
    assert "KVReuseModuleCache cannot use attention backend CPU_ATTN" in message
    assert "set KVREUSE_SPARSE_CPU_BACKEND=1" in message


def test_the_connector_refuses_the_fail_policy_that_would_not_recompute(small_model, capfd):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVREUSE_SPARSE_CPU_BACKEND", "1")  # past the layout check, to the scheduler's
        try:
            with pytest.raises(Exception) as failure:
                llm = start_llm(
                    small_model, kv_transfer_config={"kv_connector": "KVReuseModuleCache", "kv_role": "kv_both"}
                )
                stop_llm(llm)
        finally:
            AttentionBackendEnum.CPU_ATTN.clear_override()
    logs = capfd.readouterr()
    assert 'needs "kv_load_failure_policy": "recompute"' in str(failure.value) + logs.out + logs.err
