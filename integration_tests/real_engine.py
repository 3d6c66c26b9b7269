"""Start and stop a real ``vllm.LLM`` on a local model, with the harness's engine arguments.

Kept out of ``conftest.py`` so tests can import it by a name that no other test folder's module shadows.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest

from kvreuse.localmodel import local_engine_args

MODULE_CONNECTOR = {"kv_connector": "KVReuseModuleCache", "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


def start_llm(model: Path, **overrides):
    from vllm import LLM

    return LLM(**local_engine_args(model, **overrides))


def stop_llm(llm) -> None:
    from kvreuse.patches import vllm_0_32

    vllm_0_32.shutdown_llm(llm)


@contextmanager
def module_cache_llm(model: Path, cpu_bytes: int, *, recompute_first: int | None = None):
    """An in-process engine with the module connector on vLLM's CPU build (kvreuse's backend in CPU_ATTN's place,
    dense), stopped after; later engines in the process get the stock CPU_ATTN again. ``recompute_first``:
    ``modules.recompute_first`` of the engine (``None``: the setting's default; 0: the plain splice)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    overridden = AttentionBackendEnum.CPU_ATTN.is_overridden()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVREUSE_SPARSE_CPU_BACKEND", "1")
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        modules = {"gpu_bytes": 0, "cpu_bytes": cpu_bytes}
        if recompute_first is not None:
            modules["recompute_first"] = recompute_first
        engine = start_llm(
            model,
            kv_transfer_config=MODULE_CONNECTOR,
            additional_config={"kvreuse": {"sparse": {"beta": float("inf")}, "modules": modules}},
        )
        try:
            yield engine
        finally:
            stop_llm(engine)
            if not overridden:
                AttentionBackendEnum.CPU_ATTN.clear_override()
