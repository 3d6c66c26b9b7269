"""Every row order on real tables, without an engine: token hit rate, PHC, time, and GGR's gap to OPHR.

Tables: ``reorder_tables.load_tables`` (shared/datasets and PyPI data packages). Orders: original, stats (fixed
field order by statistics, rows sorted), ``paper`` (the paper's GGR as written, ``reference_ggr.py``), ggr-phc
(kvreuse's GGR on characters alone) and ggr (what kvreuse sends: ``solve(measure=...)`` with the engine's
tokenizer and block size, i.e. token-exact GGR and its candidates). Token hit rates: prompts tokenized with the
real model's tokenizer (SmolLM2), replayed through vLLM's block cache model (``block_hit_stats``, full blocks of
32 tokens, an unbounded cache). Times: ``plan s`` is what ``llm_map`` spends before generating (tokenize each
distinct cell once + solve + choose), ``render s`` the prompts' text. OPHR is exact on 16-row x 6-field samples
(rows drawn from two values of one field, so that samples share something); the gap is GGR's PHC over OPHR's.
Usage: ``python benchmarks/reorder_orders.py [--tables cars,...] [--samples 8]``.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from harness import REPO, bench_parser, new_figure, output_dir, write_results
from reference_ggr import reference_ggr
from reorder_tables import load_tables

from kvreuse.reorder import block_hit_stats, prefix_hit_count, prepare_table, prompts, solve, token_hit_measure

__all__ = ["BLOCK", "INSTRUCTION", "load_tables"]

ORDERS = ("original", "stats", "paper", "ggr-phc", "ggr")
INSTRUCTION = "Read the record below and answer in one word: is anything in it unusual?"
BLOCK = 32


def measure(name: str, df, tokenize) -> list[dict]:
    table = prepare_table(df, None)
    out = []
    for method in ORDERS:
        start = time.perf_counter()
        if method == "paper":
            ordering = reference_ggr(table)
        elif method == "ggr-phc":
            ordering = solve(table, "ggr")
        elif method == "ggr":
            ordering = solve(table, "ggr", measure=token_hit_measure(table, INSTRUCTION, "lines", tokenize, BLOCK))
        else:
            ordering = solve(table, method)
        plan_s = time.perf_counter() - start
        start = time.perf_counter()
        texts = prompts(ordering, table, INSTRUCTION)
        render_s = time.perf_counter() - start
        stats = block_hit_stats(tokenize(texts), BLOCK)
        out.append(
            dict(
                table=name,
                rows=len(table),
                fields=table.shape[1],
                order=method,
                hit_rate=stats.hit_rate,
                prompt_tokens=stats.prompt_tokens,
                phc=prefix_hit_count(table, ordering),
                plan_s=plan_s,
                render_s=render_s,
            )
        )
    return out


def ophr_gaps(df, samples: int, seed: int = 0) -> list[dict]:
    """GGR's PHC over OPHR's, and OPHR's time, on random 16-row x 6-field samples."""
    rng = np.random.default_rng(seed)
    table = prepare_table(df, None)
    out = []
    while len(out) < samples:
        cols = rng.choice(table.shape[1], size=min(6, table.shape[1]), replace=False)
        key = table.columns[cols[0]]
        pool = table[table[key].isin(rng.choice(table[key].unique(), size=2))]
        if len(pool) < 16:
            pool = table
        sample = pool.sample(n=16, random_state=int(rng.integers(1 << 30))).iloc[:, cols].reset_index(drop=True)
        start = time.perf_counter()
        best = prefix_hit_count(sample, solve(sample, "ophr"))
        seconds = time.perf_counter() - start
        if best:
            out.append(dict(ratio=prefix_hit_count(sample, solve(sample, "ggr")) / best, ophr_s=seconds))
    return out


def plot(rows: list[dict]) -> Any:
    """The token hit rate of every order, grouped by table."""
    tables = list(dict.fromkeys(r["table"] for r in rows))
    fig, ax = new_figure(figsize=(10, 4))
    width = 0.8 / len(ORDERS)
    for i, method in enumerate(ORDERS):
        rates = [next(r["hit_rate"] for r in rows if r["table"] == t and r["order"] == method) for t in tables]
        ax.bar(np.arange(len(tables)) + i * width, rates, width, label=method)
    ax.set_xticks(np.arange(len(tables)) + width * (len(ORDERS) - 1) / 2, tables)
    ax.set_ylabel("token hit rate (SmolLM2 tokens, blocks of 32)")
    ax.set_title("Token prefix hit rate by order")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--tables", default=None)
    parser.add_argument("--samples", type=int, default=8)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from kvreuse.vllm.backend import batch_tokenizer

    tokenize = batch_tokenizer(AutoTokenizer.from_pretrained(REPO / "build" / "models" / "smollm2"))
    rows, gaps = [], {}
    for name, df in load_tables(args.tables).items():
        rows += measure(name, df, tokenize)
        gaps[name] = ophr_gaps(df, args.samples)
        print(f"{name} done", flush=True)
    print(
        f"{'table':9} {'rows x fields':>14} " + " ".join(f"{o:>9}" for o in ORDERS) + "  plan s (paper, ggr)  render s"
    )
    for name in dict.fromkeys(r["table"] for r in rows):
        mine = {r["order"]: r for r in rows if r["table"] == name}
        first = mine["ggr"]
        print(
            f"{name:9} {first['rows']:>7,} x {first['fields']:<4} "
            + " ".join(f"{mine[o]['hit_rate']:9.1%}" for o in ORDERS)
            + f"  {mine['paper']['plan_s']:7.2f} {mine['ggr']['plan_s']:7.2f}  {mine['ggr']['render_s']:8.2f}"
        )
    print("\nGGR PHC / OPHR PHC on 16 x 6 samples: min / median / mean, OPHR max s")
    for name, g in gaps.items():
        ratios = [x["ratio"] for x in g]
        print(
            f"{name:9} {min(ratios):.3f} / {np.median(ratios):.3f} / {np.mean(ratios):.3f}  "
            f"{max(x['ophr_s'] for x in g):.1f}"
        )
    write_results("reorder_orders", {"orders": rows, "ggr_over_ophr": gaps}, output_dir(args), plot(rows))


if __name__ == "__main__":
    main()
