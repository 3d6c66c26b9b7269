"""``make demo``: the main job, an LLM call per row of a real table, A/B on the real vLLM engine.

Table: ``shared/datasets/movies_small.csv`` (1,019 Rotten Tomatoes reviews of 51 movies, rows shuffled), asked
"is this movie suitable for kids?" with every field but ``id``, in the table's field order. Arms:

- ``stock``: rows and fields as they come, stock vLLM (prefix caching on, as by default);
- ``scheduler``: rows as they come, admitted by kvreuse's prefix-affinity scheduler
  (``--scheduler-cls kvreuse.vllm.PrefixAffinityScheduler``), which regroups what is waiting;
- ``reorder``: kvreuse's GGR order of rows and fields, stock scheduler;
- ``reorder+scheduler``: both.

Figures are vLLM's own (per-request ``num_cached_tokens``, ``vllm:prefix_cache_*`` counters). Random weights:
latency and cache figures only, answers mean nothing. Usage: ``python benchmarks/demo.py [--rows N]``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
from harness import Arm, BenchRequest, run_ab

from kvreuse.localmodel import DATASETS, build_model
from kvreuse.reorder.ordering import prompts
from kvreuse.reorder.solvers import solve
from kvreuse.reorder.table import prepare_table

REPO = Path(__file__).resolve().parents[1]
INSTRUCTION = (
    "Given the following fields of a movie and a user review, is this movie suitable for kids? Answer yes or no."
)


def movies_table(rows: int | None = None) -> pd.DataFrame:
    """The demo's table as prompt text: every field of ``movies_small.csv`` but ``id``; the first ``rows`` if given.

    The scheduler and Ray benchmarks ask the same question of the same table, so they take it from here.
    """
    df = pd.read_csv(DATASETS / "movies_small.csv", dtype=str, keep_default_na=False)
    if rows:
        df = df.head(rows)
    return prepare_table(df, [c for c in df.columns if c != "id"])


def table_requests(table: pd.DataFrame, method: str) -> list[BenchRequest]:
    """The table's requests in the send order of ``method``; keys are row positions in the original table."""
    ordering = solve(table, method)
    return [
        BenchRequest(int(row), prompt)
        for row, prompt in zip(ordering.rows, prompts(ordering, table, INSTRUCTION, "lines"))
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=None, help="use only the first N rows")
    parser.add_argument("--preset", default="small", help="local model preset (small, large)")
    args = parser.parse_args(argv)

    model = build_model(args.preset, REPO / "build" / "models" / args.preset)
    table = movies_table(args.rows)
    ggr = lambda _requests: table_requests(table, "ggr")  # noqa: E731 - the arm re-renders prompts in GGR order
    affinity = {"scheduler_cls": "kvreuse.vllm.PrefixAffinityScheduler"}
    arms = [
        Arm("stock"),
        Arm("scheduler", engine_args=affinity),
        Arm("reorder", prepare=ggr),
        Arm("reorder+scheduler", engine_args=affinity, prepare=ggr),
    ]
    run_ab("demo_movies", table_requests(table, "original"), arms, model, max_tokens=4)


if __name__ == "__main__":
    main()
