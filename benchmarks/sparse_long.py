"""DIPR on the real model at long contexts: SmolLM2 extended past its trained 8K by RoPE scaling, stock beside
kvreuse's sparse backend on vLLM's CPU engine.

The model is SmolLM2-135M-Instruct (``build/models/smollm2``, 8K positions, float32) with its RoPE extended through
vLLM's own model overrides (``kvreuse.localmodel.extended_context``: ``--scaling yarn`` or ``linear``, factor 2 for
contexts up to 16K, 4 up to 32K, none up to 8K). Per length, two engines run in one process: the stock one
(CPU_ATTN) and one with kvreuse's sparse backend (``KVREUSE_SPARSE_CPU_BACKEND=1``, ``--sparse`` settings, with
``min_context`` 0 unless given, so every context is pruned); with ``--module-cache`` the sparse engine also runs
the module cache's connector (as a user who turns on both plugins: the prompts splice no modules, so this measures
what the connector's presence costs plain decodes).

Prompts (``retrieval_cases.make_document_cases``): one document of about the length's tokens (real text) holding
``--questions`` facts "The secret number of X is N." at spread depths, and one question per fact after it, the reply
started. The document is a shared prefix, so each engine prefills it once (the first question) and every other
question costs its own few tokens: long-context needle questions on a 2-core CPU, where a 32K prefill takes ~9
minutes. Question by question the arms alternate: stock, then the sparse engine at each beta of ``--betas``
(reconfigured in its worker between requests), each greedy ``--tokens`` tokens.

Per length and arm: ``found`` the questions whose answer is in the completion, ``kept`` the stock's right answers
this arm also gets, ``identical`` the completions whose tokens equal stock's; ``blocks``: the share of KV blocks the
decodes read over the DIPR layers (the backend's counters); ``decode ms``: time per output token after the first
(vLLM's own timestamps), median over the questions, and ``decode / stock``: median over the questions of the ratio to
stock's on the same question; ``prefill ms/token``: the document's prefill (each engine's first question; later arms
find it cached) per prompt token, and its ratio to stock's. The load average is taken with every length.

Run: ``KVREUSE_DATASETS=/work/shared/datasets .venv/bin/python benchmarks/sparse_long.py --lengths 16000``
(``--lengths 8000,16000,32000 --questions 20 --betas inf,4,2``); writes ``NAME.json`` (``--name``, default
``sparse_long``) under ``build/benchmarks/``, or ``docs/benchmarks/results/`` with ``--update-results``, and prints
the table. One length per invocation keeps a run within ~25 minutes on the 2-core machine at 32K; ``--combine
A.json B.tmp`` prints the table of several runs (a ``.tmp`` file holds the questions a run has answered so far).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, bench_parser, output_dir, pin_engine_cores, write_results  # noqa: E402
from module_cache import CONNECTOR as MODULE_CONNECTOR  # noqa: E402
from retrieval_cases import RetrievalCase, make_document_cases  # noqa: E402
from sparse_qa import _configure, _timing  # noqa: E402  (the same worker call and vLLM timestamps)

MODEL = REPO / "build" / "models" / "smollm2"
TRAINED = 8192  # SmolLM2's positions


def rope_factor(length: int) -> int:
    """The smallest factor of 1, 2, 4, ... whose extended context holds ``length`` tokens and the answer."""
    factor = 1
    while TRAINED * factor < length + 64:
        factor *= 2
    return factor


def _figures(worker):
    from kvreuse.vllm.runtime import sparse_attention

    attention = sparse_attention()
    rows = [r for r in attention.figures.rows() if r["layer"] >= attention.config.dense_layers]
    return {"blocks_read": sum(r["blocks_read"] for r in rows), "blocks_total": sum(r["blocks_total"] for r in rows)}


def load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def run_length(length: int, args: argparse.Namespace, settings: dict, partial: Path) -> dict:
    from vllm import LLM, SamplingParams

    from kvreuse.localmodel import extended_context, local_engine_args
    from kvreuse.patches import vllm_0_32

    factor = rope_factor(length)
    extra = extended_context(args.model, args.scaling, factor) if factor > 1 else {"max_model_len": TRAINED}
    kv_bytes = max(512 << 20, (length + 1024) * 30 * 3 * 64 * 2 * 4 * 5 // 4)  # K/V fp32 of 30 layers, + the sketch
    engine_args = local_engine_args(args.model, kv_cache_memory_bytes=kv_bytes, **extra)
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc sends the closures above
    os.environ.pop("KVREUSE_SPARSE_CPU_BACKEND", None)
    pin_engine_cores()  # the same cores for both engines, also with --module-cache's connector
    stock = LLM(**engine_args)
    os.environ["KVREUSE_SPARSE_CPU_BACKEND"] = "1"  # read by the sparse engine's processes when they start
    sparse = LLM(**engine_args, **({"kv_transfer_config": MODULE_CONNECTOR} if args.module_cache else {}))
    os.environ.pop("KVREUSE_SPARSE_CPU_BACKEND")
    sampling = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    tokenizer = stock.get_tokenizer()

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    def chat(message: str) -> str:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
        )

    cases: list[RetrievalCase] = make_document_cases(length, args.questions, count, chat)
    run = {
        "length": length,
        "scaling": args.scaling if factor > 1 else "none",
        "factor": factor,
        "tokens": args.tokens,
        "settings": settings,
        "module_cache": args.module_cache,
    }
    betas = [float(b) for b in args.betas.split(",")]
    for engine in (stock, sparse):
        engine.generate(["Hello, who are you?"], sampling, use_tqdm=False)
    records = []
    loads = [load()]
    try:
        for case in cases:
            out = stock.generate([case.prompt], sampling, use_tqdm=False)[0]
            prefill, decode = _timing(out)
            stock_tokens = list(out.outputs[0].token_ids)
            record = {
                "index": case.index,
                "answer": case.answer,
                "prompt_tokens": len(out.prompt_token_ids),
                "cached_tokens": out.num_cached_tokens,
                "arms": {
                    "stock": {
                        "text": out.outputs[0].text,
                        "found": case.correct(out.outputs[0].text),
                        "prefill_s": prefill,
                        "decode_s": decode,
                    }
                },
            }
            for beta in betas:
                sparse.collective_rpc(_configure(beta, settings))
                got = sparse.generate([case.prompt], sampling, use_tqdm=False)[0]
                prefill, decode = _timing(got)
                record["arms"][f"beta={beta:g}"] = {
                    "text": got.outputs[0].text,
                    "found": case.correct(got.outputs[0].text),
                    "identical": list(got.outputs[0].token_ids) == stock_tokens,
                    "prefill_s": prefill,
                    "decode_s": decode,
                    "cached_tokens": got.num_cached_tokens,
                    **sparse.collective_rpc(_figures)[0],
                }
            records.append(record)
            loads.append(load())
            partial.write_text(json.dumps({"runs": [{**run, "load": loads, "questions": records}]}, indent=1))
            print(f"{length}: question {case.index} {json.dumps({a: e['text'] for a, e in record['arms'].items()})}")
    finally:
        for engine in (stock, sparse):
            vllm_0_32.shutdown_llm(engine)
    return {**run, "load": loads, "questions": records}


def summarise(runs: list[dict]) -> list[dict]:
    rows = []
    for run in runs:
        questions = run["questions"]
        stock = [q["arms"]["stock"] for q in questions]
        first = questions[0]
        for arm in first["arms"]:
            entries = [q["arms"][arm] for q in questions]
            row = {
                "length": run["length"],
                "rope": f"{run['scaling']} x{run['factor']}",
                "arm": arm,
                "questions": len(entries),
                "found": sum(e["found"] for e in entries),
                "stock_found": sum(s["found"] for s in stock),
                "kept": sum(e["found"] and s["found"] for e, s in zip(entries, stock)),
                "decode_ms": 1e3 * statistics.median(e["decode_s"] for e in entries),
                "load": [min(run["load"]), max(run["load"])],
            }
            # the document's prefill: each engine's first question (later arms find it in the prefix cache)
            if (first["arms"][arm].get("cached_tokens") or 0) < first["prompt_tokens"] // 2:
                row["prefill_ms_per_token"] = 1e3 * first["arms"][arm]["prefill_s"] / first["prompt_tokens"]
            if arm != "stock":
                row["identical"] = sum(e["identical"] for e in entries)
                read, total = sum(e["blocks_read"] for e in entries), sum(e["blocks_total"] for e in entries)
                row["blocks_read"] = read / total if total else None
                row["decode_ratio"] = statistics.median(e["decode_s"] / s["decode_s"] for e, s in zip(entries, stock))
                if "prefill_ms_per_token" in row:
                    row["prefill_ratio"] = first["arms"][arm]["prefill_s"] / first["arms"]["stock"]["prefill_s"]
            rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    header = ["length", "RoPE", "arm", "found", "kept", "identical", "blocks read", "decode ms/token",
              "decode / stock", "prefill ms/token", "prefill / stock", "load"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        n = r["questions"]
        cells = [
            f"{r['length']:,}",
            r["rope"],
            r["arm"],
            f"{r['found']}/{n}",
            f"{r['kept']}/{r['stock_found']}",
            f"{r['identical']}/{n}" if "identical" in r else "-",
            "-" if r.get("blocks_read") is None else f"{r['blocks_read']:.1%}",
            f"{r['decode_ms']:.1f}",
            f"{r['decode_ratio']:.2f}" if "decode_ratio" in r else "-",
            f"{r['prefill_ms_per_token']:.2f}" if "prefill_ms_per_token" in r else "-",
            f"{r['prefill_ratio']:.2f}" if "prefill_ratio" in r else "-",
            f"{r['load'][0]:.1f}-{r['load'][1]:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--lengths", default="16000", help="prompt tokens, comma-separated (one engine pair each)")
    parser.add_argument("--questions", type=int, default=20, help="needle questions per length (one document)")
    parser.add_argument("--betas", default="inf,4", help="the sparse engine's arms")
    parser.add_argument("--tokens", type=int, default=12, help="greedy tokens per answer")
    parser.add_argument("--scaling", default="yarn", help="RoPE scaling past 8K: yarn or linear")
    parser.add_argument("--sparse", default='{"min_context": 0}', help="sparse settings besides beta")
    parser.add_argument("--module-cache", action="store_true", help="the sparse engine with the module connector")
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--name", default="sparse_long")
    parser.add_argument("--combine", nargs="+", type=Path, help="print the table of these runs; runs nothing")
    args = parser.parse_args()
    if args.combine:
        runs = [run for path in args.combine for run in json.loads(path.read_text())["runs"]]
    else:
        started = time.time()
        settings = json.loads(args.sparse)
        out = output_dir(args)
        out.mkdir(parents=True, exist_ok=True)
        partial = out / f"{args.name}.tmp"  # the questions so far, for a run cut short (--combine reads it)
        runs = [run_length(int(n), args, settings, partial) for n in args.lengths.split(",")]
        write_results(args.name, {"rows": summarise(runs), "runs": runs}, out)
        partial.unlink(missing_ok=True)  # the run finished: its questions are in the results
        print(f"in {time.time() - started:.0f} s")
    print(format_table(summarise(runs)))


if __name__ == "__main__":
    main()
