"""What a job's order saved against the table's own order: tokens planned, wall time estimated from a probe."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvreuse.batch import Completion
from kvreuse.batch.backend import PrefixCacheModel
from kvreuse.batch.calibrate import planned_stats
from kvreuse.batch.savings import PROBE_ROWS, PrefillCost, measure_prefill_cost, time_saved_line
from kvreuse.reorder import BlockHitStats


class Clock:
    """A stand-in for ``time.perf_counter`` that only the backend moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class PricedBackend:
    """Charges the clock 1 ms per character of a prompt it has not seen before and 0.1 s a call (the decode
    step both passes share); keeps what it was asked."""

    cache_model = None

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.seen: set[str] = set()
        self.calls: list[tuple[list[str], int]] = []

    def generate(self, prompts: Sequence[str], *, max_tokens: int, progress: bool = False) -> list[Completion]:
        self.calls.append((list(prompts), max_tokens))
        self.clock.now += 0.1 + 0.001 * sum(len(p) for p in prompts if p not in self.seen)
        self.seen.update(prompts)
        return [Completion("a", None, None) for _ in prompts]


def job_prompts(n: int) -> list[str]:
    return [
        f"Q\n\nplot: a long plot summary that every row of this film repeats\nreview: number {i}\n" for i in range(n)
    ]


def test_the_probe_sends_its_prompts_cold_then_again_one_answer_token_each(monkeypatch):
    clock = Clock()
    monkeypatch.setattr("kvreuse.batch.savings.time.perf_counter", clock)
    backend = PricedBackend(clock)
    prompts = job_prompts(40)
    cost = measure_prefill_cost(backend, prompts)
    (first, first_tokens), (second, second_tokens) = backend.calls
    assert first == second and first_tokens == second_tokens == 1
    assert len(first) == cost.rows == PROBE_ROWS
    # each probe prompt is a job prompt behind a marker made for this probe: it shares no row with the job
    markers = {p.split("]", 1)[0] for p in first}
    assert len(markers) == PROBE_ROWS and all(p.endswith(prompts[k]) for k, p in enumerate(first))
    assert not set(first) & set(prompts)
    assert cost.cold_s == pytest.approx(0.1 + 0.001 * sum(map(len, first)))
    assert cost.cached_s == pytest.approx(0.1)  # the decode step is in both passes and cancels out


def test_a_second_probe_is_cold_again(monkeypatch):
    clock = Clock()
    monkeypatch.setattr("kvreuse.batch.savings.time.perf_counter", clock)
    backend = PricedBackend(clock)
    first = measure_prefill_cost(backend, job_prompts(4))
    second = measure_prefill_cost(backend, job_prompts(4))
    assert second.cold_s == pytest.approx(first.cold_s)


def test_the_cost_of_a_prefill_unit_is_the_time_the_cache_saved_over_the_units_it_saved():
    cost = PrefillCost(rows=16, cold_units=2_000, cached_units=400, cold_s=3.3, cached_s=1.7)
    assert cost.seconds_per_unit == pytest.approx(1.6 / 1_600)
    assert PrefillCost(16, 2_000, 400, 1.0, 1.2).seconds_per_unit == 0.0  # noise never makes prefill pay time
    assert PrefillCost(16, 30, 30, 1.0, 0.5).seconds_per_unit is None  # prompts shorter than a block


def test_the_summary_line_prices_the_prefill_saved_and_says_it_is_an_estimate():
    original, planned = BlockHitStats(10_000, 2_000, 8_000), BlockHitStats(10_000, 5_000, 5_000)
    cost = PrefillCost(rows=16, cold_units=2_000, cached_units=400, cold_s=3.3, cached_s=1.7)
    line = time_saved_line(planned, original, cost, "tokens")
    assert line.startswith("wall time saved  ~3.0 s saved against the table's own order (estimated: 3,000 prefill")
    assert "16 probe prompts sent cold and then cached: 3.30 s vs 1.70 s" in line
    assert "~3.0 s lost" in time_saved_line(original, planned, cost, "tokens")


def test_an_order_that_saves_no_prefill_saves_no_time_and_needs_no_probe():
    same = BlockHitStats(10_000, 2_000, 8_000)
    assert time_saved_line(same, same, None, "tokens") == (
        "wall time saved  none: the same prefill tokens as the table's own order"
    )


def test_planned_prefill_replays_the_prompts_through_a_cache_of_the_engines_size():
    rows = [f"row {k}: " + "x" * 25 for k in (1, 2, 3)]  # 32 characters each: 4 blocks of 8

    def tokenize(texts: list[str]) -> list[list[int]]:
        return [[ord(c) for c in text] for text in texts]

    unbounded = planned_stats(rows * 2, PrefixCacheModel(tokenize, block_size=8))
    small = planned_stats(rows * 2, PrefixCacheModel(tokenize, block_size=8, capacity_blocks=4))
    # unbounded, each row asked again reuses 3 blocks (its last is recomputed); a cache of one row's blocks has
    # evicted a row by the time it comes again
    assert unbounded.computed_tokens == 6 * 32 - 3 * 24
    assert small.computed_tokens == 6 * 32


def test_the_probe_takes_only_the_prompts_that_fill_half_the_engines_cache(monkeypatch):
    clock = Clock()
    monkeypatch.setattr("kvreuse.batch.savings.time.perf_counter", clock)
    backend = PricedBackend(clock)

    def tokenize(texts: list[str]) -> list[list[int]]:
        return [[ord(c) for c in text] for text in texts]

    # every probe prompt is 4 to 5 blocks of 16 characters: a cache of 20 blocks is half full after 2
    backend.cache_model = PrefixCacheModel(tokenize, block_size=16, capacity_blocks=20)
    cost = measure_prefill_cost(backend, [f"row {k:02d}: " + "x" * 52 for k in range(40)])
    assert cost.rows == 2 and len(backend.calls[0][0]) == 2
    assert cost.cached_units < cost.cold_units / 4  # the second pass is served from the cache, as planned
