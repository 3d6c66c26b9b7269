"""What planning a table job costs before the engine generates: render + tokenize + solve, at 16K rows x 8 fields.

The table is ``reorder_tables.flights`` (16,384 rows, 8 fields); the tokenizer SmolLM2's, through the Rust batch
encoder as the vLLM backend calls it. Stages, each the best of ``--repeats`` runs (the machine is shared; the
median is printed too): ``tokenize`` (each distinct line once, ``token_hit_measure``), ``solve`` (``solve(...,
measure=...)``: token-exact GGR candidates and the choice among them), ``render`` (the prompts' text), and the
whole ``plan_table`` call. Each stage reports wall time and the process's CPU time (``time.process_time``, all its
threads): on a shared machine the wall time includes waiting for a core, the CPU time does not. For comparison,
``GGR alone`` (characters, no measure) and ``old check``: tokenizing the prompts of three candidate orders whole,
which is what choosing among candidates cost before.
Usage: ``python benchmarks/reorder_plan_time.py [--rows 16384] [--repeats 5]``.
"""

from __future__ import annotations

import statistics
import time

from harness import REPO, bench_parser, output_dir, write_results
from reorder_orders import BLOCK, INSTRUCTION
from reorder_tables import flights

from kvreuse.batch.backend import PrefixCacheModel
from kvreuse.batch.job import plan_table
from kvreuse.reorder import prepare_table, prompts, solve, token_hit_measure


def timed(fn, repeats: int) -> tuple[float, float, float, object]:
    """Best and median wall seconds, best CPU seconds, and the result of ``repeats`` calls of ``fn``."""
    times, cpu, result = [], [], None
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        result = fn()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return min(times), statistics.median(times), min(cpu), result


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--rows", type=int, default=16_384)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from kvreuse.vllm.backend import batch_tokenizer

    tokenize = batch_tokenizer(AutoTokenizer.from_pretrained(REPO / "build" / "models" / "smollm2"))
    df = flights(args.rows)
    table = prepare_table(df, None)
    r = args.repeats
    figures = {}
    figures["tokenize"] = timed(lambda: token_hit_measure(table, INSTRUCTION, "lines", tokenize, BLOCK), r)
    measure = figures["tokenize"][-1]
    figures["solve"] = timed(lambda: solve(table, "ggr", measure=measure), r)
    figures["render"] = timed(lambda: prompts(figures["solve"][-1], table, INSTRUCTION), r)
    model = PrefixCacheModel(tokenize=tokenize, block_size=BLOCK)
    figures["plan_table (all)"] = timed(lambda: plan_table(df, INSTRUCTION, field_order="free", cache_model=model), r)
    figures["GGR alone"] = timed(lambda: solve(table, "ggr"), r)
    candidates = [solve(table, m) for m in ("ggr", "stats", "sorted")]
    figures["old check"] = timed(lambda: [tokenize(prompts(o, table, INSTRUCTION)) for o in candidates], r)
    print(f"{len(table):,} rows x {table.shape[1]} fields, best / median of {r} runs (wall), best CPU")
    for name, (best, median, cpu, _) in figures.items():
        print(f"{name:18} {best:7.3f} s  {median:7.3f} s  {cpu:7.3f} s")
    out = {
        name: {"best_s": best, "median_s": median, "best_cpu_s": cpu}
        for name, (best, median, cpu, _) in figures.items()
    }
    write_results("reorder_plan_time", {"rows": len(table), "repeats": r, "stages": out}, output_dir(args))


if __name__ == "__main__":
    main()
