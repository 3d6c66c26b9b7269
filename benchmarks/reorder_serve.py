"""The prefix-affinity scheduler against vLLM's FCFS scheduler under a backlog, driven by vLLM's own client.

Each arm starts ``vllm serve`` on the real SmolLM2 (the CPU engine, a KV cache of 1,440 tokens: 45 blocks of 32)
and runs ``vllm bench serve`` against it, all requests sent at once (``--request-rate inf``) so they queue:

* ``prefix_repetition``: 400 prompts over 16 shared prefixes of 256 tokens (256-token suffixes, 128 output
  tokens), shuffled by vLLM's dataset;
* ``table``: every row of vega_datasets' cars (406 rows) as a ``field: value`` prompt in the statistics field
  order, rows shuffled, 16 output tokens (a ``custom`` JSONL dataset).

Arms: ``fcfs`` (stock) and ``prefix-affinity`` with its DEFAULT settings (``--scheduler-cls
kvreuse.vllm.PrefixAffinityScheduler`` and nothing else). Figures: request throughput, TTFT p50/p99/max
(vLLM's client), preemptions and prefix cache hits (the server's ``/metrics``), and the scheduler's own counters
(``kvreuse:reorder_*``). The server starts as the harness starts servers (``harness.server``); ``vllm bench serve``
runs as ``python -P -m kvreuse.vllm.vllm_cli bench serve`` (works with either vLLM distribution). Usage: ``python
benchmarks/reorder_serve.py [--workloads prefix_repetition,table]``; ``--prompts``, ``--suffix-len``,
``--output-len`` and ``--table-rows`` shrink the run for a loaded machine. The arms run one after the other, once
each (each is a server of its own).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from harness import REPO, bench_parser, output_dir, server, write_results

MODEL = REPO / "build" / "models" / "smollm2"
CLI = [sys.executable, "-P", "-m", "kvreuse.vllm.vllm_cli"]
KV_TOKENS = 1440
# float32 SmolLM2: 30 layers x 3 KV heads x 64 dims x 2 (K and V) x 4 bytes per token.
KV_BYTES = KV_TOKENS * 30 * 3 * 64 * 2 * 4
SERVER = [
    "--block-size", "32", "--enforce-eager", "--dtype", "float32", "--seed", "0", "--max-model-len", "1024",
    "--kv-cache-memory-bytes", str(KV_BYTES), "--enable-prefix-caching", "--enable-prompt-tokens-details",
]  # fmt: skip
ARMS = {"fcfs": [], "prefix-affinity": ["--scheduler-cls", "kvreuse.vllm.PrefixAffinityScheduler"]}
TABLE_INSTRUCTION = "Describe this car in one sentence."
# Counters as /metrics writes them (``name_total{labels} value``), read by their name without ``_total``.
METRIC = re.compile(
    r"^(vllm:num_preemptions|vllm:prefix_cache_hits|vllm:prefix_cache_queries|kvreuse:reorder_[a-z_]+?)(?:_total)?"
    r"\{.*\} ([0-9.e+]+)$"
)


def table_dataset(path: Path, rows: int) -> None:
    """The cars table as a custom JSONL dataset: statistics field order, rows shuffled."""
    from vega_datasets import data

    from kvreuse.reorder import column_stats, fixed_field_order, prepare_table, render_prompt

    table = prepare_table(data.cars().sample(n=rows, random_state=0), None)
    fields = [table.columns[c] for c in fixed_field_order(column_stats(table))]
    rows = [render_prompt(TABLE_INSTRUCTION, fields, [row[f] for f in fields]) for _, row in table.iterrows()]
    random.Random(0).shuffle(rows)
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in rows))


def workload_args(name: str, scratch: Path, args: argparse.Namespace) -> list[str]:
    if name == "prefix_repetition":
        return [
            "--dataset-name", "prefix_repetition", "--num-prompts", str(args.prompts),
            "--prefix-repetition-num-prefixes", "16", "--prefix-repetition-prefix-len", "256",
            "--prefix-repetition-suffix-len", str(args.suffix_len),
            "--prefix-repetition-output-len", str(args.output_len),
        ]  # fmt: skip
    path = scratch / "cars.jsonl"
    table_dataset(path, args.table_rows)
    return [
        "--dataset-name", "custom", "--dataset-path", str(path), "--num-prompts", str(args.table_rows),
        "--custom-output-len", "16", "--skip-chat-template",
    ]  # fmt: skip


def metrics(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = METRIC.match(line)
        if match:
            out[match.group(1)] = out.get(match.group(1), 0.0) + float(match.group(2))
    return out


def run_arm(arm: str, workloads: list[str], scratch: Path, args: argparse.Namespace) -> list[dict]:
    rows = []
    with server(["--model", str(MODEL), *SERVER, *ARMS[arm]], scratch) as (url, _):
        port = url.rsplit(":", 1)[1]
        for workload in workloads:
            before = metrics(url)
            name = f"{workload}-{arm}.json"
            subprocess.run(
                [
                    *CLI, "bench", "serve", "--backend", "vllm", "--model", str(MODEL), "--port", port,
                    "--request-rate", "inf", "--seed", "0", "--save-result", "--save-detailed",
                    "--result-dir", str(scratch), "--result-filename", name,
                    "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99",
                    *workload_args(workload, scratch, args),
                ],
                check=True, stdout=subprocess.DEVNULL,
            )  # fmt: skip
            after = metrics(url)
            result = json.loads((scratch / name).read_text())
            delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
            ttfts = [t for t in result.get("ttfts", []) if t]
            rows.append(
                dict(
                    workload=workload,
                    arm=arm,
                    completed=result["completed"],
                    request_throughput=result["request_throughput"],
                    ttft_p50_s=result["median_ttft_ms"] / 1000,
                    ttft_p99_s=result["p99_ttft_ms"] / 1000,
                    ttft_max_s=max(ttfts) if ttfts else None,
                    preemptions=delta.get("vllm:num_preemptions", 0.0),
                    hit_rate=delta.get("vllm:prefix_cache_hits", 0.0)
                    / max(delta.get("vllm:prefix_cache_queries", 0.0), 1),
                    reorder={
                        k.removeprefix("kvreuse:reorder_"): v
                        for k, v in after.items()
                        if k.startswith("kvreuse:") and not k.endswith("_created")
                    },
                )
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--workloads", default="prefix_repetition,table")
    parser.add_argument("--prompts", type=int, default=400)
    parser.add_argument("--suffix-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--table-rows", type=int, default=406)
    args = parser.parse_args(argv)
    workloads = args.workloads.split(",")
    with tempfile.TemporaryDirectory() as scratch:
        rows = [row for arm in ARMS for row in run_arm(arm, workloads, Path(scratch), args)]
    print(
        f"\n{'workload':18} {'arm':16} {'req/s':>6} {'x':>5} {'TTFT p50':>9} {'x':>5} {'p99':>7} {'x':>5} "
        f"{'max':>7} {'preempt':>7} {'hit':>6}"
    )
    for row in rows:
        base = next(r for r in rows if r["workload"] == row["workload"] and r["arm"] == "fcfs")
        print(
            f"{row['workload']:18} {row['arm']:16} {row['request_throughput']:6.2f} "
            f"{row['request_throughput'] / base['request_throughput']:5.2f} {row['ttft_p50_s']:9.1f} "
            f"{row['ttft_p50_s'] / base['ttft_p50_s']:5.2f} {row['ttft_p99_s']:7.1f} "
            f"{row['ttft_p99_s'] / base['ttft_p99_s']:5.2f} {row['ttft_max_s'] or 0:7.1f} {row['preemptions']:7.0f} "
            f"{row['hit_rate']:6.1%}"
        )
    write_results("reorder_serve", {"settings": vars(args), "rows": rows}, output_dir(args))


if __name__ == "__main__":
    main()
