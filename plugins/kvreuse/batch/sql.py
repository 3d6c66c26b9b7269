"""The DuckDB front end: ``llm(instruction, value, ...)`` in SQL, asked as one reordered batch per query.

``run_query(con, "SELECT llm('Is this movie suitable for kids?', movie_title, movie_info) FROM 'movies.csv'",
backend=b)`` returns every row with its own answer. DuckDB calls a Python function once per chunk of about 2048
rows, in scan order, so a plain function would make one small engine call per chunk and could not reorder
across chunks. Instead the query runs more than once:

1. The query is parsed by DuckDB itself (``json_serialize_sql``). Each ``llm(...)`` call in it is a *call
   site*; the names of its fields come from its arguments (a column's name, ``argN`` for any other
   expression) and are what the prompt's ``field: value`` lines show.
2. The text of each call is rewritten to a hidden function that also receives the call site's number, and the
   query runs. The function answers what it already knows and records every other argument tuple (returning
   NULL for it). All recorded tuples of a run are then reordered per (call site fields, instruction) and sent
   to the backend in a single call.
3. The query runs again, until a run records nothing new: every ``llm()`` value of that last run is a real
   answer, and its result is returned. A query whose ``llm()`` results feed a filter or another ``llm()``
   needs one more run per such level; one that keeps asking new questions past that is not deterministic
   (``random()``, ``TABLESAMPLE``, ...) and is refused.

Answers are greedy, and identical argument tuples (after turning values into prompt text, NULL as ``''``) are
asked once per query. A question the engine refuses (a prompt longer than its context) makes that ``llm()`` value
NULL and is listed in ``QueryAnswers.errors``; it is not asked again. With ``out``, every answer is appended to a
JSON-lines file as soon as it arrives (instruction, fields, values, answer, error); ``resume=True`` reads that
file first and asks only the questions it does not answer, so a query interrupted by a dead engine or Ctrl-C loses
no answer. Only a single ``SELECT`` statement can call ``llm()``. Python DataFrames must be
registered on the connection (``con.register("movies", df)``): DuckDB looks up variables in the caller's frame,
which here is not the user's.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import duckdb
import pandas as pd
import pyarrow as pa

from kvreuse.batch.backend import MAX_TOKENS, Backend
from kvreuse.batch.calibrate import Calibration
from kvreuse.batch.calibrate import calibrate as calibrate_field_order
from kvreuse.batch.job import BatchFigures, answer_plans, plan_table
from kvreuse.batch.progress import JobProgress
from kvreuse.errors import ConfigError, TableError
from kvreuse.reorder import ReorderConfig, prepare_table

FUNCTION = "llm"
# The rewritten calls' name; registered only while a query runs.
_HIDDEN_FUNCTION = "kvreuse_llm"

_Fields = tuple[str, ...]
_Values = tuple[str, ...]


@dataclass(frozen=True)
class CallSite:
    """One ``llm(...)`` call in a query: where it is (UTF-8 byte offset, as DuckDB reports) and its field names."""

    offset: int
    fields: _Fields


@dataclass(frozen=True)
class QueryAnswers:
    """A query's result with its ``llm()`` answers filled in, what its batches cost, and how often it ran.

    ``runs`` is 2 for a query whose ``llm()`` values feed nothing but the result, 1 for a query without ``llm()``.
    ``calibrations`` has, when calibrated, each ``(fields, instruction)`` batch's :class:`Calibration`.
    """

    frame: pd.DataFrame
    figures: BatchFigures
    runs: int
    errors: pd.DataFrame = field(
        default_factory=lambda: pd.DataFrame(columns=["instruction", "fields", "values", "error"])
    )
    calibrations: dict[tuple[tuple[str, ...], str], Calibration] = field(default_factory=dict)


def run_query(
    con: duckdb.DuckDBPyConnection,
    query: str,
    *,
    backend: Backend,
    order: str = "ggr",
    field_order: str = "keep",
    fmt: str = "lines",
    max_tokens: int = MAX_TOKENS,
    pin: Sequence[str] | None = None,
    config: ReorderConfig | None = None,
    progress: bool = False,
    out: str | os.PathLike | None = None,
    resume: bool = False,
    calibrate: int | None = None,
    min_agreement: float = 1.0,
) -> QueryAnswers:
    """Run a ``SELECT`` whose ``llm(instruction, value, ...)`` calls are answered by ``backend`` in batches.

    See the module's description for how; ``order``, ``field_order`` (default ``"keep"``: each prompt lists the
    fields in the call's argument order), ``fmt`` and ``max_tokens`` are as in
    :func:`kvreuse.batch.run_table`, except that ``"original"`` means the order in which DuckDB first passed each
    argument tuple (scan order, which DuckDB's threads may vary). ``pin`` names fields (as the call sites name
    them, see :func:`call_sites`) that lead every prompt of each ``llm()`` call that passes them. ``out`` and
    ``resume`` keep answers in a file as they arrive (see the module's description). ``calibrate=N`` chooses the
    field order of each ``llm()`` call's batch as :func:`kvreuse.batch.run_table` does. The connection is left as
    it was.
    """
    if calibrate is not None and field_order != "keep":
        raise ConfigError("give either field_order or calibrate (which chooses the field order)")
    calibrations: dict[tuple[tuple[str, ...], str], Calibration] = {}
    sites = call_sites(con, query)
    _check_pins(pin, sites)
    figures = BatchFigures(0, 0, 0, 0.0, 0.0)
    if not sites:
        return QueryAnswers(_execute(con, query), figures, 1)
    rewritten = _rewrite(query, sites)
    config = config if config is not None else getattr(backend, "reorder_config", None)
    book = _AnswerBook([site.fields for site in sites])
    journal = None if out is None else _Journal(Path(out), book, resume)
    # One run per level of llm() feeding llm() (at most one per call site), plus the run that only reads answers.
    most_runs = len(sites) + 1
    con.create_function(
        _HIDDEN_FUNCTION, book, None, "VARCHAR", type="arrow", null_handling="special", side_effects=True
    )
    try:
        for run in range(1, most_runs + 1):
            frame = _execute(con, rewritten)
            questions = book.take_new_questions()
            if not questions:
                return QueryAnswers(frame, figures, run, book.errors(), calibrations)
            if run == most_runs:
                break
            if calibrate is not None:
                for (fields, instruction), rows in questions.items():
                    calibrations[(tuple(fields), instruction)] = calibrate_field_order(
                        pd.DataFrame(list(rows), columns=list(fields), dtype=object),
                        instruction,
                        list(fields),
                        backend=backend,
                        n=calibrate,
                        min_agreement=min_agreement,
                        order=order,
                        fmt=fmt,
                        max_tokens=max_tokens,
                        pin=None if pin is None else [name for name in pin if name in fields],
                        config=config,
                    )
            plans = [
                plan_table(
                    pd.DataFrame(list(rows), columns=list(fields), dtype=object),
                    instruction,
                    list(fields),
                    order=order,
                    field_order=calibrations[(tuple(fields), instruction)].chosen if calibrations else field_order,
                    fmt=fmt,
                    pin=None if pin is None else [name for name in pin if name in fields],
                    config=config,
                    cache_model=backend.cache_model,
                )
                for (fields, instruction), rows in questions.items()
            ]
            groups = list(questions.items())
            start = time.perf_counter()
            with JobProgress(sum(len(rows) for rows in questions.values()), enabled=progress) as bar:
                for k, row, completion in answer_plans(plans, backend, max_tokens=max_tokens):
                    (fields, instruction), rows = groups[k]
                    book.learn(fields, instruction, rows[row], completion.text, completion.error)
                    if journal is not None:
                        journal.write(fields, instruction, rows[row], completion.text, completion.error)
                    bar.add(completion)
            solve_s = sum(plan.solve_s for plan in plans)
            figures = figures + BatchFigures.of(bar.tally, solve_s, time.perf_counter() - start)
    finally:
        con.remove_function(_HIDDEN_FUNCTION)
        if journal is not None:
            journal.close()
    raise TableError(
        f"the query still asked new llm() questions on run {most_runs}; llm() needs a deterministic "
        "query (no random(), uuid(), TABLESAMPLE, ... deciding which values it is asked about)"
    )


def llm_sql(
    con: duckdb.DuckDBPyConnection,
    query: str,
    *,
    backend: Backend,
    order: str = "ggr",
    field_order: str = "keep",
    fmt: str = "lines",
    max_tokens: int = MAX_TOKENS,
    pin: Sequence[str] | None = None,
    config: ReorderConfig | None = None,
    progress: bool = False,
    out: str | os.PathLike | None = None,
    resume: bool = False,
    calibrate: int | None = None,
    min_agreement: float = 1.0,
) -> pd.DataFrame:
    """The result of :func:`run_query` alone, as a DataFrame."""
    return run_query(
        con,
        query,
        backend=backend,
        order=order,
        field_order=field_order,
        fmt=fmt,
        max_tokens=max_tokens,
        pin=pin,
        config=config,
        progress=progress,
        out=out,
        resume=resume,
        calibrate=calibrate,
        min_agreement=min_agreement,
    ).frame


def _check_pins(pin: Sequence[str] | None, sites: list[CallSite]) -> None:
    """Every pinned name must be a field of some ``llm()`` call: a misspelt pin must not be silently ignored."""
    if pin is None:
        return
    if isinstance(pin, str):
        raise TableError(f"pin must be a list of field names, not the single string {pin!r}; write pin=[{pin!r}]")
    named = {name for site in sites for name in site.fields}
    unknown = [name for name in pin if name not in named]
    if unknown:
        raise TableError(
            f"cannot pin {', '.join(map(repr, unknown))}: no llm() call of the query passes such a field; "
            f"its fields are {', '.join(map(repr, sorted(named)))}"
        )


def call_sites(con: duckdb.DuckDBPyConnection, query: str) -> list[CallSite]:
    """The ``llm(...)`` calls of ``query``, parsed by DuckDB, with the field names their prompts will show.

    A column argument is named by its column (``m.movie_info`` -> ``movie_info``, or the qualified name when two
    arguments share a column name); any other expression by its position, ``arg1`` for the first value.
    """
    parsed = json.loads(con.execute("SELECT json_serialize_sql(?::VARCHAR)", [query]).fetchall()[0][0])
    if parsed["error"]:
        if parsed.get("error_type") == "not implemented":
            raise TableError(f"llm() works in a single SELECT statement; DuckDB says: {parsed['error_message']}")
        raise TableError(f"the query does not parse: {parsed['error_message']}")
    if len(parsed["statements"]) != 1:
        raise TableError(f"llm() works in a single SELECT statement; the query has {len(parsed['statements'])}")
    sites = []
    for node in _nodes(parsed["statements"][0]):
        if node.get("class") == "FUNCTION" and str(node.get("function_name", "")).lower() == FUNCTION:
            arguments = [argument["expression"] for argument in node["arguments"]]
            if len(arguments) < 2:
                raise TableError(
                    f"llm() at byte {node['query_location']} of the query needs an instruction and "
                    f"at least one value, e.g. llm('Is this movie suitable for kids?', movie_title)"
                )
            sites.append(CallSite(node["query_location"], _field_names(arguments[1:], node["query_location"])))
    return sorted(sites, key=lambda site: site.offset)


def _nodes(tree: Any) -> Iterator[dict]:
    """Every JSON object in the parse tree, parents before children."""
    if isinstance(tree, dict):
        yield tree
        for value in tree.values():
            yield from _nodes(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from _nodes(value)


def _field_names(values: list[dict], offset: int) -> _Fields:
    """Names for a call's value arguments (see :func:`call_sites`); two values never share a name."""
    paths = [node["column_names"] if node.get("class") == "COLUMN_REF" else None for node in values]
    short = [path[-1] if path else f"arg{i}" for i, path in enumerate(paths, start=1)]
    names = [".".join(path) if path and short.count(short[i]) > 1 else short[i] for i, path in enumerate(paths)]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise TableError(
            f"llm() at byte {offset} of the query passes {', '.join(map(repr, repeated))} more than "
            "once; each value must be a different field"
        )
    return tuple(names)


def _rewrite(query: str, sites: list[CallSite]) -> str:
    """``query`` with each ``llm(`` replaced by ``kvreuse_llm(<site number>, ``.

    DuckDB reports a call's offset in UTF-8 bytes at the start of its (possibly schema-qualified) name; the
    text from there to the first ``(`` must be that name, which is checked rather than assumed.
    """
    text = query.encode("utf-8")
    for number in reversed(range(len(sites))):  # from the end, so earlier offsets stay valid
        start = sites[number].offset
        paren = text.find(b"(", start)
        name = text[start : max(paren, start)].strip().replace(b'"', b"").lower()
        if not (name == FUNCTION.encode() or name.endswith(b"." + FUNCTION.encode())):
            raise TableError(f"cannot find the llm( call at byte {start} of the query; write it as llm(...)")
        text = text[:start] + f"{_HIDDEN_FUNCTION}({number}, ".encode() + text[paren + 1 :]
    return text.decode("utf-8")


def _execute(con: duckdb.DuckDBPyConnection, query: str) -> pd.DataFrame:
    """Run ``query`` to the end; DuckDB's own errors (missing table, bad column, ...) become ``TableError``."""
    try:
        return con.execute(query).df()
    except duckdb.Error as error:
        raise TableError(f"the query failed: {error}") from None


class _AnswerBook:
    """The hidden SQL function: answers known questions, records the others for the next batch.

    A question is (call site fields, instruction, values as prompt text). A question the engine refused is known
    too (its value is NULL), so it is not asked again. DuckDB may call the function from several threads, so the
    book is guarded by a lock.
    """

    def __init__(self, site_fields: list[_Fields]) -> None:
        self._site_fields = site_fields
        self._answers: dict[tuple[_Fields, str, _Values], str | None] = {}
        self._errors: dict[tuple[_Fields, str, _Values], str] = {}
        self._new: dict[tuple[_Fields, str], dict[_Values, None]] = {}  # a dict keeps first-seen order
        self._lock = threading.Lock()

    def __call__(self, site: pa.Array, instruction: pa.Array, *values: pa.Array) -> pa.Array:
        if len(site) == 0:
            return pa.array([], pa.string())
        fields = self._site_fields[site[0].as_py()]
        cells = prepare_table(
            pd.DataFrame(
                {str(i): pd.Series(column.to_pylist(), dtype=object) for i, column in enumerate((instruction, *values))}
            )
        )
        out: list[str | None] = []
        with self._lock:
            for instruction_text, *row in cells.itertuples(index=False, name=None):
                key = (fields, instruction_text, tuple(row))
                if key not in self._answers:
                    self._new.setdefault((fields, instruction_text), {})[tuple(row)] = None
                out.append(self._answers.get(key))
        return pa.array(out, pa.string())

    def take_new_questions(self) -> dict[tuple[_Fields, str], list[_Values]]:
        """The questions recorded since the last call, grouped by (fields, instruction), in first-seen order."""
        with self._lock:
            new, self._new = self._new, {}
        return {group: list(rows) for group, rows in new.items()}

    def learn(self, fields: _Fields, instruction: str, row: _Values, answer: str, error: str | None) -> None:
        """One question's answer, or why the engine refused it (its value is then NULL)."""
        key = (fields, instruction, tuple(row))
        with self._lock:
            self._answers[key] = None if error else answer
            if error:
                self._errors[key] = error

    def errors(self) -> pd.DataFrame:
        """The refused questions and why."""
        with self._lock:
            rows = [(i, list(f), list(v), e) for (f, i, v), e in self._errors.items()]
        return pd.DataFrame(rows, columns=["instruction", "fields", "values", "error"])


class _Journal:
    """Answers appended to a JSON-lines file as they arrive; with ``resume``, the file's answers are learnt first
    (a last line cut short by a crash is dropped)."""

    def __init__(self, path: Path, book: _AnswerBook, resume: bool) -> None:
        if path.exists() and not resume:
            raise TableError(f"{path} exists; pass resume=True to keep its answers, or choose another file")
        kept: list[str] = []
        if path.exists():
            lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
            for number, line in enumerate(lines, start=1):
                try:
                    entry = json.loads(line)
                    key = (tuple(entry["fields"]), entry["instruction"], tuple(entry["values"]))
                    answer, error = entry["answer"], entry["error"]
                except (ValueError, KeyError, TypeError):
                    if number == len(lines):
                        break  # cut short
                    raise TableError(f"{path}, line {number}: not an answer this front end wrote") from None
                book.learn(key[0], key[1], key[2], answer, error)
                kept.append(json.dumps(entry) + "\n")
            path.write_text("".join(kept), encoding="utf-8")
        self._handle: TextIO = path.open("a", encoding="utf-8")

    def write(self, fields: _Fields, instruction: str, values: _Values, answer: str, error: str | None) -> None:
        entry = {"instruction": instruction, "fields": list(fields), "values": list(values)}
        self._handle.write(json.dumps({**entry, "answer": answer, "error": error}) + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()
