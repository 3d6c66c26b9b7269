"""DIPR sparse attention on the real model: retrieval accuracy, agreement with the stock engine, KV read, speed.

The model is SmolLM2-135M-Instruct (``build/models/smollm2``) on vLLM's CPU engine, float32, greedy decoding of 16
tokens. Two engines run side by side in one process: the stock one (CPU_ATTN) and one with kvreuse's sparse backend
(``KVREUSE_SPARSE_CPU_BACKEND=1``, the plugin's default settings except beta). Cases (``retrieval_cases.py``: needle
and multi-fact questions with known answers, in real text) go to the stock engine, then to the sparse engine once
per beta in ``BETAS`` (beta reconfigured in the worker between requests). The sparse engine's prefix cache keeps the
prompts, so only its first arm pays the prefill (dense in every arm, so the same for all betas); every arm pays its
own 16 decode steps. The first ``TIMED`` cases of each length run alone, one after the other in both engines, and
give the speed ratios; the others run in groups (all of a group's prompts in one ``generate`` call per engine and
arm), which only saves time: answers and counters do not depend on the batch.

Per length and arm: ``agree`` the share of cases whose 16 greedy tokens equal the stock engine's, ``acc`` the share
answered correctly (the asked number in the completion), ``blocks``/``tokens`` the fractions of KV blocks read and
of tokens attended by all decode steps of all layers (the backend's own counters; layers and contexts the policy
keeps dense count as reading everything), ``blocks dipr`` the same over the layers that run DIPR, and speed as
ratios to the stock engine on the same case, medians over the timed cases: ``decode x`` (time per output token after
the first, from vLLM's own per-request timestamps) and ``prefill x`` (time to the first token of the first arm).

``agree inf`` is the share of cases whose completion equals beta = inf's (the backend's exact dense attention), so
it isolates what pruning changes from the float-order differences between two attention implementations.

Run: ``KVREUSE_DATASETS=/work/shared/datasets .venv/bin/python benchmarks/sparse_qa.py`` (``--cases N`` per length,
``--lengths 1024,2048``); prints the table and writes ``sparse_qa.json`` and ``.png`` (``--name``) under
``build/benchmarks/`` (``--update-results``: into ``docs/benchmarks/results/``, the figures the docs cite; the
partial file ``NAME.tmp`` of a run still going stays under ``build/benchmarks/``). On a
2-core shared CPU the full run takes hours, most of it prefills: ``--stock-cases N`` runs the stock engine on the
first N cases of each length only (``agree`` is then over those, the ``cases`` column says how many), and
``--combine A.json B.tmp ...`` summarises several runs (or the partial file of one) into one table, and
``--start-at 4096:28,8000:12`` goes on from those case indices (case ``i`` of a length is the same in every run) so
that a run cut short can be completed by another. ``--stock-only`` runs the stock engine alone on such cases, so
that runs with ``--stock-cases`` get their agreement with stock afterwards: ``--combine`` joins the records of one
case (length and index) from several runs, and where the stock engine and the sparse arms ran in different runs,
agreement is that of the completion texts (16 tokens that decode to the same text; within one run the token ids are
compared). Timings are ratios taken side by side, but still noisy. ``--betas inf,4`` chooses the sparse arms,
``--model`` another build of the model, ``--sparse '{"engine_kernel": false}'`` kvreuse's own CPU attention.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, SCRATCH, bench_parser, engine, new_figure, output_dir, write_results  # noqa: E402
from retrieval_cases import RetrievalCase, make_cases  # noqa: E402

MODEL = REPO / "build" / "models" / "smollm2"
BETAS = [float("inf"), 8.0, 4.0, 2.0, 1.0]
LENGTHS = [1024, 2048, 4096, 8000]
CASES = {1024: 50, 2048: 50, 4096: 50, 8000: 20}  # 8K: fewer, a case costs ~4 minutes of a shared 2-core CPU
TIMED = 6  # the first cases of each length run alone, for the speed ratios; the rest in groups
GROUP_TOKENS, MAX_GROUP = 30_000, 16  # a group's prompts must all stay in the sparse engine's prefix cache
KV_CACHE_BYTES = 2 << 30  # ~40K tokens of SmolLM2 with the sketch (52 KB per token over 30 layers)
MAX_TOKENS = 16


def _configure(beta: float, settings: dict):
    """A ``collective_rpc`` call: the worker's sparse settings (``settings`` with ``beta``), its figures emptied."""

    def call(worker):
        from kvreuse.vllm import runtime

        runtime.configure_sparse({**settings, "beta": beta})
        runtime.reset_sparse_figures()

    return call


def _figures(worker):
    from kvreuse.vllm.runtime import sparse_attention

    attention = sparse_attention()
    return {"rows": attention.figures.rows(), "dense_layers": attention.config.dense_layers}


def _timing(output) -> tuple[float, float]:
    """(seconds from scheduling to the first token, seconds per token after it), from vLLM's own timestamps."""
    m = output.metrics
    tokens = len(output.outputs[0].token_ids)
    return m.first_token_ts - m.scheduled_ts, (m.last_token_ts - m.first_token_ts) / max(tokens - 1, 1)


def _fractions(rows: list[dict], dense_layers: int) -> dict:
    """Blocks read and tokens attended over all layers and over the DIPR layers, from the worker's rows."""
    out = {}
    for name, chosen in (("all", rows), ("dipr", [r for r in rows if r["layer"] >= dense_layers])):
        read = sum(r["blocks_read"] for r in chosen)
        total = sum(r["blocks_total"] for r in chosen)
        attended = sum(r["tokens_attended"] for r in chosen)
        tokens = sum(r["tokens_total"] for r in chosen)
        out[name] = {"blocks_read": read, "blocks_total": total, "tokens_attended": attended, "tokens_total": tokens}
    return out


def run(
    lengths: list[int],
    cases_per_length: dict[int, int],
    settings: dict,
    partial: Path,
    stock_cases: int | None,
    timed: int = TIMED,
    start_at: dict[int, int] | None = None,
    stock_only: bool = False,
    betas: list[float] = BETAS,
    model: Path = MODEL,
) -> dict:
    from vllm import SamplingParams

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc sends the closures above
    args: dict[str, Any] = {"max_model_len": 8192, "kv_cache_memory_bytes": KV_CACHE_BYTES}
    result: dict = {"cases": [], "groups": []}
    with ExitStack() as engines:  # both shut down when the run ends, whatever happens in it
        stock = engines.enter_context(engine(model, **args)) if stock_cases != 0 else None
        os.environ["KVREUSE_SPARSE_CPU_BACKEND"] = "1"  # read by the sparse engine's processes when they start
        sparse = engines.enter_context(engine(model, **args)) if not stock_only else None
        sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        tokenizer = (stock or sparse).get_tokenizer()
        warm = make_cases(1024, 100, tokenizer)[-1].prompt  # not one of the measured cases (no prefix-cache hit)
        for llm in (stock, sparse):
            if llm is not None:
                llm.generate([warm], sampling, use_tqdm=False)
        for length in lengths:
            first = (start_at or {}).get(length, 0)
            cases = make_cases(length, cases_per_length[length], tokenizer)
            started = time.time()
            size = max(1, min(MAX_GROUP, GROUP_TOKENS // length))
            timed_here = max(0, min(timed, len(cases)) - first)
            starts = [*range(first, first + timed_here), *range(first + timed_here, len(cases), size)]
            for start in starts:
                alone = start < first + timed_here
                group = cases[start : start + (1 if alone else size)]
                with_stock = stock_cases is None or start < stock_cases
                run_group(group, stock if with_stock else None, sparse, sampling, settings, result, alone, betas)
                partial.write_text(json.dumps(result, indent=1))  # a long run can be read while it goes
            print(f"{length} tokens: {len(cases)} cases in {time.time() - started:.0f} s", flush=True)
    return result


def run_group(
    cases: list[RetrievalCase],
    stock,
    sparse,
    sampling,
    settings: dict,
    result: dict,
    timed: bool,
    betas: list[float] = BETAS,
) -> None:
    """The cases through the stock engine (unless ``stock`` is None), then through the sparse one once per beta
    (unless ``sparse`` is None), each engine given them all at once. A case alone is timed; for a group, only
    answers and figures count (the requests share the steps)."""
    records = [
        {
            "kind": case.kind,
            "length": case.tokens,
            "index": case.index,
            "answer": case.answer,
            "timed": timed and stock is not None,
            "stock_tokens": None,
            "arms": {},
        }
        for case in cases
    ]
    if stock is not None:
        for case, out, record in zip(
            cases, stock.generate([c.prompt for c in cases], sampling, use_tqdm=False), records
        ):
            prefill, decode = _timing(out) if timed else (None, None)
            record["stock_tokens"] = list(out.outputs[0].token_ids)
            record["prompt_tokens"] = len(out.prompt_token_ids)
            record["arms"]["stock"] = {
                "text": out.outputs[0].text,
                "correct": case.correct(out.outputs[0].text),
                "prefill_s": prefill,
                "decode_s": decode,
            }
    for i, beta in enumerate(betas if sparse is not None else []):
        arm = f"beta={beta:g}"
        sparse.collective_rpc(_configure(beta, settings))
        outs = sparse.generate([c.prompt for c in cases], sampling, use_tqdm=False)
        figures = sparse.collective_rpc(_figures)[0]
        result["groups"].append(
            {
                "length": cases[0].tokens,
                "arm": arm,
                "cases": len(cases),
                "fractions": _fractions(figures["rows"], figures["dense_layers"]),
            }
        )
        for case, out, record in zip(cases, outs, records):
            prefill, decode = _timing(out) if timed else (None, None)
            tokens = list(out.outputs[0].token_ids)
            record["prompt_tokens"] = len(out.prompt_token_ids)
            record["arms"][arm] = {
                "text": out.outputs[0].text,
                "correct": case.correct(out.outputs[0].text),
                "agree": None if record["stock_tokens"] is None else tokens == record["stock_tokens"],
                "prefill_s": prefill if i == 0 else None,  # later arms find the prompt in the prefix cache
                "decode_s": decode,
            }
    result["cases"] += records


def join_runs(runs: list[dict]) -> dict:
    """Several runs' records as one: a case (length and index) run in more than one keeps the union of its arms,
    and where its stock completion came from another run than a sparse arm's, that arm's agreement with stock is
    the equality of their completion texts."""
    cases: dict[tuple[int, int], dict] = {}
    for record in (r for run_ in runs for r in run_["cases"]):
        key = (record["length"], record["index"])
        if key not in cases:
            cases[key] = {**record, "arms": dict(record["arms"])}
            continue
        joined = cases[key]
        joined["arms"].update(record["arms"])
        joined["stock_tokens"] = joined["stock_tokens"] or record["stock_tokens"]
        joined["timed"] = joined["timed"] or record["timed"]
    for record in cases.values():
        stock = record["arms"].get("stock")
        for arm, entry in record["arms"].items():
            if arm != "stock" and entry["agree"] is None and stock is not None:
                entry["agree"] = entry["text"] == stock["text"]
    return {"cases": list(cases.values()), "groups": [g for run_ in runs for g in run_["groups"]]}


def summarise(result: dict) -> list[dict]:
    """Per length and arm: accuracy over the cases the arm ran, agreement with the stock engine over the cases it
    ran too, agreement with beta = inf (the same backend's exact dense attention: the same completion text) over
    all cases, fractions over all groups' decodes, speed ratios (medians over the cases timed alone)."""
    records, groups = result["cases"], result["groups"]
    rows = []
    arms = list(dict.fromkeys(arm for r in records for arm in r["arms"]))
    dense = next((arm for arm in arms if arm != "stock"), None)
    for length in sorted({r["length"] for r in records}):
        cases = [r for r in records if r["length"] == length]
        timed = [c for c in cases if c["timed"]]
        for arm in arms:
            ran = [c for c in cases if arm in c["arms"]]
            if not ran:
                continue
            entries = [c["arms"][arm] for c in ran]
            row = {
                "length": length,
                "arm": arm,
                "cases": len(ran),
                "timed_cases": len(timed),
                "prompt_tokens": statistics.median(c["prompt_tokens"] for c in ran),
                "accuracy": sum(e["correct"] for e in entries) / len(entries),
                "decode_ms": 1e3 * statistics.median(c["arms"][arm]["decode_s"] for c in timed) if timed else None,
            }
            if arm != "stock":
                with_stock = [e for e in entries if e["agree"] is not None]
                row["stock_cases"] = len(with_stock)
                row["agreement"] = sum(e["agree"] for e in with_stock) / len(with_stock) if with_stock else None
                row["agreement_dense"] = sum(c["arms"][arm]["text"] == c["arms"][dense]["text"] for c in ran) / len(ran)
                fractions = [g["fractions"] for g in groups if g["length"] == length and g["arm"] == arm]
                for scope in ("all", "dipr"):
                    f = [x[scope] for x in fractions]
                    total_b, total_t = sum(x["blocks_total"] for x in f), sum(x["tokens_total"] for x in f)
                    row[f"blocks_{scope}"] = sum(x["blocks_read"] for x in f) / total_b if total_b else None
                    row[f"tokens_{scope}"] = sum(x["tokens_attended"] for x in f) / total_t if total_t else None
                if timed:
                    row["decode_ratio"] = statistics.median(
                        c["arms"][arm]["decode_s"] / c["arms"]["stock"]["decode_s"] for c in timed
                    )
                    row["prefill_ratio"] = statistics.median(
                        c["arms"][dense]["prefill_s"] / c["arms"]["stock"]["prefill_s"] for c in timed
                    )
            rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    header = [
        "length",
        "arm",
        "cases",
        "acc",
        "agree",
        "agree inf",
        "blocks",
        "tokens",
        "blocks dipr",
        "tokens dipr",
        "decode ms",
        "decode x",
        "prefill x",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def pct(x):
        return "-" if x is None else f"{x:.1%}"

    for r in rows:
        lines.append(
            "| "
            + " | ".join(
                [
                    f"{r['length']:,}",
                    r["arm"],
                    str(r["cases"]) if "stock_cases" not in r else f"{r['cases']} ({r['stock_cases']})",
                    pct(r["accuracy"]),
                    pct(r.get("agreement")),
                    pct(r.get("agreement_dense")),
                    pct(r.get("blocks_all")),
                    pct(r.get("tokens_all")),
                    pct(r.get("blocks_dipr")),
                    pct(r.get("tokens_dipr")),
                    "-" if r["decode_ms"] is None else f"{r['decode_ms']:.1f}",
                    "-" if "decode_ratio" not in r else f"{r['decode_ratio']:.2f}",
                    "-" if "prefill_ratio" not in r else f"{r['prefill_ratio']:.2f}",
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def plot(rows: list[dict]) -> Any:
    """Accuracy, blocks read and decode time over stock's against the prompt length, one line per arm."""
    fig, axes = new_figure(1, 3, figsize=(15, 4))
    lengths = sorted({r["length"] for r in rows})
    for arm in dict.fromkeys(r["arm"] for r in rows):  # each arm over the lengths it ran (runs can omit stock)
        pts = sorted((r for r in rows if r["arm"] == arm), key=lambda r: r["length"])
        at = [p["length"] for p in pts]
        if arm == "stock":
            axes[0].plot(at, [p["accuracy"] for p in pts], "k--", label="stock")
            continue
        axes[0].plot(at, [p["accuracy"] for p in pts], marker="o", label=arm)
        axes[1].plot(at, [p["blocks_all"] for p in pts], marker="o", label=f"{arm} blocks")
        timed = [p for p in pts if "decode_ratio" in p]
        if timed:
            axes[2].plot([p["length"] for p in timed], [p["decode_ratio"] for p in timed], marker="o", label=arm)
    axes[0].set_ylabel("accuracy")
    axes[1].set_ylabel("KV blocks read (all layers)")
    axes[2].set_ylabel("decode time / stock")
    axes[2].axhline(1.0, color="grey", lw=0.8)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [f"{n // 1000}K" for n in lengths])
        ax.set_xlabel("prompt tokens")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("DIPR on SmolLM2-135M, vLLM CPU: retrieval QA")
    fig.tight_layout()
    return fig


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--cases", type=int, help="cases per length (default: 50, 20 at 8K)")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--name", default="sparse_qa")
    parser.add_argument("--sparse", default="{}", help="sparse settings besides beta, e.g. '{\"min_context\": 0}'")
    parser.add_argument("--betas", default=",".join(f"{b:g}" for b in BETAS), help="the sparse engine's arms")
    parser.add_argument("--model", type=Path, default=MODEL, help="the model folder (default: build/models/smollm2)")
    parser.add_argument(
        "--stock-cases", type=int, help="run the stock engine on the first N cases of each length only (N >= 6)"
    )
    parser.add_argument(
        "--timed", type=int, default=TIMED, help=f"cases per length run alone for the speed ratios (default {TIMED})"
    )
    parser.add_argument(
        "--stock-only", action="store_true", help="run the stock engine alone (its arm for another run's cases)"
    )
    parser.add_argument(
        "--start-at", default="", help="LENGTH:INDEX,... the first case index to run per length (default 0)"
    )
    parser.add_argument(
        "--combine", nargs="+", type=Path, help="summarise these runs' JSON (or .tmp) files together; runs nothing"
    )
    args = parser.parse_args()
    if args.stock_only and args.timed:
        parser.error("--stock-only needs --timed 0: speed is a ratio to the sparse engine in the same run")
    if args.stock_cases is not None and args.stock_cases < args.timed:
        parser.error(f"--stock-cases must be at least --timed ({args.timed}): the timed cases need the stock engine")
    started = time.time()
    if args.combine:
        runs = [json.loads(path.read_text()) for path in args.combine]
        records = join_runs(runs)
    else:
        lengths = [int(x) for x in args.lengths.split(",")]
        per_length = {n: args.cases or CASES.get(n, 50) for n in lengths}
        SCRATCH.mkdir(parents=True, exist_ok=True)
        partial = SCRATCH / f"{args.name}.tmp"  # the run so far, beside the results (never among those committed)
        start_at = {int(n): int(i) for n, i in (item.split(":") for item in args.start_at.split(",") if item)}
        settings = json.loads(args.sparse)
        betas = [float(b) for b in args.betas.split(",")]
        records = run(
            lengths, per_length, settings, partial, args.stock_cases, args.timed, start_at, args.stock_only, betas,
            args.model,
        )  # fmt: skip
    rows = summarise(records)
    print(format_table(rows))
    write_results(args.name, {"rows": rows, **records}, output_dir(args), plot(rows))
    print(f"in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
