"""How close the planned prefill of ``kvreuse run``'s summary comes to vLLM's own count, per table and order.

``kvreuse run`` reports the prompt tokens vLLM computed for the job (its own prefix-cache count) beside the
tokens the table's own order would have computed, which is planned, not run: its prompts replayed through the
model of vLLM's prefix cache (:func:`kvreuse.batch.calibrate.planned_stats`). Here every order is both planned and
run, so the plan's error is measured: SmolLM2-135M-Instruct (``build/models/smollm2``) with its chat template on
vLLM's CPU engine, in process as ``kvreuse run`` starts it, greedy, 8 answer tokens, its prefix cache emptied
before each arm; ``--rows`` random rows per table (seed 0). Arms: the table's own order (``original``), the
default (GGR over rows, fields kept) and GGR moving fields (``free``). Tables: those of
``reorder_chat_orders.py`` (``movies`` asked about its review before the movie's description, the review
table's order: a unique field before a long shared one; ``flights``, ``penguins``) and three the project has not
tuned for: ``barley`` and ``weather`` (PyPI ``vega_datasets``: a field trial's yields; Seattle's daily weather) and
``fec`` (``/work/shared/datasets``' election contributions, 15 fields). Engines: ``--kv-cache-mib`` each (64: 45
blocks of 32 tokens, a job larger than its cache; 256: one that holds it).

Usage: ``python benchmarks/reorder_plan_accuracy.py [--rows 128] [--tables ...] [--kv-cache-mib 64,256]``;
writes ``reorder_plan_accuracy.json`` (the harness's output folder) and prints a table: per arm vLLM's computed
tokens, the plan's, the plan's error, and the ratio to the original order both ways (as the summary states it:
counted for the job, planned for the original; and as both runs counted it).

``--replay-engine-results`` starts no engine: it plans the arms of the committed results of ``reorder_engine.py``
(raw prompts, the ``small`` model's tokenizer, blocks of 32, its 256 MiB cache: 4,096 blocks; the orders whose
prompts the solver still sends: ``original``, ``sorted``, ``stats``, its ``ggr`` arm predating token-exact GGR)
and of ``reorder_chat_orders.py`` (SmolLM2's tokenizer and chat template, blocks of 32, its 64 MiB cache: 45
blocks; ``original``, ``rows only``, ``free``), and prints each plan beside the count vLLM recorded then.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, RESULTS, bench_parser, output_dir, write_results  # noqa: E402
from reorder_chat_orders import MAX_TOKENS, MODEL, SPECS  # noqa: E402

from kvreuse.localmodel import DATASETS

FEC = DATASETS / "fec_contributions.csv"
ARMS = {
    "original": dict(order="original"),
    "rows only": dict(order="ggr"),
    "free": dict(order="ggr", field_order="free"),
}


def review_table() -> tuple:
    """The movies table as a review table orders it: the review (unique) before the movie's description."""
    df, _, question, answer = SPECS["movies"]()
    return df, ["review_content", "movie_info"], "Is this review positive or negative? Answer with one word.", answer


def barley() -> tuple:
    from vega_datasets import data

    df = data.barley()
    return df, ["yield", "variety", "year", "site"], "Is this a good yield? Answer yes or no.", "site"


def weather() -> tuple:
    from vega_datasets import data

    df = data.seattle_weather().astype({"date": str})
    return (
        df,
        ["date", "precipitation", "temp_max", "temp_min", "wind"],
        "What was the weather that day: drizzle, rain, sun, snow or fog? Answer with one word.",
        "weather",
    )


def fec() -> tuple:
    from kvreuse.batch.table_io import read_table

    df = read_table(FEC)
    fields = [c for c in df.columns if c not in ("TRAN_ID",)][:10]
    return df, fields, "Is this contribution from a retired person? Answer yes or no.", fields[0]


TABLES = {
    "movies (review first)": review_table,
    "flights": SPECS["flights"],
    "penguins": SPECS["penguins"],
    "barley": barley,
    "weather": weather,
    "fec": fec,
}


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--tables", default=",".join(TABLES))
    parser.add_argument("--kv-cache-mib", default="64,256")
    parser.add_argument("--replay-engine-results", action="store_true")
    args = parser.parse_args(argv)
    if args.replay_engine_results:
        replay_engine_results()
        return
    from kvreuse.batch import run_table
    from kvreuse.batch.calibrate import planned_stats
    from kvreuse.batch.job import plan_table
    from kvreuse.localmodel import local_engine_args
    from kvreuse.patches.vllm_0_32 import shutdown_llm
    from kvreuse.vllm.backend import vllm_backend

    names = args.tables.split(",")
    chosen = {}
    for name in names:
        df, fields, question, _ = TABLES[name]()
        chosen[name] = (df.sample(n=min(args.rows, len(df)), random_state=0).reset_index(drop=True), fields, question)
    report = []
    for mib in [int(m) for m in args.kv_cache_mib.split(",")]:
        backend = vllm_backend(local_engine_args(MODEL, kv_cache_memory_bytes=mib << 20, max_model_len=1024))
        try:
            backend.generate(["warm-up"], max_tokens=2)
            model = backend.cache_model
            for name in names:
                df, fields, question = chosen[name]
                entries = {}
                for arm, options in ARMS.items():
                    plan = plan_table(df, question, fields, cache_model=model, **options)
                    start = time.perf_counter()
                    planned = planned_stats(plan.prompts, model)
                    plan_s = time.perf_counter() - start
                    backend.reset_prefix_cache()
                    start = time.perf_counter()
                    figures = run_table(df, question, fields, backend=backend, max_tokens=MAX_TOKENS, **options).figures
                    counted = figures.prompt_tokens - figures.cached_tokens
                    entries[arm] = entry = dict(
                        kv_cache_mib=mib,
                        blocks=model.capacity_blocks,
                        table=name,
                        arm=arm,
                        rows=len(df),
                        prompt_tokens=figures.prompt_tokens,
                        planned_prompt_tokens=planned.prompt_tokens,
                        computed_tokens=counted,
                        planned_computed_tokens=planned.computed_tokens,
                        plan_error=(planned.computed_tokens - counted) / counted,
                        plan_s=plan_s,
                        run_s=time.perf_counter() - start,
                    )
                    report.append(entry)
                    print(json.dumps(entry), flush=True)
                base = entries["original"]
                for entry in entries.values():
                    entry["vs_original_counted"] = base["computed_tokens"] / entry["computed_tokens"]
                    entry["vs_original_as_summarised"] = base["planned_computed_tokens"] / entry["computed_tokens"]
        finally:
            shutdown_llm(backend.llm)
    print_table(report)
    write_results("reorder_plan_accuracy", {"settings": vars(args), "rows": report}, output_dir(args))


def committed_rows(name: str) -> list[dict[str, Any]]:
    """The rows of a committed result (the harness's record, or a list of rows written before it)."""
    data = json.loads((RESULTS / f"{name}.json").read_text())
    return data["rows"] if isinstance(data, dict) else data


def replay_engine_results() -> None:
    """Plan each order of ``reorder_engine.py``'s committed results and print the plan beside vLLM's count."""
    from reorder_orders import BLOCK, INSTRUCTION, load_tables
    from transformers import AutoTokenizer

    from kvreuse.batch.backend import PrefixCacheModel
    from kvreuse.batch.calibrate import planned_stats
    from kvreuse.reorder import prepare_table, prompts, solve
    from kvreuse.vllm.backend import batch_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(REPO / "build" / "models" / "small")
    bytes_per_token = 2 * 2 * 2 * 64 * 4  # K and V, 2 layers, 2 KV heads of 64, float32
    model = PrefixCacheModel(
        batch_tokenizer(tokenizer), BLOCK, capacity_blocks=(256 << 20) // (bytes_per_token * BLOCK)
    )
    tables = load_tables()
    tables["fec"] = tables["fec"].head(3000)  # reorder_engine.py's --fec-rows
    print("| table | order | prompt tokens | computed: vLLM | planned | plan's error |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name in ("movies", "fec", "airports", "penguins"):
        table = prepare_table(tables[name], None)
        counted = {e["arm"]: e for e in committed_rows(f"reorder_engine_{name}")}
        for method in ("original", "sorted", "stats"):
            planned = planned_stats(prompts(solve(table, method), table, INSTRUCTION), model)
            vllm = counted[method]["computed_prompt_tokens"]
            print(
                f"| {name} | {method} | {counted[method]['prompt_tokens']:,} | {vllm:,} | {planned.computed_tokens:,} "
                f"| {(planned.computed_tokens - vllm) / vllm:+.1%} |"
            )
    replay_chat_results()


def replay_chat_results() -> None:
    """The same for ``reorder_chat_orders.py``'s committed results (its 128 rows per table, seed 0)."""
    import reorder_chat_orders
    from transformers import AutoTokenizer

    from kvreuse.batch.backend import PrefixCacheModel
    from kvreuse.batch.calibrate import planned_stats
    from kvreuse.batch.chat import template_frame
    from kvreuse.batch.job import plan_table
    from kvreuse.vllm.backend import batch_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(MODEL))
    head, tail = template_frame(
        lambda messages: str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    )
    bytes_per_token = 30 * 2 * 3 * 64 * 4  # SmolLM2 in float32: 30 layers, K and V, 3 KV heads of 64
    blocks = (64 << 20) // (bytes_per_token * 32)
    model = PrefixCacheModel(
        batch_tokenizer(tokenizer, special_tokens=False), 32, prefix=head, suffix=tail, capacity_blocks=blocks
    )
    counted = {(e["table"], e["arm"]): e for e in committed_rows("reorder_chat_orders")}
    names = list(dict.fromkeys(table for table, _ in counted))
    chosen = reorder_chat_orders.tables(128, names)
    for name in names:
        df, fields, question, _ = chosen[name]
        for arm, options in ARMS.items():
            planned = planned_stats(plan_table(df, question, fields, cache_model=model, **options).prompts, model)
            vllm = counted[(name, arm)]["computed_tokens"]
            print(
                f"| {name} (chat, {blocks} blocks) | {arm} | {counted[(name, arm)]['prompt_tokens']:,} | {vllm:,} | "
                f"{planned.computed_tokens:,} | {(planned.computed_tokens - vllm) / vllm:+.1%} |"
            )


def print_table(report: list[dict]) -> None:
    print(
        "| KV cache | table | arm | prompt tokens | computed: vLLM | planned | plan's error "
        "| original / this: counted | as the summary states it |"
    )
    print("| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for e in report:
        print(
            f"| {e['kv_cache_mib']} MiB ({e['blocks']} blocks) | {e['table']} | {e['arm']} | {e['prompt_tokens']:,} | "
            f"{e['computed_tokens']:,} | {e['planned_computed_tokens']:,} | {e['plan_error']:+.1%} | "
            f"{e['vs_original_counted']:.2f}x | {e['vs_original_as_summarised']:.2f}x |"
        )


if __name__ == "__main__":
    main()
