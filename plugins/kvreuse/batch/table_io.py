"""Tables in and out of the batch front ends, read strictly and written so that they read back exactly.

Reading. A ``.csv`` file is read with one explicit dialect, RFC 4180 (comma-separated, fields with a comma, a
double quote or a line break in double quotes, ``""`` for a quote inside), as UTF-8 (a byte-order mark is
allowed), every cell as its exact text. Nothing is guessed: the first line names the columns, every column must
have a name and every name be distinct, and every record must have exactly one field per column; otherwise the
error names the file, the line and what to fix (a record one field longer than the header usually is a pandas
index written without a header, which pandas would silently take as the index). Blank lines are skipped. A
``.parquet`` file keeps its types; an index pandas stored in it comes back as a column. Another text encoding is
read where it is named (``encoding="latin-1"``); a file that is not text of its encoding is an error naming the
line of the first byte that is not, and the fix. A CSV cell may hold up
to :data:`CSV_FIELD_LIMIT` characters (Python's ``csv`` module stops at 131,072 unless told otherwise, which a
long document or answer passes); a longer one is an error naming the limit.

Writing. CSV is written with Python's ``csv`` module in the same dialect (line terminator ``\\r\\n``), which quotes
every field holding a delimiter, a quote, ``\\r`` or ``\\n``: an answer with a bare carriage return reads back as
one row. NUL characters, which Python's CSV reader refuses, are written as U+FFFD.
"""

from __future__ import annotations

import codecs
import csv
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd

from kvreuse.errors import TableError

TABLE_SUFFIXES = (".csv", ".parquet")
# The text encoding of CSV files unless another is named (a byte-order mark is allowed and dropped).
UTF8 = "utf-8"
# The longest CSV cell read, in characters (a bound, so a file without a closing quote is not read whole as one cell).
CSV_FIELD_LIMIT = 1 << 28
# A column pandas' to_csv writes for an index without a name, read back by pandas under this name.
_PANDAS_UNNAMED = re.compile(r"Unnamed: \d+")


def read_table(path: Path, encoding: str = UTF8) -> pd.DataFrame:
    """A table file as a DataFrame indexed ``0..n-1``: CSV cells as their exact text (an empty cell is ``''``) read
    as ``encoding``, Parquet as typed."""
    _check_file(path)
    if path.suffix.lower() == ".csv":
        chunks = list(csv_chunks(path, rows_per_chunk=1 << 30, encoding=encoding))
        return chunks[0]
    return read_parquet(path)


def read_parquet(path: Path) -> pd.DataFrame:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        frame = pq.read_table(path).to_pandas()
    except (pa.ArrowException, OSError, ValueError) as error:
        raise TableError(f"cannot read {path}: {error}") from None
    if not isinstance(frame.index, pd.RangeIndex):  # an index pandas stored: a column of the data like any other
        frame = frame.reset_index()
    return frame.reset_index(drop=True)


def csv_chunks(path: Path, rows_per_chunk: int = 4096, encoding: str = UTF8) -> Iterator[pd.DataFrame]:
    """The records of a CSV file (see the module's rules) as DataFrames of at most ``rows_per_chunk`` rows, each
    cell a ``str``; an empty table gives one empty DataFrame with the header's columns. Errors name the line."""
    _check_file(path)
    check_encoding(encoding)
    try:
        with path.open(encoding="utf-8-sig" if encoding == UTF8 else encoding, newline="") as handle:
            reader = csv_reader(handle)
            header = _header(path, reader)
            rows: list[list[str]] = []
            sent = False
            line = reader.line_num + 1
            for record in reader:
                if record:
                    _check_record(path, line, record, header)
                    rows.append(record)
                if len(rows) == rows_per_chunk:
                    yield pd.DataFrame(rows, columns=header, dtype=object)
                    rows, sent = [], True
                line = reader.line_num + 1
            if rows or not sent:
                yield pd.DataFrame(rows, columns=header, dtype=object)
    except csv.Error as error:
        raise TableError(f"{path}, line {reader.line_num}: {csv_problem(error)} (read as RFC 4180 CSV)") from None
    except UnicodeDecodeError:
        raise TableError(not_text(path, encoding)) from None


def check_encoding(encoding: str) -> None:
    """Refuse a text encoding Python does not know, naming it."""
    try:
        codecs.lookup(encoding)
    except LookupError:
        raise TableError(f"unknown text encoding {encoding!r} (e.g. utf-8, latin-1, cp1252)") from None


def not_text(path: Path, encoding: str) -> str:
    """Why ``path`` is not text of ``encoding``: the line and byte of its first byte that is not, and the fix."""
    data = path.read_bytes()
    try:
        data.decode("utf-8-sig" if encoding == UTF8 else encoding)
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        byte = data[error.start : error.start + 1].hex()
        fix = (
            "; a file saved by Excel or an older tool is often Latin-1 or cp1252: pass --encoding latin-1 (or cp1252), "
            "or save it as UTF-8"
            if encoding == UTF8
            else "; pass the file's --encoding"
        )
        return f"{path}, line {line}: byte 0x{byte} is not {encoding} text ({error.reason}){fix}"
    return f"{path} is not {encoding} text"


def csv_reader(lines: Iterable[str]) -> Any:
    """A strict RFC 4180 reader of ``lines`` whose cells may hold up to :data:`CSV_FIELD_LIMIT` characters."""
    csv.field_size_limit(CSV_FIELD_LIMIT)  # process-wide in the csv module: set for every read
    return csv.reader(lines, strict=True)


def csv_problem(error: csv.Error) -> str:
    """What a CSV reader's error means, with the fix where there is one."""
    if str(error).startswith("field larger than field limit"):
        return (
            f"a cell is longer than {CSV_FIELD_LIMIT:,} characters, the most kvreuse reads from one CSV cell "
            "(or a quote is never closed); store a table with such cells as Parquet"
        )
    return str(error)


def _check_file(path: Path) -> None:
    if path.suffix.lower() not in TABLE_SUFFIXES:
        raise TableError(f"{path}: read a {' or '.join(TABLE_SUFFIXES)} file")
    if not path.is_file():
        raise TableError(f"table file {path} does not exist")


def _header(path: Path, reader: Iterator[list[str]]) -> list[str]:
    header = next(reader, None)
    while header == []:
        header = next(reader, None)
    if header is None:
        raise TableError(f"{path} is empty; its first line must name the columns")
    seen: dict[str, int] = {}
    for number, name in enumerate(header, start=1):
        if not name.strip() or _PANDAS_UNNAMED.fullmatch(name):
            raise TableError(
                f"{path}, line 1: column {number} has no name ({name!r}); a table written by pandas' to_csv without "
                "index=False starts with such an index column: remove the column, or give it a name"
            )
        if name in seen:
            raise TableError(f"{path}, line 1: columns {seen[name]} and {number} are both named {name!r}")
        seen[name] = number
    return header


def _check_record(path: Path, line: int, record: list[str], header: list[str]) -> None:
    if len(record) == len(header):
        return
    hint = (
        "; a first field without a column name is usually an index column written without a header"
        if len(record) == len(header) + 1
        else "; quote fields that hold a comma, a quote or a line break"
    )
    raise TableError(
        f"{path}, line {line}: {len(record)} fields, but the header names {len(header)} columns "
        f"({', '.join(header)}){hint}"
    )


def csv_text(value: object) -> str:
    """A cell as the text CSV holds (``None`` as empty, NUL as U+FFFD)."""
    if value is None:
        return ""
    return str(value).replace("\x00", "\ufffd")
