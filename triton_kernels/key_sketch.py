"""Key sketches for DIPR: every cached key also kept as 8-bit codes and one scale, from which a query gets an upper
and a lower bound on the key's logit while reading a quarter (fp32 cache) or half (fp16) of the key's bytes.

Why per token: on the real model (SmolLM2-135M, ``benchmarks/sparse_real_keys.py``) Quest's per-block box of
channel-wise maxima and minima lies 14-24 nats above the best logit of its block, in every layer, so at beta = 4
it excluded almost no block; a box per 8 tokens, a disc per RoPE pair, a per-head principal basis or leaving
each block's best token out did not change that. The box of 32 keys in 64 dimensions is far from every one of
them. An 8-bit code per token bounds each logit within ~0.1-0.5 nats and reads within a few points of the blocks
an oracle would read.

Layout (indexed like the key cache, see ``paged_layout.py``): ``codes[num_blocks, block_size, num_kv_heads,
head_dim]`` int8 and ``scales[num_blocks, block_size, num_kv_heads]`` fp32, any strides. In memory
(``sketch_strides``, what ``KeySketch.allocate`` and the vLLM backend's pages use) each block keeps its sketch KV
head by KV head; on a GPU a key's codes are contiguous (a kernel reads a token's row), on a CPU a channel's codes
are, for ``TOKEN_ROW``-token rows of the block (the compiled scan, ``kvreuse.sparse.lane_bounds``, bounds that many
tokens side by side, one per vector lane). For a stored key ``k`` (one KV head): ``s = max_c |k_c| / 127`` and
``u = floor(k / s + 1/2)`` (``u = 0`` where ``s = 0``), so ``|k_c - s u_c| <= s / 2``. For a query ``q`` (the
softmax scale folded in):

    s (q . u) - s ||q||_1 (1/2 + CODE_SLACK)  <=  q . k  <=  s (q . u) + s ||q||_1 (1/2 + CODE_SLACK)

``CODE_SLACK`` absorbs fp32 rounding (of ``k / s``, and of the ``head_dim``-term dot product ``q . u`` whose
terms are at most ``127 |q_c|``: relative ``head_dim * 2**-24``), so the bounds hold as computed, not only in real
arithmetic. Codes are per token and written with the token (``KeySketchWrite`` after each cache write), so a
block's sketch never goes stale: a rewritten slot gets its new key's code.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvreuse.errors import check_kernel_argument as _check
from kvreuse.kernels.paged_layout import check_cache_shape

CODE_MAX = 127  # int8 codes in [-127, 127]
# Slack on the half-step, in units of s ||q||_1: rounding of k / s (~2**-24 of a code, <= 127) and of the fp32 dot
# product q . u over head_dim <= 256 terms of size <= 127 |q_c| (256 * 127 * 2**-24 < 2e-3).
CODE_SLACK = 4e-3
TOKEN_ROW = 16  # a CPU layout's rows hold a multiple of this many tokens (kvreuse.sparse.lane_bounds.TOKEN_LANES)


@dataclass(frozen=True)
class SketchStrides:
    """Where a block's sketch lies (in elements of its own dtype): ``codes``' and ``scales``' strides, and the
    codes and scales one block takes (``block_codes``, ``block_scales``: their block strides)."""

    codes: tuple[int, int, int, int]
    scales: tuple[int, int, int]

    @property
    def block_codes(self) -> int:
        return self.codes[0]

    @property
    def block_scales(self) -> int:
        return self.scales[0]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's sketch: its int8 codes and fp32 scales."""
        return self.block_codes + 4 * self.block_scales


@functools.lru_cache(maxsize=64)  # asked once per layer and decode step; a pure function of a few ints
def sketch_strides(block_size: int, num_kv_heads: int, head_dim: int, device: torch.device | str) -> SketchStrides:
    """The sketch's layout for a cache on ``device``: per block, KV head by KV head; in a KV head, token by token
    with each key's codes contiguous on a GPU, channel by channel with each channel's tokens contiguous (in a row
    of ``block_size`` rounded up to ``TOKEN_ROW``) on a CPU, as the compiled CPU scan reads them."""
    if torch.device(device).type == "cpu":
        row = -(-block_size // TOKEN_ROW) * TOKEN_ROW
        return SketchStrides((num_kv_heads * head_dim * row, 1, head_dim * row, row), (num_kv_heads * row, 1, row))
    return SketchStrides(
        (num_kv_heads * block_size * head_dim, head_dim, block_size * head_dim, 1),
        (num_kv_heads * block_size, 1, block_size),
    )


@dataclass(frozen=True)
class KeySketch:
    """The codes and scales of a paged key cache (layouts in the module docstring)."""

    codes: torch.Tensor
    scales: torch.Tensor

    @staticmethod
    def allocate(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, device: torch.device | str
    ) -> KeySketch:
        """A zero sketch (every code 0, every scale 0: the bounds of an unwritten slot are 0), laid out as
        ``sketch_strides`` says for ``device``."""
        strides = sketch_strides(block_size, num_kv_heads, head_dim, device)
        codes = torch.zeros(num_blocks * strides.block_codes, dtype=torch.int8, device=device)
        scales = torch.zeros(num_blocks * strides.block_scales, dtype=torch.float32, device=device)
        return KeySketch(
            codes.as_strided((num_blocks, block_size, num_kv_heads, head_dim), strides.codes),
            scales.as_strided((num_blocks, block_size, num_kv_heads), strides.scales),
        )

    def check(self, key_cache: torch.Tensor) -> None:
        """The sketch fits ``key_cache``: same blocks, block size, heads and head size, same device."""
        _check(
            self.codes.dtype == torch.int8 and tuple(self.codes.shape) == tuple(key_cache.shape),
            f"sketch codes must be int8 {list(key_cache.shape)} like key_cache, got {self.codes.dtype} "
            f"{list(self.codes.shape)}",
        )
        _check(
            self.scales.dtype == torch.float32 and tuple(self.scales.shape) == tuple(key_cache.shape[:3]),
            f"sketch scales must be float32 {list(key_cache.shape[:3])}, got {self.scales.dtype} "
            f"{list(self.scales.shape)}",
        )
        _check(
            self.codes.device == key_cache.device and self.scales.device == key_cache.device,
            f"the sketch is on {self.codes.device}/{self.scales.device} but key_cache on {key_cache.device}",
        )


@triton.jit
def _sketch_written_keys_kernel(
    key_ptr,
    codes_ptr,
    scales_ptr,
    slot_ptr,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_cd,
    stride_sb,
    stride_st,
    stride_sh,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block (vLLM's page size)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM: one tile holds a whole key row
):
    # One program per (written token, KV head): the stored key's scale and codes. Negative slots are padding.
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        d = tl.arange(0, BLOCK_D)
        k = tl.load(
            key_ptr + block * stride_kb + offset * stride_kt + head * stride_kh + d, mask=d < HEAD_DIM, other=0.0
        ).to(tl.float32)
        # Correctly rounded divisions (div_rn), as PyTorch's: a GPU's fp32 `/` is approximate (within 2 ulp), which
        # left scales a unit in the last place off the reference on an H200.
        scale = tl.div_rn(tl.max(tl.abs(k), axis=0), 127.0)
        codes = tl.where(scale > 0, tl.floor(tl.div_rn(k, tl.where(scale > 0, scale, 1.0)) + 0.5), 0.0)
        codes = tl.minimum(tl.maximum(codes, -127.0), 127.0)
        tl.store(
            codes_ptr + block * stride_cb + offset * stride_ct + head * stride_ch + d * stride_cd,
            codes.to(tl.int8),
            mask=d < HEAD_DIM,
        )
        tl.store(scales_ptr + block * stride_sb + offset * stride_st + head * stride_sh, scale)


# ----------------------------------------------------------------------------------------------------------------
# PyTorch references


def sketch_reference(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (int8, ``keys``' shape) and scales (fp32, ``keys.shape[:-1]``) of ``keys[..., head_dim]``."""
    k = keys.float()
    # In float64, rounded once to fp32: the correctly rounded quotient on any device (PyTorch's CUDA division by a
    # scalar multiplies by its reciprocal, a unit in the last place off at times).
    scales = (k.abs().amax(-1).double() / CODE_MAX).float()
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.where(scales[..., None] > 0, torch.floor(k / safe[..., None] + 0.5), torch.zeros_like(k))
    return codes.clamp(-CODE_MAX, CODE_MAX).to(torch.int8), scales


def sketch_written_reference(key_cache: torch.Tensor, sketch: KeySketch, slot_mapping: torch.Tensor) -> None:
    """What ``KeySketchWrite.run`` does, in PyTorch: sketch the keys stored at ``slot_mapping`` (negative = padding)."""
    slots = slot_mapping.long()
    slots = slots[slots >= 0]
    if slots.numel() == 0:
        return
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    codes, scales = sketch_reference(key_cache[blocks, offsets])
    sketch.codes[blocks, offsets] = codes
    sketch.scales[blocks, offsets] = scales


def logit_bounds_reference(
    query: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Upper and lower bounds ``[heads, n]`` on ``query[heads, d] . k_j`` for keys sketched as ``codes[n, d]``,
    ``scales[n]`` (``query`` already multiplied by the softmax scale), in fp32 (float64 for a float64 query, the
    exact yardstick tests compare with)."""
    q = query.to(torch.promote_types(query.dtype, torch.float32))
    approx = (q @ codes.to(q.dtype).T) * scales.to(q.dtype)[None, :]
    half = q.abs().sum(-1, keepdim=True) * scales[None, :] * (0.5 + CODE_SLACK)
    return approx + half, approx - half


# ----------------------------------------------------------------------------------------------------------------
# Launcher


class KeySketchWrite:
    """Sketches the keys of each cache write: ``run(key_cache, sketch, slot_mapping)`` right after the step's keys
    were stored (once per layer)."""

    def __init__(self, block_size: int, num_kv_heads: int, head_dim: int):
        _check(
            block_size >= 1 and num_kv_heads >= 1 and head_dim >= 1,
            f"block_size, num_kv_heads and head_dim must be >= 1, got {block_size}, {num_kv_heads}, {head_dim}",
        )
        self.block_size, self.num_kv_heads, self.head_dim = block_size, num_kv_heads, head_dim

    def run(self, key_cache: torch.Tensor, sketch: KeySketch, slot_mapping: torch.Tensor) -> None:
        check_cache_shape("key_cache", key_cache, self.block_size, self.num_kv_heads, self.head_dim)
        _check(key_cache.stride(-1) == 1, "key_cache must be contiguous in its last (head_dim) dimension")
        sketch.check(key_cache)
        _check(
            slot_mapping.dim() == 1 and slot_mapping.dtype in (torch.int32, torch.int64),
            f"slot_mapping must be a 1-D int32/int64 tensor, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}",
        )
        _check(
            slot_mapping.device == key_cache.device,
            f"slot_mapping is on {slot_mapping.device} but key_cache is on {key_cache.device}",
        )
        if slot_mapping.numel() == 0:
            return
        _sketch_written_keys_kernel[(slot_mapping.numel(), self.num_kv_heads)](
            key_cache,
            sketch.codes,
            sketch.scales,
            slot_mapping,
            *key_cache.stride()[:3],
            *sketch.codes.stride(),
            *sketch.scales.stride(),
            BLOCK_SIZE=self.block_size,
            HEAD_DIM=self.head_dim,
            BLOCK_D=triton.next_power_of_2(self.head_dim),
        )
