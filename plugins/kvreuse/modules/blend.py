"""Which tokens of a module to recompute when it is spliced, chosen when the module is encoded (engine-free).

CacheBlend (Yao et al., "CacheBlend: Fast Large Language Model Serving for RAG with Cached Knowledge Fusion",
EuroSys 2025) recomputes, per request, the module tokens whose KV deviates most from a full prefill's, measured on
layer 1 after computing layer 0 for every module token. An engine that computes whole layers for a fixed set of
tokens (vLLM's forward; ``kvreuse.patches.vllm_0_32.remap_scheduled_tokens``) cannot drop tokens after layer 1,
so kvreuse makes the choice once, when the module is encoded, with no knowledge of the request: the module is
encoded alone (what is spliced) and once more after a *probe context* (e.g. the chat header every prompt starts
with), and its tokens are ranked by how far their KV moved between the two (:func:`encode_deviation`,
:func:`token_scores`, :func:`ranking`). A splice then recomputes each module's top share of that ranking
(``kvreuse.modules.splice.chosen_tokens``). Tokens whose KV depends most on what precedes the module (the
attention sink that encoding alone put on its first tokens, and what attends to it) are the ones the ranking puts
first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvreuse.kernels.rerotate import RopeSpec
from kvreuse.modules.splice import Piece, piece_kv
from kvreuse.modules.store import EncodedModule

# Layers whose deviation ranks a module's tokens: every layer after the first (layer 0's keys and values depend on
# the token and its position alone, so they never deviate once re-rotated). Measured on SmolLM2 in
# benchmarks/module_quality.py (the ``blend-*`` arms).
RANK_LAYERS = "all"


def encode_deviation(spliced: EncodedModule, probe: EncodedModule, spec: RopeSpec) -> torch.Tensor:
    """Per layer and token (``[layers, tokens]``, float32): how far ``spliced``'s KV (keys moved to ``probe``'s
    positions) lies from ``probe``'s, the same tokens encoded after another context; CacheBlend's measure (squared
    L2 distance over heads of the keys and of the values, each divided by the layer's mean squared norm of the
    spliced keys or values, summed)."""
    if spliced.token_ids != probe.token_ids:
        raise ValueError(
            f"module {spliced.name!r}: the probe encoding holds other tokens ({len(probe.token_ids)} tokens, "
            f"the module {len(spliced.token_ids)}); encode the same token ids after the probe context"
        )
    length = len(spliced.token_ids)
    moved = piece_kv(spliced, Piece(spliced.name, 0, probe.start, length), spec, probe.kv.device)
    rows = []
    for layer, (keys, values) in enumerate(moved):
        rows.append(
            _distance(keys.float(), probe.keys(layer).float()) + _distance(values.float(), probe.values(layer).float())
        )
    return torch.stack(rows)


def _distance(spliced: torch.Tensor, probe: torch.Tensor) -> torch.Tensor:
    norm = spliced.pow(2).sum((1, 2)).mean().clamp_min(torch.finfo(torch.float32).tiny)
    return (spliced - probe).pow(2).sum((1, 2)) / norm


def token_scores(deviation: torch.Tensor, layers: str | Sequence[int] = RANK_LAYERS) -> tuple[float, ...]:
    """Per token of the module, ``deviation`` (:func:`encode_deviation`) summed over ``layers``: ``"all"`` (every
    layer but the first), ``"first"`` (layer 1 alone, where CacheBlend picks at run time) or explicit layer numbers.
    Sums over heads, so the shares of tensor-parallel workers add up."""
    num_layers = deviation.shape[0]
    if layers == "all":
        chosen: Sequence[int] = range(1, num_layers)
    elif layers == "first":
        chosen = (1,)
    elif isinstance(layers, str):
        raise ValueError(f"unknown layer set {layers!r} (all, first, or layer numbers)")
    else:
        chosen = layers
    return tuple(float(x) for x in deviation[list(chosen)].double().sum(0))


def ranking(scores: Sequence[float]) -> tuple[int, ...]:
    """Token indices of the module, highest score first (ties: the earlier token first): the order in which a
    splice recomputes them (``kvreuse.modules.splice.chosen_tokens``)."""
    return tuple(sorted(range(len(scores)), key=lambda i: (-scores[i], i)))
