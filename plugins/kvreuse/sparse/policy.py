"""Which attention each layer and sequence gets: AlayaDB's rule-based query optimizer (Deng et al., "AlayaDB: The
Data Foundation for Efficient and Effective Long-context LLM Inference", SIGMOD 2025), reduced to three rules.

1. A layer listed in ``layer_betas`` uses its own beta.
2. Otherwise the first ``dense_layers`` layers are dense (early layers attend broadly, so DIPR would read most
   blocks anyway and their outputs feed every later layer), and every other layer uses the global ``beta``.
3. A sequence shorter than ``min_context`` tokens is dense in every layer (the window and the sketch pass cost
   about as much as the blocks they would save).

"Dense" is ``beta = inf``, which the DIPR kernel computes as exact dense attention; a backend may route a batch
whose betas are all ``inf`` to its ordinary dense kernel instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvreuse.sparse.config import SparseConfig

INF = float("inf")


def layer_beta(config: SparseConfig, layer: int, overrides: dict[int, float] | None = None) -> float:
    """The beta of ``layer`` by rules 1 and 2 (``inf`` = dense)."""
    overrides = config.layer_beta_overrides if overrides is None else overrides
    if layer in overrides:
        return overrides[layer]
    return INF if layer < config.dense_layers else config.beta


def uses_dipr(config: SparseConfig, layer: int, context_len: int) -> bool:
    """Whether a sequence of ``context_len`` tokens gets DIPR (a finite beta) in ``layer``."""
    return context_len >= config.min_context and layer_beta(config, layer) < INF


def sequence_betas(
    config: SparseConfig, layer: int, seq_lens: torch.Tensor | Sequence[int], overrides: dict[int, float] | None = None
) -> torch.Tensor:
    """Per-sequence betas for one decode batch in ``layer`` (rule 3 applied), fp32 on ``seq_lens``' device.

    Computed on the device without reading ``seq_lens`` back, so a backend can call it inside a CUDA graph.
    """
    lens = torch.as_tensor(seq_lens)
    beta = torch.full(lens.shape, layer_beta(config, layer, overrides), dtype=torch.float32, device=lens.device)
    return torch.where(lens < config.min_context, torch.full_like(beta, INF), beta)


class RuleBasedPolicy:
    """AlayaDB-style rules (``name = "rules"``), with the per-layer overrides parsed once."""

    name = "rules"

    def __init__(self, config: SparseConfig):
        self.config = config
        self._overrides = config.layer_beta_overrides

    def layer_beta(self, layer: int) -> float:
        return layer_beta(self.config, layer, self._overrides)

    def sequence_betas(self, layer: int, seq_lens: torch.Tensor | Sequence[int]) -> torch.Tensor:
        return sequence_betas(self.config, layer, seq_lens, self._overrides)

    def uses_dipr(self, layer: int, context_len: int) -> bool:
        return context_len >= self.config.min_context and self.layer_beta(layer) < INF
