"""Functional dependencies between single columns: ``c -> d`` when each value of ``c`` has one value of ``d``.

GGR uses them so that a group formed on a value of ``c`` also leads with the columns ``c`` fixes (a ZIP code
fixes its city and state), and scores the group with those columns' lengths too. Dependencies are represented
as ``{c: frozenset of the columns c determines}`` over column indices, without ``c -> c``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from kvreuse.errors import TableError

Dependencies = dict[int, frozenset[int]]


def discover_fds(codes: np.ndarray) -> Dependencies:
    """Every exact dependency ``c -> d`` that holds on all rows of an ``(n_rows, n_cols)`` code matrix.

    For each determinant ``c`` the rows are sorted by ``c`` once; ``d`` depends on ``c`` when ``d``'s code never
    changes between neighbours that agree on ``c``. That is one sort and one ``n_rows x n_cols`` comparison
    per determinant: ``O(n_cols * n_rows * (log n_rows + n_cols))`` time and ``O(n_rows * n_cols)`` memory.
    Columns whose values are all distinct (keys) are skipped as determinants: they determine every column, but
    their groups have a single row and never earn a prefix hit; so a table of fewer than two rows has none.
    """
    codes = np.asarray(codes)
    n_rows, n_cols = codes.shape
    found: Dependencies = {}
    for c in range(n_cols):
        by_c, agree = _sorted_by(codes, c)
        if agree.any():
            dependents = _unchanged(by_c, agree, [d for d in range(n_cols) if d != c])
            if dependents:
                found[c] = dependents
    return found


def holding_fds(codes: np.ndarray, fds: Dependencies) -> Dependencies:
    """The part of ``fds`` that holds exactly on ``codes``: declared dependencies may have exceptions."""
    codes = np.asarray(codes)
    held = {c: _unchanged(*_sorted_by(codes, c), sorted(dependents)) for c, dependents in fds.items()}
    return {c: dependents for c, dependents in held.items() if dependents}


def _sorted_by(codes: np.ndarray, c: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows sorted on column ``c``, and whether each neighbouring pair agrees on ``c``."""
    by_c = codes[np.argsort(codes[:, c], kind="stable")]
    return by_c, by_c[1:, c] == by_c[:-1, c]


def _unchanged(by_c: np.ndarray, agree: np.ndarray, candidates: list[int]) -> frozenset[int]:
    """The columns among ``candidates`` that never change between neighbours agreeing on the sort column."""
    changed = (by_c[1:][:, candidates] != by_c[:-1][:, candidates]) & agree[:, None]
    return frozenset(d for d, bad in zip(candidates, changed.any(axis=0).tolist()) if not bad)


def resolve_fds(given: Mapping[str, Iterable[str]], names: Sequence[str]) -> Dependencies:
    """User-declared dependencies by field name (``{"zip": ["city", "state"]}``) as column indices."""
    position = {name: i for i, name in enumerate(names)}
    out: Dependencies = {}
    for determinant, dependents in given.items():
        if isinstance(dependents, str):
            raise TableError(
                f"dependents of {determinant!r} must be a list of field names, not the string {dependents!r}"
            )
        for name in (determinant, *dependents):
            if name not in position:
                raise TableError(
                    f"functional dependency names unknown field {name!r}; the table's fields are "
                    f"{', '.join(map(repr, names))}"
                )
        c = position[determinant]
        out[c] = out.get(c, frozenset()) | frozenset(position[d] for d in dependents if position[d] != c)
    return out


def merge_fds(*sources: Mapping[int, Iterable[int]]) -> Dependencies:
    """The union of several dependency maps, closed under transitivity (``a -> b`` and ``b -> c`` give ``a -> c``).

    Discovered dependencies are already closed; declared ones may not be, and a declared ``b -> c`` extends a
    discovered ``a -> b``.
    """
    merged: dict[int, set[int]] = {}
    for source in sources:
        for c, dependents in source.items():
            merged.setdefault(c, set()).update(d for d in dependents if d != c)
    changed = True
    while changed:
        changed = False
        for c, dependents in merged.items():
            reach = set().union(*(merged.get(d, ()) for d in dependents)) - dependents - {c}
            if reach:
                dependents |= reach
                changed = True
    return {c: frozenset(d) for c, d in merged.items() if d}
