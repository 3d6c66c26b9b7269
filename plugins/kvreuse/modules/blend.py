"""Which spliced tokens to recompute, chosen from the request's own context or when a module is encoded
(engine-free).

CacheBlend (Yao et al., "CacheBlend: Fast Large Language Model Serving for RAG with Cached Knowledge Fusion",
EuroSys 2025) recomputes, per request, the module tokens whose KV deviates most from a full prefill's, measured on
layer 1 after computing layer 0 for every module token. kvreuse does it in two ways:

* **From the request** (``modules.recompute_blend``): a module's layer-0 keys and values depend on its tokens and
  their positions alone, so once re-rotated the spliced layer-0 KV is a full prefill's. Computing layer 0 for every
  spliced token with the prompt's real left context therefore gives each token's exact input to layer 1, hence its
  exact layer-1 keys and values; more generally, computing the first ``L`` layers for every spliced token gives
  the exact KV of layers ``0 .. L``. The engine writes that exact KV into the cache and ranks the tokens by how far
  it lies from the spliced KV of layer ``L`` (:func:`kv_deviation`); the top share (:func:`blend_count` of them,
  :func:`top_tokens`) is recomputed through the remaining layers. The pass itself is the adapter's (in vLLM,
  ``kvreuse.vllm.modules.blend``), over the model's own layers, with :func:`attend_before` as its attention.
* **At encode time** (``modules.recompute_share`` / ``recompute_budget``), with no knowledge of the request: the
  module is encoded alone (what is spliced) and once more after a *probe context* (e.g. the chat header every
  prompt starts with), and its tokens are ranked by how far their KV moved between the two
  (:func:`encode_deviation`, :func:`token_scores`, :func:`ranking`). A splice then recomputes each module's top
  share of that ranking (``kvreuse.modules.splice.chosen_tokens``). Tokens whose KV depends most on what precedes
  the module (the attention sink that encoding alone put on its first tokens, and what attends to it) are the ones
  the ranking puts first.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
import torch.nn.functional as F

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


# -- the choice from the request's own context (modules.recompute_blend) ---------------------------------------------


def kv_deviation(
    fresh_keys: torch.Tensor, fresh_values: torch.Tensor, spliced_keys: torch.Tensor, spliced_values: torch.Tensor
) -> torch.Tensor:
    """Per token (``[tokens]``, float32): how far the keys and values a request computed for spliced tokens
    (``[tokens, kv_heads, head_dim]``, at their prompt positions) lie from the spliced ones at the same positions;
    CacheBlend's measure, as :func:`encode_deviation` takes it (squared L2 over heads and dimensions, keys and values
    each divided by the spliced tokens' mean squared norm, summed). A tensor-parallel worker holds a share of the
    heads: the sums over heads are its share of the whole."""
    if not fresh_keys.shape == fresh_values.shape == spliced_keys.shape == spliced_values.shape:
        raise ValueError(
            f"keys and values must have one shape [tokens, kv_heads, head_dim]: fresh {tuple(fresh_keys.shape)} and "
            f"{tuple(fresh_values.shape)}, spliced {tuple(spliced_keys.shape)} and {tuple(spliced_values.shape)}"
        )
    return _distance(spliced_keys.float(), fresh_keys.float()) + _distance(spliced_values.float(), fresh_values.float())


def blend_count(share: float, candidates: int) -> int:
    """How many of a spliced run's ``candidates`` tokens (those whose KV is not already a full prefill's) a request
    with ``modules.recompute_blend`` ``share`` recomputes: ``round(share x candidates)``, one budget per prompt."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"recompute blend share {share!r} is not between 0 and 1")
    if candidates < 0:
        raise ValueError(f"{candidates} candidate tokens")
    return round(share * candidates)


def top_tokens(scores: Sequence[float], count: int, fixed: Collection[int] = ()) -> tuple[int, ...]:
    """Indices (ascending) of the ``count`` highest ``scores`` among those not in ``fixed`` (tokens recomputed by
    another choice already, e.g. LegoLink's first tokens: the union then recomputes ``len(fixed) + count``); ties
    go to the earlier token, so that the choice is a function of the scores alone. Fewer where fewer are left."""
    if count < 0:
        raise ValueError(f"cannot choose {count} tokens")
    if any(score != score for score in scores):  # NaN: a broken pass must not choose at random
        raise ValueError("a deviation score is NaN")
    taken = set(fixed)
    open_ = [i for i in range(len(scores)) if i not in taken]
    open_.sort(key=lambda i: (-scores[i], i))
    return tuple(sorted(open_[:count]))


def attend_before(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention by position: ``query[q, q_heads, d]`` of tokens at prompt ``positions[q]`` over the prompt's
    ``keys``/``values[n, kv_heads, d]`` at positions ``0 .. n-1``, each query seeing the keys at or before its own
    position (grouped-query heads shared); ``[q, q_heads, d]`` in the query's dtype. What the engine's prefill
    computes for those tokens."""
    visible = torch.arange(keys.shape[0], device=query.device)[None, :] <= positions.to(query.device)[:, None]
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, keys.to(query.dtype), values.to(query.dtype)))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
