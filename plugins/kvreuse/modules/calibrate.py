"""Choosing a splice's recompute setting from a sample of a user's own prompts: the cheapest that keeps a floor.

How much of a spliced prompt must be recomputed for its answers to stay a full prefill's depends on the model and on
the prompts (their layout, the modules' lengths, what is asked). An adapter runs a sample of the user's prompts once
with full prefill and once per candidate :class:`Setting`, counts how many give full prefill's answer
(:class:`Measured`), and :func:`cheapest` picks the setting that computes the fewest prompt tokens among those that
agree on at least the floor. The sample's agreement is an estimate: :func:`agreement_lower_bound` is the one-sided
Wilson score bound (Wilson 1927) that the true agreement exceeds with the given confidence, and
:func:`prompts_needed` the sample size for which a setting that agrees on every sampled prompt is shown to keep the
floor at that confidence.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Protocol, TypeVar

# recompute_first that recomputes every module token of any prompt vLLM takes (its positions are int32): full
# prefill's answers, no splice; what calibration gives when no candidate keeps the floor.
ALL_TOKENS = 2**31 - 1


@dataclass(frozen=True)
class Setting:
    """A candidate setting of the module cache's recompute: ``modules.recompute_first``, ``recompute_share``,
    ``recompute_budget``, ``recompute_blend`` and ``blend_layers``. Both forms name all of them, so no engine default
    adds to the measured setting."""

    recompute_first: int
    recompute_share: float = 0.0
    recompute_budget: float = 0.0
    recompute_blend: float = 0.0
    blend_layers: int = 1

    def transfer_params(self) -> dict[str, int | float]:
        """The per-request form: a request's ``kv_transfer_params``."""
        return {f"kvreuse_{key}": value for key, value in self._values().items()}

    def additional_config(self) -> dict[str, dict[str, dict[str, int | float]]]:
        """The engine's form: vLLM's ``--additional-config``."""
        return {"kvreuse": {"modules": self._values()}}

    def _values(self) -> dict[str, int | float]:
        return {
            "recompute_first": self.recompute_first,
            "recompute_share": self.recompute_share,
            "recompute_budget": self.recompute_budget,
            "recompute_blend": self.recompute_blend,
            "blend_layers": self.blend_layers,
        }

    def __str__(self) -> str:
        first = "all" if self.recompute_first == ALL_TOKENS else str(self.recompute_first)
        budget = f", recompute_budget {self.recompute_budget:g}" if self.recompute_budget else ""
        blend = f", recompute_blend {self.recompute_blend:g} after {self.blend_layers}" if self.recompute_blend else ""
        return f"recompute_first {first}, recompute_share {self.recompute_share:g}{budget}{blend}"


@dataclass(frozen=True)
class Measured:
    """``setting`` gave full prefill's answer for ``agreed`` of ``prompts`` sampled prompts, computing ``computed``
    of their prompt tokens (0 to 1; the rest came from modules; ``recompute_blend``'s pass counted in, as the
    tokens whose every layer it equals: ``passed``), with a median time to first token ``speedup`` times shorter
    than full prefill's (``None`` where the engine gave no timings)."""

    setting: Setting
    agreed: int
    prompts: int
    computed: float
    passed: float = 0.0
    speedup: float | None = None

    @property
    def agreement(self) -> float:
        return self.agreed / self.prompts if self.prompts else 0.0

    def lower_bound(self, confidence: float = 0.95) -> float:
        return agreement_lower_bound(self.agreed, self.prompts, confidence)


def agreement_lower_bound(agreed: int, prompts: int, confidence: float = 0.95) -> float:
    """The one-sided Wilson score lower bound of an agreement rate seen as ``agreed`` of ``prompts``: the true rate
    is above it with probability ``confidence`` (0 for no prompts). Wilson's interval keeps its coverage near 0 and 1,
    where an agreement floor sits, unlike the normal approximation."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence {confidence!r} is not between 0 and 1")
    if not 0 <= agreed <= prompts:
        raise ValueError(f"{agreed} agreements of {prompts} prompts")
    if not prompts:
        return 0.0
    z = NormalDist().inv_cdf(confidence)
    p = agreed / prompts
    centre = p + z * z / (2 * prompts)
    spread = z * math.sqrt(p * (1 - p) / prompts + z * z / (4 * prompts * prompts))
    return max(0.0, (centre - spread) / (1 + z * z / prompts))


def prompts_needed(floor: float, confidence: float = 0.95) -> int:
    """How many sampled prompts, all agreeing, show an agreement of at least ``floor`` at ``confidence``: the
    smallest ``n`` with ``n / (n + z^2) >= floor`` (the Wilson bound at full agreement)."""
    if not 0.0 < floor < 1.0:
        raise ValueError(f"agreement floor {floor!r} is not between 0 and 1")
    z = NormalDist().inv_cdf(confidence)
    n = math.ceil(floor * z * z / (1 - floor))
    return n if agreement_lower_bound(n, n, confidence) >= floor else n + 1


def sample_notes(
    sampled: int, min_agreement: float, chosen: tuple[int, int] | None, confidence: float = 0.95
) -> list[str]:
    """What a calibration's report says about its sample of ``sampled`` prompts: that it is too small to show
    ``min_agreement`` at ``confidence`` even where all agree, else that the ``chosen`` setting's agreement (its
    ``(agreed, prompts)``) has a Wilson lower bound under the floor; nothing where neither holds."""
    needed = prompts_needed(min_agreement, confidence) if 0.0 < min_agreement < 1.0 else None
    if needed is not None and sampled < needed:
        return [
            f"{sampled} prompts cannot show {min_agreement:.0%} at {confidence:.0%} confidence even where all "
            f"agree ({needed} can): the choice keeps the floor on this sample, an estimate of your prompts'"
        ]
    if chosen is not None and agreement_lower_bound(*chosen, confidence) < min_agreement:
        return [f"the chosen setting's lower bound is below the floor at {confidence:.0%} confidence"]
    return []


class _Agreeing(Protocol):
    @property
    def agreement(self) -> float: ...


_A = TypeVar("_A", bound=_Agreeing)


def cheapest_keeping(measured: Sequence[_A], min_agreement: float, cost: Callable[[_A], float]) -> _A | None:
    """The measured candidate of least ``cost`` among those whose sampled agreement is at least ``min_agreement``
    (0 to 1); on a tie, the one listed first. ``None`` where none keeps the floor. The one rule every calibration
    (the module cache's recompute, the sparse backend's page budget) chooses by."""
    if not 0.0 <= min_agreement <= 1.0:
        raise ValueError(f"agreement floor {min_agreement!r} is not between 0 and 1")
    keeping = [m for m in measured if m.agreement >= min_agreement]
    return min(keeping, key=cost) if keeping else None


def cheapest(measured: Sequence[Measured], min_agreement: float) -> Measured | None:
    """The measured setting that computes the fewest prompt tokens among those that keep ``min_agreement``."""
    return cheapest_keeping(measured, min_agreement, lambda m: m.computed)
