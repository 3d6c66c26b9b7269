"""Calibration: choose how far fields may move by asking the model about a sample of the user's own rows.

Moving a row's fields shares more prompt prefix but can change a model's answer (a small model forgets a name
moved to the 8th line). Which orders keep the answers depends on the model, the question and the table, so it is
measured: :func:`calibrate` asks ``n`` sample rows, stratified over the table's leading field (rows taken in turn
from each of its values), in the user's field order (the reference answers) and in each candidate field order
(:data:`~kvreuse.reorder.FIELD_ORDERS`), each row's prompt exactly as the whole table's plan in that order sends
it, and compares each row's answer with its reference, exactly and after
normalising (case, surrounding spaces and punctuation, runs of spaces). A candidate whose sample prompts are the
reference's is not asked again (the same prompt gets the same greedy answer). It then picks the candidate with
the most reuse whose exact agreement is at least ``min_agreement`` (1.0: identical answers on every sample
row); the user's order always qualifies. Reuse is that of the whole table's plan: its prompts replayed through a
block cache model of the engine's tokens (:func:`kvreuse.reorder.block_hit_stats`) where the backend knows its
tokenizer, else through one of characters. Cost: ``n`` requests per candidate that moves fields, plus ``n``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from kvreuse.batch.backend import Backend, PrefixCacheModel
from kvreuse.batch.job import PlannedTable, check_max_tokens, plan_table, run_plans
from kvreuse.errors import ConfigError
from kvreuse.reorder import (
    FIELD_ORDERS,
    BlockHitStats,
    FieldOrder,
    ReorderConfig,
    block_hit_stats,
    prepare_table,
    render_prompt,
)

# The block size of the character model used when the backend's tokenizer is unknown (a server URL).
CHARACTER_BLOCK = 16

# Sample rows when the user asks for calibration without saying how many. The rule of three: a candidate with
# no disagreement on n independent sample rows has, at 95% confidence, a disagreement rate below about 3/n
# (exactly 1 - 0.05 ** (1 / n): :func:`disagreement_bound`), so 100 rows bound it below 3%; 8 rows would bound
# it only below 31%. The cost is at most 3 requests a sample row (the user's order and two others), 300
# requests: 3% of a 10,000-row job.
CALIBRATION_ROWS = 100


@dataclass(frozen=True)
class Candidate:
    """One field order's figures: the whole table's planned reuse and the sample's agreement with the reference."""

    field_order: str
    reuse: float  # planned fraction of prompt tokens (characters without a tokenizer) served from the cache
    prompt_units: int  # the whole table's prompt tokens (characters)
    computed_units: int  # of which computed
    exact: float  # fraction of sample rows answered exactly as in the user's order
    normalised: float  # the same after normalising both answers
    asked: bool  # whether the sample was asked in this order (False: its prompts are the reference's)


@dataclass(frozen=True)
class Calibration:
    """The candidates (the user's order first) and the field order chosen."""

    candidates: tuple[Candidate, ...]
    chosen: str
    sample_rows: int
    min_agreement: float
    units: str  # "tokens" or "characters"
    requests: int  # what the calibration asked the engine

    def candidate(self, field_order: str) -> Candidate:
        return next(c for c in self.candidates if c.field_order == field_order)

    def table(self) -> str:
        """The candidates as a text table (what ``kvreuse run --calibrate`` prints)."""
        lines = [
            f"calibration on {self.sample_rows} sample rows, {self.requests} requests (floor: "
            f"{self.min_agreement:.0%} identical answers)",
            f"  {'field order':<12} {'planned reuse':>13} {self.units + ' computed':>18} {'same':>6} "
            f"{'normalised':>10}",
        ]
        for c in self.candidates:
            mark = "  <- chosen" if c.field_order == self.chosen else ""
            asked = " (reference)" if c.field_order == FieldOrder.KEEP else "" if c.asked else " (same prompts)"
            lines.append(
                f"  {c.field_order:<12} {c.reuse:>13.1%} {c.computed_units:>18,} {c.exact:>6.0%} "
                f"{c.normalised:>10.0%}{asked}{mark}"
            )
        lines.append(
            f"  (no disagreement on {self.sample_rows} rows bounds a field order's disagreement rate below "
            f"{disagreement_bound(self.sample_rows):.1%} at 95% confidence)"
        )
        return "\n".join(lines)


def disagreement_bound(rows: int, confidence: float = 0.95) -> float:
    """The largest disagreement rate that ``rows`` sample rows, none disagreeing, leave possible at
    ``confidence`` (the exact form of the rule of three, 3 / rows)."""
    return 1.0 - (1.0 - confidence) ** (1.0 / rows)


def stratified_sample(table: pd.DataFrame, n: int) -> np.ndarray:
    """``n`` row positions (all rows if fewer), taken in turn from each value of the prepared ``table``'s first
    field (values in order of first appearance, rows in table order), so that no leading value is left out."""
    if len(table) <= n:
        return np.arange(len(table), dtype=np.int64)
    if table.shape[1] == 0:
        return np.arange(n, dtype=np.int64)
    first = table.iloc[:, 0]
    turn = first.groupby(first, sort=False).cumcount().to_numpy()  # k: the row is its value's k-th
    group = pd.factorize(first, sort=False)[0]
    order = np.lexsort((group, turn))  # every value's first row, then every value's second, ...
    return np.sort(order[:n]).astype(np.int64)


def normalise(answer: str) -> str:
    """An answer compared up to case, surrounding spaces and punctuation, and runs of spaces."""
    return re.sub(r"\s+", " ", answer.strip().strip(".,;:!?\"'`*()[]").strip().lower())


def calibrate(
    df: pd.DataFrame,
    instruction: str,
    fields: Sequence[str] | None = None,
    *,
    backend: Backend,
    n: int,
    min_agreement: float = 1.0,
    order: str = "ggr",
    fmt: str = "lines",
    max_tokens: int,
    pin: Sequence[str] | None = None,
    fds: Mapping[str, Iterable[str]] | None = None,
    config: ReorderConfig | None = None,
) -> Calibration:
    """Measure every field order on ``n`` sample rows of ``df`` and choose one (see the module's description)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"calibrate must be a positive number of sample rows, not {n!r}")
    if isinstance(min_agreement, bool) or not isinstance(min_agreement, (int, float)) or not 0 <= min_agreement <= 1:
        raise ConfigError(f"min_agreement must be a fraction in [0, 1], not {min_agreement!r}")
    check_max_tokens(max_tokens)
    options = dict(order=order, fmt=fmt, pin=pin, fds=fds, config=config, cache_model=backend.cache_model)
    whole = {mode: plan_table(df, instruction, fields, field_order=mode, **options) for mode in FIELD_ORDERS}
    sample = stratified_sample(prepare_table(df, fields), n)
    # Each sample row is asked exactly as the job would send it in each field order: a field order is planned
    # over the whole table (GGR's per-row field orders depend on the rows around each one), never over the sample.
    plans = {mode: _sample_plan(plan, sample) for mode, plan in whole.items()}
    reference = FieldOrder.KEEP
    asked = [mode for mode in FIELD_ORDERS if mode == reference or plans[mode].prompts != plans[reference].prompts]
    answers, _ = run_plans([plans[mode] for mode in asked], backend, max_tokens=max_tokens)
    by_mode = {mode: [c.text for c in completions] for mode, completions in zip(asked, answers)}
    candidates = []
    for mode in FIELD_ORDERS:
        texts = by_mode.get(mode, by_mode[reference])
        same = [a == b for a, b in zip(texts, by_mode[reference])]
        close = [normalise(a) == normalise(b) for a, b in zip(texts, by_mode[reference])]
        stats = planned_stats(whole[mode].prompts, backend.cache_model)
        candidates.append(
            Candidate(
                mode,
                stats.hit_rate,
                stats.prompt_tokens,
                stats.computed_tokens,
                float(np.mean(same)) if same else 1.0,
                float(np.mean(close)) if close else 1.0,
                mode in asked,
            )
        )
    # The most reuse at or above the floor; the user's order (listed first, always at 100%) wins ties.
    eligible = [c for c in candidates if c.exact >= min_agreement - 1e-12]
    chosen = max(eligible, key=lambda c: c.reuse)
    units = "tokens" if backend.cache_model is not None else "characters"
    requests = len(sample) * len(asked)
    return Calibration(tuple(candidates), chosen.field_order, len(sample), float(min_agreement), units, requests)


def _sample_plan(plan: PlannedTable, rows: np.ndarray) -> PlannedTable:
    """The prompts ``plan`` sends for the table positions ``rows``, in that order (position ``i`` answers
    ``rows[i]``)."""
    by_row = dict(zip(plan.rows.tolist(), plan.prompts))
    return PlannedTable([by_row[row] for row in rows.tolist()], np.arange(len(rows), dtype=np.int64), plan.solve_s)


def planned_stats(prompts: list[str], cache_model: PrefixCacheModel | None) -> BlockHitStats:
    """Tokens (characters, without a tokenizer) of sending ``prompts`` in order, and how many a block cache (of
    the engine's capacity, where known) reuses."""
    if cache_model is None:
        return block_hit_stats([[ord(c) for c in prompt] for prompt in prompts], CHARACTER_BLOCK)
    return block_hit_stats(cache_model.sent_tokens(prompts), cache_model.block_size, cache_model.capacity_blocks)


def original_prompts(df: pd.DataFrame, instruction: str, fields: Sequence[str] | None, fmt: str) -> list[str]:
    """The prompts of sending the table as given (rows and fields in the user's order): the baseline a job's
    summary compares its plan with."""
    table = prepare_table(df, fields)
    names = [str(name) for name in table.columns]
    return [render_prompt(instruction, names, values, fmt) for values in table.itertuples(index=False, name=None)]
