"""Worker side of ``modules.recompute_blend``: the pass that chooses, from the request's own context, which spliced
tokens a step recomputes (``kvreuse.modules.blend`` has the method and its pure parts).

It runs inside the module connector's input wrapper (``kvreuse.patches.vllm_0_32.remap_scheduled_tokens``), before
the step's forward and before the wrapper moves the scheduled tokens, once the request's spliced KV is in its blocks
(the worker loads such a request there, not in ``start_load_kv``). For the load's candidates (the run's tokens whose
spliced KV is not a full prefill's) it runs the model's first ``layers`` decoder layers through the model's own
modules (:class:`~kvreuse.patches.vllm_0_32.DecoderLayers`), each layer's attention over the request's cache
(:func:`~kvreuse.modules.blend.attend_before`), writing every candidate's fresh keys and values of each layer into the
cache first, as the forward would; on layer ``layers`` it computes their keys and values, ranks the candidates by
how far these lie from the spliced ones (:func:`~kvreuse.modules.blend.kv_deviation`), writes them, and returns the
top ``count`` candidates besides those the load recomputes already (:func:`~kvreuse.modules.blend.top_tokens`).
Layer 0 of a spliced token is exact already (its KV depends on its token and position alone), so after the pass
every candidate's KV of layers ``0 .. layers`` is a full prefill's; the forward then recomputes the chosen tokens
in every layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from kvreuse.modules.blend import attend_before, kv_deviation, top_tokens

if TYPE_CHECKING:
    from kvreuse.patches.vllm_0_32 import DecoderLayers
    from kvreuse.vllm.modules.common import LoadSpec

# (layer number, keys, values, slots): write keys and values [tokens, kv_heads, head_dim] at slots into a layer
WriteKV = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]
# A layer's keys and values as [blocks, block_size, kv_heads, head_dim] views of its paged cache (any strides)
PlainKV = tuple[torch.Tensor, torch.Tensor]


def split_kv(cache: torch.Tensor) -> PlainKV:
    """A layer's K|V cache in vLLM's plain paged layout ``[blocks, kv_heads, block_size, 2 * head_dim]`` (a token's
    keys then its values) as ``PlainKV`` views (no copy)."""
    head_dim = cache.shape[-1] // 2
    return cache[..., :head_dim].transpose(1, 2), cache[..., head_dim:].transpose(1, 2)


def read_kv(cache: PlainKV, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[tokens, kv_heads, head_dim]`` at ``slots`` of a layer's cache."""
    keys, values = cache
    block_size = keys.shape[1]
    return keys[slots // block_size, slots % block_size], values[slots // block_size, slots % block_size]


def prompt_slots(spec: LoadSpec) -> list[int]:
    """The slot of every prompt position from 0 to the end of the load's pieces (they follow one another)."""
    assert spec.blend is not None
    return [*spec.blend.context_slots, *(slot for piece_slots in spec.slots for slot in piece_slots)]


@torch.inference_mode()
def choose(
    spec: LoadSpec,
    token_ids: Sequence[int],
    model: DecoderLayers,
    caches: Sequence[PlainKV],
    write: WriteKV,
) -> tuple[int, ...]:
    """The prompt positions (ascending) the pass adds to ``spec.recompute``: ``spec.blend.count`` of its candidates,
    whose token ids are ``token_ids``. ``caches`` are the layers' KV caches (the load's pieces written already) and
    ``write`` writes a layer's keys and values through its attention backend."""
    blend = spec.blend
    assert blend is not None
    candidates = blend.candidates
    taken = set(spec.recompute)
    fixed = [i for i, position in enumerate(candidates) if position in taken]
    if blend.count >= len(candidates) - len(fixed):  # every open candidate: nothing to rank
        return tuple(position for position in candidates if position not in taken)
    device = caches[0][0].device
    positions = torch.tensor(candidates, dtype=torch.int64, device=device)
    every = torch.tensor(prompt_slots(spec)[: candidates[-1] + 1], dtype=torch.int64, device=device)
    slots = every[positions]
    hidden = model.embed(torch.tensor(list(token_ids), dtype=torch.int64, device=device))
    residual: torch.Tensor | None = None
    for layer in range(blend.layers):
        query, keys, values, residual = model.attention_inputs(layer, positions, hidden, residual)
        write(layer, keys, values, slots)
        context_keys, context_values = read_kv(caches[layer], every)
        attended = attend_before(query, context_keys, context_values, positions, model.scale)
        hidden, residual = model.finish_layer(layer, attended, residual)
    _, keys, values, _ = model.attention_inputs(blend.layers, positions, hidden, residual)
    spliced_keys, spliced_values = read_kv(caches[blend.layers], slots)
    scores = kv_deviation(keys, values, spliced_keys, spliced_values)
    write(blend.layers, keys, values, slots)
    return tuple(candidates[i] for i in top_tokens(scores.tolist(), blend.count, fixed))
