"""Choosing ``sparse.top_pages`` (the approximate page budget) from a sample of a user's own prompts.

Exact DIPR never drops a key within beta of the largest logit; ``top_pages`` caps the blocks each KV head reads
beyond the window and so may drop some, which can change an answer. Whether it does depends on the model and the
prompts, so an adapter runs a sample of the user's prompts once with dense attention (beta = inf, the reference)
and once per candidate budget, counts the prompts whose greedy tokens equal dense attention's
(:class:`BudgetMeasured`), and :func:`cheapest_budget` picks the budget that reads the fewest blocks among those that
agree on at least the user's floor. The sample's agreement is an estimate, bounded as the module cache's calibration
bounds it (``kvreuse.modules.calibrate.agreement_lower_bound``, Wilson's score bound).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvreuse.modules.calibrate import agreement_lower_bound, cheapest_keeping

EXACT = 0  # top_pages 0: exact DIPR (no budget), what calibration keeps when no budget holds the floor
CANDIDATES = (4, 8, 16, 32, 64)  # top_pages candidates: 128 to 2K tokens per KV head past the window (32-token blocks)


@dataclass(frozen=True)
class BudgetMeasured:
    """``top_pages`` gave dense attention's greedy tokens on ``agreed`` of ``prompts`` sampled prompts while its DIPR
    layers read ``blocks_read`` (0 to 1) of their KV blocks (``EXACT``: exact DIPR at the same beta)."""

    top_pages: int
    agreed: int
    prompts: int
    blocks_read: float

    @property
    def agreement(self) -> float:
        return self.agreed / self.prompts if self.prompts else 0.0

    def lower_bound(self, confidence: float = 0.95) -> float:
        return agreement_lower_bound(self.agreed, self.prompts, confidence)


def cheapest_budget(measured: Sequence[BudgetMeasured], min_agreement: float) -> BudgetMeasured | None:
    """The measured budget that reads the fewest blocks among those that keep ``min_agreement``."""
    return cheapest_keeping(measured, min_agreement, lambda m: m.blocks_read)
