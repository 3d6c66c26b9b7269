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

Arms per phase (``module_quality_vllm.CURVE_ARMS``, each case run by ``module_quality_vllm.case_rows``): ``naive``
(nothing recomputed, ``kvreuse_recompute_first`` 0) and ``first-16`` (the engine's default recovery: each inexact
module's first 16 tokens recomputed, an exact module's share going to the others).
Figures per set, phase and arm: outputs with full prefill's tokens, with full prefill's normalised SQL (schema
sets), right answers (document sets), the share of prompt tokens the engine computed (vLLM's own
``num_cached_tokens``) and which encodings were spliced (``kvreuse:module_encodings_taken_total``)::

    .venv/bin/python -P benchmarks/module_encodings_vllm.py --sets schema-4,docs-4 --cases 20

writes ``module_encodings_vllm.json`` under ``build/benchmarks/`` (``--update-results``: into
``docs/benchmarks/results/``).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, bench_parser, engine, output_dir, write_results  # noqa: E402
from module_quality import EOS_TEXT  # noqa: E402
from module_quality_data import TokenizedCase  # noqa: E402
from module_quality_vllm import CONNECTOR, SETTINGS, case_rows, curve_cases, encode_curve_modules  # noqa: E402

ARMS = ["full", "naive", "first-16"]  # of module_quality_vllm.CURVE_ARMS: full prefill, the plain splice, the default


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
    """The sets' cases on SmolLM2 with the module connector: every arm of both phases, summarised."""
    model = REPO / "build" / "models" / "smollm2"
    with engine(model, kv_transfer_config=CONNECTOR, additional_config=SETTINGS) as llm:
        return measure(llm, set_names, num_cases)


def measure(llm, set_names: list[str], num_cases: int) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tokenizer = llm.get_tokenizer()
    eos = tokenizer.convert_tokens_to_ids(EOS_TEXT)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    sets = {name: curve_cases(name, encode, num_cases) for name in set_names}
    rows: list[dict] = []
    encodings: dict[str, dict[str, float]] = {}
    started = time.perf_counter()
    names = encode_curve_modules(llm, sets)
    for phase in ("first", "per-context"):
        if phase == "per-context":
            added = add_context_encodings(llm, sets, names)
            print(f"added {added} encodings ({time.perf_counter() - started:.0f} s)", flush=True)
        before = taken(llm)
        for name, tokenized in sets.items():
            for tc in tokenized:
                rows += [{**row, "phase": phase} for row in case_rows(llm, tokenizer, eos, name, 0, tc, ARMS)]
            print(f"{phase} {name}: {len(tokenized)} cases, {time.perf_counter() - started:.0f} s", flush=True)
        # vLLM publishes connector stats with its periodic metrics: one more request flushes them
        llm.generate([TokensPrompt(prompt_token_ids=[1, 2])], SamplingParams(max_tokens=1), use_tqdm=False)
        after = taken(llm)
        encodings[phase] = {match: after.get(match, 0.0) - before.get(match, 0.0) for match in after}
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
            "same_sql_as_full": None if answered else sum(r["same_answer_as_full"] for r in mine),
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
    parser = bench_parser(__doc__)
    parser.add_argument("--sets", default="schema-4,docs-4", help="sets, comma-separated")
    parser.add_argument("--cases", type=int, default=20, help="cases per set (default 20)")
    args = parser.parse_args(argv)
    os.environ["KVREUSE_SPARSE_CPU_BACKEND"] = "1"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    results = run(args.sets.split(","), args.cases)
    print_table(results)
    write_results("module_encodings_vllm", results, output_dir(args))


if __name__ == "__main__":
    main()
