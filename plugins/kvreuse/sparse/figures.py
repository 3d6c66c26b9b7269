"""Figures of DIPR sparse attention: how much of the context each layer attends, and how much attention it keeps.

- *Fraction of blocks attended*: KV blocks whose keys and values were loaded, over all blocks of the batch's
  sequences (per KV head); 1 - this is the share of K/V bytes saved.
- *Fraction of tokens attended*: tokens in the attended set over all tokens (per query head).
- *Recovery ratio*: the share of the dense attention mass ``sum_{j in A} softmax(l)_j`` that the attended set
  ``A`` keeps (1 = nothing of weight dropped). It needs every logit, so it is computed by the PyTorch reference
  on sampled steps (``SparseConfig.sample_recovery``), not by the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the kernels need Triton; the figures import them only when sampling
    from kvreuse.kernels.dipr_decode import DIPRCounters


def should_sample(step: int, every: int) -> bool:
    """Whether decode step ``step`` (counted from 0) measures the recovery ratio; ``every = 0`` never does."""
    return every > 0 and step % every == 0


def recovery_ratio(logits: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """Share of the dense softmax mass of ``logits[..., n]`` that lies on ``attended[..., n]`` (fp32 ``[...]``)."""
    weights = torch.softmax(logits.float(), dim=-1)
    return (weights * attended).sum(-1)


def sample_recovery(query: torch.Tensor, key_cache: torch.Tensor, bounds: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, beta: float | torch.Tensor, scale: float, sink: int,
                    local: int) -> torch.Tensor:
    """Recovery ratio ``[num_seqs, num_q_heads]`` of the set the DIPR kernel attends, by the reference."""
    from kvreuse.kernels.dipr_decode import dipr_selection_reference

    sel = dipr_selection_reference(query, key_cache, bounds, block_table, seq_lens, beta, scale, sink, local)
    if not sel.logits:
        return torch.zeros(0, query.shape[1])
    return torch.stack([recovery_ratio(lg, at) for lg, at in zip(sel.logits, sel.attended)])


@dataclass
class _LayerSums:
    blocks_read: torch.Tensor | int = 0
    blocks_total: torch.Tensor | int = 0
    tokens_attended: torch.Tensor | int = 0
    tokens_total: torch.Tensor | int = 0
    recovery: list[torch.Tensor] = field(default_factory=list)


class AttendedFractions:
    """Per-layer sums of the kernel's counters and of sampled recovery ratios.

    ``add`` keeps the sums on the counters' device (no host read per layer and step); ``rows`` reads them.
    """

    def __init__(self) -> None:
        self._layers: dict[int, _LayerSums] = {}

    def add(self, layer: int, counters: DIPRCounters) -> None:
        sums = self._layers.setdefault(layer, _LayerSums())
        kv_heads, q_heads = counters.blocks_read.shape[1], counters.tokens_attended.shape[1]
        sums.blocks_read = sums.blocks_read + counters.blocks_read.sum(dtype=torch.int64)
        sums.blocks_total = sums.blocks_total + counters.blocks_total.sum(dtype=torch.int64) * kv_heads
        sums.tokens_attended = sums.tokens_attended + counters.tokens_attended.sum(dtype=torch.int64)
        sums.tokens_total = sums.tokens_total + counters.tokens_total.sum(dtype=torch.int64) * q_heads

    def add_recovery(self, layer: int, ratios: torch.Tensor) -> None:
        self._layers.setdefault(layer, _LayerSums()).recovery.append(ratios.detach().flatten().float().cpu())

    def rows(self) -> list[dict[str, float | int | None]]:
        """One row per layer: ``layer, block_fraction, token_fraction, recovery_mean, recovery_min, samples``."""
        rows = []
        for layer in sorted(self._layers):
            sums = self._layers[layer]
            rec = torch.cat(sums.recovery) if sums.recovery else torch.zeros(0)
            rows.append({
                "layer": layer,
                "block_fraction": _ratio(sums.blocks_read, sums.blocks_total),
                "token_fraction": _ratio(sums.tokens_attended, sums.tokens_total),
                "recovery_mean": float(rec.mean()) if rec.numel() else None,
                "recovery_min": float(rec.min()) if rec.numel() else None,
                "samples": int(rec.numel()),
            })
        return rows


def _ratio(part: torch.Tensor | int, whole: torch.Tensor | int) -> float | None:
    whole = int(whole)
    return int(part) / whole if whole else None
