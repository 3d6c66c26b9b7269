"""Every row order on real tables, without an engine: PHC, token prefix hit rate, solver time, GGR vs OPHR.

Tables: ``movies_small.csv`` and ``fec_contributions.csv`` (``shared/datasets``), vega_datasets' ``airports`` and
palmerpenguins' ``penguins`` (PyPI data packages, offline). Orders: original, sorted (lexicographic in the
table's field order), stats (fixed field order by statistics, then sorted), ggr-phc (GGR on PHC alone) and ggr
(what kvreuse sends: GGR checked against the baselines with the engine's tokenizer and block size, the best
kept, see ``solve(measure=...)``). The token hit rate is what
vLLM's prefix cache can reuse: prompts tokenized with the local model's tokenizer, full blocks of 32 tokens,
a hit only for a leading run of blocks an earlier prompt already computed (``block_hit_stats``), both with an
unbounded cache and with the demo engine's cache size. OPHR only finishes on tiny tables, so it is compared on
random 8-row x 4-field samples of each table. Usage: ``python benchmarks/reorder_orders.py``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pandas as pd

from kvreuse.localmodel import DATASETS, build_model
from kvreuse.reorder import block_hit_stats, prefix_hit_count, prepare_table, prompts, solve, token_hit_measure

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
ORDERS = ("original", "sorted", "stats", "ggr-phc", "ggr")
INSTRUCTION = "Read the record below and answer in one word: is anything in it unusual?"
BLOCK = 32
# The demo engine's KV cache: 256 MiB / (2 layers x 2 KV heads x 64 dims x 2 (K and V) x 4 bytes) per token.
ENGINE_CACHE_BLOCKS = (256 << 20) // (2 * 2 * 64 * 2 * 4) // BLOCK


def load_tables() -> dict[str, pd.DataFrame]:
    from palmerpenguins import load_penguins
    from vega_datasets import data

    read = dict(dtype=str, keep_default_na=False)
    movies = pd.read_csv(DATASETS / "movies_small.csv", **read).drop(columns=["id"])
    return {
        "movies": movies,
        "fec": pd.read_csv(DATASETS / "fec_contributions.csv", **read),
        "airports": data.airports(),
        "penguins": load_penguins(),
    }


def measure(name: str, df: pd.DataFrame, tokenizer) -> list[dict]:
    table = prepare_table(df, None)
    tokenize = lambda texts: tokenizer(texts)["input_ids"]  # noqa: E731
    engine_measure = token_hit_measure(table, INSTRUCTION, "lines", tokenize, BLOCK)
    rows = []
    for method in ORDERS:
        t0 = time.perf_counter()
        if method == "ggr-phc":
            ordering = solve(table, "ggr")
        else:
            ordering = solve(table, method, measure=engine_measure if method == "ggr" else None)
        solve_s = time.perf_counter() - t0
        ids = tokenizer(prompts(ordering, table, INSTRUCTION, "lines"))["input_ids"]
        unbounded = block_hit_stats(ids, BLOCK)
        bounded = block_hit_stats(ids, BLOCK, capacity_blocks=ENGINE_CACHE_BLOCKS)
        rows.append(
            dict(
                table=name,
                order=method,
                rows=len(table),
                fields=table.shape[1],
                phc=prefix_hit_count(table, ordering),
                prompt_tokens=unbounded.prompt_tokens,
                hit_rate=unbounded.hit_rate,
                hit_rate_engine_cache=bounded.hit_rate,
                solve_s=solve_s,
            )
        )
    return rows


def ggr_vs_ophr(df: pd.DataFrame, samples: int = 40, seed: int = 0) -> float:
    """Mean of GGR's PHC over OPHR's on random 8-row x 4-field samples (samples without any hit skipped)."""
    rng = np.random.default_rng(seed)
    table = prepare_table(df, None)
    ratios = []
    for _ in range(samples):
        cols = rng.choice(table.shape[1], size=min(4, table.shape[1]), replace=False)
        # Draw rows from a few values of one field so that samples have something to share.
        key = table.columns[cols[0]]
        values = rng.choice(table[key].unique(), size=2)
        pool = table[table[key].isin(values)]
        sample = pool.sample(n=min(8, len(pool)), random_state=int(rng.integers(1 << 30))).iloc[:, cols]
        sample = sample.reset_index(drop=True)
        best = prefix_hit_count(sample, solve(sample, "ophr"))
        if best:
            ratios.append(prefix_hit_count(sample, solve(sample, "ggr")) / best)
    return float(np.mean(ratios)) if ratios else float("nan")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = list(dict.fromkeys(r["table"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(ORDERS)
    for i, method in enumerate(ORDERS):
        rates = [next(r["hit_rate"] for r in rows if r["table"] == t and r["order"] == method) for t in tables]
        ax.bar(np.arange(len(tables)) + i * width, rates, width, label=method)
    ax.set_xticks(np.arange(len(tables)) + width * (len(ORDERS) - 1) / 2, tables)
    ax.set_ylabel("token prefix hit rate (block 32)")
    ax.set_title("Prefix hit rate by row/field order")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_model("small", REPO / "build" / "models" / "small"))
    rows, ophr = [], {}
    for name, df in load_tables().items():
        rows += measure(name, df, tokenizer)
        ophr[name] = ggr_vs_ophr(df)
    print(
        f"{'table':9} {'order':9} {'rows':>6} {'PHC':>14} {'prompt tok':>11} {'hit rate':>9} "
        f"{'hit (cache)':>11} {'solve s':>8}"
    )
    for r in rows:
        print(
            f"{r['table']:9} {r['order']:9} {r['rows']:>6} {r['phc']:>14,} {r['prompt_tokens']:>11,} "
            f"{r['hit_rate']:>9.1%} {r['hit_rate_engine_cache']:>11.1%} {r['solve_s']:>8.3f}"
        )
    print("GGR PHC / OPHR PHC on 8x4 samples: " + ", ".join(f"{t} {v:.3f}" for t, v in ophr.items()))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "reorder_orders.json").write_text(json.dumps({"orders": rows, "ggr_over_ophr": ophr}, indent=2))
    plot(rows, RESULTS / "reorder_orders.png")
    print(f"wrote {RESULTS / 'reorder_orders.json'} and {RESULTS / 'reorder_orders.png'}")


if __name__ == "__main__":
    main()
