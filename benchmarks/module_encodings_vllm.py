"""What encodings per context buy, in the engine on the real model: the same prompts spliced with each module's
first encoding only, then with more encodings of each module stored beside it, compared with full prefill.

SmolLM2-135M-Instruct in vLLM with the ``KVReuseModuleCache`` connector (kvreuse's attention backend over the plain
layout on CPU, dense), greedy, the prefix cache reset before each request. Sets (``module_quality_data.py``): a
document set (``docs-4`` by default: the chat header, 4 documents, a question) and the schema workload
(``schema-4``: Spider tables in foreign-key order, a question asking for a SQL query). First phase, ``first``: the
header encoded alone and every module as ``module_quality_vllm.py --curves`` encodes it (a document alone, a
table after the tables it references: TableCache), so each module has one encoding. Second phase,
``per-context``: more encodings of the same modules are stored under the same names (``encode_modules`` with
another context adds one, ``kvreuse.modules.encodings``): every module after the header, and every table after
the header and the tables it references. A request takes the encoding whose context is its own prompt's tokens
before the module (exact: a full prefill's KV, nothing recomputed), else the one whose context fits the prompt
best (its start and the tokens right before the module), else the first.

Arms per phase: ``splice`` (nothing recomputed, ``kvreuse_recompute_first`` 0) and ``legolink-16`` (the engine's
default recovery: each inexact module's first 16 tokens recomputed, an exact module's share going to the others).
Figures per set, phase and arm: outputs with full prefill's tokens, with full prefill's normalised SQL (schema
sets), right answers (document sets), the share of prompt tokens the engine computed (vLLM's own
``num_cached_tokens``) and which encodings were spliced (``kvreuse:module_encodings_taken_total``)::

    python benchmarks/module_encodings_vllm.py --sets schema-4,docs-4 --cases 20

writes ``benchmarks/results/module_encodings_vllm.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from module_quality import EOS_TEXT, MAX_NEW_TOKENS, RESULTS
from module_quality_data import SCHEMA_SETS, TokenizedCase, is_correct, normalise_sql
from module_quality_vllm import CONNECTOR, REPO, SETTINGS, curve_cases, encode_curve_modules

from kvreuse.localmodel import local_engine_args

ARMS = {"full": None, "splice": {"kvreuse_recompute_first": 0}, "legolink-16": {"kvreuse_recompute_first": 16}}


def add_context_encodings(llm, sets: dict[str, list[TokenizedCase]], names: dict[tuple[int, ...], str]) -> int:
    """Store more encodings of the modules of ``sets`` under their names: each after its case's header, and each
    schema table after the header and the tables it references; the number of encode requests."""
    from kvreuse.vllm.modules import encode_modules

    after_header: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}  # name -> (its ids, its context)
    after_references: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for tcs in sets.values():
        for tc in tcs:
            for i, ids in enumerate(tc.modules):
                after_header[names[ids]] = (ids, tc.header)
                if tc.contexts and tc.contexts[i]:
                    after_references[names[ids]] = (ids, tc.header + tc.contexts[i])
    for encodings in (after_header, after_references):  # one encode request per module each (one context a call)
        if encodings:
            modules = {name: list(ids) for name, (ids, _) in encodings.items()}
            encode_modules(llm, modules, {name: list(context) for name, (_, context) in encodings.items()})
    return len(after_header) + len(after_references)


def taken(llm) -> dict[str, float]:
    """``kvreuse:module_encodings_taken_total`` by match, as vLLM's metrics hold it now."""
    counts: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name == "kvreuse:module_encodings_taken_total" and hasattr(metric, "value"):
            match = metric.labels.get("match", "")
            counts[match] = counts.get(match, 0.0) + metric.value
    return counts


def run(set_names: list[str], num_cases: int) -> dict:
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
    encodings: dict[str, dict[str, float]] = {}
    started = time.perf_counter()
    try:
        names = encode_curve_modules(llm, sets)
        for phase in ("first", "per-context"):
            if phase == "per-context":
                added = add_context_encodings(llm, sets, names)
                print(f"added {added} encodings ({time.perf_counter() - started:.0f} s)", flush=True)
            before = taken(llm)
            for name, tokenized in sets.items():
                schema = name in SCHEMA_SETS
                max_tokens = SCHEMA_SETS[name].max_tokens if schema else MAX_NEW_TOKENS
                for tc in tokenized:
                    full_text, full_tokens = "", []
                    for arm, transfer in ARMS.items():
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
                        text = tokenizer.decode(tokens, skip_special_tokens=True)
                        if transfer is None:
                            full_text, full_tokens = text, tokens
                        rows.append(
                            {
                                "set": name,
                                "case": tc.case.key,
                                "phase": phase,
                                "arm": arm,
                                "right": None if schema else is_correct(text, tc.case),
                                "same_as_full": tokens == full_tokens,
                                "same_sql_as_full": normalise_sql(text) == normalise_sql(full_text) if schema else None,
                                "prompt_tokens": len(tc.prompt),
                                "computed": len(tc.prompt) - (out.num_cached_tokens or 0),
                            }
                        )
                print(f"{phase} {name}: {len(tokenized)} cases, {time.perf_counter() - started:.0f} s", flush=True)
            # vLLM publishes connector stats with its periodic metrics: one more request flushes them
            llm.generate([TokensPrompt(prompt_token_ids=[1, 2])], SamplingParams(max_tokens=1), use_tqdm=False)
            after = taken(llm)
            encodings[phase] = {match: after.get(match, 0.0) - before.get(match, 0.0) for match in after}
    finally:
        llm.llm_engine.engine_core.shutdown()
    return {"cases_per_set": num_cases, "summary": summarise(rows), "encodings_taken": encodings, "rows": rows}


def summarise(rows: list[dict]) -> dict:
    """Per set, phase and arm: cases, outputs equal to full prefill's (tokens; normalised SQL), right answers, full
    prefill's right answers kept, and the share of prompt tokens computed."""
    summary: dict[str, dict] = {}
    for key in dict.fromkeys((r["set"], r["phase"], r["arm"]) for r in rows):
        mine = [r for r in rows if (r["set"], r["phase"], r["arm"]) == key]
        full = {r["case"]: r for r in rows if (r["set"], r["phase"], r["arm"]) == (key[0], key[1], "full")}
        answered = mine[0]["right"] is not None
        summary.setdefault(key[0], {}).setdefault(key[1], {})[key[2]] = {
            "cases": len(mine),
            "same_as_full": sum(r["same_as_full"] for r in mine),
            "same_sql_as_full": None if answered else sum(r["same_sql_as_full"] for r in mine),
            "right": sum(r["right"] for r in mine) if answered else None,
            "kept": sum(r["right"] and full[r["case"]]["right"] for r in mine) if answered else None,
            "full_right": sum(r["right"] for r in full.values()) if answered else None,
            "computed_share": round(sum(r["computed"] for r in mine) / sum(r["prompt_tokens"] for r in mine), 4),
        }
    return summary


def print_table(results: dict) -> None:
    print("| set | encodings | arm | same tokens as full | same SQL as full | full's right answers kept | computed |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for name, phases in results["summary"].items():
        for phase, arms in phases.items():
            for arm, r in arms.items():
                n = r["cases"]
                sql = f"{r['same_sql_as_full']}/{n}" if r["same_sql_as_full"] is not None else "n/a"
                kept = f"{r['kept']}/{r['full_right']}" if r["kept"] is not None else "n/a"
                print(
                    f"| {name} | {phase} | {arm} | {r['same_as_full']}/{n} | {sql} | {kept} | "
                    f"{r['computed_share']:.1%} |"
                )
    for phase, counts in results["encodings_taken"].items():
        shown = ", ".join(f"{match} {int(count)}" for match, count in sorted(counts.items()))
        print(f"encodings spliced ({phase}): {shown}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="schema-4,docs-4", help="sets, comma-separated")
    parser.add_argument("--cases", type=int, default=20)
    parser.add_argument("--out", default=str(RESULTS / "module_encodings_vllm.json"))
    args = parser.parse_args(argv)
    os.environ["KVREUSE_SPARSE_CPU_BACKEND"] = "1"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    results = run(args.sets.split(","), args.cases)
    print_table(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
