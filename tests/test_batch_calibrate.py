"""Calibration: the field order with the most reuse whose answers on sample rows agree with the user's order."""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import pandas as pd
import pytest

from kvreuse.batch import Completion, plan_table, run_table
from kvreuse.batch.calibrate import CALIBRATION_ROWS, calibrate, disagreement_bound, normalise, stratified_sample
from kvreuse.errors import ConfigError
from kvreuse.reorder import prepare_table


class FieldBackend:
    """Answers with the prompt's field lines: in their order (``blind=False``: the answer changes when fields
    move, as a small model's may), or sorted (the answer ignores field order)."""

    cache_model = None

    def __init__(self, blind: bool) -> None:
        self.blind = blind
        self.asked: list[str] = []

    def generate(self, prompts: Sequence[str], *, max_tokens: int, progress: bool = False) -> list[Completion]:
        self.asked.extend(prompts)
        lines = [p.split("\n\n", 1)[1].splitlines() for p in prompts]
        return [Completion(" | ".join(sorted(ls) if self.blind else ls), 1, 0) for ls in lines]


def reviews(n: int = 60) -> pd.DataFrame:
    """A unique review first, then a film's fields repeated across its reviews: moving fields pays."""
    rng = np.random.default_rng(0)
    films = rng.integers(0, 4, n)
    return pd.DataFrame(
        {
            "review": [f"review number {i} of a film" for i in range(n)],
            "title": [f"Film {f}" for f in films],
            "plot": [f"A long plot summary of film {f}, the same for every review of it" for f in films],
        }
    )


def test_answers_that_change_when_fields_move_keep_the_users_field_order():
    result = calibrate(reviews(), "Q", backend=FieldBackend(blind=False), n=12, max_tokens=4)
    assert result.chosen == "keep"
    assert result.candidate("free").exact < 1 and result.candidate("free").reuse > result.candidate("keep").reuse


def test_answers_that_ignore_field_order_let_the_order_with_the_most_reuse_be_chosen():
    result = calibrate(reviews(), "Q", backend=FieldBackend(blind=True), n=12, max_tokens=4)
    best = max(result.candidates, key=lambda c: c.reuse)
    assert result.chosen == best.field_order != "keep"
    assert all(c.exact == 1 for c in result.candidates)


def test_a_lower_floor_admits_orders_that_change_some_answers():
    result = calibrate(reviews(), "Q", backend=FieldBackend(blind=False), n=12, min_agreement=0.0, max_tokens=4)
    assert result.chosen == max(result.candidates, key=lambda c: c.reuse).field_order != "keep"


def test_each_candidate_costs_at_most_the_sample_and_one_with_the_users_prompts_is_not_asked():
    backend = FieldBackend(blind=False)
    table = pd.DataFrame({"title": ["a", "b", "a", "c"]})  # one field: every field order gives the same prompts
    result = calibrate(table, "Q", backend=backend, n=3, max_tokens=4)
    assert len(backend.asked) == result.requests == 3
    assert [c.asked for c in result.candidates] == [True, False, False]
    assert "(same prompts)" in result.table() and "<- chosen" in result.table()


def test_the_sample_takes_rows_in_turn_from_every_value_of_the_leading_field():
    table = prepare_table(pd.DataFrame({"kind": ["a"] * 50 + ["b"] * 3 + ["c"], "n": [str(i) for i in range(54)]}))
    rows = stratified_sample(table, 6)
    assert sorted(table["kind"].iloc[rows]) == ["a", "a", "a", "b", "b", "c"]  # turns: a b c, a b, a


def test_answers_are_compared_exactly_and_up_to_case_spaces_and_surrounding_punctuation():
    assert normalise("  Yes.\n") == normalise("yes") == "yes"
    assert normalise("New  York") == "new york" != normalise("no")


def test_run_table_calibrated_uses_the_chosen_field_order_and_keeps_the_figures():
    backend = FieldBackend(blind=False)
    result = run_table(reviews(), "Q", backend=backend, calibrate=10, max_tokens=4)
    assert result.calibration is not None and result.calibration.chosen == "keep"
    assert all(answer.startswith("review: ") for answer in result.answers)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(calibrate=0), "calibrate must be a positive number of sample rows"),
        (dict(calibrate=5, min_agreement=1.5), "min_agreement must be a fraction in [0, 1]"),
        (dict(calibrate=5, field_order="free"), "give either field_order or calibrate"),
    ],
)
def test_calibration_settings_are_checked(options, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        run_table(reviews(), "Q", backend=FieldBackend(blind=True), max_tokens=4, **options)


def test_the_default_sample_bounds_disagreement_below_3_percent_at_3_percent_of_a_10k_row_job():
    assert disagreement_bound(CALIBRATION_ROWS) == pytest.approx(0.0295, abs=1e-4)  # the rule of three: 3 / 100
    assert disagreement_bound(8) > 0.31  # what 8 rows, none disagreeing, could say
    assert 3 * CALIBRATION_ROWS <= 0.03 * 10_000  # at most 3 requests a sample row


def test_the_calibration_table_says_what_its_sample_size_can_bound():
    result = calibrate(reviews(), "Q", backend=FieldBackend(blind=True), n=12, max_tokens=4)
    assert result.table().endswith(
        "(no disagreement on 12 rows bounds a field order's disagreement rate below 22.1% at 95% confidence)"
    )


def test_sample_rows_are_asked_as_the_whole_tables_plan_sends_them():
    # 60 rows, films 0, 1, 2, 3 in turn: over the whole table GGR moves the repeated plot first; over the 4 sample
    # rows (the first 4: one per film, every value distinct) it has nothing to share and keeps the user's order
    table = reviews()
    table["plot"] = [f"A long plot summary of film {k % 4}, the same for every review of it" for k in range(60)]
    backend = FieldBackend(blind=True)
    calibrate(table, "Q", backend=backend, n=4, max_tokens=4)
    sent = {mode: set(plan_table(table, "Q", field_order=mode).prompts) for mode in ("keep", "global", "free")}
    assert len(backend.asked) == 4 * 3 and set(backend.asked) <= sent["keep"] | sent["global"] | sent["free"]
    assert set(backend.asked[4:8]) <= sent["global"] and set(backend.asked[8:]) <= sent["free"]
