"""A/B harness: run one workload under named configurations side by side, on the real vLLM engine.

An ``Arm`` is one configuration: engine arguments (plugins switched on by their own flags) and, optionally, a
client-side ``prepare`` step (for example reordering the requests). Arms with identical engine arguments share
one engine, with vLLM's prefix cache reset between them, so they differ only in what they are meant to differ
in; every arm starts after the same warm-up. For each arm we collect vLLM's own figures (prompt tokens, tokens
served from cache per request and per the engine's counters, TTFT) and wall time, then print a table, write
JSON and draw a plot under ``benchmarks/results/``.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvreuse.reorder.measures import hit_rate

RESULTS = Path(__file__).resolve().parent / "results"


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
    out_dir: Path = RESULTS,
) -> list[ArmFigures]:
    """Run every arm over ``requests`` on the model at ``model``; report and return the figures in arm order.

    By default each arm sends its requests as one batch (``LLM.generate``). With ``arrivals_per_step`` they
    arrive online instead: that many new requests before each engine step, in the arm's order.
    """
    from tqdm import tqdm
    from vllm import LLM, SamplingParams

    from kvreuse.localmodel import local_engine_args

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    groups: dict[str, list[Arm]] = {}
    for arm in arms:
        groups.setdefault(_engine_key(arm.engine_args), []).append(arm)
    results: dict[str, ArmFigures] = {}
    answers: dict[str, dict] = {}
    with tqdm(total=len(arms), desc=f"{name}: arms", unit="arm") as bar:
        for group in groups.values():
            llm = LLM(**local_engine_args(model, **{**(base_engine_args or {}), **group[0].engine_args}))
            try:
                # Warm-up: the first batch pays one-off costs that must not land on whichever arm runs first.
                llm.generate([r.prompt for r in requests[:8]], sampling, use_tqdm=False)
                for arm in group:
                    bar.set_postfix_str(arm.name)
                    results[arm.name], answers[arm.name] = _run_arm(llm, arm, requests, sampling, arrivals_per_step)
                    bar.update()
            finally:
                llm.llm_engine.engine_core.shutdown()
    ordered = [results[a.name] for a in arms]
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


def report(name: str, figures: Sequence[ArmFigures], out_dir: Path = RESULTS) -> None:
    """Print the table, and write ``<name>.json`` and ``<name>.png`` into ``out_dir``."""
    print(f"\n== {name} ==")
    print(format_table(figures))
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = [{**asdict(f), "hit_rate": f.hit_rate} for f in figures]
    (out_dir / f"{name}.json").write_text(json.dumps(payload, indent=2))
    plot(name, figures, out_dir / f"{name}.png")
    print(f"wrote {out_dir / (name + '.json')} and {out_dir / (name + '.png')}")


def plot(name: str, figures: Sequence[ArmFigures], path: Path) -> None:
    """Two panels: prompt tokens split into served-from-cache and computed; wall time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [f.arm for f in figures]
    fig, (tok, wall) = plt.subplots(1, 2, figsize=(11, 4))
    cached = [f.cached_tokens for f in figures]
    computed = [f.computed_prompt_tokens for f in figures]
    tok.bar(arms, computed, label="computed (prefill)", color="#d95f02")
    tok.bar(arms, cached, bottom=computed, label="served from cache", color="#1b9e77")
    tok.set_ylabel("prompt tokens")
    tok.set_title("Prompt tokens (vLLM's accounting)")
    tok.legend()
    wall.bar(arms, [f.wall_s for f in figures], color="#7570b3")
    wall.set_ylabel("seconds")
    wall.set_title("Wall time")
    for ax in (tok, wall):
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle(name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
