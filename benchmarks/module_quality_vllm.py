"""The offline study's reference against the real engine: kvreuse's splice in vLLM gives the reference's answers.

``module_quality.py`` measures every arm with ``splice_reference`` (PyTorch, float32). This script checks that its
``full``, ``naive`` and ``anchored`` arms are what vLLM serves: the engine on SmolLM2 with the
``KVReuseModuleCache`` connector (kvreuse's attention backend over the plain layout on CPU, dense), the header
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
``benchmarks/results/module_quality_vllm_<set>.json``::

    python benchmarks/module_quality_vllm.py --set mixed --cases 20
    python benchmarks/module_quality_vllm.py --set long --cases 8 --ttft-only   # the issue's shape: 8 modules x ~256

``--curves --sets schema-2,schema-4,schema-8``: the same arms on the schema workload (``module_quality_data.py``:
Spider schemas of 2, 4 or 8 tables, one module per table encoded after the tables it references, as TableCache
does, and probed after the header; a question asking for a SQL query, 32 greedy tokens). It has no answers: each
arm's query is compared with full prefill's, token for token (``same_as_full``) and normalised
(``normalise_sql``: ``same_sql_as_full``)::

    python benchmarks/module_quality_vllm.py --curves --sets schema-2,schema-4,schema-8 --cases 20

``--curves``: issue 27's accuracy-compute curves, every recovery at a few compute points on the ``docs-1``,
``docs-2``, ``docs-4`` and ``docs-8`` sets (1, 2, 4, 8 documents of 100-140 tokens after the header) in one engine,
the arms taking turns per case (so TTFT ratios compare like with like), 16 greedy tokens each: full prefill, the
plain splice, StreamingLLM's attention sinks (Xiao et al., ICLR 2024: each module's first 4 tokens, the sink its
encoding alone made, recomputed), LegoLink's first K tokens (EPIC), CacheBlend's choice made at encode time
(``recompute_share``) and kvreuse's one budget per prompt (``recompute_budget``,
``kvreuse.modules.splice.budgeted_tokens``); prints the table, writes
``benchmarks/results/module_quality_vllm_curves.{json,png}``::

    python benchmarks/module_quality_vllm.py --curves --cases 10

``--ttft-only``: TTFT alone (one token per request), the arms interleaved case by case in one engine (``full``,
``naive``, ``legolink-*``, ``blend-*``; ``anchored`` computes what ``naive`` does), so that a change in the
machine's load hits every arm alike; writes ``benchmarks/results/module_quality_vllm_ttft_<set>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from module_quality import EOS_TEXT, MAX_NEW_TOKENS, RESULTS, RUNS
from module_quality_data import (
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

from kvreuse.localmodel import DATASETS, local_engine_args

REPO = Path(__file__).resolve().parents[1]
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
# --curves: arm -> its requests' kv_transfer_params (over modules encoded alone and probed after the header)
CURVE_ARMS: dict[str, dict | None] = {
    "full": None,
    "naive": {},
    "sink-4": {"kvreuse_recompute_first": 4},
    "legolink-16": {"kvreuse_recompute_first": 16},
    "legolink-32": {"kvreuse_recompute_first": 32},
    "blend-10%": {"kvreuse_recompute_share": 0.10},
    "blend-20%": {"kvreuse_recompute_share": 0.20},
    "budget-10%": {"kvreuse_recompute_budget": 0.10},
    "budget-15%": {"kvreuse_recompute_budget": 0.15},
    "budget-20%": {"kvreuse_recompute_budget": 0.20},
}
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", default="mixed", choices=sorted(QA_SETS))
    parser.add_argument("--cases", type=int, default=20)
    parser.add_argument("--ttft-only", action="store_true", help="TTFT per arm, arms interleaved per case")
    parser.add_argument("--curves", action="store_true", help="issue 27's curves: 1, 2, 4, 8 documents, every arm")
    parser.add_argument("--sets", default=",".join(CURVE_SETS), help="--curves: the sets, comma-separated")
    args = parser.parse_args(argv)
    os.environ["KVREUSE_SPARSE_CPU_BACKEND"] = "1"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if args.curves:
        _curves(args.sets.split(","), args.cases)
        return
    if args.ttft_only:
        _ttft_side_by_side(args.set, args.cases)
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
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"module_quality_vllm_{args.set}.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"wrote {path}")


def curve_cases(name: str, encode, num_cases: int) -> list[TokenizedCase]:
    """The first ``num_cases`` tokenized cases of a document set (``QA_SETS``) or a schema set (``SCHEMA_SETS``)."""
    if name in SCHEMA_SETS:
        from kvreuse.modules.schemas import spider_schemas

        schemas = spider_schemas(DATASETS / "spider" / "tables.json")
        return [tokenize_schema_case(c, encode) for c in make_schema_cases(SCHEMA_SETS[name], schemas)[:num_cases]]
    return [tokenize_case(c, encode) for c in make_cases(QA_SETS[name], encode)[:num_cases]]


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


def _curves(set_names: list[str], num_cases: int) -> None:
    """Every arm of :data:`CURVE_ARMS` on the first ``num_cases`` cases of each set, in one engine, the arms taking
    turns per case, the prefix cache reset before each request."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        **local_engine_args(
            REPO / "build" / "models" / "smollm2", kv_transfer_config=CONNECTOR, additional_config=SETTINGS
        )
    )
    tokenizer = llm.get_tokenizer()
    eos = tokenizer.convert_tokens_to_ids(EOS_TEXT)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    sets = {name: curve_cases(name, encode, num_cases) for name in set_names}
    rows: list[dict] = []
    started = time.perf_counter()
    try:
        count = len(encode_curve_modules(llm, sets))
        print(f"encoded {count} modules in {time.perf_counter() - started:.0f} s", flush=True)
        for name, tokenized in sets.items():
            schema = name in SCHEMA_SETS
            max_tokens = SCHEMA_SETS[name].max_tokens if schema else MAX_NEW_TOKENS
            for n, tc in enumerate(tokenized):
                full_tokens: list[int] = []
                for arm, transfer in CURVE_ARMS.items():
                    params = SamplingParams(
                        max_tokens=max_tokens,
                        temperature=0.0,
                        stop_token_ids=[eos],
                        skip_reading_prefix_cache=transfer is None,
                        extra_args={"kv_transfer_params": transfer} if transfer else None,
                    )
                    llm.reset_prefix_cache()
                    out = llm.generate([TokensPrompt(prompt_token_ids=list(tc.prompt))], params, use_tqdm=False)[0]
                    tokens = list(out.outputs[0].token_ids)
                    ttft = _ttft(out)
                    if ttft is None:
                        raise SystemExit("vLLM gave no request stats (disable_log_stats must be off)")
                    if transfer is None:
                        full_tokens = tokens
                    text = tokenizer.decode(tokens, skip_special_tokens=True)
                    full_text = tokenizer.decode(full_tokens, skip_special_tokens=True)
                    rows.append(
                        {
                            "set": name,
                            "case": tc.case.key,
                            "arm": arm,
                            "right": None if schema else is_correct(text, tc.case),
                            "same_as_full": tokens == full_tokens,
                            "same_sql_as_full": normalise_sql(text) == normalise_sql(full_text) if schema else None,
                            "prompt_tokens": len(tc.prompt),
                            "computed": len(tc.prompt) - out.num_cached_tokens,
                            "ttft_s": ttft,
                        }
                    )
                elapsed = time.perf_counter() - started
                print(f"{name} [{n + 1}/{len(tokenized)}] {len(tc.prompt)} tokens, {elapsed:.0f} s", flush=True)
    finally:
        llm.llm_engine.engine_core.shutdown()
    summary = _curve_summary(rows)
    _print_curves(summary)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "module_quality_vllm_curves.json"
    path.write_text(json.dumps({"cases_per_set": num_cases, "summary": summary, "rows": rows}, indent=1))
    _plot_curves(summary, RESULTS / "module_quality_vllm_curves.png")
    print(f"wrote {path}")


def _curve_summary(rows: list[dict]) -> dict[str, dict[str, dict]]:
    """Per set and arm: right answers, as a share of full prefill's, outputs equal to full's, share of prompt
    tokens computed, median TTFT and full's median TTFT over it."""
    summary: dict[str, dict[str, dict]] = {}
    for name in dict.fromkeys(r["set"] for r in rows):
        mine = [r for r in rows if r["set"] == name]
        answered = mine[0].get("right") is not None  # a schema set has no answers
        full_ttft = statistics.median(r["ttft_s"] for r in mine if r["arm"] == "full")
        full_right = sum(r["right"] for r in mine if r["arm"] == "full") if answered else 0
        summary[name] = {}
        for arm in CURVE_ARMS:
            arm_rows = [r for r in mine if r["arm"] == arm]
            right = sum(r["right"] for r in arm_rows) if answered else None
            ttft = statistics.median(r["ttft_s"] for r in arm_rows)
            summary[name][arm] = {
                "cases": len(arm_rows),
                "right": right,
                "vs_full": round(right / full_right, 4) if right is not None and full_right else None,
                "same_as_full": sum(r["same_as_full"] for r in arm_rows),
                "same_sql_as_full": None if answered else sum(r["same_sql_as_full"] for r in arm_rows),
                "computed_share": round(
                    sum(r["computed"] for r in arm_rows) / sum(r["prompt_tokens"] for r in arm_rows), 4
                ),
                "ttft_median_s": round(ttft, 5),
                "speedup": round(full_ttft / ttft, 2),
            }
    return summary


def _print_curves(summary: dict[str, dict[str, dict]]) -> None:
    print(
        "| set | arm | right | of full's | same tokens as full | same SQL as full | prompt tokens computed | "
        "TTFT full/arm |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, arms in summary.items():
        for arm, r in arms.items():
            vs_full = f"{r['vs_full']:.0%}" if r["vs_full"] is not None else "n/a"
            right = f"{r['right']}/{r['cases']}" if r["right"] is not None else "n/a"
            sql = f"{r['same_sql_as_full']}/{r['cases']}" if r.get("same_sql_as_full") is not None else "n/a"
            print(
                f"| {name} | {arm} | {right} | {vs_full} | {r['same_as_full']}/{r['cases']} | {sql} | "
                f"{r['computed_share']:.1%} | {r['speedup']:.1f}x |"
            )


def _plot_curves(summary: dict[str, dict[str, dict]], path: Path) -> None:
    """Per set, accuracy as a share of full prefill's against the share of prompt tokens computed, one colour per
    recovery (its compute points joined); the goal's corner shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = dict.fromkeys(arm.split("-")[0] for arm in CURVE_ARMS)
    colours = plt.get_cmap("tab10")
    fig, axes = plt.subplots(1, len(summary), figsize=(4.2 * len(summary), 4.2), squeeze=False, sharey=True)
    for ax, (name, arms) in zip(axes[0], summary.items()):
        for i, family in enumerate(families):
            points = sorted(
                (r["computed_share"], _agreement(r)) for arm, r in arms.items() if arm.split("-")[0] == family
            )
            ax.plot([p[0] for p in points], [p[1] for p in points], "o-", color=colours(i), label=family, markersize=5)
        ax.fill_between([0, 0.2], 0.95, 1.3, color="#1b9e77", alpha=0.15, label="goal: >= 95% at <= 20%")
        ax.set_title(f"{name} ({next(iter(arms.values()))['cases']} cases)")
        ax.set_xlabel("share of prompt tokens computed")
        ax.set_xscale("symlog", linthresh=0.05)
        ax.set_xlim(0, 1.1)
    axes[0][0].set_ylabel("right answers as a share of full's (schema sets: same SQL as full)")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _agreement(figures: dict) -> float:
    """An arm's y in the plot: its right answers as a share of full prefill's, or, on a schema set (no answers),
    the share of its queries equal to full prefill's after normalising."""
    if figures["vs_full"] is not None:
        return float(figures["vs_full"])
    if figures.get("same_sql_as_full") is not None:
        return figures["same_sql_as_full"] / figures["cases"]
    return 0.0


def _ttft_side_by_side(set_name: str, num_cases: int) -> None:
    """TTFT of every arm but ``anchored`` on the same prompts in one engine, the arms taking turns per case."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvreuse.vllm.modules import encode_modules

    llm = LLM(
        **local_engine_args(
            REPO / "build" / "models" / "smollm2", kv_transfer_config=CONNECTOR, additional_config=SETTINGS
        )
    )
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
    try:
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
    finally:
        llm.llm_engine.engine_core.shutdown()
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
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"module_quality_vllm_ttft_{set_name}.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"wrote {path}")


def _run_engine(
    set_name: str, num_cases: int, arms: tuple[str, ...], reference: dict[tuple[str, str], list[int]]
) -> dict[str, dict]:
    """``arms`` in one engine: ``naive`` and ``anchored`` encode the header and the modules first."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvreuse.vllm.modules import encode_modules

    model = REPO / "build" / "models" / "smollm2"
    llm = LLM(**local_engine_args(model, kv_transfer_config=CONNECTOR, additional_config=SETTINGS))
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
    try:
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
    finally:
        llm.llm_engine.engine_core.shutdown()
    return results


if __name__ == "__main__":
    main()
