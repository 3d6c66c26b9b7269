"""The one harness every benchmark uses: options and output, engines, alternating arms and their spread, and the
A/B table over vLLM's own figures.

* **Output.** A run writes ``NAME.json`` (its figures, the command that made them and the machine it ran on:
  :func:`machine`) and ``NAME.png`` under ``build/benchmarks/`` (:data:`SCRATCH`), so running a benchmark never
  changes a tracked file; ``--update-results`` writes them into ``docs/benchmarks/results/`` (:data:`RESULTS`)
  instead, the committed results the docs cite and the site serves. :func:`bench_parser` adds the option,
  :func:`output_dir` reads it, :func:`write_results` writes.
* **Engines.** :func:`engine` starts an in-process ``vllm.LLM`` on a local model with the test models' engine
  arguments (``kvreuse.localmodel.local_engine_args``: block size 32, a fixed KV cache) and always shuts it down;
  :func:`server` starts ``vllm serve`` on a free port as the integration tests do, and stops it and its engine.
  Every engine a benchmark starts works on the same CPU cores (:func:`pin_engine_cores`), with or without a KV
  connector.
* **Alternation.** :func:`alternate` runs arms in turns, forward then backward, so load that drifts while a shared
  machine runs lands on every arm alike; :func:`spread` and :func:`ratio_spread` state what the repeats give (median,
  lowest, highest, or that one run was taken).
* **A/B over vLLM's figures.** An :class:`Arm` is one configuration: engine arguments (plugins switched on by their
  own flags) and, optionally, a client-side ``prepare`` step (for example reordering the requests). Arms with
  identical engine arguments share one engine, with vLLM's prefix cache reset between them, so they differ only in
  what they are meant to differ in; every arm starts after the same warm-up. :func:`run_ab` collects vLLM's own
  figures per arm (prompt tokens, tokens served from cache per request and per the engine's counters, TTFT) and wall
  time, then prints a table (:func:`format_table`) and writes JSON and a plot (:func:`report`).

Importing the harness needs only the standard library (vLLM, kvreuse's cores and matplotlib are imported where they
are used), so a benchmark that runs where no engine is installed, such as the GPU kernels' on a bare GPU machine,
writes its results the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[1]
# The committed results the docs cite (the site serves them beside the benchmark pages).
RESULTS = REPO / "docs" / "benchmarks" / "results"
# Where a run writes unless --update-results asks for RESULTS.
SCRATCH = REPO / "build" / "benchmarks"

T = TypeVar("T")


# -- options and output ---------------------------------------------------------------------------------------------


def bench_parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's argument parser: its description is the first sentence of ``doc`` (the script's docstring,
    which may wrap over several lines), with the harness's ``--update-results``."""
    paragraph = " ".join((doc or "").strip().split("\n\n")[0].split())
    sentence = re.match(r".+?\.(?=\s|$)", paragraph)
    parser = argparse.ArgumentParser(description=(sentence.group(0) if sentence else paragraph) or None)
    parser.add_argument(
        "--update-results",
        action="store_true",
        help=f"write the results into {RESULTS.relative_to(REPO)}/ (the committed figures the docs cite) instead of "
        f"{SCRATCH.relative_to(REPO)}/",
    )
    return parser


def output_dir(args: argparse.Namespace) -> Path:
    """Where this run writes: :data:`RESULTS` with ``--update-results``, else :data:`SCRATCH`."""
    return RESULTS if getattr(args, "update_results", False) else SCRATCH


def machine() -> dict[str, Any]:
    """What the figures were measured on: the CPU, its cores, the load while it ran, the software versions."""
    import importlib.metadata

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "engine_cores": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "torch": version("torch"),
        "vllm": version("vllm") or (f"{version('vllm-cpu')}+cpu" if version("vllm-cpu") else None),
        "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }


def write_results(name: str, payload: Mapping[str, Any], out_dir: Path, figure: Any = None) -> Path:
    """Write ``NAME.json`` (``payload`` with the command and the machine) and, given a matplotlib ``figure``,
    ``NAME.png`` into ``out_dir``; print where. Returns the JSON's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": name, "command": " ".join(["python", *sys.argv]), "machine": machine(), **payload}
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    written = [path]
    if figure is not None:
        import matplotlib.pyplot as plt

        figure.savefig(out_dir / f"{name}.png", dpi=110)
        plt.close(figure)
        written.append(out_dir / f"{name}.png")
    print("wrote " + " and ".join(str(p.relative_to(REPO) if p.is_relative_to(REPO) else p) for p in written))
    return path


def new_figure(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """``matplotlib.pyplot.subplots`` on the file-only backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


# -- engines --------------------------------------------------------------------------------------------------------


@contextmanager
def engine(model: str | Path, **engine_args: Any) -> Iterator[Any]:
    """An in-process ``vllm.LLM`` on ``model`` with the test models' engine arguments and ``engine_args`` over
    them; shut down when the block ends, whatever happens in it."""
    from vllm import LLM

    from kvreuse.localmodel import local_engine_args
    from kvreuse.patches import vllm_0_32

    pin_engine_cores()
    llm = LLM(**local_engine_args(model, **engine_args))
    try:
        yield llm
    finally:
        vllm_0_32.shutdown_llm(llm)


def pin_engine_cores() -> str:
    """Bind every vLLM CPU engine this process starts to the same cores, and return them: all this process may use
    but the last, which is what vLLM's automatic binding gives an engine without a KV connector (it keeps one core
    for the engine's own process). With a KV connector (kvreuse's module cache, its sparse figures) vLLM keeps a
    second core, and where the machine has no more than the two it would keep (this project's 2-core machines) it
    keeps none and the worker takes every core: twice the threads of the stock engine beside it, which doubled its
    prefill speed here. A binding already set (``VLLM_CPU_OMP_THREADS_BIND``) is kept."""
    cpus = sorted(os.sched_getaffinity(0))
    cores = ",".join(str(cpu) for cpu in (cpus[:-1] or cpus))
    return os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cores)


@contextmanager
def server(arguments: Sequence[str], workdir: Path, env: Mapping[str, str] | None = None) -> Iterator[tuple[str, Any]]:
    """``(url, process)`` of vLLM's OpenAI server started with ``arguments`` (``--model``, engine flags) on a free
    port in ``workdir``, stopped with its engine processes when the block ends: the tests' own way to start one
    (``integration_tests/served.py``), so benchmarks and tests start servers alike."""
    sys.path.insert(0, str(REPO / "integration_tests"))
    from served import vllm_serve

    cores = pin_engine_cores()  # in this process's environment, which vllm_serve passes on when env is None
    if env is not None:
        env = {"VLLM_CPU_OMP_THREADS_BIND": cores, **env}
    with vllm_serve(arguments, workdir, env) as started:
        yield started


# -- alternating arms -----------------------------------------------------------------------------------------------


def alternate(arms: Sequence[T], rounds: int) -> Iterator[tuple[int, T]]:
    """``(round, arm)`` in the order to run them: every arm once per round, forward in even rounds and backward in
    odd ones (A B C, C B A, A B C, ...), so drifting load lands on every arm alike."""
    for r in range(rounds):
        for arm in arms if r % 2 == 0 else reversed(arms):
            yield r, arm


def spread(values: Sequence[float]) -> dict[str, Any]:
    """The median, lowest and highest of repeated measurements, and how many there were."""
    return {"median": statistics.median(values), "low": min(values), "high": max(values), "runs": len(values)}


def ratio_spread(numerators: Sequence[float], denominators: Sequence[float]) -> dict[str, Any]:
    """The spread of per-round ratios ``numerators[r] / denominators[r]`` (each round's arms ran side by side)."""
    return spread([n / d for n, d in zip(numerators, denominators)])


def describe_spread(figures: Mapping[str, Any], unit: str = "x") -> str:
    """``1.52x (1.40-1.61x over 3 runs)``, or ``1.52x (one run)``."""
    if figures["runs"] == 1:
        return f"{figures['median']:.2f}{unit} (one run)"
    return (
        f"{figures['median']:.2f}{unit} ({figures['low']:.2f}-{figures['high']:.2f}{unit} over {figures['runs']} runs)"
    )


# -- A/B over vLLM's figures ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchRequest:
    """One prompt of a workload; ``key`` identifies it (a row id) so answers can be matched across arms."""

    key: Any
    prompt: str


@dataclass(frozen=True)
class Arm:
    """One configuration of an A/B run.

    ``prepare`` receives the workload in its original order and returns the requests in the order to send them
    (it must return each request exactly once); its time is reported as ``prepare_s``. ``figures`` may read
    plugin-specific figures from the engine after the arm ran.
    """

    name: str
    engine_args: Mapping[str, Any] = field(default_factory=dict)
    prepare: Callable[[Sequence[BenchRequest]], Sequence[BenchRequest]] | None = None
    figures: Callable[[Any], Mapping[str, Any]] | None = None


@dataclass
class ArmFigures:
    """What one arm measured. Token counts are vLLM's own: per-request ``num_cached_tokens`` and counters."""

    arm: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    engine_cache_hits: int
    computed_prompt_tokens: int
    wall_s: float
    prepare_s: float
    ttft_median_s: float | None
    ttft_p90_s: float | None
    # See agreement(): None when no earlier arm sent the same prompts.
    same_answers: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        from kvreuse.reorder.measures import hit_rate

        return hit_rate(self.cached_tokens, self.prompt_tokens)


def _engine_key(args: Mapping[str, Any]) -> str:
    return json.dumps(args, sort_keys=True, default=str)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _generate(llm: Any, prompts: list[str], sampling: Any, arrivals_per_step: int | None) -> list[Any]:
    """Outputs of ``prompts``, in their order: one batch, or ``arrivals_per_step`` new requests per engine step."""
    if arrivals_per_step is None:
        return llm.generate(prompts, sampling, use_tqdm=True)
    from tqdm import tqdm

    engine, pending, done = llm.llm_engine, list(enumerate(prompts)), {}
    with tqdm(total=len(prompts), desc="online", unit="req") as bar:
        while pending or engine.has_unfinished_requests():
            for i, prompt in pending[:arrivals_per_step]:
                engine.add_request(f"bench-{i}", prompt, sampling)
            del pending[:arrivals_per_step]
            for out in engine.step():
                if out.finished:
                    done[int(out.request_id.split("-")[1])] = out
                    bar.update()
    return [done[i] for i in range(len(prompts))]


def _run_arm(
    llm: Any, arm: Arm, requests: Sequence[BenchRequest], sampling: Any, arrivals_per_step: int | None
) -> tuple[ArmFigures, dict]:
    from kvreuse.vllm.prefix_cache import prefix_cache_counters, sum_request_cached_tokens

    t0 = time.perf_counter()
    ordered = list(arm.prepare(requests)) if arm.prepare else list(requests)
    prepare_s = time.perf_counter() - t0
    if sorted(map(repr, (r.key for r in ordered))) != sorted(map(repr, (r.key for r in requests))):
        raise RuntimeError(f"arm {arm.name!r}: prepare() must return every request exactly once")
    llm.reset_prefix_cache()
    before = prefix_cache_counters(llm)
    t0 = time.perf_counter()
    outputs = _generate(llm, [r.prompt for r in ordered], sampling, arrivals_per_step)
    wall_s = time.perf_counter() - t0
    engine = prefix_cache_counters(llm) - before
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    cached = sum_request_cached_tokens(outputs)
    ttfts = [o.metrics.first_token_latency for o in outputs if getattr(o, "metrics", None) is not None]
    figures = ArmFigures(
        arm=arm.name,
        requests=len(ordered),
        prompt_tokens=prompt_tokens,
        cached_tokens=cached,
        engine_cache_hits=engine.hits,
        computed_prompt_tokens=prompt_tokens - cached,
        wall_s=wall_s,
        prepare_s=prepare_s,
        ttft_median_s=statistics.median(ttfts) if ttfts else None,
        ttft_p90_s=_percentile(ttfts, 0.9),
        extra=dict(arm.figures(llm)) if arm.figures else {},
    )
    answers = {r.key: (r.prompt, tuple(o.outputs[0].token_ids)) for r, o in zip(ordered, outputs)}
    return figures, answers


def run_ab(
    name: str,
    requests: Sequence[BenchRequest],
    arms: Sequence[Arm],
    model: str | Path,
    *,
    max_tokens: int = 4,
    base_engine_args: Mapping[str, Any] | None = None,
    arrivals_per_step: int | None = None,
    rounds: int = 1,
    out_dir: Path = SCRATCH,
) -> list[ArmFigures]:
    """Run every arm over ``requests`` on the model at ``model``; report and return the figures in arm order.

    By default each arm sends its requests as one batch (``LLM.generate``). With ``arrivals_per_step`` they
    arrive online instead: that many new requests before each engine step, in the arm's order. With ``rounds`` > 1
    the arms of an engine alternate (:func:`alternate`) and each arm's wall time is its median, its runs and their
    spread in ``extra``.
    """
    from tqdm import tqdm
    from vllm import SamplingParams

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    groups: dict[str, list[Arm]] = {}
    for arm in arms:
        groups.setdefault(_engine_key(arm.engine_args), []).append(arm)
    runs: dict[str, list[ArmFigures]] = {arm.name: [] for arm in arms}
    answers: dict[str, dict] = {}
    with tqdm(total=len(arms) * rounds, desc=f"{name}: arms", unit="arm") as bar:
        for group in groups.values():
            with engine(model, **{**(base_engine_args or {}), **group[0].engine_args}) as llm:
                # Warm-up: the first batch pays one-off costs that must not land on whichever arm runs first.
                llm.generate([r.prompt for r in requests[:8]], sampling, use_tqdm=False)
                for _, arm in alternate(group, rounds):
                    bar.set_postfix_str(arm.name)
                    figures, answers[arm.name] = _run_arm(llm, arm, requests, sampling, arrivals_per_step)
                    runs[arm.name].append(figures)
                    bar.update()
    ordered = []
    for arm in arms:
        first, walls = runs[arm.name][0], [f.wall_s for f in runs[arm.name]]
        first.wall_s = statistics.median(walls)
        if rounds > 1:
            first.extra["wall_s_runs"] = walls
        ordered.append(first)
    for i, fig in enumerate(ordered):
        fig.same_answers = agreement(answers[fig.arm], [answers[a.name] for a in arms[:i]])
    report(name, ordered, out_dir)
    return ordered


def agreement(
    answers: Mapping[Any, tuple[str, tuple]], earlier: Sequence[Mapping[Any, tuple[str, tuple]]]
) -> float | None:
    """Share of requests whose greedy tokens equal those of the earliest earlier arm that sent the same prompt.

    Reordering rows must not change an answer; reordering fields changes the prompt, so such requests have no
    reference and are left out. None when no request had a reference.
    """
    same = compared = 0
    for key, (prompt, tokens) in answers.items():
        reference = next((arm[key][1] for arm in earlier if key in arm and arm[key][0] == prompt), None)
        if reference is not None:
            compared += 1
            same += reference == tokens
    return same / compared if compared else None


def format_table(figures: Sequence[ArmFigures]) -> str:
    """A plain-text table of the arms, with ratios against the first arm."""
    base = figures[0]
    header = (
        "arm",
        "prompt tok",
        "cached tok",
        "hit rate",
        "computed tok",
        "computed x",
        "wall s",
        "speedup",
        "prepare s",
        "TTFT p50 s",
        "same answers",
    )
    rows = [header]
    for f in figures:
        rows.append(
            (
                f.arm,
                f"{f.prompt_tokens:,}",
                f"{f.cached_tokens:,}",
                f"{f.hit_rate:.1%}",
                f"{f.computed_prompt_tokens:,}",
                f"{base.computed_prompt_tokens / max(f.computed_prompt_tokens, 1):.2f}x",
                f"{f.wall_s:.2f}",
                f"{base.wall_s / f.wall_s:.2f}x",
                f"{f.prepare_s:.3f}",
                "-" if f.ttft_median_s is None else f"{f.ttft_median_s:.3f}",
                "-" if f.same_answers is None else f"{f.same_answers:.0%}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def report(name: str, figures: Sequence[ArmFigures], out_dir: Path = SCRATCH) -> None:
    """Print the table, and write ``<name>.json`` and ``<name>.png`` into ``out_dir`` (:func:`write_results`)."""
    print(f"\n== {name} ==")
    print(format_table(figures))
    arms = [{**asdict(f), "hit_rate": f.hit_rate} for f in figures]
    write_results(name, {"arms": arms}, out_dir, plot(name, figures))


def plot(name: str, figures: Sequence[ArmFigures]) -> Any:
    """Two panels: prompt tokens split into served-from-cache and computed; wall time. Returns the figure."""
    arms = [f.arm for f in figures]
    fig, (tok, wall) = new_figure(1, 2, figsize=(11, 4))
    cached = [f.cached_tokens for f in figures]
    computed = [f.computed_prompt_tokens for f in figures]
    tok.bar(arms, computed, label="computed (prefill)", color="#d95f02")
    tok.bar(arms, cached, bottom=computed, label="served from cache", color="#1b9e77")
    tok.set_ylabel("prompt tokens")
    tok.set_title("Prompt tokens (vLLM's accounting)")
    tok.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    wall.bar(arms, [f.wall_s for f in figures], color="#7570b3")
    wall.set_ylabel("seconds")
    wall.set_title("Wall time")
    for ax in (tok, wall):
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle(name)
    fig.tight_layout()
    return fig
