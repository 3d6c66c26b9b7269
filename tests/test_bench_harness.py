"""The A/B harness's report: a table with ratios against the first arm, JSON and a PNG plot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from harness import ArmFigures, agreement, format_table, report  # noqa: E402


def _fig(arm, cached, wall):
    return ArmFigures(
        arm=arm,
        requests=10,
        prompt_tokens=1000,
        cached_tokens=cached,
        engine_cache_hits=cached,
        computed_prompt_tokens=1000 - cached,
        wall_s=wall,
        prepare_s=0.01,
        ttft_median_s=0.2,
        ttft_p90_s=0.3,
        same_answers=1.0,
    )


def test_table_shows_hit_rate_and_ratios_against_the_first_arm():
    table = format_table([_fig("stock", 200, 4.0), _fig("reorder", 600, 2.0)])
    stock, reorder = table.splitlines()[2:]
    assert "20.0%" in stock and "1.00x" in stock
    assert "60.0%" in reorder and "2.00x" in reorder  # 800 -> 400 computed tokens, 4 s -> 2 s


def test_report_writes_json_and_png(tmp_path: Path):
    report("unit", [_fig("stock", 200, 4.0), _fig("reorder", 600, 2.0)], tmp_path)
    data = json.loads((tmp_path / "unit.json").read_text())
    assert [d["arm"] for d in data] == ["stock", "reorder"]
    assert data[1]["hit_rate"] == 0.6
    assert (tmp_path / "unit.png").read_bytes()[:4] == b"\x89PNG"


def test_answers_are_compared_only_where_an_earlier_arm_sent_the_same_prompt():
    stock = {0: ("a", (1,)), 1: ("b", (2,)), 2: ("c", (3,))}
    reordered = {0: ("a", (1,)), 1: ("b", (9,)), 2: ("c reordered", (3,))}
    assert agreement(reordered, [stock]) == 0.5  # row 2's prompt changed: no reference
    assert agreement(stock, []) is None
