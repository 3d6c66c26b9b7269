"""One entry point for every reordering method: ``solve(table, method)``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import StrEnum

import pandas as pd

from kvreuse.errors import ConfigError
from kvreuse.reorder.baselines import original_order, sorted_order, stats_order
from kvreuse.reorder.config import ReorderConfig
from kvreuse.reorder.dependencies import discover_fds, merge_fds, resolve_fds
from kvreuse.reorder.ggr import ggr_order
from kvreuse.reorder.ophr import ophr_order
from kvreuse.reorder.ordering import Ordering
from kvreuse.reorder.pinning import resolve_pin
from kvreuse.reorder.stats import encode_table
from kvreuse.reorder.table import prepare_table
from kvreuse.reorder.tokens import TokenHitMeasure, shared_start_order, sorted_neighbour_order


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
    pin: Sequence[str] | None = None,
    fds: Mapping[str, Iterable[str]] | None = None,
    config: ReorderConfig | None = None,
    measure: Callable[[Ordering], float] | None = None,
) -> Ordering:
    """The send order of ``table``'s rows, and of each row's fields, by ``method``.

    ``"original"``: as given. ``"sorted"``: rows sorted on the table's field order. ``"stats"``: fields in the
    statistics-based fixed order, rows sorted on it. ``"ggr"``: Greedy Group Recursion, the method to use.
    ``"ophr"``: the exact optimum, for tables of at most 16 rows x 6 fields (an oracle).

    ``pin`` names fields that lead every prompt, in that order, whatever the method (see
    :mod:`kvreuse.reorder.pinning`): pin a field whose place in the prompt matters to the answer; pin every
    field to keep the prompts exactly as the table writes them and reorder rows only.

    ``table`` is what :func:`prepare_table` returns (it is prepared again here, so raw tables work too: cells
    are compared as their prompt text). ``fds`` declares functional dependencies by field name,
    ``{"zip": ["city", "state"]}``; GGR merges them with those it discovers when ``config.discover_fds`` is on,
    and the other methods ignore them.

    ``measure`` scores an order the way the engine will (:func:`kvreuse.reorder.token_hit_measure`: the engine's
    tokenizer and block size). GGR maximises PHC, which counts characters of matching cells, while an engine
    reuses only whole blocks of tokens. With a measure, ``"ggr"`` returns the best under it of GGR, ``"stats"``
    and ``"sorted"`` (the first on ties), so it is never worse than any of them on it. Where the measure has the
    table's line tokens (:class:`kvreuse.reorder.TokenHitMeasure`, ``lines`` format), GGR itself solves on tokens:
    each cell weighs its line's tokens, groups stop at the last block boundary their prompts can hit, and rows no
    group takes follow the fields whose sorted values share the most tokens
    (:func:`kvreuse.reorder.tokens.sorted_neighbour_order`: numbers with common leading digits, names with a
    common first word); fields that lead a group together go first by the starts their values share
    (:func:`kvreuse.reorder.tokens.shared_start_order`), so that a group's first prompt shares the most with
    earlier ones; GGR on characters stays a candidate (on some tables its groups hit more blocks). A measure
    built for another table is a ``TableError``.
    """
    if method not in METHODS:
        raise ConfigError(f"unknown reordering method {method!r}; methods: {', '.join(METHODS)}")
    config = ReorderConfig() if config is None else config
    encoded = encode_table(prepare_table(table))
    lead = resolve_pin(pin, encoded.names)
    if method == "original":
        return original_order(encoded, lead)
    if method == "sorted":
        return sorted_order(encoded, lead)
    if method == "stats":
        return stats_order(encoded, lead)
    if method == "ophr":
        return ophr_order(encoded, lead)
    declared = resolve_fds(fds or {}, encoded.names)
    discovered = discover_fds(encoded.codes) if config.discover_fds else {}
    fds_used = merge_fds(discovered, declared)
    if isinstance(measure, TokenHitMeasure):
        measure.check_table(encoded)
    candidates: list[Ordering] = []  # GGR on tokens first: it wins ties
    if isinstance(measure, TokenHitMeasure) and measure.line_tokens is not None:
        tokens = measure.line_tokens
        neighbours = sorted_neighbour_order(encoded, tokens)
        blocks = (tokens.head_tokens, measure.block_size)
        starts = shared_start_order(encoded, tokens, neighbours)
        on_tokens = ggr_order(
            encoded,
            fds_used,
            config,
            lead,
            weights=tokens.lengths,
            blocks=blocks,
            field_order=neighbours,
            lead_order=starts,
        )
        candidates.append(on_tokens)
    ggr = ggr_order(encoded, fds_used, config, lead)
    if measure is None:
        return ggr
    candidates += [ggr, stats_order(encoded, lead), sorted_order(encoded, lead)]
    return max(candidates, key=measure)  # max keeps the first on ties
