"""The orders GGR is compared with: as given, sorted, and sorted on the statistics-based fixed field order.

Each takes ``lead``, the pinned columns (see :mod:`kvreuse.reorder.pinning`): they lead every row's fields in the
order given, and the rest follow in the order's own field order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvreuse.reorder.ordering import Ordering
from kvreuse.reorder.stats import EncodedTable, fixed_field_order


def sort_rows(codes: np.ndarray, rows: np.ndarray, field_order: Sequence[int]) -> np.ndarray:
    """``rows`` sorted lexicographically by their values in ``field_order``; equal rows keep their order."""
    if len(rows) < 2 or not len(field_order):
        return rows
    keys = codes[rows][:, list(field_order)[::-1]].T
    return rows[np.lexsort(keys)]


def original_order(encoded: EncodedTable, lead: Sequence[int] = ()) -> Ordering:
    """Rows as the table gives them; fields too, after the pinned ones."""
    rows = np.arange(encoded.n_rows, dtype=np.int64)
    return Ordering.from_segments([(rows, _after(lead, range(encoded.n_cols)))])


def sorted_order(encoded: EncodedTable, lead: Sequence[int] = ()) -> Ordering:
    """Rows sorted lexicographically on the table's own field order, after the pinned ones (a stable sort)."""
    order = _after(lead, range(encoded.n_cols))
    return Ordering.from_segments([(sort_rows(encoded.codes, np.arange(encoded.n_rows), order), order)])


def stats_order(encoded: EncodedTable, lead: Sequence[int] = ()) -> Ordering:
    """Fields in the statistics-based fixed order (:func:`fixed_field_order`) after the pinned ones, rows sorted
    on that order."""
    order = _after(lead, fixed_field_order(encoded.stats()))
    return Ordering.from_segments([(sort_rows(encoded.codes, np.arange(encoded.n_rows), order), order)])


def _after(lead: Sequence[int], order: Sequence[int]) -> tuple[int, ...]:
    """``lead``, then the columns of ``order`` not in it, in ``order``'s order."""
    return tuple(lead) + tuple(c for c in order if c not in lead)
