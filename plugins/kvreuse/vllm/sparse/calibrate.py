"""Calibrating ``sparse.top_pages`` on a sample of the user's own prompts (``kvreuse.sparse.calibrate``), in vLLM.

:func:`calibrate_top_pages` runs each sampled prompt with the sparse backend's dense attention (beta = inf, exact:
the reference) and with exact DIPR and each candidate budget at the chosen beta, greedy, one prompt at a time, and
counts a prompt as agreeing where the candidate's first ``max_tokens`` tokens are the reference's. Settings change
in the worker between requests (``kvreuse.vllm.runtime.configure_sparse`` through ``LLM.collective_rpc``, which
needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` where the engine starts); the worker's own counters give the blocks
each candidate read. The engine's settings are restored afterwards.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvreuse.errors import ConfigError
from kvreuse.modules.calibrate import sample_notes
from kvreuse.patches import vllm_0_32
from kvreuse.sparse.calibrate import CANDIDATES, EXACT, BudgetMeasured, cheapest_budget


@dataclass(frozen=True)
class SparseCalibration:
    """The curve measured on the sample (fewest blocks first) and the budget chosen: the cheapest keeping
    ``min_agreement``, else exact DIPR (``top_pages`` 0)."""

    beta: float
    min_agreement: float
    curve: list[BudgetMeasured]
    chosen: int
    confidence: float = 0.95
    notes: list[str] = field(default_factory=list)

    def report(self) -> str:
        lines = [
            f"agreement with dense attention's first tokens on {self.curve[0].prompts if self.curve else 0} prompts "
            f"at beta {self.beta:g} (floor {self.min_agreement:.0%}; lower bound at {self.confidence:.0%} "
            f"confidence, Wilson):",
            "| top_pages | agreed | agreement | lower bound | blocks read (DIPR layers) |",
            "| ---: | ---: | ---: | ---: | ---: |",
        ]
        for m in self.curve:
            name = "off (exact DIPR)" if m.top_pages == EXACT else str(m.top_pages)
            lines.append(
                f"| {name} | {m.agreed}/{m.prompts} | {m.agreement:.0%} | {m.lower_bound(self.confidence):.0%} "
                f"| {m.blocks_read:.1%} |"
            )
        settings = {"beta": self.beta, "top_pages": self.chosen}
        lines.append(f"chosen: top_pages {self.chosen}" + (" (no budget kept the floor)" if not self.chosen else ""))
        lines.append(f"--additional-config '{json.dumps({'kvreuse': {'sparse': settings}})}'")
        lines += self.notes
        return "\n".join(lines)


def _configure(flags: dict[str, Any]):
    """A ``collective_rpc`` call: the worker's sparse settings from ``flags``, its figures emptied."""

    def call(worker: Any) -> None:
        from kvreuse.vllm import runtime

        runtime.configure_sparse(flags)
        runtime.reset_sparse_figures()

    return call


def _settings(worker: Any) -> dict[str, Any]:
    import dataclasses

    from kvreuse.vllm.runtime import sparse_attention

    attention = sparse_attention()
    return {} if attention is None else dataclasses.asdict(attention.config)


def _blocks_read(worker: Any) -> tuple[int, int]:
    from kvreuse.vllm.runtime import sparse_attention

    attention = sparse_attention()
    if attention is None:
        return 0, 0
    rows = [r for r in attention.figures.rows() if r["layer"] >= attention.config.dense_layers]
    return sum(r["blocks_read"] for r in rows), sum(r["blocks_total"] for r in rows)


def calibrate_top_pages(
    llm: Any,
    prompts: Sequence[str],
    min_agreement: float = 0.95,
    *,
    beta: float = 8.0,
    candidates: Sequence[int] = CANDIDATES,
    max_tokens: int = 16,
    confidence: float = 0.95,
) -> SparseCalibration:
    """Measure exact DIPR and every ``top_pages`` in ``candidates`` at ``beta`` against dense attention on
    ``prompts`` in ``llm`` (vLLM's ``LLM`` running the sparse backend), and choose the budget that reads the fewest
    blocks among those whose sampled agreement is at least ``min_agreement``."""
    from vllm import SamplingParams

    if not prompts:
        raise ConfigError("calibration needs at least one sample prompt")
    if not 0.0 <= min_agreement <= 1.0:
        raise ConfigError(f"min_agreement must be between 0 and 1, got {min_agreement}")
    if not all(isinstance(k, int) and 1 <= k <= 1_000_000 for k in candidates):
        raise ConfigError(f"top_pages candidates must be integers from 1 to 1000000, got {list(candidates)}")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    before = llm.collective_rpc(_settings)[0]

    def run(flags: dict[str, Any]) -> tuple[list[list[int]], float]:
        llm.collective_rpc(_configure({**flags, "min_context": 0}))
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        read, total = llm.collective_rpc(_blocks_read)[0]
        return [list(o.outputs[0].token_ids) for o in outs], read / total if total else 1.0

    try:
        reference, _ = run({"beta": float("inf")})
        curve = []
        for top_pages in (EXACT, *sorted(set(candidates))):
            tokens, read = run({"beta": beta, "top_pages": top_pages})
            agreed = sum(t == r for t, r in zip(tokens, reference))
            curve.append(BudgetMeasured(top_pages, agreed, len(prompts), read))
    finally:
        if before:
            llm.collective_rpc(_configure(before))
    curve.sort(key=lambda m: m.blocks_read)
    best = cheapest_budget([m for m in curve if m.top_pages != EXACT], min_agreement)
    notes = sample_notes(len(prompts), min_agreement, None if best is None else (best.agreed, best.prompts), confidence)
    return SparseCalibration(beta, min_agreement, curve, best.top_pages if best else EXACT, confidence, notes)


def read_prompt_lines(path: Path) -> list[str]:
    """The sample prompts of a calibration command: one JSON string per line of ``path`` (blank lines skipped); a
    file that is not so raises :class:`ConfigError` naming it."""
    try:
        prompts = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as why:
        raise ConfigError(f"calibration inputs: {why}") from None
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise ConfigError(f"{path}: must hold one JSON string (a sample prompt) per line, at least one")
    return prompts


def calibrate_sparse_in_new_engine(
    model: str,
    prompts: list[str],
    min_agreement: float,
    *,
    beta: float = 8.0,
    candidates: Sequence[int] = CANDIDATES,
    engine_args: dict[str, Any] | None = None,
) -> SparseCalibration:
    """``kvreuse calibrate-sparse``: start vLLM on ``model`` with the sparse backend (``engine_args`` added),
    calibrate on ``prompts``, stop the engine."""
    from vllm import LLM

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the settings reach the worker through collective_rpc
    os.environ.setdefault("KVREUSE_SPARSE_CPU_BACKEND", "1")
    llm = LLM(model=model, **(engine_args or {}))
    try:
        return calibrate_top_pages(llm, prompts, min_agreement, beta=beta, candidates=candidates)
    finally:
        vllm_0_32.shutdown_llm(llm)
