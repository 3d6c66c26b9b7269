"""Table jobs: one LLM answer per row, asked in the order that shares the most prompt prefix.

Front ends: :func:`llm_map` / :func:`run_table` (pandas), :func:`llm_sql` / :func:`run_query` (DuckDB's
``llm(instruction, value, ...)``) and ``kvreuse run`` (:mod:`kvreuse.cli`). Each plans with
:mod:`kvreuse.reorder` and sends the prompts, in that order, to a :class:`Backend`: the in-process
``vllm.LLM`` (:class:`kvreuse.vllm.backend.VLLMBackend`) or an OpenAI-compatible server
(:class:`OpenAIServerBackend`).
"""

from __future__ import annotations

from typing import Any

from kvreuse.batch.backend import MAX_TOKENS, Backend, Completion, PrefixCacheModel
from kvreuse.batch.dataframe import TableAnswers, llm_map, run_table
from kvreuse.batch.job import BatchFigures, PlannedTable, plan_table, run_plans
from kvreuse.errors import BackendError

__all__ = [
    "MAX_TOKENS",
    "Backend",
    "BackendError",
    "BatchFigures",
    "Completion",
    "OpenAIServerBackend",
    "PlannedTable",
    "PrefixCacheModel",
    "QueryAnswers",
    "TableAnswers",
    "llm_map",
    "llm_sql",
    "plan_table",
    "run_plans",
    "run_query",
    "run_table",
]

# Names whose modules need an optional dependency (httpx, duckdb): imported when first used.
_LAZY = {
    "OpenAIServerBackend": "kvreuse.batch.openai_server",
    "QueryAnswers": "kvreuse.batch.sql",
    "llm_sql": "kvreuse.batch.sql",
    "run_query": "kvreuse.batch.sql",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
