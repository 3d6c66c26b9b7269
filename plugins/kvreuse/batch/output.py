"""A job's answers, written row by row as they arrive, so that nothing answered is lost when a job stops.

Each output row is one input row: a row id column (the row's position in the input table, counted from 0), the
input's columns, the answer and the error (empty when the row was answered). Rows are written in the order the
engine finishes them and flushed at once; when the job completes, the file is rewritten in the table's order.

* ``.csv`` (RFC 4180, see :mod:`kvreuse.batch.table_io`) and ``.jsonl`` (one JSON object per line, in ASCII:
  other characters escaped, so no reader's line separator splits a record) are appended row by row: whatever
  kills the job, every row written before is in the file (a last line cut short by a crash is dropped when the
  job resumes).
* ``.parquet`` cannot be appended to, so while the job runs its rows go to a journal beside it
  (``NAME.parquet.partial.jsonl``: row id, answer, error); the Parquet file (earlier rows, then the journal's,
  with the input's own column types) is written when the job ends, however it ends, and the journal removed.
* No path: CSV on standard output, in the table's order: each row as soon as every row before it is written, so a
  row answered early waits for the rows before it (reordering sends rows out of the table's order); when a job
  stops early, the rows still waiting are written then, in the table's order.

Nothing is created before the first row is written (or the job completes with no row to write): a job that fails
before answering anything (a wrong model path, an engine argument vLLM refuses, a server that is down) leaves no
file behind to block the corrected run.

Resuming (``resume=True``) reads the rows already in the output (answered or refused) and leaves them there; the
front end then asks only the others, so a job run to completion has every input row exactly once. The output must
have been written by the same job: its columns and each row's input values must match the table's.
"""

from __future__ import annotations

import codecs
import csv
import io
import json
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import pandas as pd

from kvreuse.batch.table_io import csv_problem, csv_reader, csv_text, read_parquet
from kvreuse.errors import TableError

OUTPUT_SUFFIXES = (".csv", ".jsonl", ".parquet")


class AnswerOutput:
    """Where a table job's rows go (see the module's description). Use as a context manager, or call
    :meth:`close` with ``complete=True`` once every row has been written."""

    def __init__(
        self,
        path: Path | None,
        table: pd.DataFrame,
        *,
        row_column: str = "row",
        answer_column: str = "answer",
        error_column: str = "error",
        resume: bool = False,
    ) -> None:
        if path is not None and path.suffix.lower() not in OUTPUT_SUFFIXES:
            raise TableError(f"{path}: write a {', '.join(OUTPUT_SUFFIXES)} file")
        names = [row_column, answer_column, error_column]
        clash = sorted({n for n in names if n in table.columns} | {n for n in names if names.count(n) > 1})
        if clash:
            raise TableError(
                f"the table already has a column {clash[0]!r} (or two output columns share it); choose other "
                "--row-column, --answer-column or --error-column names"
            )
        if resume and path is None:
            raise TableError("resuming needs an output file (--out) to read the rows already answered from")
        self.path = path
        self.table = table.reset_index(drop=True)
        self.row_column, self.answer_column, self.error_column = names
        self.columns = [row_column, *map(str, self.table.columns), answer_column, error_column]
        self.kind = "csv" if path is None else path.suffix.lower().lstrip(".")
        self.done: dict[int, tuple[str, str]] = {}  # row id -> (answer, error): rows already in the output
        self._printed = 0  # standard output: the rows before this one are printed
        self._closed = False
        if path is not None and path.exists() and not resume:
            raise TableError(f"{path} exists; pass --resume to finish the job that wrote it, or choose another --out")
        if path is not None and resume:
            self._resume()
        self._handle: IO[str] | None = None  # opened by the first write (see the module's description)

    # -- writing ---------------------------------------------------------------------------------------------------
    def write(self, row: int, answer: str, error: str | None) -> None:
        """Write one answered (or refused: ``error`` says why) row, and flush it."""
        if row in self.done:
            raise TableError(f"row {row} is answered twice")
        self.done[row] = (answer, error or "")
        if self._handle is None:
            self._handle = self._open()
        if self.kind == "parquet":
            record: dict[str, Any] = {self.row_column: row, self.answer_column: answer, self.error_column: error or ""}
            self._handle.write(json.dumps(record) + "\n")
        elif self.kind == "jsonl":
            self._handle.write(json.dumps(self._record(row), default=str) + "\n")
        elif self.path is None:
            while self._printed in self.done:  # the table's order: rows wait for those before them
                self._write_csv_row(self._printed)
                self._printed += 1
        else:
            self._write_csv_row(row)
        self._handle.flush()

    def _write_csv_row(self, row: int) -> None:
        self._csv.writerow([csv_text(value) for value in self._record(row).values()])

    def close(self, *, complete: bool = False) -> None:
        """Flush and close; with ``complete`` (every row written) the file is rewritten in the table's order. A
        Parquet output is written from its journal in either case. An output nothing was written to stays
        unwritten unless the job is ``complete`` (a table of no rows gets its header)."""
        if self._closed:
            return
        self._closed = True
        if self._handle is None and complete:
            self._handle = self._open()
        if self.path is None and self._handle is not None:  # a job stopped early: the rows still waiting
            for row in sorted(r for r in self.done if r >= self._printed):
                self._write_csv_row(row)
            self._handle.flush()
        if self._handle is not None and self._handle is not sys.stdout:
            self._handle.close()
        if self.path is None:
            return
        if self.kind == "parquet":
            if complete or self.done or self.path.exists():
                self._write_parquet(complete)
        elif complete:
            self._rewrite_in_table_order()

    def __enter__(self) -> AnswerOutput:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _record(self, row: int) -> dict[str, Any]:
        answer, error = self.done[row]
        values = self.table.iloc[row].tolist()
        return {
            self.row_column: row,
            **{str(name): _plain(value) for name, value in zip(self.table.columns, values)},
            self.answer_column: answer,
            self.error_column: error,
        }

    def _open(self) -> IO[str]:
        if self.path is None:
            self._csv = csv.writer(sys.stdout)
            self._csv.writerow(self.columns)
            return sys.stdout
        target = self._journal if self.kind == "parquet" else self.path
        fresh = not target.exists() or target.stat().st_size == 0
        handle = target.open("a", encoding="utf-8", newline="")
        if self.kind == "csv":
            self._csv = csv.writer(handle)
            if fresh:
                self._csv.writerow(self.columns)
                handle.flush()
        return handle

    @property
    def _journal(self) -> Path:
        assert self.path is not None
        return self.path.with_name(self.path.name + ".partial.jsonl")

    # -- resuming ----------------------------------------------------------------------------------------------------
    def _resume(self) -> None:
        """Read the rows already written (dropping a last line cut short), check them against the table, and
        rewrite the file with exactly those rows, so that appending continues on a clean line."""
        assert self.path is not None
        if self.kind == "parquet":
            if self.path.exists():
                frame = read_parquet(self.path)
                self._check_columns(list(frame.columns))
                for record in frame.to_dict("records"):
                    self._take(record, check_values=False)
            if self._journal.exists():
                for record in _jsonl_records(self._journal):
                    self._take(record, check_values=False)
                self._write_parquet(complete=False)  # one file again; the journal starts empty
            return
        records = _csv_records(self.path) if self.kind == "csv" else _jsonl_records(self.path, self.columns)
        first = next(records, None)
        if first is None:  # an empty file: start afresh
            return
        if self.kind == "csv":
            self._check_columns(list(first))
        else:
            records = iter([first, *records])
        for record in records:
            self._take(record, check_values=True)
        self._rewrite(self.path, [self._record(row) for row in self.done])

    def _check_columns(self, columns: list[str]) -> None:
        if columns != self.columns:
            raise TableError(
                f"{self.path} has the columns {', '.join(columns)}, but this job writes "
                f"{', '.join(self.columns)}; resume with the same table and options, or choose another --out"
            )

    def _take(self, record: Mapping[str, Any], *, check_values: bool) -> None:
        raw = record.get(self.row_column)
        try:
            row = int(raw)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise TableError(f"{self.path}: row id {raw!r} is not a row number") from None
        if not 0 <= row < len(self.table):
            raise TableError(f"{self.path}: row {row} is not a row of the table ({len(self.table)} rows)")
        if row in self.done:
            raise TableError(f"{self.path}: row {row} is written twice")
        if check_values:
            values = self.table.iloc[row].tolist()
            expected = {k: csv_text(_plain(v)) for k, v in zip(map(str, self.table.columns), values)}
            found = {k: csv_text(record.get(k)) for k in expected}
            if found != expected:
                changed = next(k for k in expected if found[k] != expected[k])
                raise TableError(
                    f"{self.path}: row {row} has {changed} = {found[changed]!r}, the table has "
                    f"{expected[changed]!r}; was the table changed since the output was written?"
                )
        answer, error = record.get(self.answer_column), record.get(self.error_column)
        self.done[row] = ("" if answer is None else str(answer), "" if error is None else str(error))

    # -- whole-file writes (atomic: a temporary file renamed over the old one) -------------------------------------
    def _rewrite(self, path: Path, records: list[dict[str, Any]]) -> None:
        temporary = path.with_name(path.name + ".tmp")
        with temporary.open("w", encoding="utf-8", newline="") as handle:
            if path.suffix.lower() == ".csv":
                writer = csv.writer(handle)
                writer.writerow(self.columns)
                writer.writerows([csv_text(v) for v in record.values()] for record in records)
            else:
                handle.writelines(json.dumps(r, default=str) + "\n" for r in records)
        os.replace(temporary, path)

    def _rewrite_in_table_order(self) -> None:
        assert self.path is not None
        self._rewrite(self.path, [self._record(row) for row in sorted(self.done)])

    def _write_parquet(self, complete: bool) -> None:
        assert self.path is not None
        rows = sorted(self.done) if complete else list(self.done)
        frame = self.table.iloc[rows].reset_index(drop=True)
        frame.insert(0, self.row_column, rows)
        frame[self.answer_column] = [self.done[row][0] for row in rows]
        frame[self.error_column] = [self.done[row][1] for row in rows]
        temporary = self.path.with_name(self.path.name + ".tmp")
        frame.to_parquet(temporary, index=False)
        os.replace(temporary, self.path)
        self._journal.unlink(missing_ok=True)


def _plain(value: Any) -> Any:
    """A cell as JSON can hold it (NaN and other NULLs as None)."""
    if value is None or (not isinstance(value, (str, bytes, list, dict)) and pd.isna(value)):
        return None
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    return value


def _csv_records(path: Path) -> Iterator[list[str] | dict[str, str]]:
    """The header (a list), then every complete record as a dict; a last record cut short is dropped (every
    record written ends with ``\r\n``, so a file that does not, or that ends inside quotes, was cut)."""
    text = _text_of(path)
    reader = csv_reader(io.StringIO(text, newline=""))
    records: list[list[str]] = []
    try:
        records.extend(reader)
        cut = not text.endswith("\r\n")
    except csv.Error as error:
        if str(error).startswith("field larger than field limit"):  # not a cut record: say so, re-ask nothing
            raise TableError(f"{path}: {csv_problem(error)}") from None
        cut = False  # the record cut inside its quotes is the one that failed, and is not in `records`
    if not records:
        return
    header, body = records[0], records[1:]
    if body and (cut or len(body[-1]) != len(header)):
        body.pop()
    yield header
    for number, record in enumerate(body, start=2):
        if len(record) != len(header):
            raise TableError(f"{path}: record {number} has {len(record)} fields, the header {len(header)}")
        yield dict(zip(header, record))


def _text_of(path: Path) -> str:
    """A file's text, as written (a bare ``\r`` stays one); a character cut short at the end by a crash is
    dropped, bytes that are not UTF-8 elsewhere are an error."""
    try:
        return codecs.getincrementaldecoder("utf-8")().decode(path.read_bytes(), final=False)
    except UnicodeDecodeError as error:
        raise TableError(f"{path} is not UTF-8 text (byte {error.start}: {error.reason})") from None


def _jsonl_records(path: Path, columns: list[str] | None = None) -> Iterator[dict[str, Any]]:
    lines = _text_of(path).splitlines(keepends=True)
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                return  # a last line cut short
            raise TableError(f"{path}, line {number}: not a JSON object") from None
        if columns is not None and list(record) != columns:
            raise TableError(
                f"{path}, line {number} has the keys {', '.join(record)}, but this job writes {', '.join(columns)}; "
                "resume with the same table and options, or choose another --out"
            )
        yield record
