"""Table jobs as a new user runs them: the real model with its chat template, per field order, on public tables.

SmolLM2-135M-Instruct (``build/models/smollm2``, float32, greedy) on vLLM's CPU engine, every row sent as a chat
(the front ends' default), three tables of the PyPI package ``vega_datasets``, each with a question whose answer
is a column the model does not see:

* ``cars``: "Which region does this car come from?" (``Origin``), the other fields in the table's order;
* ``iris``: "Which species is this iris?" (``species``), the four measurements;
* ``airports``: "Which city is this airport in?" (``city``), country, state, name and code: the leading fields
  repeat (every airport is in the USA, 56 states).

Arms, one engine, its prefix cache emptied before each: ``original`` (rows and fields as given: the reference),
``rows only`` (the default: GGR over rows, the user's field order), ``calibrated`` (the field order
``calibrate=8`` chooses at floor 1.0; the calibration runs first, its requests counted apart, and the cache is
emptied after it) and ``free`` (GGR moving fields per row). Every arm runs twice, in order and then in reverse
order (the machine is shared: its wall time is the faster of the two; the answers of both runs must agree). Per
arm: prompt tokens and those computed (not served from the prefix cache, as vLLM reports them), wall time against
the original's, answers right (the known value, case-insensitive, in the answer) and identical to the
original's. Usage: ``python benchmarks/reorder_chat_orders.py [--rows 32] [--tables cars,iris,airports]``
(``--rows``: a random sample per table, seed 0). Writes ``results/reorder_chat_orders.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MODEL = REPO / "build" / "models" / "smollm2"
MAX_TOKENS = 8
ARMS = ("original", "rows only", "calibrated", "free")
CALIBRATION_ROWS = 8


def tables(rows: int) -> dict:
    """name -> (sample, fields, question, answer column)."""
    from vega_datasets import data

    cars = data.cars()
    airports = data.airports()
    specs = {
        "cars": (
            cars,
            [c for c in cars.columns if c != "Origin"],
            "Which region does this car come from: USA, Europe or Japan? Answer with one word.",
            "Origin",
        ),
        "iris": (
            data.iris(),
            ["sepalLength", "sepalWidth", "petalLength", "petalWidth"],
            "Which species is this iris: setosa, versicolor or virginica? Answer with one word.",
            "species",
        ),
        "airports": (
            airports,
            ["country", "state", "name", "iata"],
            "Which city is this airport in? Answer with the city's name.",
            "city",
        ),
    }
    return {
        name: (df.sample(n=min(rows, len(df)), random_state=0).reset_index(drop=True), fields, question, answer)
        for name, (df, fields, question, answer) in specs.items()
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--tables", default="cars,iris,airports")
    args = parser.parse_args(argv)
    from vllm import LLM

    from kvreuse.batch import run_table
    from kvreuse.batch.calibrate import calibrate
    from kvreuse.localmodel import local_engine_args
    from kvreuse.vllm.backend import VLLMBackend

    report = []
    chosen = tables(args.rows)
    llm = LLM(**local_engine_args(MODEL))
    backend = VLLMBackend(llm)
    backend.generate(["warm-up"], max_tokens=2)
    for name in args.tables.split(","):
        df, fields, question, answer = chosen[name]
        truth = [str(v).lower() for v in df[answer]]
        llm.reset_prefix_cache()
        start = time.perf_counter()
        calibration = calibrate(
            df, question, fields, backend=backend, n=CALIBRATION_ROWS, max_tokens=MAX_TOKENS, order="ggr"
        )
        calibration_s = time.perf_counter() - start
        print(calibration.table(), flush=True)
        options = {
            "original": dict(order="original"),
            "rows only": dict(order="ggr"),
            "calibrated": dict(order="ggr", field_order=calibration.chosen),
            "free": dict(order="ggr", field_order="free"),
        }
        runs: dict[str, list] = {arm: [] for arm in ARMS}
        for arm in [*ARMS, *reversed(ARMS)]:
            llm.reset_prefix_cache()
            start = time.perf_counter()
            result = run_table(df, question, fields, backend=backend, max_tokens=MAX_TOKENS, **options[arm])
            runs[arm].append((time.perf_counter() - start, result))
        reference = [str(a) for a in runs["original"][0][1].answers]
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
                seconds=min(first_s, second_s),
                seconds_both=[first_s, second_s],
                right=sum(t in a.lower() for t, a in zip(truth, answers)),
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
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "reorder_chat_orders.json").write_text(json.dumps(report, indent=2))
    plot(report, RESULTS / "reorder_chat_orders.png")


def print_table(report: list[dict]) -> None:
    print("| table | arm | prefill computed | vs original | wall s | vs original | right | same as original |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for entry in report:
        base = next(e for e in report if e["table"] == entry["table"] and e["arm"] == "original")
        arm = entry["arm"] + (f" ({entry['chosen']})" if entry["chosen"] else "")
        print(
            f"| {entry['table']} | {arm} | {entry['computed_tokens']:,} of {entry['prompt_tokens']:,} | "
            f"{base['computed_tokens'] / max(entry['computed_tokens'], 1):.2f}x fewer | {entry['seconds']:.1f} | "
            f"{base['seconds'] / entry['seconds']:.2f}x | {entry['right']}/{entry['rows']} | "
            f"{entry['same']}/{entry['rows']} |"
        )


def plot(report: list[dict], path: Path) -> None:
    """Prefill tokens computed per arm, relative to the original order, grouped by table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(dict.fromkeys(e["table"] for e in report))
    fig, ax = plt.subplots(figsize=(9, 4))
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
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
