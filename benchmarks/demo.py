"""``make demo``: a table job as a user runs it, on the real model, against the table sent as it is.

SmolLM2-135M-Instruct (``build/models/smollm2``, float32, greedy, each row sent as a chat with its template, as
every kvreuse front end does) on vLLM's CPU or GPU engine, asked of ``--rows`` random reviews (seed 0) of
``movies_small.csv`` (Rotten Tomatoes reviews of 51 movies): "Which movie is this review about?" from the review's
link, the movie's description and the review, in that order (the movie, then the review); the movie's title, which
the model does not see, is the right answer. Arms, all on one engine whose prefix cache is emptied before every run:

- ``table order`` (stock): rows and fields as they come, what the engine does without kvreuse;
- ``kvreuse (default)``: the plan ``kvreuse run`` makes by default: rows reordered (GGR on the engine's tokens),
  each prompt's fields kept in the given order, so every prompt is one the table order sends too;
- ``global fields`` and ``free fields`` (opt-in, ``--field-order``): fields moved too, one order for all rows or
  each row its own; more reuse, and a field's place can change an answer.

The engine's KV cache is small (``--kv-cache-mib``, 64 MiB: 45 blocks of 32 tokens) so that the job is larger
than the cache, as a 10,000-row table is for any cache: a job the cache holds whole gains nothing from its order.
The arms take turns, forward then backward, ``--rounds`` times; wall-time ratios are per round against the table
order's run beside them. Writes ``demo_movies.json`` and ``.png`` under ``build/benchmarks/`` (with
``--update-results``, the docs' ``docs/benchmarks/results/``). Usage: ``python benchmarks/demo.py [--rows 120]
[--rounds 2]``.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

from harness import REPO, alternate, bench_parser, describe_spread, engine, new_figure, output_dir, ratio_spread
from harness import write_results as write

MODEL_PRESET = "smollm2"
QUESTION = "Which movie is this review about? Answer with the movie's title."
FIELDS = ["rotten_tomatoes_link", "movie_info", "review_content"]  # the movie, then its review; no title or id
TRUTH = "movie_title"
ARMS: dict[str, dict[str, str]] = {
    "table order": dict(order="original"),
    "kvreuse (default)": dict(order="ggr", field_order="keep"),
    "global fields": dict(order="ggr", field_order="global"),
    "free fields": dict(order="ggr", field_order="free"),
}
STOCK = "table order"
MAX_TOKENS = 12

COLUMNS = """Columns:
  prefill computed   prompt tokens vLLM computed (not served from its prefix cache), of all prompt tokens
  fewer              the table order's prefill over this arm's (2.00x: half the prefill)
  wall s             median wall time of the arm's runs
  speed              the table order's wall time over this arm's, per round (median, and lowest-highest)
  right              answers that name the movie (its title, a whole-word match)
  kept               the table order's right answers this arm also got right
  identical          answers token for token the table order's"""


def right(truth: str, answer: str) -> bool:
    """Whether ``truth`` (a title) is in ``answer`` as whole words, case-insensitive."""
    return re.search(rf"(?<!\w){re.escape(truth.lower())}(?!\w)", answer.lower()) is not None


def sample(rows: int) -> Any:
    from kvreuse.batch.table_io import read_table
    from kvreuse.localmodel import DATASETS

    table = read_table(DATASETS / "movies_small.csv")
    return table.sample(n=min(rows, len(table)), random_state=0).reset_index(drop=True)


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--rows", type=int, default=120, help="random rows of movies_small.csv (seed 0)")
    parser.add_argument("--rounds", type=int, default=2, help="times each arm runs, alternating")
    parser.add_argument("--kv-cache-mib", type=int, default=64, help="the engine's KV cache, MiB")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the demo prints its own lines; vLLM's stay warnings
    from kvreuse.batch import run_table
    from kvreuse.localmodel import build_model
    from kvreuse.vllm.backend import VLLMBackend

    model = build_model(MODEL_PRESET, REPO / "build" / "models" / MODEL_PRESET)
    table = sample(args.rows)
    truth = [str(t) for t in table[TRUTH]]
    print(
        f"{len(table)} reviews of {table[TRUTH].nunique()} movies; {len(ARMS)} arms x {args.rounds} rounds", flush=True
    )
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    # A prompt here is under 1,024 tokens; a smaller max_model_len lets the small cache start.
    with engine(model, kv_cache_memory_bytes=args.kv_cache_mib << 20, max_model_len=1024) as llm:
        backend = VLLMBackend(llm)
        backend.generate(["warm-up"], max_tokens=2)
        for round_, arm in alternate(list(ARMS), args.rounds):
            llm.reset_prefix_cache()
            start = time.perf_counter()
            result = run_table(table, QUESTION, FIELDS, backend=backend, max_tokens=MAX_TOKENS, **ARMS[arm])
            seconds = time.perf_counter() - start
            figures = result.figures
            answers = [str(a) for a in result.answers]
            runs[arm].append(
                dict(
                    round=round_,
                    seconds=seconds,
                    prompt_tokens=figures.prompt_tokens,
                    answers=answers,
                    computed_tokens=figures.prompt_tokens - figures.cached_tokens,
                )
            )
            print(f"  round {round_ + 1}  {arm:<18} {seconds:6.1f} s", flush=True)
    arms = summarise(runs, truth)
    print_table(arms, len(table))
    payload = {
        "rows": len(table),
        "movies": int(table[TRUTH].nunique()),
        "question": QUESTION,
        "fields": FIELDS,
        "kv_cache_mib": args.kv_cache_mib,
        "rounds": args.rounds,
        "max_tokens": MAX_TOKENS,
        "arms": arms,
    }
    write("demo_movies", payload, output_dir(args), plot(arms, len(table)))


def summarise(runs: dict[str, list[dict[str, Any]]], truth: list[str]) -> list[dict[str, Any]]:
    """Per arm: vLLM's token counts, wall times and their ratios to the table order's per round, and its answers
    against the table order's (right, kept, identical; and whether its rounds answered alike)."""
    by_round = {arm: sorted(r, key=lambda run: run["round"]) for arm, r in runs.items()}
    stock = by_round[STOCK][0]["answers"]
    stock_right = [right(t, a) for t, a in zip(truth, stock)]
    out = []
    for arm, arm_runs in by_round.items():
        answers = arm_runs[0]["answers"]
        is_right = [right(t, a) for t, a in zip(truth, answers)]
        out.append(
            dict(
                arm=arm,
                plan=ARMS[arm],
                prompt_tokens=arm_runs[0]["prompt_tokens"],
                computed_tokens=arm_runs[0]["computed_tokens"],
                fewer=by_round[STOCK][0]["computed_tokens"] / max(arm_runs[0]["computed_tokens"], 1),
                seconds=[run["seconds"] for run in arm_runs],
                speed=ratio_spread([run["seconds"] for run in by_round[STOCK]], [run["seconds"] for run in arm_runs]),
                right=sum(is_right),
                kept=sum(s and r for s, r in zip(stock_right, is_right)),
                stock_right=sum(stock_right),
                identical=sum(a == b for a, b in zip(answers, stock)),
                same_in_every_round=all(run["answers"] == answers for run in arm_runs),
            )
        )
    return out


def print_table(arms: list[dict[str, Any]], rows: int) -> None:
    import statistics

    header = ("arm", "prefill computed", "fewer", "wall s", "speed", "right", "kept", "identical")
    lines = [header]
    for a in arms:
        lines.append(
            (
                a["arm"] + ("" if a["arm"] in (STOCK, "kvreuse (default)") else " (opt-in)"),
                f"{a['computed_tokens']:,} of {a['prompt_tokens']:,}",
                f"{a['fewer']:.2f}x",
                f"{statistics.median(a['seconds']):.1f}",
                "-" if a["arm"] == STOCK else describe_spread(a["speed"]),
                f"{a['right']}/{rows}",
                "-" if a["arm"] == STOCK else f"{a['kept']}/{a['stock_right']}",
                "-" if a["arm"] == STOCK else f"{a['identical']}/{rows}",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    print()
    for i, line in enumerate(lines):
        print("  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(line, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print()
    print(COLUMNS)
    if not all(a["same_in_every_round"] for a in arms):
        print("note: an arm's answers differed between its rounds (batching changed a greedy answer)")


def plot(arms: list[dict[str, Any]], rows: int) -> Any:
    """Three panels, one colour per arm: prefill computed, speed against the table order (with the rounds' range),
    and answers identical to the table order's."""
    names = [a["arm"] + ("" if a["arm"] in (STOCK, "kvreuse (default)") else "\n(opt-in)") for a in arms]
    colours = ["#7f7f7f", "#1b9e77", "#d95f02", "#7570b3"][: len(arms)]
    fig, (tokens, speed, same) = new_figure(1, 3, figsize=(13, 4.2))
    tokens.bar(names, [a["computed_tokens"] for a in arms], color=colours)
    tokens.set_title("prefill tokens computed (vLLM's count)")
    medians = [a["speed"]["median"] for a in arms]
    errors = [
        [m - a["speed"]["low"] for m, a in zip(medians, arms)],
        [a["speed"]["high"] - m for m, a in zip(medians, arms)],
    ]
    speed.bar(names, medians, color=colours, yerr=errors, capsize=4)
    speed.axhline(1.0, color="black", linewidth=0.8)
    speed.set_title("speed vs table order (median, range over rounds)")
    same.bar(names, [a["identical"] / rows for a in arms], color=colours)
    same.set_ylim(0, 1.05)
    same.set_title("answers identical to the table order's")
    for ax in (tokens, speed, same):
        ax.tick_params(axis="x", rotation=25)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    fig.suptitle(f"SmolLM2 with its chat template, {rows} movie reviews: the table order, kvreuse's default, opt-in")
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
