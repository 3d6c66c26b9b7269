"""``make demo``'s report: answers counted against the table order's (right, kept, identical), wall-time ratios per
round with their spread, a table whose columns are explained, and a plot (benchmarks/demo.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from demo import ARMS, COLUMNS, STOCK, plot, print_table, summarise  # noqa: E402

TRUTH = ["Heat", "Alien", "Up", "Jaws"]


def runs(seconds: dict[str, tuple[float, float]], answers: dict[str, list[str]]) -> dict:
    return {
        arm: [
            dict(
                round=r,
                seconds=seconds[arm][r],
                prompt_tokens=1000,
                computed_tokens=800 if arm == STOCK else 400,
                answers=answers[arm],
            )
            for r in (1, 0)  # in the order alternation ran them
        ]
        for arm in ARMS
    }


def test_answers_are_counted_against_the_table_orders_and_speed_per_round():
    stock = ["Heat.", "It is Alien", "Cars", "Jaws"]  # 3 right
    answers = {arm: stock for arm in ARMS}
    answers["free fields"] = ["Heat.", "Aliens", "Up", "Jaws!"]  # right 3: keeps 2 of stock's 3, gains Up
    seconds = {arm: (10.0, 12.0) for arm in ARMS}
    seconds["kvreuse (default)"] = (5.0, 8.0)  # 2.0x in round 0, 1.5x in round 1
    arms = {a["arm"]: a for a in summarise(runs(seconds, answers), TRUTH)}
    default, free = arms["kvreuse (default)"], arms["free fields"]
    assert (default["right"], default["kept"], default["identical"]) == (3, 3, 4)
    assert (free["right"], free["kept"], free["stock_right"], free["identical"]) == (3, 2, 3, 1)
    assert default["fewer"] == 2.0 and default["speed"]["low"] == 1.5 and default["speed"]["high"] == 2.0


def test_the_table_explains_every_column_and_the_plot_is_drawn(capsys, tmp_path):
    arms = summarise(runs({arm: (10.0, 11.0) for arm in ARMS}, {arm: TRUTH for arm in ARMS}), TRUTH)
    print_table(arms, len(TRUTH))
    out = capsys.readouterr().out
    header = out.strip().splitlines()[0].split()
    for column in ("prefill", "fewer", "wall", "speed", "right", "kept", "identical"):
        assert column in header and f"  {column}" in COLUMNS, column
    assert "(opt-in)" in out and len(out.splitlines()) < 25
    plot(arms, len(TRUTH)).savefig(tmp_path / "demo.png")
    assert (tmp_path / "demo.png").read_bytes()[:4] == b"\x89PNG"
