"""What a job's order saved against the table's own order, without running the job twice.

Prefill tokens saved are planned: both orders' prompts replayed through the model of the engine's block cache
(:func:`kvreuse.batch.calibrate.planned_stats`). Wall time saved cannot be measured without sending the table in
its own order too, which would double the job, so it is estimated: the tokens saved times the engine's cost of
one prefill token, measured at the end of the job by a probe (:func:`measure_prefill_cost`): a few of the
table's prompts, each behind a marker no other prompt has, are sent twice, one answer token each: the first time
their tokens are computed, the second time they are served from the prefix cache, and nothing else differs
(same prompts, same single decode step), so the time between the two passes is the prefill of the tokens that
were not cached. It assumes the job's prefill costs per token what the probe's did (the probe runs its prompts
as one batch, as the job does); decode is the same in both orders (same prompts, greedy) and is not counted.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvreuse.batch.backend import Backend
from kvreuse.batch.calibrate import planned_stats
from kvreuse.reorder import BlockHitStats

# Prompts the probe sends twice: enough prefill to time above the noise of one engine step, a few percent of the
# time of a job of a few hundred rows.
PROBE_ROWS = 16


@dataclass(frozen=True)
class PrefillCost:
    """The probe's figures: ``units`` (tokens, or characters where the tokenizer is unknown) computed and wall
    seconds of its cold pass and of its cached pass."""

    rows: int
    cold_units: int
    cached_units: int
    cold_s: float
    cached_s: float

    @property
    def seconds_per_unit(self) -> float | None:
        """Seconds of prefill per token (character) not served from the cache; ``None`` where the probe's
        prompts were too short to leave any to the cache."""
        if self.cold_units <= self.cached_units:
            return None
        return max(self.cold_s - self.cached_s, 0.0) / (self.cold_units - self.cached_units)


def measure_prefill_cost(backend: Backend, prompts: Sequence[str]) -> PrefillCost:
    """Time the first :data:`PROBE_ROWS` of ``prompts`` sent cold, then again from the cache (module description).

    Each probe prompt starts with a marker made for this call, so it shares nothing with the job's prompts (or an
    earlier probe's) beyond the shared head (a chat template's preamble), and the cold pass computes its rows.
    Where the engine's cache size is known, the probe takes only as many prompts as fill half of it, so that the
    second pass finds the first pass's blocks still cached (at least one prompt).
    """
    marker = secrets.token_hex(8)
    probe = [f"[{marker}-{k}] {prompt}" for k, prompt in enumerate(prompts[:PROBE_ROWS])]
    model = backend.cache_model
    if model is not None and model.capacity_blocks is not None and probe:
        blocks = [len(ids) // model.block_size for ids in model.tokenize([model.prefix + p for p in probe])]
        fits = int(np.searchsorted(np.cumsum(blocks), model.capacity_blocks // 2, side="right"))
        probe = probe[: max(fits, 1)]
    cold = planned_stats(probe, backend.cache_model)
    both = planned_stats(probe + probe, backend.cache_model)
    start = time.perf_counter()
    backend.generate(probe, max_tokens=1)
    cold_s = time.perf_counter() - start
    start = time.perf_counter()
    backend.generate(probe, max_tokens=1)
    cached_s = time.perf_counter() - start
    return PrefillCost(len(probe), cold.computed_tokens, both.computed_tokens - cold.computed_tokens, cold_s, cached_s)


def time_saved_line(planned: BlockHitStats, original: BlockHitStats, cost: PrefillCost | None, units: str) -> str:
    """The summary line estimating the wall time the job's order saved against the table's own order (``cost``:
    the probe's figures, ``None`` where the two orders compute the same prefill and none was sent)."""
    if cost is None or planned.computed_tokens == original.computed_tokens:
        return f"wall time saved  none: the same prefill {units} as the table's own order"
    per_unit = cost.seconds_per_unit
    if per_unit is None:
        return f"wall time saved  not estimated (the {cost.rows} probe prompts were shorter than a cache block)"
    saved = original.computed_tokens - planned.computed_tokens
    seconds = saved * per_unit
    verb = "saved" if seconds >= 0 else "lost"
    return (
        f"wall time saved  ~{abs(seconds):.1f} s {verb} against the table's own order (estimated: {saved:,} prefill "
        f"{units} x {per_unit * 1e3:.3f} ms, the cost of one measured on {cost.rows} probe prompts sent cold and "
        f"then cached: {cost.cold_s:.2f} s vs {cost.cached_s:.2f} s)"
    )
