"""Per-column statistics of a prepared table, and the fixed field order they imply.

Solvers never compare strings row by row: each column is factorized once into integer codes, numbered in the
lexicographic order of the values, with the character length of each distinct value beside them. Sorting codes
then sorts strings, and equal codes mean equal cells.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd


@dataclass(frozen=True)
class ColumnStats:
    """One column's number of distinct values and mean value length in characters."""

    name: str
    cardinality: int
    avg_len: float


@dataclass(frozen=True)
class EncodedTable:
    """A prepared table as codes: ``codes[r, c]`` numbers row ``r``'s value in column ``c``.

    Codes of a column run over ``0..cardinality-1`` in the lexicographic order of the values, and
    ``lengths[c][code]`` is that value's length in characters.
    """

    names: tuple[str, ...]
    codes: np.ndarray
    lengths: tuple[np.ndarray, ...]

    @property
    def n_rows(self) -> int:
        return int(self.codes.shape[0])

    @property
    def n_cols(self) -> int:
        return int(self.codes.shape[1])

    def cell_lengths(self) -> np.ndarray:
        """``(n_rows, n_cols)`` int64 lengths of every cell."""
        out = np.empty(self.codes.shape, dtype=np.int64)
        for c, lengths in enumerate(self.lengths):
            out[:, c] = lengths[self.codes[:, c]]
        return out

    def stats(self) -> list[ColumnStats]:
        """:class:`ColumnStats` of every column, in column order."""
        cells = self.cell_lengths()
        return [
            ColumnStats(name, len(self.lengths[c]), float(cells[:, c].mean()) if self.n_rows else 0.0)
            for c, name in enumerate(self.names)
        ]


def encode_table(table: pd.DataFrame) -> EncodedTable:
    """Factorize every column of a prepared (all-``str``) table."""
    codes = np.empty(table.shape, dtype=np.int64)
    lengths = []
    for c in range(table.shape[1]):
        column_codes, uniques = pd.factorize(table.iloc[:, c].to_numpy(dtype=object), sort=True)
        codes[:, c] = column_codes
        lengths.append(np.fromiter((len(u) for u in uniques), dtype=np.int64, count=len(uniques)))
    return EncodedTable(tuple(str(c) for c in table.columns), codes, tuple(lengths))


def column_stats(table: pd.DataFrame) -> list[ColumnStats]:
    """:class:`ColumnStats` of every column of a prepared table."""
    return encode_table(table).stats()


def fixed_field_order(stats: Sequence[ColumnStats]) -> tuple[int, ...]:
    """Column indices in the statistics-based fixed order: ascending cardinality, then descending mean length.

    With rows then sorted by this order, a column of few distinct values placed first splits the rows into few
    long runs, and every later column can only share a prefix inside its run; so the fewest distinct values go
    first. Between columns of equal cardinality the longer one goes first: the same runs then share more
    characters. Remaining ties keep the table's column order.
    """
    return tuple(sorted(range(len(stats)), key=lambda c: (stats[c].cardinality, -stats[c].avg_len, c)))
