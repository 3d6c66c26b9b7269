"""Tables as streams of ``(row_id, prompt)`` for the multi-replica job, read chunk by chunk.

A source is read in chunks of at most ``rows_per_chunk`` rows, so a table larger than memory streams through
the bucketing and the replicas: a ``.csv`` or ``.parquet`` path, a DuckDB relation (``con.sql(...)``), a Ray
Dataset, a pandas DataFrame, or any iterable of DataFrames. Each row's prompt is rendered as everywhere in
kvreuse (:func:`kvreuse.reorder.render_prompt`: the instruction, then one ``field: value`` line per field,
NULL as the empty value); its row id is its position in the source, counted from 0, or the value of an
``id_column`` (give one for a Ray Dataset, whose rows arrive in execution order unless Ray Data is told to
preserve order).

For a DataFrame that fits in memory, :func:`run_table_on_replicas` also reorders fields per row with GGR first.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from kvreuse.batch.backend import MAX_TOKENS, Completion
from kvreuse.batch.distributed import JobFigures, ReplicaPool, answer_stream, new_figures
from kvreuse.batch.job import plan_table
from kvreuse.batch.output import AnswerOutput
from kvreuse.batch.table_io import csv_chunks
from kvreuse.errors import TableError
from kvreuse.reorder import prepare_table, render_prompt


def table_chunks(source: Any, rows_per_chunk: int = 4096) -> Iterator[pd.DataFrame]:
    """``source`` as DataFrames of at most ``rows_per_chunk`` rows, in the source's row order."""
    if isinstance(source, (str, os.PathLike)):
        yield from _file_chunks(Path(source), rows_per_chunk)
    elif isinstance(source, pd.DataFrame):
        for start in range(0, len(source), rows_per_chunk):
            yield source.iloc[start : start + rows_per_chunk]
    elif hasattr(source, "to_arrow_reader"):  # a DuckDB relation
        for batch in source.to_arrow_reader(rows_per_chunk):
            yield batch.to_pandas()
    elif hasattr(source, "iter_batches") and hasattr(source, "schema"):  # a Ray Dataset
        yield from source.iter_batches(batch_size=rows_per_chunk, batch_format="pandas")
    elif isinstance(source, Iterable):
        yield from source
    else:
        raise TableError(
            f"cannot read rows from a {type(source).__name__}; give a .csv/.parquet path, a DuckDB "
            "relation, a Ray Dataset, a DataFrame or an iterable of DataFrames"
        )


def _file_chunks(path: Path, rows_per_chunk: int) -> Iterator[pd.DataFrame]:
    if not path.is_file():
        raise TableError(f"table file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".csv":
        yield from csv_chunks(path, rows_per_chunk)  # one dialect, header and field counts checked per line
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=rows_per_chunk):
            yield batch.to_pandas()
    else:
        raise TableError(f"{path}: read a .csv or .parquet file")


def prompt_rows(
    chunks: Iterable[pd.DataFrame],
    instruction: str,
    fields: Sequence[str] | None = None,
    *,
    fmt: str = "lines",
    id_column: str | None = None,
) -> Iterator[tuple[Hashable, str]]:
    """``(row_id, prompt)`` for every row of ``chunks``: row ids count rows from 0 across chunks, or are the
    values of ``id_column`` (which the model then does not see unless ``fields`` names it)."""
    row = 0
    for chunk in chunks:
        if id_column is not None and id_column not in chunk.columns:
            raise TableError(f"id column {id_column!r} is not in the table; columns: {', '.join(chunk.columns)}")
        shown = fields if fields is not None or id_column is None else [c for c in chunk.columns if c != id_column]
        table = prepare_table(chunk, shown)
        names = list(table.columns)
        ids = chunk[id_column].tolist() if id_column is not None else range(row, row + len(chunk))
        for row_id, values in zip(ids, table.itertuples(index=False, name=None)):
            yield row_id, render_prompt(instruction, names, values, fmt)
        row += len(chunk)


def answer_table_stream(
    source: Any,
    instruction: str,
    fields: Sequence[str] | None = None,
    *,
    pool: ReplicaPool,
    fmt: str = "lines",
    rows_per_chunk: int = 4096,
    id_column: str | None = None,
    **options: Any,
) -> Iterator[tuple[Hashable, Completion]]:
    """``(row_id, completion)`` for every row of ``source`` as the replicas answer them (options of
    :func:`kvreuse.batch.distributed.answer_stream`). Memory: one chunk, the bucketing buffer, what is in flight."""
    rows = prompt_rows(table_chunks(source, rows_per_chunk), instruction, fields, fmt=fmt, id_column=id_column)
    return answer_stream(rows, pool, **options)


@dataclass(frozen=True)
class ReplicaTableAnswers:
    """A DataFrame's answers (its index, its order; ``None`` where the engine refused the row), their
    completions (``None`` for a row answered by an earlier run), and the job's figures."""

    answers: pd.Series
    completions: list[Completion | None]
    figures: JobFigures


def run_table_on_replicas(
    df: pd.DataFrame,
    instruction: str,
    fields: Sequence[str] | None = None,
    *,
    pool: ReplicaPool,
    order: str = "ggr",
    field_order: str = "keep",
    fmt: str = "lines",
    max_tokens: int = MAX_TOKENS,
    pin: Sequence[str] | None = None,
    out: str | os.PathLike | None = None,
    resume: bool = False,
    **options: Any,
) -> ReplicaTableAnswers:
    """Like :func:`kvreuse.batch.run_table`, on a pool of replicas: ``order`` and ``field_order`` pick a first row
    order (and, with ``field_order="free"`` or ``"global"``, each row's field order; ``pin``: fields that lead every
    prompt), then rows are bucketed by prefix and routed (options of ``answer_stream``). ``out`` gets
    each row as it is answered and ``resume`` asks only the rows it does not hold (as in ``run_table``)."""
    plan = plan_table(df, instruction, fields, order=order, field_order=field_order, fmt=fmt, pin=pin)
    output = None if out is None else AnswerOutput(Path(out), df, resume=resume)
    done = output.done if output is not None else {}
    completions: list[Completion | None] = [None] * len(df)
    texts: list[str | None] = [None] * len(df)
    for row, (answer, error) in done.items():
        texts[row] = None if error else answer
    rows = [(row, prompt) for row, prompt in zip(plan.rows.tolist(), plan.prompts) if row not in done]
    figures = new_figures(pool.size, options.get("router", "prefix-aware"))
    try:
        for row, completion in answer_stream(rows, pool, max_tokens=max_tokens, figures=figures, **options):
            completions[row] = completion
            texts[row] = None if completion.error else completion.text
            if output is not None:
                output.write(row, completion.text, completion.error)
    finally:
        if output is not None:
            output.close(complete=len(output.done) == len(df))
    answers = pd.Series(texts, index=df.index, dtype=object, name="answer")
    return ReplicaTableAnswers(answers, completions, figures)
