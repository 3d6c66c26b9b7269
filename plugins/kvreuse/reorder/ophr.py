"""OPHR: the exact optimum of the Prefix Hit Count, for tiny tables; the oracle GGR is tested against.

Any send order splits into maximal runs of rows sharing their first cell; inside a run of ``k`` rows led by a
value of length ``L`` the run earns ``(k - 1) * L**2`` plus the PHC of its rows over the remaining fields, and
runs earn nothing from each other. So the optimum over a set of rows is the best partition into such runs, found
by a memoised search over (row subset, field subset) that enumerates the run holding the first row: exact over
all row orders and per-row field orders, without assuming that a run takes every row holding its value (checked
against brute force in the tests).

Two rules prune without losing the optimum. A cell shared by all rows leads: moving it to the front of every
row adds its weight to every hit and shortens no common prefix. Rows equal on every remaining field are sent
together: a row moved next to its copy gains its whole weight, and taking it out of its old place loses at most
that, since the rows that were its neighbours share at least the shorter of their two prefixes with each other.
The search stays exponential, hence the size limit; branch and bound keeps it to seconds at 16 rows x 6 fields.
A candidate run is skipped when its earnings plus upper bounds of its inside and of the rest cannot beat the best
partition found so far. The bound of rows ``R`` over fields ``F``: in any order, a row earns at most the weight of
the cells it shares with its predecessor, so at most its largest such weight with any other row of ``R``; the
first row earns nothing, so the row of the smallest such weight is left out. Only exact values are memoised.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from kvreuse.errors import TableError
from kvreuse.reorder.ordering import Ordering
from kvreuse.reorder.pinning import pinned_runs
from kvreuse.reorder.stats import EncodedTable

# 16 rows x 6 fields take up to seconds on tables of many repeated values; each extra row or field multiplies the
# worst case several times over.
OPHR_MAX_ROWS = 16
OPHR_MAX_COLS = 6

Plan = tuple[tuple[int, tuple[int, ...]], ...]


def ophr_order(encoded: EncodedTable, lead: tuple[int, ...] = ()) -> Ordering:
    """The send order of maximal PHC; :class:`TableError` past ``OPHR_MAX_ROWS`` x ``OPHR_MAX_COLS``.

    With pinned columns ``lead``, the optimum among the orders that lead every row with them: each run of equal
    pinned values solved exactly over the other columns (see :mod:`kvreuse.reorder.pinning`).
    """
    n, m = encoded.codes.shape
    if n > OPHR_MAX_ROWS or m > OPHR_MAX_COLS:
        raise TableError(
            f"OPHR is exponential and takes at most {OPHR_MAX_ROWS} rows x {OPHR_MAX_COLS} fields; "
            f"this table has {n} x {m}: use method 'ggr'"
        )
    search = _OptimalRuns(encoded)
    rest = sum(1 << c for c in range(m) if c not in lead)
    segments = []
    for run in pinned_runs(encoded.codes, lead):
        plan = search.best(sum(1 << r for r in run.tolist()), rest)[1]
        segments += [(np.array([row]), lead + order) for row, order in plan]
    return Ordering.from_segments(segments)


def _bits(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class _OptimalRuns:
    """The memoised search; subsets of rows and of fields are bit masks."""

    def __init__(self, encoded: EncodedTable) -> None:
        self.codes = encoded.codes.tolist()
        self.weight = (encoded.cell_lengths() ** 2).tolist()
        n, m = encoded.codes.shape
        # same[c][r]: the rows whose value in field c equals row r's.
        self.same = [
            [sum(1 << s for s in range(n) if self.codes[s][c] == self.codes[r][c]) for r in range(n)] for c in range(m)
        ]
        self.memo: dict[tuple[int, int], tuple[int, Plan]] = {}
        self.n, self.m = n, m
        self.partners: dict[int, list[list[tuple[int, int]]]] = {}  # fields -> per row (shared weight, row bit)
        self.bounds: dict[tuple[int, int], int] = {}

    def bound(self, rows: int, fields: int) -> int:
        """An upper bound of the PHC of ``rows`` over ``fields`` (see the module docstring)."""
        key = (rows, fields)
        if key in self.bounds:
            return self.bounds[key]
        if fields not in self.partners:
            cols = list(_bits(fields))
            self.partners[fields] = [
                sorted(
                    (
                        (sum(self.weight[r][c] for c in cols if self.codes[r][c] == self.codes[s][c]), 1 << s)
                        for s in range(self.n)
                        if s != r
                    ),
                    reverse=True,
                )
                for r in range(self.n)
            ]
        partners = self.partners[fields]
        best = [next((w for w, bit in partners[r] if bit & rows), 0) for r in _bits(rows)]
        value = sum(best) - min(best) if len(best) > 1 else 0
        self.bounds[key] = value
        return value

    def best(self, rows: int, fields: int) -> tuple[int, Plan]:
        """The maximal PHC of sending ``rows`` over ``fields``, and a plan ``((row, field order), ...)`` reaching it."""
        key = (rows, fields)
        if key not in self.memo:
            self.memo[key] = self._solve(rows, fields)
        return self.memo[key]

    def _solve(self, rows: int, fields: int) -> tuple[int, Plan]:
        members, cols = list(_bits(rows)), tuple(_bits(fields))
        if len(members) < 2 or not cols:
            return 0, tuple((r, cols) for r in members)
        first = members[0]
        for c in cols:
            if self.same[c][first] & rows == rows:
                value, plan = self.best(rows, fields & ~(1 << c))
                return value + (len(members) - 1) * self.weight[first][c], _lead(c, plan)
        copies: dict[tuple[int, ...], list[int]] = {}
        for r in members:
            copies.setdefault(tuple(self.codes[r][c] for c in cols), []).append(r)
        if len(copies) < len(members):
            return self._with_copies(list(copies.values()), fields, cols)
        rest = rows & ~(1 << first)
        value, plan = self.best(rest, fields)
        best_value, best_plan = value, ((first, cols),) + plan
        for c in sorted(cols, key=lambda c: -self.weight[first][c]):  # heavy runs first: good bounds early
            weight = self.weight[first][c]
            if weight == 0:
                continue  # a run led by an empty value earns only what its rows earn led by their next field
            candidates = self.same[c][first] & rest
            subset = candidates
            while subset:
                run = subset | (1 << first)
                gain = (run.bit_count() - 1) * weight
                inside = fields & ~(1 << c)
                if gain + self.bound(run, inside) + self.bound(rows & ~run, fields) <= best_value:
                    subset = (subset - 1) & candidates
                    continue
                inner, inner_plan = self.best(run, inside)
                outer, outer_plan = self.best(rows & ~run, fields)
                total = (run.bit_count() - 1) * weight + inner + outer
                if total > best_value:
                    best_value, best_plan = total, _lead(c, inner_plan) + outer_plan
                subset = (subset - 1) & candidates
        return best_value, best_plan

    def _with_copies(self, classes: list[list[int]], fields: int, cols: tuple[int, ...]) -> tuple[int, Plan]:
        """Solve over one row per class of equal rows, then send each row's copies right after it."""
        value, plan = self.best(sum(1 << members[0] for members in classes), fields)
        copies = {members[0]: members[1:] for members in classes}
        value += sum((len(members) - 1) * sum(self.weight[members[0]][c] for c in cols) for members in classes)
        return value, tuple((r, order) for row, order in plan for r in (row, *copies[row]))


def _lead(field: int, plan: Plan) -> Plan:
    return tuple((row, (field,) + order) for row, order in plan)
