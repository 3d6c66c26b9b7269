"""The A/B harness's report: a table with ratios against the first arm, JSON and a PNG plot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from harness import (  # noqa: E402
    RESULTS,
    SCRATCH,
    ArmFigures,
    agreement,
    alternate,
    bench_parser,
    describe_spread,
    format_table,
    output_dir,
    ratio_spread,
    report,
)


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
    assert [d["arm"] for d in data["arms"]] == ["stock", "reorder"]
    assert data["arms"][1]["hit_rate"] == 0.6
    assert data["machine"]["cores"] >= 1 and data["command"].startswith("python")  # what the figures ran on
    assert (tmp_path / "unit.png").read_bytes()[:4] == b"\x89PNG"


def test_answers_are_compared_only_where_an_earlier_arm_sent_the_same_prompt():
    stock = {0: ("a", (1,)), 1: ("b", (2,)), 2: ("c", (3,))}
    reordered = {0: ("a", (1,)), 1: ("b", (9,)), 2: ("c reordered", (3,))}
    assert agreement(reordered, [stock]) == 0.5  # row 2's prompt changed: no reference
    assert agreement(stock, []) is None


def test_a_run_writes_under_build_unless_asked_to_update_the_results_the_docs_cite():
    parser = bench_parser("A benchmark.\n\nMore.")
    assert output_dir(parser.parse_args([])) == SCRATCH and SCRATCH.parts[-2:] == ("build", "benchmarks")
    assert output_dir(parser.parse_args(["--update-results"])) == RESULTS
    assert RESULTS.parts[-3:] == ("docs", "benchmarks", "results")


def test_arms_alternate_forward_then_backward():
    assert [arm for _, arm in alternate(["a", "b", "c"], 3)] == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]


def test_the_spread_of_per_round_ratios_is_stated_or_one_run_is_said():
    two = ratio_spread([10.0, 12.0], [5.0, 8.0])  # 2.0x in round 1, 1.5x in round 2
    assert (two["median"], two["low"], two["high"], two["runs"]) == (1.75, 1.5, 2.0, 2)
    assert describe_spread(two) == "1.75x (1.50-2.00x over 2 runs)"
    assert describe_spread(ratio_spread([3.0], [2.0])) == "1.50x (one run)"
