"""The prefix-affinity scheduler against vLLM's FCFS scheduler, on a stream that cannot be sorted whole.

The movies table's rows arrive online in their original (shuffled) order, a few per engine step, each prompt
led by its movie's fields (the statistics field order), so prompts of one movie share ~100 tokens. The engine
runs few requests at a time with a KV cache too small to keep every movie, so the order in which waiting
requests are admitted decides what the cache still holds. Both arms run in-process so the scheduler's own
counters (requests admitted out of order, most skips of one request) can be read. Usage:
``python benchmarks/reorder_scheduler.py [--rounds 1]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before vLLM is imported: read the scheduler

from dataclasses import asdict  # noqa: E402

from harness import REPO, Arm, BenchRequest, bench_parser, output_dir, run_ab  # noqa: E402
from reorder_tables import MOVIES_QUESTION, movies_prompt_table  # noqa: E402

from kvreuse.localmodel import build_model  # noqa: E402
from kvreuse.reorder import column_stats, fixed_field_order, render_prompt  # noqa: E402

MAX_SKIPS = 32
ENGINE = dict(kv_cache_memory_bytes=8 << 20, max_num_seqs=8, max_model_len=1024)


def scheduler_counters(llm) -> dict:
    return asdict(llm.llm_engine.engine_core.engine_core.scheduler.reorder_counters())


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args(argv)
    model = build_model("small", REPO / "build" / "models" / "small")
    table = movies_prompt_table()
    fields = [table.columns[c] for c in fixed_field_order(column_stats(table))]
    stream = [
        BenchRequest(i, render_prompt(MOVIES_QUESTION, fields, [row[f] for f in fields]))
        for i, row in enumerate(table.to_dict("records"))
    ]
    affinity = dict(
        scheduler_cls="kvreuse.vllm.PrefixAffinityScheduler",
        additional_config={"kvreuse": {"reorder": {"max_skips": MAX_SKIPS, "max_wait_s": 3600.0}}},
    )
    run_ab(
        "reorder_scheduler",
        stream,
        [Arm("fcfs"), Arm("prefix-affinity", engine_args=affinity, figures=scheduler_counters)],
        model,
        max_tokens=4,
        base_engine_args=ENGINE,
        arrivals_per_step=8,
        rounds=args.rounds,
        out_dir=output_dir(args),
    )


if __name__ == "__main__":
    main()
