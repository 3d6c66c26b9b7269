"""One entry point for every reordering method: ``solve(table, method)``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from enum import StrEnum

import pandas as pd

from kvreuse.errors import ConfigError
from kvreuse.reorder.baselines import original_order, sorted_order, stats_order
from kvreuse.reorder.config import ReorderConfig
from kvreuse.reorder.dependencies import discover_fds, merge_fds, resolve_fds
from kvreuse.reorder.ggr import ggr_order
from kvreuse.reorder.ophr import ophr_order
from kvreuse.reorder.ordering import Ordering
from kvreuse.reorder.stats import encode_table
from kvreuse.reorder.table import prepare_table


class Order(StrEnum):
    """The reordering methods a user names (``--order``, ``order=``); see :func:`solve`."""

    ORIGINAL = "original"
    SORTED = "sorted"
    STATS = "stats"
    GGR = "ggr"
    OPHR = "ophr"


METHODS = tuple(Order)


def solve(
    table: pd.DataFrame,
    method: str,
    *,
    fds: Mapping[str, Iterable[str]] | None = None,
    config: ReorderConfig | None = None,
    measure: Callable[[Ordering], float] | None = None,
) -> Ordering:
    """The send order of ``table``'s rows, and of each row's fields, by ``method``.

    ``"original"``: as given. ``"sorted"``: rows sorted on the table's field order. ``"stats"``: fields in the
    statistics-based fixed order, rows sorted on it. ``"ggr"``: Greedy Group Recursion, the method to use.
    ``"ophr"``: the exact optimum, for tables of at most 10 rows x 4 fields (a test oracle).

    ``table`` is what :func:`prepare_table` returns (it is prepared again here, so raw tables work too: cells
    are compared as their prompt text). ``fds`` declares functional dependencies by field name,
    ``{"zip": ["city", "state"]}``; GGR merges them with those it discovers when ``config.discover_fds`` is on,
    and the other methods ignore them.

    ``measure`` scores an order the way the engine will (see :func:`kvreuse.reorder.measures.token_hit_measure`:
    the engine's tokenizer and block size). GGR maximises PHC, which counts characters of matching cells, while
    an engine reuses only whole blocks of tokens, so on some tables a baseline shares more full blocks. With a
    measure, ``"ggr"`` returns the best of GGR, ``"stats"`` and ``"sorted"`` under it, GGR on ties, and so is
    never worse than a baseline on the measure that matters.
    """
    if method not in METHODS:
        raise ConfigError(f"unknown reordering method {method!r}; methods: {', '.join(METHODS)}")
    config = ReorderConfig() if config is None else config
    encoded = encode_table(prepare_table(table))
    if method == "original":
        return original_order(encoded)
    if method == "sorted":
        return sorted_order(encoded)
    if method == "stats":
        return stats_order(encoded)
    if method == "ophr":
        return ophr_order(encoded)
    declared = resolve_fds(fds or {}, encoded.names)
    discovered = discover_fds(encoded.codes) if config.discover_fds else {}
    ggr = ggr_order(encoded, merge_fds(discovered, declared), config)
    if measure is None:
        return ggr
    return max((ggr, stats_order(encoded), sorted_order(encoded)), key=measure)  # max keeps the first on ties
