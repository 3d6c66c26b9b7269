"""Turn a user's table into cells of text, and a row's cells into a prompt.

Reordering works on what the model reads, so every cell is first made the exact string that goes into the prompt.
The prompt layout puts the instruction first and then the fields in the order the caller chose: requests over
the same table then share the instruction and every leading field whose value they share, and a solver may move
a row's fields around without changing what the row asks.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from enum import StrEnum

import numpy as np
import pandas as pd

from kvreuse.errors import ConfigError, TableError


class PromptFormat(StrEnum):
    """How a prompt shows a row's fields (``--format``, ``fmt=``)."""

    LINES = "lines"  # one "field: value" line per field
    JSON = "json"  # one JSON object


PROMPT_FORMATS = tuple(PromptFormat)


def prepare_table(df: pd.DataFrame, fields: Sequence[str] | None = None) -> pd.DataFrame:
    """The columns ``fields`` of ``df`` (all columns when ``None``), in that order, with every cell as ``str``.

    Cells become the text a prompt shows: NULLs (``None``, ``NaN``, ``pd.NA``, ``NaT``) become the empty string,
    so a missing value shares its (empty) prefix with other missing values instead of rendering as ``nan``;
    ``bytes`` are decoded as UTF-8 with replacement characters; everything else goes through ``str()``.
    Column names are compared and returned as ``str``. The result is indexed by position ``0..n-1`` and keeps
    every row, so callers map a solver's positions back with ``df.index[positions]``. A table with no rows is
    allowed and gives a table with no rows.
    """
    names = [str(c) for c in df.columns]
    repeated = sorted(name for name, count in Counter(names).items() if count > 1)
    if repeated:
        raise TableError(
            f"the table has duplicate column name(s) {', '.join(map(repr, repeated))}; "
            "rename them so each field is unambiguous"
        )
    if fields is None:
        fields = names
    elif isinstance(fields, str):
        raise TableError(f"fields must be a sequence of column names, not the single string {fields!r}")
    fields = list(fields)
    if not fields:
        raise TableError("no fields to reorder: the field list (or the table's columns) is empty")
    repeated = sorted(str(name) for name, count in Counter(fields).items() if count > 1)
    if repeated:
        raise TableError(f"field(s) {', '.join(map(repr, repeated))} listed more than once")
    position = {name: i for i, name in enumerate(names)}
    for name in fields:
        if not isinstance(name, str) or name not in position:
            raise TableError(f"unknown field {name!r}; the table's fields are {', '.join(map(repr, names))}")
    columns = {name: _column_text(df.iloc[:, position[name]]) for name in fields}
    return pd.DataFrame(columns, index=pd.RangeIndex(len(df)), columns=fields)


def _column_text(column: pd.Series) -> np.ndarray:
    """One column as an object array of ``str``; a column that already holds only text takes the fast path."""
    if pd.api.types.infer_dtype(column, skipna=True) in ("string", "empty"):
        return column.to_numpy(dtype=object, na_value="")
    return np.array([_cell_text(value) for value in column.tolist()], dtype=object)


def _cell_text(value: object) -> str:
    """The prompt text of one cell (see :func:`prepare_table` for the rules)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", errors="replace")
    missing = pd.isna(value)
    if isinstance(missing, (bool, np.bool_)) and missing:
        return ""
    return str(value)


def render_prompt(instruction: str, fields: Sequence[str], values: Sequence[str], fmt: str = "lines") -> str:
    """The prompt for one row: ``instruction``, a blank line, then the row's fields in the given order.

    ``fmt="lines"`` writes one ``"{field}: {value}\\n"`` line per field; ``fmt="json"`` writes one JSON object
    (keys in the given order, non-ASCII kept as is) followed by ``"\\n"``. Values are written verbatim (a
    value's own newlines stay). Nothing that differs between rows precedes the first field, so two rows share
    the prompt up to their first differing field.
    """
    if fmt not in PROMPT_FORMATS:
        raise ConfigError(f"prompt format {fmt!r} is not one of {', '.join(PROMPT_FORMATS)}")
    if len(fields) != len(values):
        raise TableError(f"{len(fields)} field name(s) but {len(values)} value(s); each field needs one value")
    if len(set(fields)) != len(fields):
        raise TableError(f"a prompt lists a field more than once: {list(fields)!r}")
    if fmt == "json":
        body = json.dumps(dict(zip(fields, values)), ensure_ascii=False) + "\n"
    else:
        body = "".join(f"{field}: {value}\n" for field, value in zip(fields, values))
    return f"{instruction}\n\n{body}"
