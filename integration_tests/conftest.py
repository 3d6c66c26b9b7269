"""Real-engine harness: a locally built model and one ``vllm.LLM`` per test module.

A test module sets ``ENGINE_ARGS = {...}`` (vLLM engine arguments) to start its engine with the flags it needs;
the ``llm`` fixture starts that engine once for the module and shuts it down after the module's last test.
"""

from __future__ import annotations

import atexit
import sys
from pathlib import Path

import pytest
from real_engine import start_llm, stop_llm

from kvreuse.localmodel import build_model

REPO = Path(__file__).resolve().parents[1]


def pytest_unconfigure(config: pytest.Config) -> None:
    """The sparse backend logs its figures at exit (an ``atexit`` hook, as a user's process wants them), through
    vLLM's log handler, which holds the standard stream of the moment vLLM configured its log: pytest's capture,
    closed by then, so every in-process sparse engine's figures would end the run in "--- Logging error ---". The
    tests read the figures themselves; the hook is dropped."""
    backend = sys.modules.get("kvreuse.vllm.sparse.backend")
    if backend is not None:
        atexit.unregister(backend.log_sparse_figures)


@pytest.fixture(scope="session")
def small_model() -> Path:
    """The small random-weight Llama (2 layers, GQA, head_dim 64), built once into build/models/small."""
    return build_model("small", REPO / "build" / "models" / "small")


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    """The real trained model (SmolLM2-135M-Instruct, the ``smollm2`` preset): every test about answers uses it."""
    return build_model("smollm2", REPO / "build" / "models" / "smollm2")


@pytest.fixture(scope="module")
def llm(request, small_model):
    engine = start_llm(small_model, **getattr(request.module, "ENGINE_ARGS", {}))
    yield engine
    stop_llm(engine)
