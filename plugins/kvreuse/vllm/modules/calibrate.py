"""Calibrating the module cache's recompute on a sample of the user's own prompts (``kvreuse.modules.calibrate``).

:func:`calibrate_modules` runs each sampled prompt with full prefill (``skip_reading_prefix_cache``: no module, no
prefix hit) and with each candidate setting (per request, ``kv_transfer_params``), greedy, and counts a prompt as
agreeing where the candidate's first ``max_tokens`` tokens are full prefill's. vLLM's prefix cache is reset before
every request, so that each is computed from the modules alone, as a new prompt would be. The modules must be in
the engine's store already (``encode_modules``; probed, ``probe=...``, for candidate shares). What a candidate
computes is vLLM's own count: the prompt's tokens less those it reports cached (``RequestOutput.num_cached_tokens``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvreuse.errors import ConfigError
from kvreuse.modules.calibrate import (
    ALL_TOKENS,
    Measured,
    Setting,
    agreement_lower_bound,
    cheapest,
    prompts_needed,
)
from kvreuse.patches import vllm_0_32
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

    def report(self) -> str:
        """The curve as a table, the choice, and its two forms (engine flag, per request)."""
        lines = [
            f"agreement with full prefill's first tokens on {self.curve[0].prompts if self.curve else 0} prompts "
            f"(floor {self.min_agreement:.0%}; lower bound at {self.confidence:.0%} confidence, Wilson):",
            "| setting | agreed | agreement | lower bound | prompt tokens computed |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for m in self.curve:
            lines.append(
                f"| {m.setting} | {m.agreed}/{m.prompts} | {m.agreement:.0%} | {m.lower_bound(self.confidence):.0%} "
                f"| {m.computed:.1%} |"
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
    max_tokens: int = 16,
    confidence: float = 0.95,
) -> Calibration:
    """Measure every candidate (``recompute_first`` in ``firsts``, each also with every ``recompute_share`` in
    ``shares``; and each ``recompute_budget`` in ``budgets`` alone) against full prefill on ``prompts`` (texts or
    token ids) in ``llm`` (vLLM's ``LLM`` with the ``KVReuseModuleCache`` connector and the prompts' modules
    encoded), and choose the cheapest whose sampled
    agreement is at least ``min_agreement``. Fewer prompts than ``prompts_needed(min_agreement, confidence)`` cannot
    show the floor at that confidence even where all agree; the result says so."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if not prompts:
        raise ValueError("calibration needs at least one sample prompt")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    inputs = [p if isinstance(p, str) else TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
    candidates = [Setting(k, share) for k in firsts for share in (0.0, *shares)]
    candidates += [Setting(0, 0.0, budget) for budget in budgets]

    def run(transfer: dict[str, Any] | None) -> list[tuple[list[int], int, int]]:
        """(output tokens, prompt tokens, prompt tokens computed) per prompt, one request at a time."""
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
            length = len(out.prompt_token_ids)
            results.append((list(out.outputs[0].token_ids), length, length - (out.num_cached_tokens or 0)))
        return results

    full = [tokens for tokens, _, _ in run(None)]
    curve: list[Measured] = []
    for setting in candidates:
        runs = run(setting.transfer_params())
        agreed = sum(tokens == reference for (tokens, _, _), reference in zip(runs, full))
        computed = sum(c for _, _, c in runs) / sum(n for _, n, _ in runs)
        curve.append(Measured(setting, agreed, len(runs), computed))
    curve.sort(key=lambda m: m.computed)
    best = cheapest(curve, min_agreement)
    notes = []
    needed = prompts_needed(min_agreement, confidence) if 0.0 < min_agreement < 1.0 else None
    if needed is not None and len(prompts) < needed:
        notes.append(
            f"{len(prompts)} prompts cannot show {min_agreement:.0%} at {confidence:.0%} confidence even where all "
            f"agree ({needed} can): the choice keeps the floor on this sample, an estimate of your prompts'"
        )
    elif best is not None and agreement_lower_bound(best.agreed, best.prompts, confidence) < min_agreement:
        notes.append(f"the chosen setting's lower bound is below the floor at {confidence:.0%} confidence")
    if best is None:
        return Calibration(min_agreement, curve, Setting(ALL_TOKENS), False, confidence, notes)
    return Calibration(min_agreement, curve, best.setting, True, confidence, notes)


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
    probe: str | None = None,
    engine_args: dict[str, Any] | None = None,
) -> Calibration:
    """``kvreuse calibrate-modules``: start vLLM on ``model`` with the module connector (``engine_args`` added),
    encode ``modules`` alone (probed after ``probe``'s tokens where given, for ``shares`` and ``budgets``),
    calibrate on ``prompts``, stop the engine."""
    from vllm import LLM

    from kvreuse.vllm.modules.encode import encode_modules

    connector = {"kv_connector": "KVReuseModuleCache", "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
    llm = LLM(model=model, kv_transfer_config=connector, **(engine_args or {}))
    try:
        tokenizer = llm.get_tokenizer()
        probe_ids = tokenizer.encode(probe, add_special_tokens=False) if probe is not None else None
        encode_modules(llm, modules, probe=probe_ids)
        return calibrate_modules(llm, prompts, min_agreement, shares=shares, budgets=budgets)
    finally:
        vllm_0_32.shutdown_llm(llm)
