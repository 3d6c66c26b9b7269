"""The offline study's reference against the real engine: kvreuse's splice in vLLM gives the reference's answers.

``module_quality.py`` measures every arm with ``splice_reference`` (PyTorch, float32). This script checks that its
``full``, ``naive`` and ``anchored`` arms are what vLLM serves: the engine on SmolLM2 with the
``KVReuseModuleCache`` connector (kvreuse's attention backend on CPU, dense), the header
and each module encoded through encode requests (alone; after the header for ``anchored``, in an engine of its
own), each prompt sent after a prefix-cache reset so that its modules come from the connector. Greedy, 16 tokens,
stopping at ``<|im_end|>``; ``full`` is the same engine with ``skip_reading_prefix_cache`` (the connector and the
prefix cache ignored, every token computed).

The ``legolink-K`` arms are the engine's selective recompute (``modules.recompute_first``, here per request with
``kv_transfer_params {"kvreuse_recompute_first": K}``) over the naive encodings: K first tokens per spliced module
computed with the whole prompt before them, the header's K going to the other modules (its spliced KV is exact at
the prompt's start, so it recomputes none: ``kvreuse.modules.splice.allot_first_tokens``). The ``blend-*`` arms are
CacheBlend's token choice made at encode time (``modules.recompute_share``, here per request with ``kv_transfer_params
{"kvreuse_recompute_share": R}``): the modules encoded with ``encode_modules(..., probe=header)``, the header
without (its spliced KV is exact), the top R of each module's tokens by the probe's ranking recomputed.

TTFT per arm is vLLM's own per-request figure (``RequestOutput.metrics``: ``first_token_ts - scheduled_ts``, engine
core timestamps), median over the cases, with its ratio to ``full``'s median in the same run; arms run one after
another in the same process on a machine others may share, so only the ratios mean anything.

The ``ape-*`` arms are the engine's APE (``modules.ape_temperature``, here per request with ``kv_transfer_params
{"kvreuse_ape": {"temperature": T}}``): the question and the decoded tokens attend to the module keys (not the
header's, the prompt's shared prefix) with temperature T; ``ape-alone-T0.8`` over the naive encodings,
``ape-anchored-T0.8`` over the anchored ones, ``ape+legolink-16`` with ``kvreuse_recompute_first`` 16 too.

Prints, per arm, how many answers are right, how many outputs equal the engine's own full prefill's, the share of
prompt tokens the engine computed, and, where ``module_quality.py`` measured the same cases and arm, how many give
the reference's tokens exactly (and, where not, the first output token that differs); writes
``module_quality_vllm_<set>.json`` (the arms' figures under ``arms``) under ``build/benchmarks/``
(``--update-results``: into ``docs/benchmarks/results/``, the figures the docs cite; so for every output below)::

    python benchmarks/module_quality_vllm.py --set mixed --cases 20
    python benchmarks/module_quality_vllm.py --set long --cases 8 --ttft-only   # the issue's shape: 8 modules x ~256

``--curves``: answers against compute, every recovery the engine serves (``--arms``, from :data:`CURVE_ARMS`: the
plain splice, LegoLink's first K tokens, the engine's default 16 among them, CacheBlend's choice made at encode
time (``recompute_share``), the one budget (``recompute_budget``) and CacheBlend's choice from the request
(``recompute_blend`` after ``blend_layers`` exact layers)), on document sets (``docs-1`` to ``docs-8``: 1 to 8
documents of 100-140 tokens after the chat header) or the schema workload (``schema-2``, ``schema-4``,
``schema-8``: Spider schemas of 2, 4 or 8 tables, one module per table encoded after the tables it references, as
TableCache does; a question asking for a SQL query, 32 greedy tokens), the cases drawn with ``--seed``, in one
engine, the arms taking turns per case (so TTFT ratios compare like with like), the prefix cache reset before each
request. Per arm and set: right answers, full prefill's right answers kept, outputs with the same 16 tokens as full
prefill's, the same answer (the first line, case and whitespace aside; on a schema set, the same query after
``normalise_sql``), the share of prompt tokens vLLM computed (and with the pass of ``recompute_blend``, counted as
its tokens through its layers and one more), TTFT full/arm (medians) and where the arm's TTFT went (the module
loads and the pass, each a median share of its TTFT, from the worker's figures). Rows go to
``build/module_quality_vllm/curves-<tag>.jsonl`` as each case finishes; a run stops starting cases after
``--minutes`` and the next resumes, so a long run goes in pieces; writes ``module_quality_vllm_<tag>.{json,png}``::

    python benchmarks/module_quality_vllm.py --curves --sets docs-4 --cases 60 --tag docs4 \
        --arms naive,first-16,first-64,share-30%,blend-15%,blend-20%,blend-30%
    python benchmarks/module_quality_vllm.py --curves --sets schema-2,schema-4,schema-8 --cases 16 --tag schema

``--ttft-only``: TTFT alone (one token per request), the arms interleaved case by case in one engine (``full``,
``naive``, ``legolink-*``, ``blend-*``; ``anchored`` computes what ``naive`` does), so that a change in the
machine's load hits every arm alike; writes ``module_quality_vllm_ttft_<set>.json`` (the arms under ``arms``).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, bench_parser, engine, new_figure, output_dir, write_results  # noqa: E402
from module_quality import EOS_TEXT, MAX_NEW_TOKENS, RUNS  # noqa: E402
from module_quality_data import (  # noqa: E402
    HEADER,
    QA_SETS,
    SCHEMA_SETS,
    TokenizedCase,
    is_correct,
    make_cases,
    make_schema_cases,
    normalise_sql,
    tokenize_case,
    tokenize_schema_case,
)

from kvreuse.localmodel import DATASETS  # noqa: E402
from kvreuse.modules.agreement import Normaliser, same_output  # noqa: E402

MODEL = REPO / "build" / "models" / "smollm2"
CONNECTOR = {"kv_connector": "KVReuseModuleCache", "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
# recompute_first 0 (the setting's default is 16): each arm recomputes only what its name says, the legolink arms
# per request.
SETTINGS = {
    "kvreuse": {
        "sparse": {"beta": float("inf")},
        "modules": {"gpu_bytes": 0, "cpu_bytes": 4 << 30, "recompute_first": 0},
    }
}


LEGOLINK = {"legolink-16": 16, "legolink-32": 32}  # arm -> modules.recompute_first
BLEND = {"blend-all-10%": 0.10}  # arm -> modules.recompute_share (modules probed after the header)
APE = {"kvreuse_ape": {"temperature": 0.8, "scale": 1.0}}  # the offline study's APE setting
# arm -> its requests' kv_transfer_params (modules.recompute_first / recompute_share, APE), per engine (naive,
# anchored encodings)
NAIVE_ARMS = {
    **{arm: {"kvreuse_recompute_first": k} for arm, k in LEGOLINK.items()},
    **{arm: {"kvreuse_recompute_share": r} for arm, r in BLEND.items()},
    "ape-alone-T0.8": APE,
}
ANCHORED_ARMS = {"ape-anchored-T0.8": APE, "ape+legolink-16": {**APE, "kvreuse_recompute_first": 16}}
TRANSFER = {**NAIVE_ARMS, **ANCHORED_ARMS}
SPLICED = ("naive", "anchored", "ape-alone-T0.8", "ape-anchored-T0.8")  # the whole run of modules from the cache
# --curves: arm -> its requests' kv_transfer_params (over modules encoded alone and probed after the header): full
# prefill, the plain splice, LegoLink's first tokens (16 is the engine's default), CacheBlend's choice made at encode
# time (recompute_share), the one budget (recompute_budget) and CacheBlend's choice from the request
# (recompute_blend after blend_layers exact layers; +first: with the default's first tokens too).
CURVE_ARMS: dict[str, dict | None] = {
    "full": None,
    "naive": {"kvreuse_recompute_first": 0},
    "first-16": {"kvreuse_recompute_first": 16},
    "first-32": {"kvreuse_recompute_first": 32},
    "first-64": {"kvreuse_recompute_first": 64},
    "share-20%": {"kvreuse_recompute_share": 0.2},
    "budget-20%": {"kvreuse_recompute_budget": 0.2},
    **{f"blend-{p}%": {"kvreuse_recompute_blend": p / 100} for p in (10, 15, 20, 25, 30)},
    **{f"blend-L2-{p}%": {"kvreuse_recompute_blend": p / 100, "kvreuse_blend_layers": 2} for p in (15, 20)},
    **{f"first-16+blend-{p}%": {"kvreuse_recompute_first": 16, "kvreuse_recompute_blend": p / 100} for p in (10, 15)},
}
DEFAULT_CURVE_ARMS = ("naive", "first-16", "first-64", "share-20%", "blend-15%", "blend-20%", "blend-30%")
ANSWER = Normaliser.parse(["first-line", "case", "whitespace"])  # what a reader of these answers compares
NUM_LAYERS = 30  # SmolLM2-135M's
CURVE_SETS = ("docs-1", "docs-2", "docs-4", "docs-8")
SCHEMA_CURVE_SETS = tuple(SCHEMA_SETS)  # schema-2, schema-4, schema-8: --curves --sets schema-2,schema-4,schema-8


def _ttft(out) -> float | None:
    """vLLM's own time to first token of a finished request (engine-core timestamps; ``None`` without stats)."""
    stats = getattr(out, "metrics", None)
    if stats is None or not getattr(stats, "first_token_ts", 0.0) or not getattr(stats, "scheduled_ts", 0.0):
        return None
    return stats.first_token_ts - stats.scheduled_ts


def _reference(set_name: str) -> dict[tuple[str, str], list[int]]:
    log = RUNS / f"{set_name}.jsonl"
    if not log.exists():
        print(f"no reference results in {log} (benchmarks/module_quality.py --set {set_name}): engine figures only")
        return {}
    rows = (json.loads(line) for line in log.read_text().splitlines())
    return {(r["case"], r["arm"]): r["tokens"] for r in rows}


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--set", default="mixed", choices=sorted(QA_SETS))
    parser.add_argument("--cases", type=int, default=20)
    parser.add_argument("--ttft-only", action="store_true", help="TTFT per arm, arms interleaved per case")
    parser.add_argument("--curves", action="store_true", help="answers against compute per arm, arms interleaved")
    parser.add_argument("--sets", default=",".join(CURVE_SETS), help="--curves: the sets, comma-separated")
    parser.add_argument(
        "--arms",
        default=",".join(DEFAULT_CURVE_ARMS),
        help="--curves: arms of " + ", ".join(CURVE_ARMS).replace("%", "%%"),  # argparse %-formats its help
    )
    parser.add_argument("--seed", type=int, default=0, help="--curves: the seed the cases are drawn with")
    parser.add_argument("--minutes", type=float, default=20.0, help="--curves: start no case after this long")
    parser.add_argument("--tag", default="curves", help="--curves: name of the resumable log and the results")
    parser.add_argument("--report-only", action="store_true", help="--curves: summarise the log, run nothing")
    args = parser.parse_args(argv)
    os.environ["KVREUSE_SPARSE_CPU_BACKEND"] = "1"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if args.curves:
        arms = args.arms.split(",")
        unknown = [arm for arm in arms if arm not in CURVE_ARMS or arm == "full"]
        if unknown:
            raise SystemExit(f"unknown arms {unknown}; known: {', '.join(a for a in CURVE_ARMS if a != 'full')}")
        sets = args.sets.split(",")
        if not args.report_only:
            _curves(sets, args.cases, arms, args.seed, args.minutes, args.tag)
        log = RUNS.parent / "module_quality_vllm" / f"curves-{args.tag}.jsonl"
        keys = {name: {f"{name}-{i}" for i in range(args.cases)} for name in sets}  # make_cases' keys: "<set>-<index>"
        rows = [r for r in _rows(log) if r["set"] in keys and r["case"] in keys[r["set"]] and r["seed"] == args.seed]
        rows.sort(key=lambda r: sets.index(r["set"]))  # the sets in the order asked (the log's is the runs')
        summary = _curve_summary(rows, arms)
        _print_curves(summary)
        meta = {"cases_per_set": args.cases, "seed": args.seed, "answer": str(ANSWER)}
        payload = {**meta, "summary": summary, "rows": rows}
        write_results(f"module_quality_vllm_{args.tag}", payload, output_dir(args), _plot_curves(summary))
        return
    if args.ttft_only:
        _ttft_side_by_side(args.set, args.cases, output_dir(args))
        return
    reference = _reference(args.set)
    results: dict[str, dict] = {}
    # One engine per way of encoding the modules: the store refuses a module re-encoded under its name with
    # another start (kvreuse.errors.ModuleConflict), so anchored encodings cannot replace the naive ones in place.
    for arms in (("full", "naive", *NAIVE_ARMS), ("anchored", *ANCHORED_ARMS)):
        results.update(_run_engine(args.set, args.cases, arms, reference))
    full_ttft = results.get("full", {}).get("ttft_median_s")
    for arm, figures in results.items():
        ttft = figures.get("ttft_median_s")
        figures["ttft_vs_full"] = round(ttft / full_ttft, 4) if ttft and full_ttft else None
        print(f"{arm}: TTFT {ttft * 1e3 if ttft else float('nan'):.1f} ms median, {figures['ttft_vs_full']} of full's")
    write_results(f"module_quality_vllm_{args.set}", {"set": args.set, "arms": results}, output_dir(args))


def curve_cases(name: str, encode, num_cases: int, seed: int = 0) -> list[TokenizedCase]:
    """The first ``num_cases`` tokenized cases of a document set (``QA_SETS``) or a schema set (``SCHEMA_SETS``),
    drawn with ``seed``."""
    if name in SCHEMA_SETS:
        from kvreuse.modules.schemas import spider_schemas

        schemas = spider_schemas(DATASETS / "spider" / "tables.json")
        cases = make_schema_cases(SCHEMA_SETS[name], schemas, seed)[:num_cases]
        return [tokenize_schema_case(c, encode) for c in cases]
    return [tokenize_case(c, encode) for c in make_cases(QA_SETS[name], encode, seed)[:num_cases]]


def encode_curve_modules(llm, sets: dict[str, list[TokenizedCase]]) -> dict[tuple[int, ...], str]:
    """Encode every header of ``sets`` alone (exact at the prompt's start: never recomputed, no probe) and every
    module after its own context (none for a document, the referenced tables for a schema's table: TableCache),
    probed after its case's header; the modules' names by their token ids."""
    from kvreuse.vllm.modules import encode_modules

    headers = list(dict.fromkeys(tc.header for tcs in sets.values() for tc in tcs))
    encode_modules(llm, {f"header-{i}": list(h) for i, h in enumerate(headers)})
    named: dict[tuple[int, ...], str] = {}
    for h, header in enumerate(headers):
        contexts: dict[tuple[int, ...], tuple[int, ...]] = {}
        for tc in (tc for tcs in sets.values() for tc in tcs if tc.header == header):
            for i, ids in enumerate(tc.modules):
                contexts.setdefault(ids, tc.contexts[i] if tc.contexts else ())
        names = {f"module-{h}-{i}": ids for i, ids in enumerate(contexts)}
        encode_modules(
            llm,
            {name: list(ids) for name, ids in names.items()},
            {name: list(contexts[ids]) for name, ids in names.items() if contexts[ids]},
            probe=header,
        )
        named.update({ids: name for name, ids in names.items()})
    return named


def _curves(set_names: list[str], num_cases: int, arms: list[str], seed: int, minutes: float, tag: str) -> None:
    """The arms ``arms`` of :data:`CURVE_ARMS` on the first ``num_cases`` cases of each set (drawn with ``seed``), in
    one engine, the arms taking turns per case, the prefix cache reset before each request. Rows go to
    ``build/module_quality_vllm/curves-<tag>.jsonl`` as each case finishes; a run stops starting cases after
    ``minutes`` and the next one resumes (each piece fits the machine's CPU lock)."""
    log = RUNS.parent / "module_quality_vllm" / f"curves-{tag}.jsonl"
    log.parent.mkdir(parents=True, exist_ok=True)
    done = {(r["set"], r["case"], r["arm"]) for r in _rows(log)}
    with engine(MODEL, kv_transfer_config=CONNECTOR, additional_config=SETTINGS) as llm:
        tokenizer = llm.get_tokenizer()
        eos = tokenizer.convert_tokens_to_ids(EOS_TEXT)

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

        sets = {name: curve_cases(name, encode, num_cases, seed) for name in set_names}
        todo = {
            name: [tc for tc in tokenized if any((name, tc.case.key, arm) not in done for arm in ["full", *arms])]
            for name, tokenized in sets.items()
        }
        started = time.perf_counter()
        count = len(encode_curve_modules(llm, {name: tcs for name, tcs in todo.items() if tcs}))
        print(f"encoded {count} modules in {time.perf_counter() - started:.0f} s", flush=True)
        with log.open("a") as out:
            for name, tokenized in todo.items():
                for tc in tokenized:
                    if time.perf_counter() - started > minutes * 60:
                        print(f"stopped after {minutes} minutes: run again to go on", flush=True)
                        return
                    rows = case_rows(llm, tokenizer, eos, name, seed, tc, ["full", *arms])
                    for row in rows:
                        out.write(json.dumps(row) + "\n")
                    out.flush()
                    elapsed = time.perf_counter() - started
                    print(f"{name} {tc.case.key}: {len(tc.prompt)} tokens, {elapsed:.0f} s", flush=True)


def case_rows(llm, tokenizer, eos: int, name: str, seed: int, tc, arms: list[str]) -> list[dict]:
    """One case under every arm in turn: its figures per arm (full prefill first: the others compare with it)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvreuse.vllm.modules.common import BLEND_PASS

    rows: list[dict] = []
    full_tokens: list[int] = []
    full_right: bool | None = False
    schema = name in SCHEMA_SETS
    answer = normalise_sql if schema else ANSWER
    for arm in arms:
        transfer = CURVE_ARMS[arm]
        params = SamplingParams(
            max_tokens=SCHEMA_SETS[name].max_tokens if schema else MAX_NEW_TOKENS,
            temperature=0.0,
            stop_token_ids=[eos],
            skip_reading_prefix_cache=transfer is None,
            extra_args={"kv_transfer_params": transfer} if transfer else None,
        )
        llm.reset_prefix_cache()
        before = llm.collective_rpc(_worker_figures)[0]
        out = llm.generate([TokensPrompt(prompt_token_ids=list(tc.prompt))], params, use_tqdm=False)[0]
        after = llm.collective_rpc(_worker_figures)[0]
        tokens = list(out.outputs[0].token_ids)
        ttft = _ttft(out)
        if ttft is None:
            raise SystemExit("vLLM gave no request stats (disable_log_stats must be off)")
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        right = None if schema else is_correct(text, tc.case)  # a schema case has no gold query: agreement only
        if transfer is None:
            full_tokens, full_right = tokens, right
        report = (out.kv_transfer_params or {}).get(BLEND_PASS)
        rows.append(
            {
                "set": name,
                "seed": seed,
                "case": tc.case.key,
                "arm": arm,
                "right": right,
                "full_right": full_right,
                "same_as_full": tokens == full_tokens,
                "same_answer_as_full": same_output(full_tokens, tokens, answer, _decoder(tokenizer)),
                "prompt_tokens": len(tc.prompt),
                "computed": len(tc.prompt) - out.num_cached_tokens,
                "passed": report["tokens"] * (report["layers"] + 1) / NUM_LAYERS if report else 0.0,
                "ttft_s": ttft,
                "load_s": after["load_s"] - before["load_s"],
                "blend_s": after["blend_s"] - before["blend_s"],
                "loadavg": os.getloadavg()[0],
            }
        )
    return rows


def _decoder(tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def _worker_figures(worker) -> dict:
    from kvreuse.vllm.runtime import module_figures

    return module_figures()


def _rows(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _curve_summary(rows: list[dict], arms: list[str]) -> dict[str, dict[str, dict]]:
    """Per set and arm: right answers, full prefill's right answers kept, outputs equal to full's (tokens; answers
    after :data:`ANSWER`), prompt tokens computed (vLLM's count; with the pass), median TTFT and full's median over
    it, and where the arm's TTFT went (module loads, the pass), each a share of its median TTFT."""
    summary: dict[str, dict[str, dict]] = {}
    for name in dict.fromkeys(r["set"] for r in rows):
        mine = [r for r in rows if r["set"] == name]
        full = {r["case"]: r for r in mine if r["arm"] == "full"}
        full_ttft = statistics.median(r["ttft_s"] for r in full.values())
        summary[name] = {}
        for arm in ["full", *arms]:
            arm_rows = [r for r in mine if r["arm"] == arm and r["case"] in full]
            if not arm_rows:
                continue
            ttft = statistics.median(r["ttft_s"] for r in arm_rows)
            tokens = sum(r["prompt_tokens"] for r in arm_rows)
            answered = arm_rows[0]["right"] is not None  # a schema case has no gold query
            summary[name][arm] = {
                "cases": len(arm_rows),
                "right": sum(r["right"] for r in arm_rows) if answered else None,
                "full_right": sum(full[r["case"]]["right"] for r in arm_rows) if answered else None,
                "kept": sum(r["right"] and full[r["case"]]["right"] for r in arm_rows) if answered else None,
                "same_as_full": sum(r["same_as_full"] for r in arm_rows),
                "same_answer_as_full": sum(r["same_answer_as_full"] for r in arm_rows),
                "computed_share": round(sum(r["computed"] for r in arm_rows) / tokens, 4),
                "with_pass_share": round(sum(r["computed"] + r["passed"] for r in arm_rows) / tokens, 4),
                "ttft_median_s": round(ttft, 5),
                "speedup": round(full_ttft / ttft, 2),
                "load_share": round(statistics.median(r["load_s"] / r["ttft_s"] for r in arm_rows), 3),
                "pass_share": round(statistics.median(r["blend_s"] / r["ttft_s"] for r in arm_rows), 3),
                "loadavg": [
                    round(min(r["loadavg"] for r in arm_rows), 1),
                    round(max(r["loadavg"] for r in arm_rows), 1),
                ],
            }
    return summary


def _print_curves(summary: dict[str, dict[str, dict]]) -> None:
    print(
        "| set | arm | right | full's right answers kept | same 16 tokens as full | same answer as full "
        "| prompt tokens computed (with the pass) | TTFT full/arm | of its TTFT: loads, pass |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, arms in summary.items():
        for arm, r in arms.items():
            n = r["cases"]
            with_pass = f" ({r['with_pass_share']:.1%})" if r["with_pass_share"] != r["computed_share"] else ""
            right = f"{r['right']}/{n}" if r["right"] is not None else "n/a"
            kept = f"{r['kept']}/{r['full_right']}" if r["kept"] is not None else "n/a"
            print(
                f"| {name} | {arm} | {right} | {kept} | {r['same_as_full']}/{n} "
                f"| {r['same_answer_as_full']}/{n} | {r['computed_share']:.1%}{with_pass} | {r['speedup']:.1f}x "
                f"| {r['load_share']:.0%}, {r['pass_share']:.0%} |"
            )


def _plot_curves(summary: dict[str, dict[str, dict]]):
    """Per set, full prefill's answers kept and outputs the same as full's against the share of prompt tokens
    computed (with the pass), one point per arm; the goal's corner shaded. Returns the figure."""
    fig, axes = new_figure(1, len(summary), figsize=(5 * len(summary), 4.4), squeeze=False, sharey=True)
    for ax, (name, arms) in zip(axes[0], summary.items()):
        for arm, r in arms.items():
            x = r["with_pass_share"]
            same = r["same_answer_as_full"] / r["cases"]
            if r["kept"] is not None:
                kept = r["kept"] / r["full_right"] if r["full_right"] else 0.0
                ax.scatter([x], [kept], marker="o", color="tab:blue")
            ax.scatter([x], [same], marker="x", color="tab:orange")
            ax.annotate(arm, (x, same), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.scatter([], [], marker="o", color="tab:blue", label="full's right answers kept")
        ax.scatter([], [], marker="x", color="tab:orange", label="same answer as full (first line; schema: SQL)")
        ax.fill_between([0, 0.3], 0.9, 1.05, color="#1b9e77", alpha=0.15, label="goal: >= 0.9 at <= 30%")
        ax.set_title(f"{name} ({arms['full']['cases']} cases)")
        ax.set_xlabel("share of prompt tokens computed (with the pass)")
        ax.set_xscale("symlog", linthresh=0.05)
        ax.set_xlim(0, 1.1)
    axes[0][0].set_ylabel("share of cases")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def _ttft_side_by_side(set_name: str, num_cases: int, out_dir: Path) -> None:
    """TTFT of every arm but ``anchored`` on the same prompts in one engine, the arms taking turns per case."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvreuse.vllm.modules import encode_modules

    with engine(MODEL, kv_transfer_config=CONNECTOR, additional_config=SETTINGS) as llm:
        tokenizer = llm.get_tokenizer()

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

        tokenized = [tokenize_case(c, encode) for c in make_cases(QA_SETS[set_name], encode)[:num_cases]]
        header = encode(HEADER)
        unique = list(dict.fromkeys(ids for tc in tokenized for ids in tc.modules))
        arms: dict[str, dict] = {"full": {}, "naive": {}}
        arms.update({arm: {"kvreuse_recompute_first": k} for arm, k in LEGOLINK.items()})
        arms.update({arm: {"kvreuse_recompute_share": r} for arm, r in BLEND.items()})
        ttfts: dict[str, list[float]] = {arm: [] for arm in arms}
        computed = dict.fromkeys(arms, 0)
        encode_modules(llm, {"header": header})
        encode_modules(llm, {f"module-{i}": list(ids) for i, ids in enumerate(unique)}, probe=header)
        for n, tc in enumerate(tokenized):
            for arm, transfer in arms.items():
                params = SamplingParams(
                    max_tokens=1,
                    temperature=0.0,
                    skip_reading_prefix_cache=arm == "full",
                    extra_args={"kv_transfer_params": transfer} if transfer else None,
                )
                llm.reset_prefix_cache()
                out = llm.generate([TokensPrompt(prompt_token_ids=list(tc.prompt))], params, use_tqdm=False)[0]
                ttft = _ttft(out)
                if ttft is None:
                    raise SystemExit("vLLM gave no request stats (disable_log_stats must be off)")
                ttfts[arm].append(ttft)
                computed[arm] += len(tc.prompt) - out.num_cached_tokens
            print(f"[{n + 1}/{len(tokenized)}] {len(tc.prompt)} tokens", flush=True)
    total = sum(len(tc.prompt) for tc in tokenized)
    full = statistics.median(ttfts["full"])
    results = {
        arm: {
            "cases": len(tokenized),
            "computed_share": round(computed[arm] / total, 4),
            "ttft_median_s": round(statistics.median(values), 5),
            "ttft_vs_full": round(statistics.median(values) / full, 4),
            "speedup": round(full / statistics.median(values), 2),
        }
        for arm, values in ttfts.items()
    }
    print(f"{set_name}: {len(tokenized)} prompts of {total / len(tokenized):.0f} tokens on average")
    for arm, r in results.items():
        print(
            f"{arm}: {r['computed_share']:.1%} of prompt tokens computed; TTFT {r['ttft_median_s'] * 1e3:.1f} ms "
            f"median, {r['ttft_vs_full']:.3f} of full's ({r['speedup']:.2f}x faster)"
        )
    write_results(f"module_quality_vllm_ttft_{set_name}", {"set": set_name, "arms": results}, out_dir)


def _run_engine(
    set_name: str, num_cases: int, arms: tuple[str, ...], reference: dict[tuple[str, str], list[int]]
) -> dict[str, dict]:
    """``arms`` in one engine: ``naive`` and ``anchored`` encode the header and the modules first."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvreuse.vllm.modules import encode_modules

    with engine(MODEL, kv_transfer_config=CONNECTOR, additional_config=SETTINGS) as llm:
        tokenizer = llm.get_tokenizer()
        eos = tokenizer.convert_tokens_to_ids(EOS_TEXT)

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

        cases = [c for c in make_cases(QA_SETS[set_name], encode) if not reference or (c.key, "naive") in reference]
        cases = cases[:num_cases]
        tokenized = [tokenize_case(c, encode) for c in cases]
        header = encode(HEADER)
        unique = list(dict.fromkeys(ids for tc in tokenized for ids in tc.modules))
        modules = {f"module-{i}": list(ids) for i, ids in enumerate(unique)}
        results: dict[str, dict] = {}
        sampling = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, stop_token_ids=[eos])
        full = SamplingParams(
            max_tokens=MAX_NEW_TOKENS, temperature=0.0, stop_token_ids=[eos], skip_reading_prefix_cache=True
        )
        full_tokens: dict[str, list[int]] = {}
        for arm in arms:
            started = time.perf_counter()
            if arm == "naive":
                encode_modules(llm, {"header": header})  # exact as spliced at 0: no probe, nothing to choose
                encode_modules(llm, modules, probe=header)
            elif arm == "anchored":
                encode_modules(llm, {"header": header, **modules}, contexts={name: header for name in modules})
            same = right_both = right_engine = same_as_full = compared = 0
            computed = prompt_tokens = 0
            differ: dict[str, int] = {}  # case -> first output token that differs from the reference's
            ttfts: list[float] = []
            for case, tc in zip(cases, tokenized):
                llm.reset_prefix_cache()
                params = full if arm == "full" else sampling
                if arm in TRANSFER:
                    params = SamplingParams(
                        max_tokens=MAX_NEW_TOKENS,
                        temperature=0.0,
                        stop_token_ids=[eos],
                        extra_args={"kv_transfer_params": TRANSFER[arm]},
                    )
                out = llm.generate([TokensPrompt(prompt_token_ids=tc.prompt)], params, use_tqdm=False)[0]
                tokens = list(out.outputs[0].token_ids)
                ttft = _ttft(out)
                if ttft is not None:
                    ttfts.append(ttft)
                ours = is_correct(tokenizer.decode(tokens, skip_special_tokens=True), case)
                right_engine += ours
                computed += len(tc.prompt) - out.num_cached_tokens
                prompt_tokens += len(tc.prompt)
                if arm == "full":
                    full_tokens[case.key] = tokens
                same_as_full += tokens == full_tokens.get(case.key)
                expected = reference.get((case.key, arm))
                if expected is not None:
                    compared += 1
                    theirs = is_correct(tokenizer.decode(expected, skip_special_tokens=True), case)
                    same += tokens == expected
                    right_both += ours and theirs
                    if tokens != expected:
                        differ[case.key] = next(
                            (i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b),
                            min(len(tokens), len(expected)),
                        )
                if arm in SPLICED and out.num_cached_tokens < len(tc.prompt) - len(tc.question):
                    raise SystemExit(f"{case.key}: only {out.num_cached_tokens} prompt tokens came from the cache")
            results[arm] = {
                "cases": len(cases),
                "right_in_engine": right_engine,
                "same_tokens_as_full": same_as_full if full_tokens else None,
                "computed_share": round(computed / prompt_tokens, 4),
                "compared_with_reference": compared,
                "same_tokens_as_reference": same,
                "right_in_both": right_both,
                "first_difference": differ,
                "seconds": round(time.perf_counter() - started, 1),
                "ttft_median_s": round(statistics.median(ttfts), 5) if ttfts else None,
            }
            versus_full = f"{same_as_full}/{len(cases)}" if full_tokens else "n/a (no full arm in this engine)"
            print(
                f"{arm}: {right_engine}/{len(cases)} right in the engine; {versus_full} outputs equal the engine's "
                f"full prefill's; {computed / prompt_tokens:.1%} of prompt tokens computed; {same}/{compared} equal "
                "the reference's"
            )
    return results


if __name__ == "__main__":
    main()
