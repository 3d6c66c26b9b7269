"""GGR, Greedy Group Recursion (Liu et al. 2024, Algorithm 1): the solver for real tables.

GGR picks the (field, value) whose group earns the most, the hit value
``HV = (count - 1) * (len(value)**2 + sum over the fields it determines of their mean squared length)``,
sends that group first led by the field and the fields it determines, recurses into the group on the remaining
fields, and goes on with the other rows. Sending the group's rows together is what earns its ``count - 1`` hits;
rows outside the group cannot share its first cell, so groups never earn from each other.

Choices this implementation makes where the paper leaves room:

* The cells that every row of a subproblem shares lead at once, as one grouping step. This is never worse than
  any other choice (see :mod:`kvreuse.reorder.ophr`), and it saves one recursion level per shared field.
* A determined field leads with its determinant only if it is constant in the group (always so for discovered
  dependencies; a declared one may have exceptions, and then only the score uses it).
* Depth counts grouping steps (each fixes one or more leading fields of a row). Past ``max_depth`` steps, or once
  no group's HV exceeds ``min_group_hit`` (with the default 0: once no non-empty value repeats), the rest of a
  subproblem is sent in the statistics-based fixed order, rows sorted on it.
* Equal HVs go to the field with fewer distinct values in the whole table (its other values are more likely
  to form groups too), then to the longer value (more of the hit sits in one shared cell, which token-level
  caches also reuse), then to the earlier field and the smaller value, so the result is deterministic.

The "go on with the other rows" half of the recursion is a loop that never rescans: removing a group's rows only
lowers the counts of the values those rows hold, so a subproblem keeps its HVs in a lazy max-heap (an entry found
stale when popped is pushed back with its current value) and updates counts from the removed rows alone. Each
subproblem factorizes its cells once, so memory is ``O(rows x fields)``. Subproblems of at most
``SMALL_SUBPROBLEM`` rows, the great majority, are solved in plain Python by rescanning, which for so few rows is
cheaper than setting up arrays; both paths compute the same HVs with the same float operations and choose the same
groups.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

import numpy as np

from kvreuse.reorder.baselines import sort_rows
from kvreuse.reorder.config import ReorderConfig
from kvreuse.reorder.dependencies import Dependencies, holding_fds
from kvreuse.reorder.ordering import Ordering
from kvreuse.reorder.pinning import pinned_runs
from kvreuse.reorder.stats import EncodedTable, fixed_field_order

# Below this many rows the rescanning path is faster than the heap path (measured on fec_contributions.csv).
SMALL_SUBPROBLEM = 24


def ggr_order(
    encoded: EncodedTable,
    fds: Dependencies,
    config: ReorderConfig,
    lead: tuple[int, ...] = (),
    weights: tuple[np.ndarray, ...] | None = None,
    blocks: tuple[int, int] | None = None,
    field_order: tuple[int, ...] | None = None,
) -> Ordering:
    """The GGR send order of an encoded table, using the functional dependencies ``fds``.

    ``lead`` are pinned columns: every row leads with them, and GGR orders each run of equal pinned values over
    the other columns (see :mod:`kvreuse.reorder.pinning`). ``weights[c][code]`` is what sharing that cell earns
    (default: its squared length in characters, the paper's PHC); the engine's measure is the cell's line in
    tokens (:mod:`kvreuse.reorder.tokens`). With token weights, ``blocks = (head tokens, block size)`` says that
    only full blocks are reused: a subproblem whose shared prefix already reaches the last block boundary any of
    its prompts can hit (a hit never covers a prompt's last token) cannot earn more, and is sorted, not searched.
    ``field_order`` is the fixed order rows are sent in where no group is formed (default: the statistics order,
    :func:`fixed_field_order`); it also orders fields that lead together.
    """
    solver = _GreedyGroups(encoded, fds, config, weights, blocks, field_order)
    rest = tuple(c for c in range(encoded.n_cols) if c not in lead)
    for run in pinned_runs(encoded.codes, lead):
        solver.order(run, rest, lead, 0)
    return Ordering.from_segments(solver.segments)


class _GreedyGroups:
    """One GGR run; ``segments`` collects (rows, field order) runs in send order.

    Every cell has a global key, its column's offset plus its value's code, so one integer names a
    (field, value) pair and keys sort by field, then by value.
    """

    def __init__(
        self,
        encoded: EncodedTable,
        fds: Dependencies,
        config: ReorderConfig,
        weights: tuple[np.ndarray, ...] | None = None,
        blocks: tuple[int, int] | None = None,
        field_order: tuple[int, ...] | None = None,
    ) -> None:
        self.codes = encoded.codes
        self.exact = holding_fds(encoded.codes, fds)
        self.max_depth = config.max_depth
        self.threshold = config.min_group_hit
        if weights is None:
            weights = tuple(lengths**2 for lengths in encoded.lengths)
        self.cell_weight = np.empty(encoded.codes.shape, dtype=np.int64)
        for c, column_weights in enumerate(weights):
            self.cell_weight[:, c] = column_weights[encoded.codes[:, c]]
        self.blocks = blocks
        if blocks is not None:
            head, block = blocks
            # The last block boundary each row's prompt can hit: its length less the recomputed last token.
            self.last_boundary = (head + self.cell_weight.sum(axis=1) - 1) // block * block
        cardinality = np.array([len(lengths) for lengths in encoded.lengths], dtype=np.int64)
        self.offset = np.concatenate([[0], np.cumsum(cardinality)[:-1]]).astype(np.int64)
        self.key_column = np.repeat(np.arange(encoded.n_cols), cardinality).tolist()
        self.key_weight = np.concatenate(weights).astype(np.int64)
        self.key_card = np.repeat(cardinality, cardinality)
        self.key_neg_len = -np.concatenate(encoded.lengths).astype(np.int64)
        if field_order is None:
            field_order = fixed_field_order(encoded.stats())
        self.rank = {c: i for i, c in enumerate(field_order)}
        self.dependents = {c: sorted(dependents, key=self.rank.__getitem__) for c, dependents in fds.items()}
        self.segments: list[tuple[np.ndarray, tuple[int, ...]]] = []

    def fixed(self, rows: np.ndarray, cols: tuple[int, ...], prefix: tuple[int, ...]) -> None:
        """Send ``rows`` led by ``prefix``, then ``cols`` in the fixed order, rows sorted on it."""
        order = tuple(sorted(cols, key=self.rank.__getitem__))
        self.segments.append((sort_rows(self.codes, rows, order), prefix + order))

    def order(self, rows: np.ndarray, cols: tuple[int, ...], prefix: tuple[int, ...], depth: int) -> None:
        """Send ``rows``, which share the cells of ``prefix``, over the fields ``cols``."""
        if len(rows) < 2 or not cols or depth >= self.max_depth or self.filled(rows, prefix):
            self.fixed(rows, cols, prefix)
            return
        if len(rows) == 2:
            self.pair(rows, cols, prefix)
            return
        col_index = np.array(cols, dtype=np.int64)
        keys = self.codes[rows][:, col_index] + self.offset[col_index]
        weight = self.cell_weight[rows[0], col_index]
        shared = (keys == keys[0]).all(axis=0) & (weight > 0)
        if (len(rows) - 1) * int(weight[shared].sum()) > self.threshold:
            lead = tuple(sorted((c for c, s in zip(cols, shared.tolist()) if s), key=self.rank.__getitem__))
            cols, prefix, depth = tuple(c for c in cols if c not in lead), prefix + lead, depth + 1
            if not cols or depth >= self.max_depth:
                self.fixed(rows, cols, prefix)
                return
            col_index, keys = col_index[~shared], keys[:, ~shared]
        determined = [[d for d in self.dependents[c] if d in cols] if c in self.dependents else [] for c in cols]
        fd_weight = None
        if any(determined):
            # fd_weight[r, j]: the squared lengths of the fields that field cols[j] determines, in row r.
            fd_weight = np.zeros(keys.shape, dtype=np.float64)
            row_weight = self.cell_weight[rows]
            for j, dependents in enumerate(determined):
                if dependents:
                    fd_weight[:, j] = row_weight[:, dependents].sum(axis=1)
        alive = np.ones(len(rows), dtype=bool)
        groups = self.groups_by_rescan if len(rows) <= SMALL_SUBPROBLEM else self.groups_by_heap
        for members, key in groups(keys, fd_weight, alive):
            j = cols.index(self.key_column[key])
            group = rows[members]
            exact = self.exact.get(cols[j], frozenset())
            lead = (cols[j],) + tuple(d for d in determined[j] if d in exact or _constant(self.codes[group, d]))
            self.order(group, tuple(c for c in cols if c not in lead), prefix + lead, depth + 1)
        if alive.any():
            self.fixed(rows[alive], cols, prefix)

    def filled(self, rows: np.ndarray, prefix: tuple[int, ...]) -> bool:
        """Whether ``rows``' shared ``prefix`` reaches the last block boundary any of them can hit (token mode)."""
        if self.blocks is None:
            return False
        shared = self.blocks[0] + int(self.cell_weight[rows[0], list(prefix)].sum())
        return shared >= int(self.last_boundary[rows].max())

    def pair(self, rows: np.ndarray, cols: tuple[int, ...], prefix: tuple[int, ...]) -> None:
        """Two rows: the non-empty cells they share lead, all at once (the rest cannot earn), as in :meth:`order`."""
        first, second = rows.tolist()
        same = ((self.codes[first] == self.codes[second]) & (self.cell_weight[first] > 0)).tolist()
        lead = tuple(sorted((c for c in cols if same[c]), key=self.rank.__getitem__))
        if int(self.cell_weight[first, list(lead)].sum()) > self.threshold:
            cols, prefix = tuple(c for c in cols if c not in lead), prefix + lead
        self.fixed(rows, cols, prefix)

    def groups_by_heap(
        self, keys: np.ndarray, fd_weight: np.ndarray | None, alive: np.ndarray
    ) -> Iterator[tuple[np.ndarray, int]]:
        """Yield (member rows, key) of each group in turn, marking its rows not ``alive``; a lazy max-heap."""
        unique, inverse, count = np.unique(keys, return_inverse=True, return_counts=True)
        inverse = inverse.reshape(keys.shape)
        if fd_weight is None:
            fd_sum = np.zeros(len(unique), dtype=np.float64)
        else:
            fd_sum = np.bincount(inverse.ravel(), weights=fd_weight.ravel(), minlength=len(unique))
        weight = self.key_weight[unique]
        repeated = np.flatnonzero(count > 1)
        n = count[repeated]
        value = (n - 1) * (weight[repeated] * n + fd_sum[repeated]) / n
        keep = value > self.threshold
        repeated = repeated[keep]
        heap = list(
            zip(
                (-value[keep]).tolist(),
                self.key_card[unique[repeated]].tolist(),
                self.key_neg_len[unique[repeated]].tolist(),
                repeated.tolist(),
            )
        )
        if not heap:
            return
        heapq.heapify(heap)
        weight_of = weight.tolist()
        holders = np.argsort(inverse.ravel(), kind="stable") // keys.shape[1]  # rows holding key u: a CSR layout
        start = np.concatenate([[0], np.cumsum(count)]).tolist()
        while heap:
            stored, card, neg_len, u = heapq.heappop(heap)
            n = int(count[u])
            if n < 2:
                continue
            current = (n - 1) * (weight_of[u] * n + float(fd_sum[u])) / n
            if current <= self.threshold:
                continue
            if current != -stored:
                heapq.heappush(heap, (-current, card, neg_len, u))
                continue
            members = holders[start[u] : start[u + 1]]
            members = members[alive[members]]
            alive[members] = False
            removed = inverse[members].ravel()
            np.subtract.at(count, removed, 1)
            if fd_weight is not None:
                np.subtract.at(fd_sum, removed, fd_weight[members].ravel())
            yield members, int(unique[u])

    def groups_by_rescan(
        self, keys: np.ndarray, fd_weight: np.ndarray | None, alive: np.ndarray
    ) -> Iterator[tuple[np.ndarray, int]]:
        """What :meth:`groups_by_heap` yields, found by rescanning the live rows after each group."""
        row_keys = keys.tolist()
        row_fd = fd_weight.tolist() if fd_weight is not None else None
        live = list(range(len(row_keys)))
        while True:
            holders: dict[int, tuple[int, list[int]]] = {}
            for i in live:
                for j, key in enumerate(row_keys[i]):
                    holders.setdefault(key, (j, []))[1].append(i)
            best = None
            for key, (j, members) in holders.items():
                n = len(members)
                if n < 2:
                    continue
                fd = sum(row_fd[i][j] for i in members) if row_fd is not None else 0.0
                current = (n - 1) * (int(self.key_weight[key]) * n + fd) / n
                if current <= self.threshold:
                    continue
                rank = (-current, int(self.key_card[key]), int(self.key_neg_len[key]), key)
                if best is None or rank < best[0]:
                    best = (rank, members)
            if best is None:
                return
            (*_, key), members = best
            alive[members] = False
            live = [i for i in live if alive[i]]
            yield np.array(members, dtype=np.int64), key


def _constant(values: np.ndarray) -> bool:
    return bool((values == values[0]).all())
