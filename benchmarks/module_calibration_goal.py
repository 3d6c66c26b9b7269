"""Calibration to an answer floor, as a user runs it: ``kvreuse calibrate-modules`` on a sample of one seed's prompts,
then the chosen setting on held-back prompts of another seed.

For each QA set (``module_quality_data``: the chat header and documents as modules, one question per prompt), the
script writes what the command reads (``modules.json``: the header and the sample's documents by name;
``prompts.jsonl``: the sample's prompts as text, each checked to tokenize to the ids a module splice needs), runs::

    kvreuse calibrate-modules --model build/models/smollm2 --modules modules.json --prompts prompts.jsonl \\
        --min-agreement 0.9 --normalise first-line --normalise case --normalise whitespace \\
        --blends ... --engine-args '{...}'

in a subprocess (its report printed as is), reads the chosen setting from the report's per-request line, then
starts one engine with the held-back prompts' modules and measures the chosen setting on them with the same
comparison (``calibrate_modules(..., firsts=(), settings=[chosen])``): agreement, prompt tokens computed and TTFT
against full prefill on the same prompts. Writes ``module_calibration_goal_<set>.json`` under ``build/benchmarks/``
(``--update-results``: into ``docs/benchmarks/results/``, the figures the docs cite; ``--step check`` reads the
calibration from the same place)::

    python benchmarks/module_calibration_goal.py --set docs-4 --prompts 25 --blends 0.15,0.2,0.3

A schema set (``--set schema-4``: Spider schemas, one module per table encoded after the tables it references, as
``module_quality_vllm.py --curves`` encodes them) goes through the API instead, as the command's modules file holds
no contexts: ``calibrate_modules(llm, prompts, ..., normalise=["sql"])`` in one engine for the sample, and the chosen
setting in another for the held-back prompts; outputs agree where their first SQL statements are the same, keyword
case and layout aside.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, bench_parser, engine, output_dir, write_results  # noqa: E402
from module_quality_data import HEADER, QA_SETS, SCHEMA_SETS, make_cases, tokenize_case  # noqa: E402

from kvreuse.localmodel import local_engine_args  # noqa: E402

MODEL = REPO / "build" / "models" / "smollm2"
NORMALISE = ["first-line", "case", "whitespace"]  # the answer as a reader of these prompts reads it
SQL = ["sql"]  # a schema set's answers: the first SQL statement, keyword case and layout aside
CONNECTOR = {"kv_connector": "KVReuseModuleCache", "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
MODULES = {"gpu_bytes": 0, "cpu_bytes": 4 << 30}
CPU_ENGINE = {"kvreuse": {"sparse": {"beta": float("inf")}, "modules": MODULES}}


def engine_args() -> dict:
    """The engine of every run here: ``local_engine_args`` (float32, block size 32, statistics on) with the module
    store in host memory and kvreuse's dense attention backend (``KVREUSE_SPARSE_CPU_BACKEND=1``)."""
    args = local_engine_args(MODEL, additional_config=CPU_ENGINE)
    del args["model"]
    return args


def prompts_of(set_name: str, seed: int, count: int, tokenizer) -> tuple[dict[str, str], list[str]]:
    """The first ``count`` cases of the set drawn with ``seed``: their documents by name (the header too) and their
    prompts as text. Each prompt's tokens must be the header's, the documents' and the question's ids in a row."""

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    cases = make_cases(QA_SETS[set_name], encode, seed)[:count]
    modules = {"header": HEADER}
    prompts = []
    for case in cases:
        for document in case.modules:
            modules[module_name(document.name)] = document.text
        text = HEADER + "".join(document.text for document in case.modules) + case.question
        if encode(text) != tokenize_case(case, encode).prompt:
            raise SystemExit(
                f"{case.key}: its text does not tokenize to its parts' ids; the splice would not find them"
            )
        prompts.append(text)
    return modules, prompts


def module_name(document: str) -> str:
    """A document's module name: its title with what a module name may not hold (spaces) as ``_``."""
    return re.sub(r"[^A-Za-z0-9._:/@+#-]", "_", document)


def calibrate_command(modules: dict[str, str], prompts: list[str], args: argparse.Namespace, folder: Path) -> str:
    """``kvreuse calibrate-modules`` on the sample; its report."""
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    command = [
        str(REPO / ".venv" / "bin" / "kvreuse"),
        "calibrate-modules",
        "--model",
        str(MODEL),
        "--modules",
        str(folder / "modules.json"),
        "--prompts",
        str(folder / "prompts.jsonl"),
        "--min-agreement",
        str(args.min_agreement),
        *(part for step in NORMALISE for part in ("--normalise", step)),
        "--engine-args",
        json.dumps(engine_args()),
    ]
    if args.blends:
        command += ["--blends", args.blends, "--blend-layers", args.blend_layers]
    environment = {**os.environ, "KVREUSE_SPARSE_CPU_BACKEND": "1"}
    print("$", " ".join(command[:-2]), "--engine-args '...'", flush=True)
    done = subprocess.run(command, env=environment, capture_output=True, text=True, check=False)
    if done.returncode:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"kvreuse calibrate-modules failed ({done.returncode})")
    return done.stdout


def chosen_setting(report: str):
    """The setting the report chose, from its per-request line."""
    from kvreuse.modules.calibrate import Setting

    line = next(line for line in report.splitlines() if line.startswith("per request:"))
    params = json.loads(line.split('"kv_transfer_params": ', 1)[1])
    return Setting(**{key.removeprefix("kvreuse_"): value for key, value in params.items()})


def check_held_back(modules: dict[str, str], prompts: list[str], setting, args: argparse.Namespace):
    """The chosen setting on the held-back prompts, in an engine of their own modules (:func:`engine_args`'s)."""
    from kvreuse.vllm.modules import calibrate_modules, encode_modules

    with engine(MODEL, kv_transfer_config=CONNECTOR, **engine_args()) as llm:
        encode_modules(llm, modules)
        return calibrate_modules(llm, prompts, args.min_agreement, firsts=(), settings=[setting], normalise=NORMALISE)


def calibrate_schema(set_name: str, seed: int, args: argparse.Namespace, settings=None):
    """A schema set through the API: its first ``args.prompts`` cases drawn with ``seed``, their tables encoded
    after the tables they reference, then ``calibrate_modules`` over the blends of ``args`` (or only ``settings``,
    the held-back check) with the ``sql`` normaliser."""
    from module_quality_vllm import curve_cases, encode_curve_modules

    from kvreuse.vllm.modules import calibrate_modules

    with engine(MODEL, kv_transfer_config=CONNECTOR, **engine_args()) as llm:
        tokenizer = llm.get_tokenizer()
        cases = curve_cases(set_name, lambda text: tokenizer.encode(text, add_special_tokens=False), args.prompts, seed)
        encode_curve_modules(llm, {set_name: cases})
        prompts = [list(tc.prompt) for tc in cases]
        if settings is None:  # the sample: the command's candidates and the blends of args
            blends = [float(b) for b in args.blends.split(",") if b]
            candidates = {"blends": blends, "blend_layers": [int(n) for n in args.blend_layers.split(",")]}
        else:  # the held-back check: the chosen setting alone
            candidates = {"firsts": (), "settings": settings}
        return calibrate_modules(
            llm, prompts, args.min_agreement, normalise=SQL, max_tokens=SCHEMA_SETS[set_name].max_tokens, **candidates
        )


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--set", default="docs-4", choices=sorted([*QA_SETS, *SCHEMA_SETS]))
    parser.add_argument("--prompts", type=int, default=25, help="sample size, and as many held back")
    parser.add_argument("--min-agreement", type=float, default=0.9)
    parser.add_argument("--blends", default="0.15,0.2,0.3", help="--blends of the command ('' for none)")
    parser.add_argument("--blend-layers", default="1", help="--blend-layers of the command")
    parser.add_argument("--sample-seed", type=int, default=1)
    parser.add_argument("--held-back-seed", type=int, default=2)
    parser.add_argument("--step", choices=("both", "calibrate", "check"), default="both", help="one piece of the run")
    args = parser.parse_args(argv)
    os.environ["KVREUSE_SPARSE_CPU_BACKEND"] = "1"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    name = f"module_calibration_goal_{args.set}"
    path = output_dir(args) / f"{name}.json"
    result = {}
    if path.exists() and args.step == "check":  # the calibration an earlier --step calibrate wrote; its figures only
        result = {k: v for k, v in json.loads(path.read_text()).items() if k not in ("benchmark", "command", "machine")}
    schema = args.set in SCHEMA_SETS
    if args.step in ("both", "calibrate"):
        started = time.perf_counter()
        if schema:
            report = calibrate_schema(args.set, args.sample_seed, args).report()
        else:
            modules, prompts = prompts_of(args.set, args.sample_seed, args.prompts, tokenizer)
            with tempfile.TemporaryDirectory(prefix="kvreuse-goal-") as folder:
                report = calibrate_command(modules, prompts, args, Path(folder))
        print(report, flush=True)
        result = {
            "set": args.set,
            "prompts": args.prompts,
            "sample_seed": args.sample_seed,
            "min_agreement": args.min_agreement,
            "normalise": SQL if schema else NORMALISE,
            "report": report,
            "chosen": chosen_setting(report).transfer_params(),
            "calibrate_s": round(time.perf_counter() - started),
            "loadavg": os.getloadavg(),
        }
    if args.step in ("both", "check"):
        from kvreuse.modules.calibrate import Setting

        setting = Setting(**{key.removeprefix("kvreuse_"): value for key, value in result["chosen"].items()})
        started = time.perf_counter()
        if schema:
            check = calibrate_schema(args.set, args.held_back_seed, args, settings=[setting])
        else:
            modules, prompts = prompts_of(args.set, args.held_back_seed, args.prompts, tokenizer)
            check = check_held_back(modules, prompts, setting, args)
        print(check.report(), flush=True)
        (measured,) = check.curve
        result["held_back"] = {
            "seed": args.held_back_seed,
            "agreed": measured.agreed,
            "prompts": measured.prompts,
            "computed": measured.computed,
            "passed": measured.passed,
            "speedup": measured.speedup,
            "check_s": round(time.perf_counter() - started),
            "loadavg": os.getloadavg(),
        }
    write_results(name, result, output_dir(args))


if __name__ == "__main__":
    main()
