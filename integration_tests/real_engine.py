"""Start and stop a real ``vllm.LLM`` on a local model, with the harness's engine arguments.

Kept out of ``conftest.py`` so tests can import it by a name that no other test folder's module shadows.
"""

from __future__ import annotations

from pathlib import Path

from kvreuse.localmodel import local_engine_args


def start_llm(model: Path, **overrides):
    from vllm import LLM

    return LLM(**local_engine_args(model, **overrides))


def stop_llm(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
