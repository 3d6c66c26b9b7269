"""Calibrating the module cache's recompute on a sample of the user's own prompts (``kvreuse.modules.calibrate``).

:func:`calibrate_modules` runs each sampled prompt with full prefill (``skip_reading_prefix_cache``: no module, no
prefix hit) and with each candidate setting (per request, ``kv_transfer_params``), greedy, and counts a prompt as
agreeing where the candidate's first ``max_tokens`` tokens are full prefill's, or, with a normaliser, where both
outputs' texts are the same after it (``kvreuse.modules.agreement``: the first line, a regex group, a JSON field,
case and whitespace). vLLM's prefix cache is reset before every request, so that each is computed from the modules
alone, as a new prompt would be. The modules must be in the engine's store already (``encode_modules``; probed,
``probe=...``, for candidate shares). What a candidate computes is vLLM's own count, the prompt's tokens less those
it reports cached (``RequestOutput.num_cached_tokens``), plus the pass ``recompute_blend`` runs (reported in the
output's ``kv_transfer_params``), counted as its tokens through its layers and one more of the model's. TTFT is
vLLM's own per request (``RequestOutput.metrics``, with the engine's statistics on), median per candidate against
full prefill's on the same prompts.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvreuse.errors import ConfigError
from kvreuse.modules.agreement import Normaliser, same_output
from kvreuse.modules.calibrate import (
    ALL_TOKENS,
    Measured,
    Setting,
    cheapest,
    sample_notes,
)
from kvreuse.patches import vllm_0_32
from kvreuse.vllm.modules.common import BLEND_PASS
from kvreuse.vllm.sparse.calibrate import read_prompt_lines

FIRSTS = (0, 16, 32, 64)  # recompute_first candidates: the plain splice to a quarter of a ~250-token module


@dataclass(frozen=True)
class Calibration:
    """The curve measured on the sample (cheapest first) and the setting chosen: the cheapest keeping
    ``min_agreement``, else every module token recomputed (:data:`ALL_TOKENS`: full prefill's answers)."""

    min_agreement: float
    curve: list[Measured]
    chosen: Setting
    kept: bool  # whether a candidate kept the floor (else ``chosen`` recomputes everything)
    confidence: float = 0.95
    notes: list[str] = field(default_factory=list)
    compared: str = "first tokens"  # what agreement compares: the outputs' first tokens, or a normaliser's steps

    def report(self) -> str:
        """The curve as a table, the choice, and its two forms (engine flag, per request)."""
        lines = [
            f"agreement with full prefill's {self.compared} on {self.curve[0].prompts if self.curve else 0} prompts "
            f"(floor {self.min_agreement:.0%}; lower bound at {self.confidence:.0%} confidence, Wilson):",
            "| setting | agreed | agreement | lower bound | prompt tokens computed (pass) | TTFT full/setting |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for m in self.curve:
            passed = f" ({m.passed:.1%})" if m.passed else ""
            speedup = f"{m.speedup:.2f}x" if m.speedup is not None else "n/a"
            lines.append(
                f"| {m.setting} | {m.agreed}/{m.prompts} | {m.agreement:.0%} | {m.lower_bound(self.confidence):.0%} "
                f"| {m.computed:.1%}{passed} | {speedup} |"
            )
        if self.kept:
            lines.append(f"chosen: {self.chosen} (the cheapest whose agreement is at least the floor)")
        else:
            lines.append(f"no candidate kept the floor: {self.chosen} (every module token recomputed)")
        lines.append(f"--additional-config '{json.dumps(self.chosen.additional_config())}'")
        lines.append(f'per request: "kv_transfer_params": {json.dumps(self.chosen.transfer_params())}')
        lines += self.notes
        return "\n".join(lines)


def calibrate_modules(
    llm: Any,
    prompts: Sequence[str | Sequence[int]],
    min_agreement: float = 0.95,
    *,
    firsts: Sequence[int] = FIRSTS,
    shares: Sequence[float] = (),
    budgets: Sequence[float] = (),
    blends: Sequence[float] = (),
    blend_layers: Sequence[int] = (1,),
    settings: Sequence[Setting] = (),
    normalise: str | Sequence[str] | Normaliser | None = None,
    max_tokens: int = 16,
    confidence: float = 0.95,
) -> Calibration:
    """Measure every candidate (``recompute_first`` in ``firsts``, each also with every ``recompute_share`` in
    ``shares``; each ``recompute_budget`` in ``budgets`` alone; each ``recompute_blend`` in ``blends`` alone after
    each of ``blend_layers``; and each of ``settings`` as it is, e.g. a chosen setting checked on held-back prompts
    with ``firsts=()``) against full prefill on ``prompts`` (texts or token ids) in ``llm`` (vLLM's ``LLM``
    with the ``KVReuseModuleCache`` connector and the prompts' modules encoded), and choose the cheapest whose
    sampled agreement is at least ``min_agreement``. Outputs agree where their tokens are the same, or with
    ``normalise`` (a :class:`~kvreuse.modules.agreement.Normaliser` or its steps, e.g. ``["first-line", "case"]``)
    where their texts are the same after it. Fewer prompts than ``prompts_needed(min_agreement, confidence)`` cannot
    show the floor at that confidence even where all agree; the result says so."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if not prompts:
        raise ValueError("calibration needs at least one sample prompt")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    normaliser = normalise if normalise is None or isinstance(normalise, Normaliser) else Normaliser.parse(normalise)
    tokenizer = llm.get_tokenizer() if normaliser is not None else None
    num_layers = int(vllm_0_32.llm_config(llm).model_config.hf_config.num_hidden_layers)
    inputs = [p if isinstance(p, str) else TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
    candidates = [Setting(k, share) for k in firsts for share in (0.0, *shares)]
    candidates += [Setting(0, 0.0, budget) for budget in budgets]
    candidates += [Setting(0, 0.0, 0.0, blend, layers) for blend in blends for layers in blend_layers]
    candidates += list(settings)
    if not candidates:
        raise ValueError("calibration needs at least one candidate setting")

    def run(transfer: dict[str, Any] | None) -> list[_Run]:
        """What each prompt gave, one request at a time."""
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            skip_reading_prefix_cache=transfer is None,
            extra_args={"kv_transfer_params": transfer} if transfer is not None else None,
        )
        results = []
        for prompt in inputs:
            llm.reset_prefix_cache()
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            results.append(_Run.of(out, num_layers))
        return results

    def agree(reference: Sequence[int], output: Sequence[int]) -> bool:
        decode = tokenizer.decode if tokenizer is not None else None
        return same_output(reference, output, normaliser, decode)

    full = run(None)
    full_ttft = _median_ttft(full)
    curve: list[Measured] = []
    for setting in candidates:
        runs = run(setting.transfer_params())
        agreed = sum(agree(reference.tokens, r.tokens) for r, reference in zip(runs, full))
        prompt_tokens = sum(r.prompt for r in runs)
        passed = sum(r.passed for r in runs) / prompt_tokens
        computed = sum(r.computed for r in runs) / prompt_tokens + passed
        ttft = _median_ttft(runs)
        speedup = full_ttft / ttft if full_ttft is not None and ttft else None
        curve.append(Measured(setting, agreed, len(runs), computed, passed, speedup))
    curve.sort(key=lambda m: m.computed)
    best = cheapest(curve, min_agreement)
    notes = sample_notes(len(prompts), min_agreement, None if best is None else (best.agreed, best.prompts), confidence)
    compared = f"output after {normaliser}" if normaliser is not None else f"first {max_tokens} tokens"
    if best is None:
        return Calibration(min_agreement, curve, Setting(ALL_TOKENS), False, confidence, notes, compared)
    return Calibration(min_agreement, curve, best.setting, True, confidence, notes, compared)


@dataclass(frozen=True)
class _Run:
    """One request's output tokens, prompt length, prompt tokens computed (vLLM's count), tokens-equivalent of the
    pass ``recompute_blend`` ran, and time to first token (``None`` without the engine's statistics)."""

    tokens: list[int]
    prompt: int
    computed: int
    passed: float
    ttft: float | None

    @staticmethod
    def of(out: Any, num_layers: int) -> _Run:
        length = len(out.prompt_token_ids)
        report = (out.kv_transfer_params or {}).get(BLEND_PASS)
        passed = report["tokens"] * (report["layers"] + 1) / num_layers if report else 0.0
        stats = out.metrics
        ttft = None
        if stats is not None and stats.first_token_ts and stats.scheduled_ts:
            ttft = stats.first_token_ts - stats.scheduled_ts
        return _Run(list(out.outputs[0].token_ids), length, length - (out.num_cached_tokens or 0), passed, ttft)


def _median_ttft(runs: Sequence[_Run]) -> float | None:
    times = [r.ttft for r in runs if r.ttft is not None]
    return statistics.median(times) if len(times) == len(runs) else None


def read_calibration_inputs(modules_path: Path, prompts_path: Path) -> tuple[dict[str, str], list[str]]:
    """The modules (a JSON object, name -> text) and the sample prompts (one JSON string per line) of the
    ``kvreuse calibrate-modules`` command; a file that is not so raises :class:`ConfigError` naming it."""
    try:
        modules = json.loads(modules_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as why:
        raise ConfigError(f"calibration inputs: {why}") from None
    if not isinstance(modules, dict) or not modules or not all(isinstance(t, str) for t in modules.values()):
        raise ConfigError(f"{modules_path}: must be a JSON object of module name -> text, at least one")
    return modules, read_prompt_lines(prompts_path)


def calibrate_in_new_engine(
    model: str,
    modules: dict[str, str],
    prompts: list[str],
    min_agreement: float,
    *,
    shares: Sequence[float] = (),
    budgets: Sequence[float] = (),
    blends: Sequence[float] = (),
    blend_layers: Sequence[int] = (1,),
    normalise: Sequence[str] | None = None,
    probe: str | None = None,
    engine_args: dict[str, Any] | None = None,
) -> Calibration:
    """``kvreuse calibrate-modules``: start vLLM on ``model`` with the module connector and its statistics on
    (``engine_args`` added), encode ``modules`` alone (probed after ``probe``'s tokens where given, for ``shares``
    and ``budgets``), calibrate on ``prompts``, stop the engine."""
    from vllm import LLM

    from kvreuse.vllm.modules.encode import encode_modules

    normaliser = Normaliser.parse(normalise) if normalise else None  # refused before the engine starts
    connector = {"kv_connector": "KVReuseModuleCache", "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
    llm = LLM(model=model, kv_transfer_config=connector, **{"disable_log_stats": False, **(engine_args or {})})
    try:
        tokenizer = llm.get_tokenizer()
        probe_ids = tokenizer.encode(probe, add_special_tokens=False) if probe is not None else None
        encode_modules(llm, modules, probe=probe_ids)
        return calibrate_modules(
            llm,
            prompts,
            min_agreement,
            shares=shares,
            budgets=budgets,
            blends=blends,
            blend_layers=blend_layers,
            normalise=normaliser,
        )
    finally:
        vllm_0_32.shutdown_llm(llm)
