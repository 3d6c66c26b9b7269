"""Pinned fields: fields that lead every prompt in a fixed order, so reordering cannot move them.

A model's answer can depend on where a field sits in its prompt (a small model names the row's ``Name`` when it
comes first and forgets it when it comes eighth), so a user may pin fields: they lead every row, in the order
given, and solvers order only the rows and the remaining fields. Pinning every field keeps the prompts exactly
as the table's field order writes them and reorders rows only, so answers can change only through the engine's
batching, never through the prompt.

With a fixed leading sequence, the best any order can do is send rows with equal pinned values together (the
rows of such a run share the whole pinned prefix and can share more; rows of different runs share at most part
of it), and order the runs lexicographically on the pinned values, which makes each pair of neighbouring runs
share the longest possible part of the pinned prefix. So every solver reduces to: sort on the pinned fields,
cut into runs of equal pinned values, and solve each run over the other fields.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from enum import StrEnum

import numpy as np
import pandas as pd

from kvreuse.errors import ConfigError, TableError
from kvreuse.reorder.baselines import sort_rows
from kvreuse.reorder.stats import column_stats, fixed_field_order


class FieldOrder(StrEnum):
    """Whether reordering may move a row's fields (``--field-order``, ``field_order=``); see :func:`field_pin`."""

    KEEP = "keep"  # every prompt lists the fields as the table (or ``fields``) does: rows move, prompts do not
    GLOBAL = "global"  # one field order for every row, the statistics-based fixed order
    FREE = "free"  # each row its own field order, as the method chooses (GGR's per-row orders)


FIELD_ORDERS = tuple(FieldOrder)


def resolve_pin(pin: Sequence[str] | None, names: Sequence[str]) -> tuple[int, ...]:
    """The column indices of the pinned field names, in the order given; ``()`` for no pins."""
    if pin is None:
        return ()
    if isinstance(pin, str):
        raise TableError(f"pin must be a list of field names, not the single string {pin!r}; write pin=[{pin!r}]")
    pin = list(pin)
    repeated = sorted(str(name) for name, count in Counter(pin).items() if count > 1)
    if repeated:
        raise TableError(f"pinned field(s) {', '.join(map(repr, repeated))} listed more than once")
    position = {name: i for i, name in enumerate(names)}
    unknown = [name for name in pin if name not in position]
    if unknown:
        raise TableError(
            f"cannot pin unknown field(s) {', '.join(map(repr, unknown))}; the prompt's fields are "
            f"{', '.join(map(repr, names))}"
        )
    return tuple(position[name] for name in pin)


def field_pin(table: pd.DataFrame, field_order: str, pin: Sequence[str] | None) -> list[str] | None:
    """The pin that makes a solver honour ``field_order`` on a prepared ``table``, the user's ``pin`` leading in
    every case.

    ``"keep"`` pins every field, in the table's order after ``pin``: each row's prompt is the one the user wrote,
    so its greedy answer is the model's answer to it whatever the row order. ``"global"`` pins every field in the
    statistics-based fixed order (:func:`kvreuse.reorder.stats.fixed_field_order`): every row's fields move the
    same way. ``"free"`` returns ``pin`` as given and lets the method order each row's other fields.
    """
    if field_order not in FIELD_ORDERS:
        raise ConfigError(f"unknown field order {field_order!r}; field orders: {', '.join(FIELD_ORDERS)}")
    if field_order == FieldOrder.FREE:
        return None if pin is None else list(pin)
    names = [str(c) for c in table.columns]
    lead = [names[c] for c in resolve_pin(pin, names)]
    if field_order == FieldOrder.KEEP:
        rest = names
    else:
        rest = [names[c] for c in fixed_field_order(column_stats(table))]
    return lead + [name for name in rest if name not in lead]


def pinned_runs(codes: np.ndarray, lead: Sequence[int]) -> list[np.ndarray]:
    """All rows, sorted on the pinned columns ``lead`` and cut into runs of equal pinned values, in send order."""
    rows = np.arange(codes.shape[0], dtype=np.int64)
    if not len(lead) or not len(rows):
        return [rows]
    rows = sort_rows(codes, rows, lead)
    keys = codes[rows][:, list(lead)]
    cuts = np.flatnonzero((keys[1:] != keys[:-1]).any(axis=1)) + 1
    return np.split(rows, cuts)
