"""The pipeline every batch front end runs: prepare a table, order it, render prompts, generate, map back.

Planning (:func:`plan_table`) is engine-free; :func:`run_plans` sends one or more planned tables to a backend in
a single call, so a front end with several tables (the SQL ``llm()`` with two different instructions) still
gives the engine one batch. Answers come back indexed by table position, never by send position: reordering
changes what is sent when, not which row an answer belongs to.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from kvreuse.batch.backend import Backend, Completion, PrefixCacheModel
from kvreuse.errors import BackendError, ConfigError
from kvreuse.reorder import PROMPT_FORMATS, ReorderConfig, prepare_table, prompts, solve, token_hit_measure


@dataclass(frozen=True)
class PlannedTable:
    """A table's prompts in send order; ``rows[i]`` is the table position that ``prompts[i]`` asks about."""

    prompts: list[str]
    rows: np.ndarray
    solve_s: float


@dataclass(frozen=True)
class BatchFigures:
    """What a batch cost, as the engine counted it.

    ``cached_tokens`` is ``None`` when the backend did not report it for every request (a hit rate from part of
    the requests would mislead). ``solve_s`` is time spent ordering, ``generate_s`` time waiting for the engine.
    """

    requests: int
    prompt_tokens: int | None
    cached_tokens: int | None
    solve_s: float
    generate_s: float

    @property
    def hit_rate(self) -> float | None:
        """Fraction of prompt tokens served from the prefix cache, when both counts are known."""
        if self.cached_tokens is None or not self.prompt_tokens:
            return None
        return self.cached_tokens / self.prompt_tokens

    def __add__(self, other: BatchFigures) -> BatchFigures:
        return BatchFigures(
            self.requests + other.requests,
            sum_known([self.prompt_tokens, other.prompt_tokens]),
            sum_known([self.cached_tokens, other.cached_tokens]),
            self.solve_s + other.solve_s,
            self.generate_s + other.generate_s,
        )


def plan_table(
    df: pd.DataFrame,
    instruction: str,
    fields: Sequence[str] | None = None,
    *,
    order: str = "ggr",
    fmt: str = "lines",
    pin: Sequence[str] | None = None,
    fds: Mapping[str, Iterable[str]] | None = None,
    config: ReorderConfig | None = None,
    cache_model: PrefixCacheModel | None = None,
) -> PlannedTable:
    """Order ``df``'s rows (and each row's ``fields``) by ``order`` and render their prompts in send order.

    Every row gets exactly one prompt, duplicates included, so every row keeps its own answer. With the engine's
    ``cache_model``, GGR solves on the engine's own tokens and blocks and keeps the best of its candidates on them
    (see ``solve``); ``solve_s`` counts that tokenization.
    ``pin`` names fields that lead every prompt in that order, whatever ``order`` does with the rest.
    """
    if fmt not in PROMPT_FORMATS:
        raise ConfigError(f"prompt format {fmt!r} is not one of {', '.join(PROMPT_FORMATS)}")
    table = prepare_table(df, fields)
    start = time.perf_counter()
    measure = None
    if cache_model is not None and order == "ggr":
        measure = token_hit_measure(table, instruction, fmt, cache_model.tokenize, cache_model.block_size)
    ordering = solve(table, order, pin=pin, fds=fds, config=config, measure=measure)
    solve_s = time.perf_counter() - start
    return PlannedTable(prompts(ordering, table, instruction, fmt), np.asarray(ordering.rows, dtype=np.int64), solve_s)


def run_plans(
    plans: Sequence[PlannedTable], backend: Backend, *, max_tokens: int, progress: bool = False
) -> tuple[list[list[Completion]], BatchFigures]:
    """Send every plan's prompts in one backend call, plan after plan, each in its send order.

    Returns, per plan, its completions by table position (``result[k][row]`` answers row ``row`` of plan ``k``)
    and the figures of the whole call.
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ConfigError(f"max_tokens must be a positive integer, not {max_tokens!r}")
    sent = [prompt for plan in plans for prompt in plan.prompts]
    start = time.perf_counter()
    completions = backend.generate(sent, max_tokens=max_tokens, progress=progress)
    generate_s = time.perf_counter() - start
    if len(completions) != len(sent):
        raise BackendError(
            f"the backend returned {len(completions)} completion(s) for {len(sent)} prompt(s); "
            "a backend must answer every prompt, in order"
        )
    by_plan: list[list[Completion]] = []
    offset = 0
    for plan in plans:
        sent_by_plan = completions[offset : offset + len(plan.prompts)]
        # rows is a permutation, so its argsort is the inverse: the send position of each table position.
        by_plan.append([sent_by_plan[i] for i in np.argsort(plan.rows).tolist()])
        offset += len(plan.prompts)
    figures = BatchFigures(
        len(sent),
        sum_known(c.prompt_tokens for c in completions),
        sum_known(c.cached_tokens for c in completions),
        sum(plan.solve_s for plan in plans),
        generate_s,
    )
    return by_plan, figures


def sum_known(counts: Iterable[int | None]) -> int | None:
    """The sum of token counts, or ``None`` if any is unknown (a server that does not report cached tokens)."""
    total = 0
    for count in counts:
        if count is None:
            return None
        total += count
    return total
