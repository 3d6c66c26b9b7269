"""The pandas front end: one LLM answer per row of a DataFrame, asked in a prefix-sharing order.

A row the engine refuses (a prompt longer than its context) gets no answer (``None``) and its error, and the other
rows are asked as usual; an engine that stops answering raises ``BackendError``. With ``out``, each row is also
written to a file as soon as it is answered (:class:`kvreuse.batch.output.AnswerOutput`), so an interrupted job
keeps its rows, and ``resume=True`` asks only the rows that file does not hold yet.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from kvreuse.batch.backend import MAX_TOKENS, Backend, Completion
from kvreuse.batch.calibrate import Calibration
from kvreuse.batch.calibrate import calibrate as calibrate_field_order
from kvreuse.batch.job import BatchFigures, answer_plans, plan_table
from kvreuse.batch.output import AnswerOutput
from kvreuse.batch.progress import JobProgress
from kvreuse.errors import ConfigError
from kvreuse.reorder import ReorderConfig

logger = logging.getLogger("kvreuse.batch")


@dataclass(frozen=True)
class TableAnswers:
    """The answers of a table job, aligned with the input table.

    ``answers`` has the input's index (labels and order), ``None`` where the engine refused the row; ``errors``
    likewise says why (``None`` where answered); ``completions[i]`` belongs to the input's ``i``-th row (``None``
    for a row answered by an earlier run, when resumed from ``out``). ``calibration`` holds the candidates and
    the field order chosen when the job was calibrated (``calibrate=N``).
    """

    answers: pd.Series
    completions: list[Completion | None]
    figures: BatchFigures
    errors: pd.Series | None = None
    calibration: Calibration | None = None


def run_table(
    df: pd.DataFrame,
    instruction: str,
    fields: Sequence[str] | None = None,
    *,
    backend: Backend,
    order: str = "ggr",
    field_order: str = "keep",
    fmt: str = "lines",
    max_tokens: int = MAX_TOKENS,
    pin: Sequence[str] | None = None,
    fds: Mapping[str, Iterable[str]] | None = None,
    config: ReorderConfig | None = None,
    progress: bool = False,
    out: str | os.PathLike | None = None,
    resume: bool = False,
    calibrate: int | None = None,
    min_agreement: float = 1.0,
) -> TableAnswers:
    """Ask ``instruction`` about every row of ``df``, showing the model the columns ``fields`` (default: all).

    Each prompt is the instruction followed by one ``field: value`` line per field (``fmt="json"``: one JSON
    object). Rows are sent in the order ``order`` chooses (``"ggr"``, ``"original"``, ``"sorted"``, ``"stats"``,
    ``"ophr"``). ``field_order`` says whether each prompt keeps the fields in ``fields``' order (``"keep"``, the
    default: only rows move, so every answer is the one the original order gets), lists them in one order chosen
    for reuse (``"global"``) or in each row's own (``"free"``, GGR's per-row orders: most reuse, but a field's
    place can change a small model's answer). Every row is asked, duplicates included, and no row is dropped.
    ``pin`` names fields that lead every prompt, in that order (``pin=["name"]``); pinning every field keeps each
    prompt exactly as the table's field order writes it and reorders rows only.
    ``config`` defaults to the backend's (an in-process vLLM's ``additional_config``) or else the
    ``KVREUSE_REORDER_*`` settings. ``out`` (``.csv``, ``.jsonl``, ``.parquet``) gets
    each row as it is answered; ``resume`` keeps the rows it holds and asks the others.
    ``calibrate=N`` chooses ``field_order`` instead: ``N`` sample rows are asked in every field order and the one
    with the most reuse whose answers agree with the user's order on at least ``min_agreement`` of them (1.0:
    all) is used (:mod:`kvreuse.batch.calibrate`; ``TableAnswers.calibration`` has the figures).
    """
    config = config if config is not None else getattr(backend, "reorder_config", None)
    calibration = None
    if calibrate is not None:
        if field_order != "keep":
            raise ConfigError("give either field_order or calibrate (which chooses the field order)")
        calibration = calibrate_field_order(
            df,
            instruction,
            fields,
            backend=backend,
            n=calibrate,
            min_agreement=min_agreement,
            order=order,
            fmt=fmt,
            max_tokens=max_tokens,
            pin=pin,
            fds=fds,
            config=config,
        )
        field_order = calibration.chosen
    plan = plan_table(
        df,
        instruction,
        fields,
        order=order,
        field_order=field_order,
        fmt=fmt,
        pin=pin,
        fds=fds,
        config=config,
        cache_model=backend.cache_model,
    )
    completions: list[Completion | None] = [None] * len(df)
    texts: list[str | None] = [None] * len(df)
    errors: list[str | None] = [None] * len(df)
    output = None if out is None else AnswerOutput(Path(out), df, resume=resume)
    for row, (answer, error) in (output.done if output is not None else {}).items():
        texts[row], errors[row] = (None, error) if error else (answer, None)
    start = time.perf_counter()
    try:
        skip = {(0, row) for row in (output.done if output is not None else ())}
        with JobProgress(len(df), done=len(skip), enabled=progress) as bar:
            for _, row, completion in answer_plans([plan], backend, max_tokens=max_tokens, skip=skip):
                completions[row] = completion
                texts[row], errors[row] = (None, completion.error) if completion.error else (completion.text, None)
                if output is not None:
                    output.write(row, completion.text, completion.error)
                bar.add(completion)
    finally:
        if output is not None:
            output.close(complete=len(output.done) == len(df))
    figures = BatchFigures.of(bar.tally, plan.solve_s, time.perf_counter() - start)
    if figures.errors:
        first = next(e for e in errors if e)
        logger.warning("kvreuse: the engine refused %d of %d rows; e.g. %s", figures.errors, len(df), first)
    # Positional: labels may repeat, and the answers belong to positions.
    answers = pd.Series(texts, index=df.index, dtype=object, name="answer")
    errors_by_row = pd.Series(errors, index=df.index, dtype=object, name="error")
    return TableAnswers(answers, completions, figures, errors_by_row, calibration)


def llm_map(
    df: pd.DataFrame,
    instruction: str,
    fields: Sequence[str] | None = None,
    *,
    backend: Backend,
    order: str = "ggr",
    field_order: str = "keep",
    fmt: str = "lines",
    max_tokens: int = MAX_TOKENS,
    pin: Sequence[str] | None = None,
    fds: Mapping[str, Iterable[str]] | None = None,
    config: ReorderConfig | None = None,
    progress: bool = False,
    out: str | os.PathLike | None = None,
    resume: bool = False,
    calibrate: int | None = None,
    min_agreement: float = 1.0,
) -> pd.Series:
    """The answers of :func:`run_table` alone: a Series of ``str`` with ``df``'s index, one answer per row
    (``None`` for a row the engine refused; the log says why).

    ``df["kids"] = llm_map(df, "Is this movie suitable for kids?", ["movie_title", "movie_info"], backend=b)``
    """
    return run_table(
        df,
        instruction,
        fields,
        backend=backend,
        order=order,
        field_order=field_order,
        fmt=fmt,
        max_tokens=max_tokens,
        pin=pin,
        fds=fds,
        config=config,
        progress=progress,
        out=out,
        resume=resume,
        calibrate=calibrate,
        min_agreement=min_agreement,
    ).answers
