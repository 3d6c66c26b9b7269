"""A Llama forward pass written out over an explicit KV cache: the reference for splicing modules and recovering.

kvreuse's module cache puts each module's KV into a prompt as it was computed alone (or after a context) with
its keys re-rotated to the positions it takes. Everything after that, the question's prefill and the decode, runs
over the assembled cache. This module does the same in plain PyTorch on a Hugging Face ``LlamaForCausalLM``'s
weights, one layer at a time, so that each recovery method is a few readable lines:

* :meth:`ReferenceLlama.forward` computes *new* tokens (the question, a decoded token) over a :class:`KVCache`, and
  optionally *recomputes* tokens already in the cache: their fresh keys and values replace the cached ones, layer
  by layer, and they attend with full (causal) attention to everything before them. Which tokens is a
  :class:`Recompute` policy's choice: a fixed set in every layer (:class:`FixedTokens`: LegoLink's first tokens of
  each module, a chosen module), or a set that shrinks at chosen layers by how far the fresh KV deviates from the
  cached KV (:class:`KVDeviation`: CacheBlend). A token leaves the set and never comes back: its hidden state
  is only known while it is computed.
* :class:`ApeBias` changes how new tokens attend to spliced keys (APE: an attention temperature on their logits and
  a scaling factor on their attention mass).
* :func:`splice` assembles a prompt's cache from a prefix and stored modules with kvreuse's own
  ``kvreuse.modules.splice.piece_kv``: the exact KV kvreuse writes into vLLM's paged cache.

Compute is counted in token-layers (:class:`Compute`): one token through one layer (attention and MLP). A token
whose keys and values alone are computed at a layer (to measure their deviation) counts :data:`KV_ONLY_SHARE` of a
token-layer, the share of the layer's weight multiply-adds its key and value projections take.

Numerics: float32 throughout, like the model; RoPE angles come from ``kvreuse.kernels.rerotate`` (float64, rounded
to float32), so a full prefill here equals Hugging Face's within float32 rounding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from kvreuse.kernels.rerotate import RopeSpec, rope_spec_from_hf_config, rotation_angles
from kvreuse.modules.splice import Piece, piece_kv
from kvreuse.modules.store import EncodedModule


@dataclass
class KVCache:
    """Keys (rotated at ``positions``) and values of a sequence's tokens, every layer, in sequence order.

    ``keys``/``values``: ``[layers, tokens, kv_heads, head_dim]``; ``positions``: ``[tokens]`` int64 RoPE positions
    (contiguous for kvreuse's prompts; APE's parallel layout reuses them); ``token_ids``: ``[tokens]`` int64, what
    a recomputation starts from.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    token_ids: torch.Tensor

    def __len__(self) -> int:
        return self.keys.shape[1]

    def slice(self, start: int, stop: int) -> KVCache:
        return KVCache(
            self.keys[:, start:stop], self.values[:, start:stop], self.positions[start:stop], self.token_ids[start:stop]
        )

    @staticmethod
    def cat(parts: Sequence[KVCache]) -> KVCache:
        return KVCache(
            torch.cat([p.keys for p in parts], 1),
            torch.cat([p.values for p in parts], 1),
            torch.cat([p.positions for p in parts]),
            torch.cat([p.token_ids for p in parts]),
        )


# Share of one token-layer's weight multiply-adds spent on the key and value projections alone (SmolLM2-135M:
# hidden 576, 3 KV heads of 64, MLP 1536: 2 * 576 * 192 of 576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536).
def kv_only_share(hidden: int, kv_dim: int, q_dim: int, intermediate: int) -> float:
    kv = 2 * hidden * kv_dim
    return kv / (hidden * (q_dim + 2 * kv_dim) + q_dim * hidden + 3 * hidden * intermediate)


KV_ONLY_SHARE = kv_only_share(576, 192, 576, 1536)


@dataclass
class Compute:
    """Token-layers computed: ``full`` (attention and MLP) and ``kv_only`` (key and value projections alone)."""

    full: int = 0
    kv_only: int = 0

    def token_layers(self) -> float:
        return self.full + KV_ONLY_SHARE * self.kv_only

    def add(self, other: Compute) -> None:
        self.full += other.full
        self.kv_only += other.kv_only


class Recompute(Protocol):
    """Which cached tokens a forward pass computes again, layer by layer."""

    def start(self, cache: KVCache) -> torch.Tensor:
        """Sorted cache indices computed from layer 0 on."""
        ...

    def keep(
        self, layer: int, index: torch.Tensor, fresh: tuple[torch.Tensor, torch.Tensor], cache: KVCache
    ) -> torch.Tensor | None:
        """Before ``layer``'s attention, with the fresh keys and values of the tokens ``index`` still computed:
        a bool mask of those that go on (the others' fresh KV is written, then they stop), or ``None`` for all."""
        ...

    def joining(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Cache indices that join the computation at ``layer``, and their hidden states there (``None``: none)."""
        ...


@dataclass(frozen=True)
class FixedTokens:
    """The same cache indices in every layer (LegoLink's first tokens of each module, a whole module, ...)."""

    index: torch.Tensor

    def start(self, cache: KVCache) -> torch.Tensor:
        return torch.unique(self.index)

    def keep(self, layer, index, fresh, cache) -> None:
        return None

    def joining(self, layer: int) -> None:
        return None


@dataclass(frozen=True)
class ResumedTokens:
    """Tokens that join at ``layer`` with given hidden states (a module's own, kept from encoding it alone) and
    are computed from there on with full attention: the late layers recomputed without the early ones."""

    index: torch.Tensor
    layer: int
    hidden: torch.Tensor  # [len(index), hidden_size]

    def start(self, cache: KVCache) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64)

    def keep(self, layer, index, fresh, cache) -> None:
        return None

    def joining(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return (self.index, self.hidden) if layer == self.layer else None


@dataclass(frozen=True)
class KVDeviation:
    """CacheBlend's selection (Yao et al., "CacheBlend: Fast Large Language Model Serving for RAG with Cached
    Knowledge Fusion", EuroSys 2025): every ``candidates`` token is computed in layer 0 (whose KV the splice already
    has exactly; the pass gives their hidden states), then at each layer of ``ratios`` only the tokens whose fresh
    keys and values deviate most from the cached ones (squared L2 over heads, keys and values each normalised by
    their mean squared norm) go on, ``ratios[layer]`` of ``candidates`` in all.

    ``ratios = {1: 0.15}``: pick once on layer 1 (the first layer whose KV differs); ``{1: 0.3, 2: 0.2, 3: 0.15}``:
    CacheBlend's gradual filtering; ``{2: 0.15}``: every candidate computed exactly through layers 0 and 1, then the
    pick on layer 2. ``forced`` (cache indices among the candidates, e.g. LegoLink's first tokens) always go on, on
    top of the ratio's count (the union of both choices). Ties go to the earlier token.
    """

    candidates: torch.Tensor
    ratios: dict[int, float]
    forced: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))

    def start(self, cache: KVCache) -> torch.Tensor:
        return torch.unique(self.candidates)

    def keep(self, layer, index, fresh, cache) -> torch.Tensor | None:
        if layer not in self.ratios:
            return None
        k, v = fresh
        dk = (k - cache.keys[layer, index]).pow(2).sum((1, 2)) / cache.keys[layer, index].pow(2).sum((1, 2)).mean()
        dv = (v - cache.values[layer, index]).pow(2).sum((1, 2)) / cache.values[layer, index].pow(2).sum((1, 2)).mean()
        score = (dk + dv).double()
        forced = torch.isin(index, self.forced)
        score[forced] = math.inf
        count = min(len(index), int(forced.sum()) + max(0, round(self.ratios[layer] * len(self.candidates))))
        order = sorted(range(len(index)), key=lambda i: (-float(score[i]), i))
        mask = torch.zeros(len(index), dtype=torch.bool)
        mask[order[:count]] = True
        return mask

    def joining(self, layer: int) -> None:
        return None


@dataclass(frozen=True)
class ApeBias:
    """APE's attention over spliced keys (Yang, Chen, Chen, "APE: Faster and Longer Context-Augmented Generation
    via Adaptive Parallel Encoding", ICLR 2025), for new tokens (the question, decoded tokens):
    ``logit = q.k / (sqrt(d) * temperature) + log(scale)`` for keys at ``columns`` (cache indices of module
    tokens), plain ``q.k / sqrt(d)`` elsewhere. A temperature below 1 sharpens the attention among module tokens;
    a scale multiplies their attention mass against the prefix and the new tokens.

    Both fold into the keys and one additive bias: keys at ``columns`` divided by ``temperature``, ``log(scale)``
    added to their logits; ``temperature = scale = 1`` is plain attention. ``hidden`` (cache indices) are not
    attended to at all by new tokens (e.g. the attention sinks of modules encoded alone).
    """

    columns: torch.Tensor  # cache indices
    temperature: float = 1.0
    scale: float = 1.0
    hidden: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))


@dataclass
class PassResult:
    """What one forward pass gives: the cache with the new tokens appended (recomputed entries replaced), the
    last new token's logits, the compute spent, and (when probed) per layer the new tokens' attention mass on each
    cache entry, summed over heads and new tokens."""

    cache: KVCache
    logits: torch.Tensor
    compute: Compute
    attention_mass: torch.Tensor | None = None
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # new tokens' hidden states at captured layers


@dataclass
class Generation:
    tokens: list[int]
    first_logits: torch.Tensor
    compute: Compute = field(default_factory=Compute)  # prefill only (the decode is the same for every method)


@dataclass(frozen=True)
class _Layer:
    ln_in: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    ln_post: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class ReferenceLlama:
    """A Hugging Face ``LlamaForCausalLM``'s weights, run layer by layer over a :class:`KVCache`."""

    def __init__(self, model):
        config = model.config
        self.spec: RopeSpec = rope_spec_from_hf_config(config.to_dict())
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.eps = config.rms_norm_eps
        inner = model.model
        self.embed = inner.embed_tokens.weight.detach()
        self.norm = inner.norm.weight.detach()
        self.lm_head = model.lm_head.weight.detach()
        self.layers = [
            _Layer(
                layer.input_layernorm.weight.detach(),
                layer.self_attn.q_proj.weight.detach(),
                layer.self_attn.k_proj.weight.detach(),
                layer.self_attn.v_proj.weight.detach(),
                layer.self_attn.o_proj.weight.detach(),
                layer.post_attention_layernorm.weight.detach(),
                torch.cat([layer.mlp.gate_proj.weight.detach(), layer.mlp.up_proj.weight.detach()]),
                layer.mlp.down_proj.weight.detach(),
            )
            for layer in inner.layers
        ]

    # -- pieces -------------------------------------------------------------------------------------------------
    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = self.head_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    def _angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rotation_angles(self.spec, positions)
        return cos.to(torch.float32)[:, None, :], sin.to(torch.float32)[:, None, :]

    def empty_cache(self) -> KVCache:
        shape = (self.num_layers, 0, self.num_kv_heads, self.head_dim)
        none = torch.empty(0, dtype=torch.int64)
        return KVCache(torch.empty(shape), torch.empty(shape), none, none)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._rms(hidden, self.norm) @ self.lm_head.T

    # -- the pass -----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        cache: KVCache,
        new_ids: Sequence[int],
        new_positions: Sequence[int] | torch.Tensor,
        *,
        recompute: Recompute | None = None,
        ape: ApeBias | None = None,
        probe: bool = False,
        layers: int | None = None,
        capture: Sequence[int] = (),
    ) -> PassResult:
        """Compute ``new_ids`` at ``new_positions`` after ``cache`` (which is not modified), recomputing the cached
        tokens ``recompute`` chooses; new tokens see every cache entry and the new tokens before them.
        ``capture``: keep the new tokens' hidden states at the input of these layers (:attr:`PassResult.hidden`).

        ``probe``: record the new tokens' attention mass (:attr:`PassResult.attention_mass`); ``layers``: stop after
        that many layers (a probe that looks at the first layers only; the logits are then meaningless)."""
        n_old, n_new = len(cache), len(new_ids)
        total = n_old + n_new
        positions = torch.cat([cache.positions, torch.as_tensor(new_positions, dtype=torch.int64)])
        token_ids = torch.cat([cache.token_ids, torch.as_tensor(list(new_ids), dtype=torch.int64)])
        keys = torch.empty(self.num_layers, total, self.num_kv_heads, self.head_dim)
        values = torch.empty_like(keys)
        keys[:, :n_old], values[:, :n_old] = cache.keys, cache.values
        out = KVCache(keys, values, positions, token_ids)
        active = recompute.start(cache) if recompute is not None else torch.empty(0, dtype=torch.int64)
        new_index = torch.arange(n_old, total)
        hidden = self.embed[token_ids[torch.cat([active, new_index])]]
        ape_keys = None
        if ape is not None:
            ape_keys = torch.ones(total)
            ape_keys[ape.columns] = 1.0 / ape.temperature
        compute = Compute()
        mass = torch.zeros(self.num_layers, total) if probe else None
        captured: dict[int, torch.Tensor] = {}
        for layer_no, w in enumerate(self.layers[:layers]):
            if layer_no in capture:
                captured[layer_no] = hidden[len(active) :].clone()
            joining = recompute.joining(layer_no) if recompute is not None else None
            if joining is not None:
                hidden = torch.cat([hidden[: len(active)], joining[1], hidden[len(active) :]])
                active = torch.cat([active, joining[0]])
            rows = torch.cat([active, new_index])
            cos, sin = self._angles(positions[rows])
            x = self._rms(hidden, w.ln_in)
            q = self._rope((x @ w.q.T).view(len(rows), self.num_heads, self.head_dim), cos, sin)
            k = self._rope((x @ w.k.T).view(len(rows), self.num_kv_heads, self.head_dim), cos, sin)
            v = (x @ w.v.T).view(len(rows), self.num_kv_heads, self.head_dim)
            keys[layer_no, rows], values[layer_no, rows] = k, v
            if recompute is not None and len(active):
                kept = recompute.keep(layer_no, active, (k[: len(active)], v[: len(active)]), cache)
                if kept is not None:
                    compute.kv_only += int((~kept).sum())
                    keep_rows = torch.cat([kept, torch.ones(n_new, dtype=torch.bool)])
                    active, rows = active[kept], rows[keep_rows]
                    q, hidden = q[keep_rows], hidden[keep_rows]
            compute.full += len(rows)
            attn = self._attend(layer_no, q, rows, out, n_old, ape, ape_keys, mass)
            hidden = hidden + attn.reshape(len(rows), -1) @ w.o.T
            x = self._rms(hidden, w.ln_post)
            gate, up = (x @ w.gate_up.T).chunk(2, -1)
            hidden = hidden + (F.silu(gate) * up) @ w.down.T
        return PassResult(out, self.logits(hidden[-1]), compute, mass, captured)

    def _attend(
        self,
        layer: int,
        q: torch.Tensor,
        rows: torch.Tensor,
        cache: KVCache,
        n_old: int,
        ape: ApeBias | None,
        ape_keys: torch.Tensor | None,
        mass: torch.Tensor | None,
    ) -> torch.Tensor:
        """Causal attention of the query ``rows`` over ``cache`` (entry ``j`` visible to row ``i`` iff ``j <= i``);
        APE and the probe apply to the new tokens' rows only."""
        keys, values = cache.keys[layer], cache.values[layer]
        total = keys.shape[0]
        visible = torch.arange(total)[None, :] <= rows[:, None]
        is_new = rows >= n_old
        out = torch.empty(len(rows), self.num_heads, self.head_dim)
        groups = [(~is_new, None), (is_new, ape)] if ape is not None or mass is not None else [(None, None)]
        for select, bias in groups:
            if select is not None and not bool(select.any()):
                continue
            qs = q if select is None else q[select]
            vis = visible if select is None else visible[select]
            k = keys
            mask = torch.zeros(vis.shape).masked_fill(~vis, float("-inf"))
            if bias is not None:
                k = keys * ape_keys[:, None, None]
                mask[:, bias.columns] += math.log(bias.scale)
                mask[:, bias.hidden] = float("-inf")
            if mass is not None and select is not None and select is is_new:
                scores = torch.einsum("rhd,nhd->hrn", qs, k.repeat_interleave(self.num_heads // self.num_kv_heads, 1))
                probs = torch.softmax(scores / math.sqrt(self.head_dim) + mask, -1)
                mass[layer] += probs.sum((0, 1))
                o = torch.einsum(
                    "hrn,nhd->rhd", probs, values.repeat_interleave(self.num_heads // self.num_kv_heads, 1)
                )
            else:
                o = F.scaled_dot_product_attention(
                    qs.transpose(0, 1)[None],
                    k.transpose(0, 1)[None],
                    values.transpose(0, 1)[None],
                    attn_mask=mask,
                    enable_gqa=True,
                )[0].transpose(0, 1)
            if select is None:
                out = o
            else:
                out[select] = o
        return out

    # -- whole requests -------------------------------------------------------------------------------------------
    def prefill(
        self,
        cache: KVCache,
        new_ids: Sequence[int],
        *,
        recompute: Recompute | None = None,
        ape: ApeBias | None = None,
        probe: bool = False,
        layers: int | None = None,
    ) -> PassResult:
        """:meth:`forward` with ``new_ids`` at the positions after the cache's highest."""
        start = int(cache.positions.max()) + 1 if len(cache) else 0
        positions = torch.arange(start, start + len(new_ids))
        return self.forward(cache, new_ids, positions, recompute=recompute, ape=ape, probe=probe, layers=layers)

    def generate(
        self,
        cache: KVCache,
        new_ids: Sequence[int],
        *,
        max_new_tokens: int,
        eos: int | None = None,
        recompute: Recompute | None = None,
        ape: ApeBias | None = None,
    ) -> Generation:
        """Greedy tokens after ``cache`` and ``new_ids``, stopping after ``eos``; ``recompute`` and ``ape`` apply to
        the prefill, ``ape`` to the decode too."""
        result = self.prefill(cache, new_ids, recompute=recompute, ape=ape)
        (tokens,) = self.decode([(result, ape)], max_new_tokens=max_new_tokens, eos=eos)
        return Generation(tokens, result.logits, result.compute)

    @torch.inference_mode()
    def decode(
        self, prefilled: Sequence[tuple[PassResult, ApeBias | None]], *, max_new_tokens: int, eos: int | None = None
    ) -> list[list[int]]:
        """Greedy decoding of several prefilled sequences at once (one weight pass per step for all of them;
        attention per sequence over its own cache and bias). Each sequence's first token is its prefill's argmax;
        it stops after ``eos`` or ``max_new_tokens`` tokens."""
        states = [_Decoding.start(self, result, ape, max_new_tokens) for result, ape in prefilled]
        while True:
            running = [s for s in states if len(s.tokens) < max_new_tokens and s.tokens[-1] != eos]
            if not running:
                return [s.tokens for s in states]
            positions = torch.tensor([s.position for s in running])
            cos, sin = self._angles(positions)
            hidden = self.embed[torch.tensor([s.tokens[-1] for s in running])]
            for layer_no, w in enumerate(self.layers):
                x = self._rms(hidden, w.ln_in)
                q = self._rope((x @ w.q.T).view(len(running), self.num_heads, self.head_dim), cos, sin)
                k = self._rope((x @ w.k.T).view(len(running), self.num_kv_heads, self.head_dim), cos, sin)
                v = (x @ w.v.T).view(len(running), self.num_kv_heads, self.head_dim)
                attn = torch.stack([s.attend(layer_no, q[i], k[i], v[i]) for i, s in enumerate(running)])
                hidden = hidden + attn.reshape(len(running), -1) @ w.o.T
                x = self._rms(hidden, w.ln_post)
                gate, up = (x @ w.gate_up.T).chunk(2, -1)
                hidden = hidden + (F.silu(gate) * up) @ w.down.T
            for state, token in zip(running, self.logits(hidden).argmax(-1).tolist()):
                state.advance(token)

    def encode(self, token_ids: Sequence[int], context: KVCache | None = None) -> KVCache:
        """KV of ``token_ids`` computed after ``context`` (alone when ``None``), at the positions that follow it."""
        return self.encode_with_hidden(token_ids, context)[0]

    def encode_with_hidden(
        self, token_ids: Sequence[int], context: KVCache | None = None, capture: Sequence[int] = ()
    ) -> tuple[KVCache, dict[int, torch.Tensor]]:
        """:meth:`encode`, and the tokens' hidden states at the input of the layers ``capture``."""
        context = context if context is not None else self.empty_cache()
        start = int(context.positions.max()) + 1 if len(context) else 0
        result = self.forward(context, token_ids, torch.arange(start, start + len(token_ids)), capture=capture)
        return result.cache.slice(len(context), len(result.cache)), result.hidden


def as_module(name: str, kv: KVCache) -> EncodedModule:
    """A reference encoding as kvreuse stores it (keys as encoded at the module's first position)."""
    return EncodedModule(
        name,
        "reference",
        "reference",
        tuple(kv.token_ids.tolist()),
        int(kv.positions[0]),
        torch.stack([kv.keys, kv.values], 1),
    )


def splice(prefix: KVCache, modules: Sequence[EncodedModule], spec: RopeSpec) -> KVCache:
    """The cache kvreuse assembles: ``prefix``, then each module's KV moved to the positions that follow
    (``kvreuse.modules.splice.piece_kv``: keys re-rotated by the float64 reference, values as stored)."""
    parts, position = [prefix], int(prefix.positions.max()) + 1 if len(prefix) else 0
    for module in modules:
        length = len(module.token_ids)
        moved = list(piece_kv(module, Piece(module.name, 0, position, length), spec, "cpu"))
        parts.append(
            KVCache(
                torch.stack([k for k, _ in moved]),
                torch.stack([v for _, v in moved]),
                torch.arange(position, position + length),
                torch.tensor(module.token_ids),
            )
        )
        position += length
    return KVCache.cat(parts)


def stack_parallel(prefix: KVCache, modules: Sequence[EncodedModule]) -> KVCache:
    """APE's layout: ``prefix``, then every module at the positions it was encoded at (all after the prefix, so
    they share positions); what follows continues after the longest."""
    parts = [prefix]
    for module in modules:
        length = len(module.token_ids)
        parts.append(
            KVCache(
                module.kv[:, 0],
                module.kv[:, 1],
                torch.arange(module.start, module.start + length),
                torch.tensor(module.token_ids),
            )
        )
    return KVCache.cat(parts)


@dataclass
class _Decoding:
    """One sequence being decoded: its cache with room for the new tokens, and APE's bias over it."""

    keys: torch.Tensor  # [layers, capacity, kv_heads, head_dim]
    values: torch.Tensor
    length: int
    position: int
    key_scale: torch.Tensor  # [capacity]: 1 / temperature on module keys, else 1
    logit_bias: torch.Tensor  # [capacity]: log(scale) on module keys, -inf on hidden ones, else 0
    tokens: list[int]

    @staticmethod
    def start(model: ReferenceLlama, result: PassResult, ape: ApeBias | None, room: int) -> _Decoding:
        cache = result.cache
        n = len(cache)
        shape = (model.num_layers, n + room, model.num_kv_heads, model.head_dim)
        keys, values = torch.empty(shape), torch.empty(shape)
        keys[:, :n], values[:, :n] = cache.keys, cache.values
        key_scale, logit_bias = torch.ones(n + room), torch.zeros(n + room)
        if ape is not None:
            key_scale[ape.columns] = 1.0 / ape.temperature
            logit_bias[ape.columns] = math.log(ape.scale)
            logit_bias[ape.hidden] = float("-inf")
        position = int(cache.positions.max()) + 1
        return _Decoding(keys, values, n, position, key_scale, logit_bias, [int(result.logits.argmax())])

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write this step's key and value, then attend (``q``: ``[heads, head_dim]``) over the whole cache."""
        self.keys[layer, self.length], self.values[layer, self.length] = k, v
        n = self.length + 1
        keys = self.keys[layer, :n] * self.key_scale[:n, None, None]
        out = F.scaled_dot_product_attention(
            q[:, None, :][None],
            keys.transpose(0, 1)[None],
            self.values[layer, :n].transpose(0, 1)[None],
            attn_mask=self.logit_bias[:n][None, :],
            enable_gqa=True,
        )
        return out[0, :, 0]

    def advance(self, token: int) -> None:
        self.tokens.append(token)
        self.length += 1
        self.position += 1
