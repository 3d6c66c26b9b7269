"""What a solver returns: the order rows are sent in, and the order of each row's fields."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from kvreuse.errors import TableError
from kvreuse.reorder.table import render_prompt


@dataclass(frozen=True)
class Ordering:
    """A send order over a prepared table.

    ``rows[i]`` is the table position sent ``i``-th (an ``int64`` permutation of ``0..n-1``); ``fields[i]`` is
    the column-index order its prompt lists the fields in (a permutation of ``0..m-1``). Rows sent next to each
    other with equal leading fields share a prompt prefix, which is what solvers maximise.
    """

    rows: np.ndarray
    fields: tuple[tuple[int, ...], ...]

    @classmethod
    def from_segments(cls, segments: Sequence[tuple[np.ndarray, tuple[int, ...]]]) -> Ordering:
        """Concatenate runs of rows, each run sent with one field order (how solvers build their answer)."""
        rows = [np.asarray(run, dtype=np.int64) for run, _ in segments]
        return cls(
            np.concatenate(rows) if rows else np.empty(0, dtype=np.int64),
            tuple(order for run, order in segments for _ in range(len(run))),
        )

    def validate(self, n_rows: int, n_cols: int) -> None:
        """Raise :class:`TableError` unless this ordering fits a table of ``n_rows`` x ``n_cols``."""
        rows = np.asarray(self.rows)
        if rows.ndim != 1 or len(rows) != n_rows or len(self.fields) != n_rows:
            raise TableError(
                f"ordering has {rows.size} row position(s) and {len(self.fields)} field order(s); "
                f"the table has {n_rows} rows"
            )
        if n_rows and (
            not np.issubdtype(rows.dtype, np.integer) or not np.array_equal(np.sort(rows), np.arange(n_rows))
        ):
            raise TableError(f"ordering rows are not a permutation of 0..{n_rows - 1}")
        every = tuple(range(n_cols))
        if all(tuple(sorted(order)) == every for order in set(self.fields)):
            return  # each distinct field order checked once: a table's rows share a few
        for i, order in enumerate(self.fields):
            if tuple(sorted(order)) != every:
                raise TableError(
                    f"field order {order!r} at send position {i} is not a permutation of the "
                    f"{n_cols} column indices 0..{n_cols - 1}"
                )


def prompts(ordering: Ordering, table: pd.DataFrame, instruction: str, fmt: str = "lines") -> list[str]:
    """The prompts of a prepared ``table`` in send order, each listing its fields in the ordering's order."""
    ordering.validate(*table.shape)
    names = [str(c) for c in table.columns]
    cells = table.to_numpy(dtype=object).tolist()  # lists index faster than an object array, cell by cell
    named = {order: [names[j] for j in order] for order in set(ordering.fields)}
    return [
        render_prompt(instruction, named[order], [cells[row][j] for j in order], fmt)
        for row, order in zip(ordering.rows.tolist(), ordering.fields)
    ]
