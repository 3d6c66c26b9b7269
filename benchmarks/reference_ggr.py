"""The paper's GGR, implemented as written, as the reference kvreuse's solver is compared with.

Liu, Biswal, Cheng, Mo, Cao, Gonzalez, Stoica, Zaharia, "Optimizing LLM Queries in Relational Data Analytics
Workloads" (arXiv 2403.05821, v4, 9 Apr 2025), Algorithm 1 "Greedy Group Recursion", with the three evident typos
fixed as others have noted: an inferred field's contribution is its value's squared length (line 6); the group's
leading values include the inferred ones (line 29); and line 29 prepends to the group's sub-result ``L_B`` and
appends the rest ``L_A``. Nothing else is added: no early stopping, no statistics fallback, no shared-cell rule.

* ``HitCount(v, c)``: ``R_v`` the rows holding ``v`` in ``c``; ``inferred`` the fields ``c'`` with ``(c, c')`` in
  the dependencies; ``HC = (len(v)**2 + sum of len(v')**2 over the inferred values) * (|R_v| - 1)``.
* ``GGR(T)``: one row: the row as it is (its remaining fields in table order). One field: rows sorted on it.
  Otherwise the ``(c, v)`` of largest ``HC`` over every field and every distinct value (the first found on ties,
  fields in table order, values in order of first appearance); its rows are sent first, led by ``v`` and the
  inferred values, followed by ``GGR`` of those rows over the other fields; then ``GGR`` of the other rows.

The "other rows" recursion is run as a loop (it is a tail call), and a subtable in which no value repeats is sent
as the algorithm would, row by row, in one step. Dependencies are kvreuse's exact discovered ones (the paper takes
them as input). ``reference_ggr(table)`` returns a :class:`kvreuse.reorder.Ordering`.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from kvreuse.reorder import Ordering, discover_fds, prepare_table
from kvreuse.reorder.stats import encode_table


def reference_ggr(table: pd.DataFrame) -> Ordering:
    """The paper's GGR order of ``table`` (prepared as kvreuse prepares it: cells as prompt text)."""
    encoded = encode_table(prepare_table(table, None))
    codes = encoded.codes
    lengths = encoded.cell_lengths()
    fds = {c: sorted(d) for c, d in discover_fds(codes).items()}
    out: list[tuple[int, tuple[int, ...]]] = []
    _ggr(codes, lengths, fds, np.arange(encoded.n_rows), tuple(range(encoded.n_cols)), (), out)
    return Ordering(np.array([r for r, _ in out], dtype=np.int64), tuple(order for _, order in out))


def _ggr(codes, lengths, fds, rows, cols, prefix, out) -> None:
    while len(rows):
        if len(rows) == 1 or not cols:
            out.extend((int(r), prefix + cols) for r in rows)
            return
        if len(cols) == 1:
            sorted_rows = rows[np.argsort(codes[rows, cols[0]], kind="stable")]
            out.extend((int(r), prefix + cols) for r in sorted_rows)
            return
        best = None  # (HC, column, first row holding the value)
        for c in cols:
            values = codes[rows, c]
            _, first, count = np.unique(values, return_index=True, return_counts=True)
            inferred = [d for d in fds.get(c, ()) if d in cols]
            weight = lengths[rows[first], c] ** 2
            for d in inferred:
                weight = weight + lengths[rows[first], d] ** 2
            hc = weight * (count - 1)
            # Values in order of first appearance; the first of the largest HC wins, as a strict ">" scan would.
            by_appearance = np.argsort(first, kind="stable")
            k = by_appearance[int(np.argmax(hc[by_appearance]))]
            if best is None or hc[k] > best[0]:
                best = (int(hc[k]), c, int(first[k]))
        hc, c, first_row = best
        if hc == 0 and len(np.unique(codes[rows, cols[0]])) == len(rows):
            # No value repeats in the first field: every step from here picks the next row's value in it, alone.
            lead = (cols[0], *[d for d in fds.get(cols[0], ()) if d in cols])
            rest = tuple(d for d in cols if d not in lead)
            out.extend((int(r), prefix + lead + rest) for r in rows)
            return
        value = codes[rows[first_row], c]
        lead = (c, *[d for d in fds.get(c, ()) if d in cols])
        member = codes[rows, c] == value
        _ggr(codes, lengths, fds, rows[member], tuple(d for d in cols if d not in lead), prefix + lead, out)
        rows = rows[~member]
