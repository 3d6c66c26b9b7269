"""Re-apply RoPE to cached keys: a key stored for position ``p`` becomes the key for position ``p + delta``.

RoPE (Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", 2021) rotates each pair of a
key's first ``rotary_dim`` coordinates by the angle ``p * inv_freq[i]``. Rotations of one plane compose by adding
angles, ``R(p + delta) = R(delta) R(p)``, so a key cached at ``p`` moves to ``p + delta`` with ``K_new =
R(delta) K`` and no recomputation; values carry no position and are untouched. This is what lets the module cache
(Gim et al., "Prompt Cache: Modular Attention Reuse for Low-Latency Inference", MLSys 2024) splice a module's KV
cache at a position other than the one it was encoded at.

Layouts of the pairs: NeoX / Llama (``rotate_half``): coordinate ``i`` pairs with ``i + rotary_dim / 2``; GPT-J
(interleaved): ``2i`` with ``2i + 1``. Coordinates ``rotary_dim..head_dim`` (partial rotary, e.g. GPT-J, Phi)
are copied unchanged. The rotation is Hugging Face's ``x * cos + rotate_half(x) * sin``.

Frequencies: ``inv_freq[i] = theta ** (-2i / rotary_dim)`` in float64, then, by ``rope_type``:

* ``default``: as is;
* ``linear`` (position interpolation, Chen et al., 2023): ``inv_freq / factor``;
* ``llama3``: the frequency-dependent scaling of Meta's Llama 3.1 (``apply_scaling`` in
  ``meta-llama/llama-models``, ``models/llama3/reference_impl/model.py``; the same as ``_compute_llama3_parameters``
  in ``transformers``): wavelengths ``2 pi / inv_freq`` longer than ``original_max_position_embeddings /
  low_freq_factor`` are divided by ``factor``, shorter than ``original_max_position_embeddings /
  high_freq_factor`` are kept, and in between ``(1 - s) * inv_freq / factor + s * inv_freq`` with ``s =
  (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)``.

All three depend on the position only through ``p * inv_freq``, so re-rotation by ``delta`` is exact. Encodings
for which that fails are refused with :class:`UnsupportedPositionalEncoding`: dynamic NTK (the frequencies
depend on the current sequence length), YaRN and LongRoPE (an attention factor multiplies cos and sin, and
LongRoPE switches factors by length), ALiBi and learned or absent position embeddings (there is no rotation to
undo).

The angles ``delta * inv_freq`` are computed on the host in float64 (``plan``), once per move, and shared by all
layers; in fp32, a delta of 10^5 would already be off by ~10^-2 rad. The kernel (``run``) rotates in fp32 and
stores in the keys' dtype (fp16, bf16 or fp32).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from kvreuse.errors import RerotationMismatch, UnsupportedPositionalEncoding
from kvreuse.errors import check_kernel_argument as _check
from kvreuse.kernels import SUPPORTED_DTYPES

ROPE_TYPES = ("default", "linear", "llama3")


# Families whose Hugging Face configs use NeoX-style RoPE without always naming rope_theta (default 10000).
_ROPE_MODEL_TYPES = {
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen3",
    "qwen2_moe",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "phi3",
    "olmo",
    "olmo2",
    "granite",
    "internlm2",
    "deepseek",
    "yi",
    "stablelm",
    "gpt_neox",
    "starcoder2",
    "cohere",
    "phi",
    "gptj",
    "codegen",
}
# Families with interleaved (GPT-J) pairs.
_INTERLEAVED_MODEL_TYPES = {"gptj", "codegen"}
# Families without rotary embeddings: ALiBi or learned absolute positions.
_NO_ROPE_MODEL_TYPES = {
    "bloom": "ALiBi",
    "mpt": "ALiBi",
    "gpt2": "learned absolute positions",
    "opt": "learned absolute positions",
    "gpt_bigcode": "learned absolute positions",
    "bert": "learned absolute positions",
}


@dataclass(frozen=True)
class RopeSpec:
    """Everything that determines a model's key rotation.

    ``rotary_dim`` (even, ``<= head_dim``) leading coordinates are rotated; ``interleaved`` selects GPT-J pairs
    ``(2i, 2i+1)`` over NeoX pairs ``(i, i + rotary_dim/2)``. ``rope_type`` is one of :data:`ROPE_TYPES`;
    ``factor``, ``low_freq_factor``, ``high_freq_factor`` and ``original_max_position_embeddings`` are the
    scaling parameters (unused by ``default``).
    """

    head_dim: int
    rotary_dim: int
    theta: float = 10000.0
    interleaved: bool = False
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise UnsupportedPositionalEncoding(
                f"rope_type {self.rope_type!r} cannot be re-applied to cached keys; supported: {', '.join(ROPE_TYPES)}"
            )
        if not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise UnsupportedPositionalEncoding(
                f"rotary_dim must be even and in 1..head_dim ({self.head_dim}), got {self.rotary_dim}"
            )
        if self.theta <= 0 or self.factor <= 0:
            raise UnsupportedPositionalEncoding(f"rope theta and factor must be > 0, got {self.theta}, {self.factor}")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise UnsupportedPositionalEncoding(
                f"llama3 RoPE needs high_freq_factor > low_freq_factor > 0, got {self.high_freq_factor}, "
                f"{self.low_freq_factor}"
            )

    def inv_freq(self) -> torch.Tensor:
        """``[rotary_dim / 2]`` float64 frequencies after scaling (see the module docstring)."""
        inv_freq = self.theta ** -(torch.arange(0, self.rotary_dim, 2, dtype=torch.float64) / self.rotary_dim)
        if self.rope_type == "linear":
            return inv_freq / self.factor
        if self.rope_type == "llama3":
            old = self.original_max_position_embeddings
            low_wavelen, high_wavelen = old / self.low_freq_factor, old / self.high_freq_factor
            wavelen = 2 * math.pi / inv_freq
            scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
            smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            return torch.where(medium, smoothed, scaled)
        return inv_freq


def rope_spec_from_hf_config(config: Mapping[str, Any]) -> RopeSpec:
    """Read a Hugging Face ``config.json`` dict; refuse an encoding that cannot be re-applied, saying why.

    Reads ``head_dim`` (or ``hidden_size / num_attention_heads``), ``partial_rotary_factor`` or ``rotary_dim``,
    ``rope_theta`` and ``rope_scaling`` (transformers 4) or ``rope_parameters`` (transformers 5).
    """
    model_type = str(config.get("model_type", ""))
    if config.get("alibi") or config.get("position_embedding_type") == "alibi":
        raise UnsupportedPositionalEncoding(
            f"{model_type or 'this model'} uses ALiBi: there is no rotation to re-apply"
        )
    if model_type in _NO_ROPE_MODEL_TYPES:
        raise UnsupportedPositionalEncoding(
            f"{model_type} uses {_NO_ROPE_MODEL_TYPES[model_type]}: there is no rotation to re-apply"
        )
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if params and all(isinstance(v, Mapping) for v in params.values()):
        raise UnsupportedPositionalEncoding(
            f"per-layer-type RoPE parameters ({', '.join(params)}) are not supported: one rotation per model only"
        )
    theta = params.get("rope_theta", config.get("rope_theta", config.get("rotary_emb_base")))
    if theta is None and not params and "rotary_dim" not in config and model_type not in _ROPE_MODEL_TYPES:
        raise UnsupportedPositionalEncoding(
            f"no rotary positional encoding found in the config of {model_type or 'this model'} (no rope_theta, "
            "rope_scaling, rope_parameters or rotary_dim): modules of a model without RoPE cannot be moved"
        )
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        why = {
            "dynamic": "dynamic NTK scaling changes the frequencies with the sequence length",
            "yarn": "YaRN multiplies cos and sin by an attention factor, so rotations do not compose",
            "longrope": "LongRoPE switches frequencies with the sequence length",
            "su": "LongRoPE switches frequencies with the sequence length",
            "mrope": "multimodal RoPE rotates by several position ids",
        }.get(rope_type, "it is not implemented")
        raise UnsupportedPositionalEncoding(
            f"RoPE scaling {rope_type!r} cannot be re-applied to cached keys: {why}; supported: {', '.join(ROPE_TYPES)}"
        )
    hidden = config.get("hidden_size", config.get("n_embd"))
    heads = config.get("num_attention_heads", config.get("n_head"))
    if not config.get("head_dim") and not (hidden and heads):
        raise UnsupportedPositionalEncoding(
            "the config gives neither head_dim nor hidden_size and num_attention_heads: cannot tell the key size"
        )
    head_dim = config.get("head_dim") or hidden // heads
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", config.get("rotary_pct")))
    rotary_dim = config.get("rotary_dim") or (int(head_dim * partial) if partial is not None else head_dim)
    extra = {}
    if rope_type in ("linear", "llama3"):
        extra["factor"] = float(params["factor"])
    if rope_type == "llama3":
        extra.update(
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    return RopeSpec(
        head_dim=int(head_dim),
        rotary_dim=int(rotary_dim),
        theta=float(theta or 10000.0),
        interleaved=model_type in _INTERLEAVED_MODEL_TYPES or bool(config.get("rope_interleaved")),
        rope_type=rope_type,
        **extra,
    )


# ----------------------------------------------------------------------------------------------------------------
# Kernel


@triton.jit
def _rerotate_kernel(
    k_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    num_heads,
    stride_kt,
    stride_kh,
    stride_ot,
    stride_oh,
    HALF: tl.constexpr,  # rotary_dim / 2: pairs per head
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # heads per program: a module moves all KV heads of a token by the same angle
    BLOCK_R: tl.constexpr,  # next power of two >= HALF
    BLOCK_TAIL: tl.constexpr,  # next power of two >= HEAD_DIM - 2 * HALF (the unrotated coordinates), >= 1
    INTERLEAVED: tl.constexpr,
    COPY_TAIL: tl.constexpr,  # out is not the keys: copy the unrotated coordinates
):
    # One program per (token, block of heads): out[t, h, pair] = R(angle_t[i]) k[t, h, pair].
    token, hblock = tl.program_id(0), tl.program_id(1)
    h = hblock * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_R)
    if INTERLEAVED:
        i1, i2 = 2 * i, 2 * i + 1
    else:
        i1, i2 = i, i + HALF
    cos = tl.load(cos_ptr + token * HALF + i, mask=i < HALF, other=1.0)[None, :]
    sin = tl.load(sin_ptr + token * HALF + i, mask=i < HALF, other=0.0)[None, :]
    mask = (h < num_heads)[:, None] & (i < HALF)[None, :]
    k_row = k_ptr + token.to(tl.int64) * stride_kt + h[:, None] * stride_kh
    o_row = out_ptr + token.to(tl.int64) * stride_ot + h[:, None] * stride_oh
    x1 = tl.load(k_row + i1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(k_row + i2[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(o_row + i1[None, :], (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_row + i2[None, :], (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    if COPY_TAIL:
        j = 2 * HALF + tl.arange(0, BLOCK_TAIL)
        tail_mask = (h < num_heads)[:, None] & (j < HEAD_DIM)[None, :]
        tl.store(o_row + j[None, :], tl.load(k_row + j[None, :], mask=tail_mask), mask=tail_mask)


# ----------------------------------------------------------------------------------------------------------------
# PyTorch references


def rotation_angles(spec: RopeSpec, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of ``positions[:, None] * inv_freq``, ``[num_tokens, rotary_dim / 2]`` float64."""
    angles = positions.to(torch.float64).cpu()[:, None] * spec.inv_freq()[None, :]
    return angles.cos(), angles.sin()


def _rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    x64 = x.to(torch.float64).cpu()
    half = spec.rotary_dim // 2
    if spec.interleaved:
        x1, x2 = x64[..., 0 : spec.rotary_dim : 2], x64[..., 1 : spec.rotary_dim : 2]
    else:
        x1, x2 = x64[..., :half], x64[..., half : spec.rotary_dim]
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    out = x64.clone()
    if spec.interleaved:
        out[..., 0 : spec.rotary_dim : 2], out[..., 1 : spec.rotary_dim : 2] = y1, y2
    else:
        out[..., :half], out[..., half : spec.rotary_dim] = y1, y2
    return out


def apply_rope_reference(x: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """RoPE of ``x[num_tokens, num_heads, head_dim]`` at ``positions[num_tokens]``, float64 (as a model would)."""
    return _rotate_reference(x, *rotation_angles(spec, positions), spec)


def rerotate_keys_reference(keys: torch.Tensor, deltas: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """``keys[num_tokens, num_heads, head_dim]`` moved by ``deltas[num_tokens]`` positions, float64."""
    return apply_rope_reference(keys, deltas, spec)


# ----------------------------------------------------------------------------------------------------------------
# Launcher


class KeyRerotation:
    """Moves cached keys of one model by per-token position deltas.

    ``plan(deltas)`` once per move (the angles, float64 on the host, shared by every layer), then per layer
    ``run(keys, out=None)``: ``keys[num_tokens, num_kv_heads, head_dim]`` (rows contiguous, any token and head
    strides, e.g. a slice of a KV cache); ``out`` defaults to a new tensor and may be ``keys`` itself (in place).
    """

    def __init__(self, spec: RopeSpec):
        self.spec = spec
        self._plan: tuple[torch.Tensor, torch.Tensor] | None = None

    def plan(self, deltas: torch.Tensor, *, device: torch.device | str | None = None) -> None:
        """Fix the per-token deltas (``[num_tokens]`` integers, any sign) of the next ``run`` calls."""
        _check(
            deltas.dim() == 1 and not deltas.is_floating_point() and not deltas.is_complex(),
            f"deltas must be a 1-D integer tensor, got {tuple(deltas.shape)} {deltas.dtype}",
        )
        cos, sin = rotation_angles(self.spec, deltas)
        device = deltas.device if device is None else device
        self._plan = (cos.to(torch.float32).to(device).contiguous(), sin.to(torch.float32).to(device).contiguous())

    def run(self, keys: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Keys rotated by the planned deltas, in ``out`` (a new tensor unless given)."""
        _check(self._plan is not None, "KeyRerotation.run called before plan(deltas)")
        cos, sin = self._plan
        spec = self.spec
        _check(
            keys.dim() == 3 and keys.shape[0] == cos.shape[0] and keys.shape[2] == spec.head_dim,
            f"keys must be [num_tokens={cos.shape[0]}, num_kv_heads, head_dim={spec.head_dim}], got {list(keys.shape)}",
        )
        _check(keys.dtype in SUPPORTED_DTYPES, f"keys must be fp16, bf16 or fp32, got {keys.dtype}")
        _check(keys.stride(2) == 1, f"keys must have contiguous rows (last stride 1), got strides {keys.stride()}")
        _check(keys.device == cos.device, f"keys are on {keys.device} but deltas were planned on {cos.device}")
        if out is None:
            out = torch.empty_like(keys)
        _check(
            out.shape == keys.shape and out.dtype == keys.dtype and out.stride(2) == 1 and out.device == keys.device,
            f"out must be {list(keys.shape)} {keys.dtype} on {keys.device} with contiguous rows, "
            f"got {list(out.shape)} {out.dtype} on {out.device}",
        )
        num_tokens, num_heads = keys.shape[0], keys.shape[1]
        if num_tokens == 0 or num_heads == 0:
            return out
        block_h = min(16, triton.next_power_of_2(num_heads))
        half, tail = spec.rotary_dim // 2, spec.head_dim - spec.rotary_dim
        _rerotate_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
            keys,
            out,
            cos,
            sin,
            num_heads,
            keys.stride(0),
            keys.stride(1),
            out.stride(0),
            out.stride(1),
            HALF=half,
            HEAD_DIM=spec.head_dim,
            BLOCK_H=block_h,
            BLOCK_R=triton.next_power_of_2(half),
            BLOCK_TAIL=triton.next_power_of_2(max(tail, 1)),
            INTERLEAVED=spec.interleaved,
            COPY_TAIL=tail > 0 and out.data_ptr() != keys.data_ptr(),
        )
        return out


def rerotate_keys(
    keys: torch.Tensor, deltas: torch.Tensor, spec: RopeSpec, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """One-shot :class:`KeyRerotation`: ``keys`` moved by ``deltas`` positions (``K_new = R(delta) K``)."""
    rotation = KeyRerotation(spec)
    rotation.plan(deltas, device=keys.device)
    return rotation.run(keys, out=out)


def move_keys(keys: torch.Tensor, deltas: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """What engines call: ``keys`` moved by ``deltas``, in the keys' dtype, as a new tensor.

    On a GPU this is the Triton kernel. On CPU it is the float64 reference rounded to the keys' dtype: Triton's
    interpreter is far too slow inside an engine, and the reference is the kernel's own yardstick.
    """
    if keys.is_cuda:
        return rerotate_keys(keys, deltas, spec)
    return rerotate_keys_reference(keys, deltas, spec).to(keys.dtype)


# fp32 rotation then a rounding to the keys' dtype per move: two moves are within a few units in the last place.
_CHECK_TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def check_rerotation(
    config: Mapping[str, Any] | RopeSpec,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    num_kv_heads: int = 2,
    positions: tuple[int, int] = (37, 4093),
) -> RopeSpec:
    """Start-up check: refuse an encoding that cannot be re-applied, and test that moving works on ``device``
    (through :func:`move_keys`, the path an engine on that device takes).

    A key encoded at position 0 is moved to ``p1`` and then to ``p2``; it must equal the key encoded directly at
    ``p2`` (float64 reference) within the dtype's tolerance (relative to the largest coordinate). Returns the
    :class:`RopeSpec`; raises :class:`UnsupportedPositionalEncoding` or :class:`RerotationMismatch`.
    """
    spec = config if isinstance(config, RopeSpec) else rope_spec_from_hf_config(config)
    p1, p2 = positions
    gen = torch.Generator().manual_seed(0)
    raw = torch.randn(8, num_kv_heads, spec.head_dim, generator=gen, dtype=torch.float64)
    keys = raw.to(dtype).to(device)
    n = len(raw)
    moved = move_keys(keys, torch.full((n,), p1, dtype=torch.int64), spec)
    moved = move_keys(moved, torch.full((n,), p2 - p1, dtype=torch.int64), spec)
    direct = apply_rope_reference(keys, torch.full((n,), p2), spec)
    error = (moved.cpu().to(torch.float64) - direct).abs().max().item() / direct.abs().max().item()
    if not error <= _CHECK_TOLERANCE[dtype]:
        raise RerotationMismatch(
            f"moving keys 0 -> {p1} -> {p2} differs from encoding them at {p2} by {error:.2e} (relative) in {dtype} "
            f"on {device}, above the tolerance {_CHECK_TOLERANCE[dtype]:.0e}: module reuse would change answers"
        )
    return spec
