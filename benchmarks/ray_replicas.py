"""Two engine replicas on Ray: naive batching vs a global sort vs prefix bucketing with prefix-aware routing.

Table: ``shared/datasets/movies_small.csv`` (1,019 reviews of 51 movies, rows shuffled), fields in GGR's order
(the film's fields before the review), asked one question per row. The same two replicas (Ray actors, each an
in-process ``vllm.LLM`` on the local model, one CPU each) run every arm, with their prefix caches emptied in
between. Arms:

- ``naive``: rows as they come, in consecutive batches, round-robin;
- ``sorted``: rows sorted by prompt, in consecutive batches, round-robin;
- ``bucketed+prefix-aware``: the streaming prefix bucketing (bounded buffer) and the prefix-aware router.

Figures are vLLM's own (per-request ``num_cached_tokens``); the arms take turns ``--rounds`` times (forward, then
backward) and wall time is each arm's median, with its ratio to ``naive``'s per round. Usage: ``python
benchmarks/ray_replicas.py [--rows N] [--replicas 2] [--rounds 1]``; writes ``ray_replicas.json`` and ``.png``
(the harness's output folder).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

from harness import alternate, bench_parser, describe_spread, new_figure, output_dir, ratio_spread, write_results
from reorder_tables import MOVIES_QUESTION, movies_prompt_table

from kvreuse.batch.distributed import answer_rows
from kvreuse.localmodel import build_model, local_engine_args
from kvreuse.reorder import prompts, solve

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = bench_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=1, help="times each arm runs, alternating")
    parser.add_argument("--rows", type=int, default=None, help="use only the first N rows")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--buffer", type=int, default=256, help="bucketing buffer (rows)")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument(
        "--kv-cache-mib",
        type=int,
        default=8,
        help="KV cache per replica (default 8 MiB = 4,096 tokens: a replica cannot hold every film)",
    )
    args = parser.parse_args(argv)

    import ray

    from kvreuse.vllm.ray_replicas import RayVLLMReplicas

    model = build_model("small", REPO / "build" / "models" / "small")
    table = movies_prompt_table(args.rows)
    ordering = solve(table, "ggr")  # for its per-row field order; the row order is what the arms change
    by_row = dict(zip(ordering.rows, prompts(ordering, table, MOVIES_QUESTION, "lines")))
    shuffled = [by_row[row] for row in range(len(table))]  # the table's rows are shuffled already
    arms = [
        ("naive", shuffled, dict(bucket=False, router="round-robin")),
        ("sorted", sorted(shuffled), dict(bucket=False, router="round-robin")),
        ("bucketed+prefix-aware", shuffled, dict(bucket=True, router="prefix-aware", buffer_size=args.buffer)),
    ]
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in arms}
    answers = {}
    ray.init(num_cpus=args.replicas, include_dashboard=False, log_to_driver=False)
    try:
        with RayVLLMReplicas(
            args.replicas,
            local_engine_args(model, kv_cache_memory_bytes=args.kv_cache_mib << 20, max_model_len=1024),
            num_cpus=1,
        ) as pool:
            answer_rows(shuffled[:8], pool, max_tokens=args.max_tokens, bucket=False)  # warm-up, both arms alike
            for _, (name, sent, options) in alternate(arms, args.rounds):
                pool.reset_prefix_cache()
                t0 = time.perf_counter()
                completions, figures = answer_rows(
                    sent, pool, max_tokens=args.max_tokens, batch_size=args.batch_size, **options
                )
                wall = time.perf_counter() - t0
                answers[name] = dict(zip(sent, (c.text for c in completions)))
                runs[name].append(
                    {
                        "arm": name,
                        "rows": len(sent),
                        "prompt_tokens": figures.prompt_tokens,
                        "cached_tokens": figures.cached_tokens,
                        "hit_rate": figures.hit_rate,
                        "wall_s": wall,
                        "rows_per_replica": [r.requests for r in figures.replicas],
                        "hit_rate_per_replica": [r.hit_rate for r in figures.replicas],
                    }
                )
                print(f"  {name}: {wall:.1f} s", file=sys.stderr)
    finally:
        ray.shutdown()
    same = all(answers[name] == answers["naive"] for name in answers)
    results = []
    for arm_runs in runs.values():
        walls = [run["wall_s"] for run in arm_runs]
        speed = ratio_spread([run["wall_s"] for run in runs["naive"]], walls)
        results.append({**arm_runs[0], "wall_s": statistics.median(walls), "wall_s_runs": walls, "speedup": speed})
    base = results[0]
    print(
        f"{len(table):,} rows of movies_small.csv on {args.replicas} replicas, batches of {args.batch_size}, "
        f"{args.kv_cache_mib} MiB of KV cache each, bucketing buffer {args.buffer}"
    )
    print(f"{'arm':<22} {'hit rate':>8} {'computed tok':>12} {'wall s':>7}  {'speedup':<30} rows per replica")
    for r in results:
        computed = r["prompt_tokens"] - r["cached_tokens"]
        speedup = "-" if r is base else describe_spread(r["speedup"])
        figures = f"{r['arm']:<22} {r['hit_rate']:>8.1%} {computed:>12,} {r['wall_s']:>7.2f}"
        print(f"{figures}  {speedup:<30} {r['rows_per_replica']}")
    print(f"greedy answers identical across arms: {same}")
    payload = {"settings": vars(args), "arms": results, "same_answers": same}
    write_results("ray_replicas", payload, output_dir(args), plot(results))
    return results


def plot(results: list[dict]) -> Any:
    names = [r["arm"] for r in results]
    fig, axes = new_figure(1, 2, figsize=(9, 3.4))
    axes[0].bar(names, [r["hit_rate"] * 100 for r in results], color="#69c")
    axes[0].set_title("prefix cache hit rate, %")
    axes[1].bar(names, [r["wall_s"] for r in results], color="#c63")
    axes[1].set_title("wall time, s")
    for ax in axes:
        ax.tick_params(axis="x", rotation=15)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
