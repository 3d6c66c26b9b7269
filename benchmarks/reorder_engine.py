"""Every row order end to end on the real vLLM engine (prefix caching on), one table at a time.

Same tables and orders as ``reorder_orders.py`` (``ggr`` is what kvreuse sends: token-exact GGR with the engine's
tokenizer and block size). All orders of a table share one engine, its prefix cache reset
between them. ``fec`` is cut to its first ``--fec-rows`` rows (default 3,000) to keep the run to minutes on a
2-core machine. Usage: ``python benchmarks/reorder_engine.py [--tables movies,fec,airports,penguins] [--rounds 1]``
(``--rounds``: times each order runs, alternating; wall time is the median).
"""

from __future__ import annotations

from harness import REPO, Arm, BenchRequest, bench_parser, output_dir, run_ab
from reorder_orders import BLOCK, INSTRUCTION, load_tables

from kvreuse.localmodel import build_model
from kvreuse.reorder import prepare_table, prompts, solve, token_hit_measure

ORDERS = ("original", "sorted", "stats", "ggr")


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--tables", default="movies,fec,airports,penguins")
    parser.add_argument("--fec-rows", type=int, default=3000)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    model = build_model("small", REPO / "build" / "models" / "small")
    tokenizer = AutoTokenizer.from_pretrained(model)
    tables = load_tables()
    tables["fec"] = tables["fec"].head(args.fec_rows)
    for name in args.tables.split(","):
        table = prepare_table(tables[name], None)
        measure = token_hit_measure(table, INSTRUCTION, "lines", lambda t: tokenizer(t)["input_ids"], BLOCK)

        def send_in(method: str, _table=table, _measure=measure):
            def prepare(_requests):
                ordering = solve(_table, method, measure=_measure if method == "ggr" else None)
                return [BenchRequest(int(r), p) for r, p in zip(ordering.rows, prompts(ordering, _table, INSTRUCTION))]

            return prepare

        original = send_in("original")(None)
        arms = [Arm(m, prepare=send_in(m)) for m in ORDERS]
        run_ab(f"reorder_engine_{name}", original, arms, model, rounds=args.rounds, out_dir=output_dir(args))


if __name__ == "__main__":
    main()
