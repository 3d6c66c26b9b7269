"""The pandas front end: one LLM answer per row of a DataFrame, asked in a prefix-sharing order."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import pandas as pd

from kvreuse.batch.backend import MAX_TOKENS, Backend, Completion
from kvreuse.batch.job import BatchFigures, plan_table, run_plans
from kvreuse.reorder import ReorderConfig


@dataclass(frozen=True)
class TableAnswers:
    """The answers of a table job, aligned with the input table.

    ``answers`` has the input's index (labels and order); ``completions[i]`` belongs to the input's ``i``-th row.
    """

    answers: pd.Series
    completions: list[Completion]
    figures: BatchFigures


def run_table(
    df: pd.DataFrame,
    instruction: str,
    fields: Sequence[str] | None = None,
    *,
    backend: Backend,
    order: str = "ggr",
    fmt: str = "lines",
    max_tokens: int = MAX_TOKENS,
    pin: Sequence[str] | None = None,
    fds: Mapping[str, Iterable[str]] | None = None,
    config: ReorderConfig | None = None,
    progress: bool = False,
) -> TableAnswers:
    """Ask ``instruction`` about every row of ``df``, showing the model the columns ``fields`` (default: all).

    Each prompt is the instruction followed by one ``field: value`` line per field (``fmt="json"``: one JSON
    object). Rows are sent in the order ``order`` chooses (``"ggr"``, ``"original"``, ``"sorted"``, ``"stats"``,
    ``"ophr"``), and each row may list its fields in its own order; answers are greedy, so they do not depend on
    that order beyond the prompt itself. Every row is asked, duplicates included, and no row is dropped.
    ``pin`` names fields that lead every prompt, in that order (``pin=["name"]``); pinning every field keeps each
    prompt exactly as the table's field order writes it and reorders rows only.
    """
    plan = plan_table(
        df,
        instruction,
        fields,
        order=order,
        fmt=fmt,
        pin=pin,
        fds=fds,
        config=config,
        cache_model=backend.cache_model,
    )
    (completions,), figures = run_plans([plan], backend, max_tokens=max_tokens, progress=progress)
    # Positional: labels may repeat, and the answers belong to positions.
    answers = pd.Series([c.text for c in completions], index=df.index, dtype=object, name="answer")
    return TableAnswers(answers, completions, figures)


def llm_map(
    df: pd.DataFrame,
    instruction: str,
    fields: Sequence[str] | None = None,
    *,
    backend: Backend,
    order: str = "ggr",
    fmt: str = "lines",
    max_tokens: int = MAX_TOKENS,
    pin: Sequence[str] | None = None,
    fds: Mapping[str, Iterable[str]] | None = None,
    config: ReorderConfig | None = None,
    progress: bool = False,
) -> pd.Series:
    """The answers of :func:`run_table` alone: a Series of ``str`` with ``df``'s index, one answer per row.

    ``df["kids"] = llm_map(df, "Is this movie suitable for kids?", ["movie_title", "movie_info"], backend=b)``
    """
    return run_table(
        df,
        instruction,
        fields,
        backend=backend,
        order=order,
        fmt=fmt,
        max_tokens=max_tokens,
        pin=pin,
        fds=fds,
        config=config,
        progress=progress,
    ).answers
