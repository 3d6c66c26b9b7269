"""The pipeline every batch front end runs: prepare a table, order it, render prompts, generate, map back.

Planning (:func:`plan_table`) is engine-free; :func:`answer_plans` sends one or more planned tables to a backend
as one stream, so a front end with several tables (the SQL ``llm()`` with two different instructions) still
gives the engine one batch, and hands each answer over as soon as it is done, so a front end can write it at
once; :func:`run_plans` collects them. Answers come back indexed by table position, never by send position:
reordering changes what is sent when, not which row an answer belongs to.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from kvreuse.batch.backend import Backend, Completion, PrefixCacheModel, stream_completions
from kvreuse.batch.progress import JobProgress, Tally
from kvreuse.errors import ConfigError
from kvreuse.reorder import (
    PROMPT_FORMATS,
    FieldOrder,
    ReorderConfig,
    field_pin,
    prepare_table,
    prompts,
    solve,
    token_hit_measure,
)


@dataclass(frozen=True)
class PlannedTable:
    """A table's prompts in send order; ``rows[i]`` is the table position that ``prompts[i]`` asks about."""

    prompts: list[str]
    rows: np.ndarray
    solve_s: float


@dataclass(frozen=True)
class BatchFigures:
    """What a batch cost, as the engine counted it.

    ``cached_tokens`` is ``None`` when the backend did not report it for every answered request (a hit rate from
    part of the requests would mislead). ``solve_s`` is time spent ordering, ``generate_s`` time waiting for the
    engine. ``errors`` counts the requests the engine refused (their rows carry the error); their tokens are not
    counted.
    """

    requests: int
    prompt_tokens: int | None
    cached_tokens: int | None
    solve_s: float
    generate_s: float
    errors: int = 0

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
            self.errors + other.errors,
        )

    @classmethod
    def of(cls, tally: Tally, solve_s: float, generate_s: float) -> BatchFigures:
        return cls(tally.requests, tally.prompt_tokens, tally.cached_tokens, solve_s, generate_s, tally.errors)


def plan_table(
    df: pd.DataFrame,
    instruction: str,
    fields: Sequence[str] | None = None,
    *,
    order: str = "ggr",
    field_order: str = FieldOrder.KEEP,
    fmt: str = "lines",
    pin: Sequence[str] | None = None,
    fds: Mapping[str, Iterable[str]] | None = None,
    config: ReorderConfig | None = None,
    cache_model: PrefixCacheModel | None = None,
) -> PlannedTable:
    """Order ``df``'s rows (and, with ``field_order="free"`` or ``"global"``, each row's ``fields``) by ``order``
    and render their prompts in send order.

    By default (``field_order="keep"``) every prompt lists its fields as ``fields`` (or the table) does and only
    the rows move, so every row's prompt, and so its greedy answer, is the one the user's order gives: a field's
    place in the prompt can change a model's answer (see :func:`kvreuse.reorder.field_pin`).

    Every row gets exactly one prompt, duplicates included, so every row keeps its own answer. With the engine's
    ``cache_model``, GGR solves on the engine's own tokens and blocks and keeps the best of its candidates on them
    (see ``solve``); ``solve_s`` counts that tokenization.
    ``pin`` names fields that lead every prompt in that order, whatever ``order`` does with the rest.
    ``config`` defaults to the user's settings (``KVREUSE_REORDER_*``), never to bare defaults.
    """
    config = ReorderConfig.load() if config is None else config
    if fmt not in PROMPT_FORMATS:
        raise ConfigError(f"prompt format {fmt!r} is not one of {', '.join(PROMPT_FORMATS)}")
    table = prepare_table(df, fields)
    start = time.perf_counter()
    pinned = field_pin(table, field_order, pin)
    measure = None
    if cache_model is not None and order == "ggr":
        # The backend's prefix (a chat template's preamble) is a shared head, as the instruction is.
        head = cache_model.prefix + instruction
        measure = token_hit_measure(table, head, fmt, cache_model.tokenize, cache_model.block_size)
    ordering = solve(table, order, pin=pinned, fds=fds, config=config, measure=measure)
    solve_s = time.perf_counter() - start
    return PlannedTable(prompts(ordering, table, instruction, fmt), np.asarray(ordering.rows, dtype=np.int64), solve_s)


def answer_plans(
    plans: Sequence[PlannedTable],
    backend: Backend,
    *,
    max_tokens: int,
    skip: Collection[tuple[int, int]] = (),
) -> Iterator[tuple[int, int, Completion]]:
    """``(plan index, table row, completion)`` for every row of every plan, as the backend finishes them.

    Every plan's prompts go to the backend as one stream, plan after plan, each in its send order; rows in
    ``skip`` (``(plan index, table row)`` pairs, e.g. answered by an earlier run) are not sent. A refused prompt
    comes back as a completion with an ``error``; an engine that stops answering raises ``BackendError`` after
    the rows already handed over.
    """
    check_max_tokens(max_tokens)
    rows: list[tuple[int, int]] = []
    sent: list[str] = []
    for k, plan in enumerate(plans):
        for prompt, row in zip(plan.prompts, plan.rows.tolist()):
            if (k, row) not in skip:
                rows.append((k, row))
                sent.append(prompt)
    for position, completion in stream_completions(backend, sent, max_tokens=max_tokens):
        k, row = rows[position]
        yield k, row, completion


def run_plans(
    plans: Sequence[PlannedTable], backend: Backend, *, max_tokens: int, progress: bool = False
) -> tuple[list[list[Completion]], BatchFigures]:
    """Every plan's completions by table position (``result[k][row]`` answers row ``row`` of plan ``k``) and the
    figures of the whole job (see :func:`answer_plans`); ``progress`` shows a bar on standard error."""
    check_max_tokens(max_tokens)
    by_plan: list[list[Completion]] = [[None] * len(plan.prompts) for plan in plans]  # type: ignore[list-item]
    start = time.perf_counter()
    with JobProgress(sum(len(plan.prompts) for plan in plans), enabled=progress) as bar:
        for k, row, completion in answer_plans(plans, backend, max_tokens=max_tokens):
            by_plan[k][row] = completion
            bar.add(completion)
    generate_s = time.perf_counter() - start
    return by_plan, BatchFigures.of(bar.tally, sum(plan.solve_s for plan in plans), generate_s)


def check_max_tokens(max_tokens: object) -> None:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ConfigError(f"max_tokens must be a positive integer, not {max_tokens!r}")


def sum_known(counts: Iterable[int | None]) -> int | None:
    """The sum of token counts, or ``None`` if any is unknown (a server that does not report cached tokens)."""
    total = 0
    for count in counts:
        if count is None:
            return None
        total += count
    return total
