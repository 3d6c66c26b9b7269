"""Device helpers shared by the attention kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot_fp32(a, b, UPCAST: tl.constexpr):
    """``a @ b`` accumulated in fp32 (IEEE, no TF32).

    ``UPCAST`` only under Triton's interpreter, which keeps bf16 as raw uint16 and would multiply the integers:
    upcasting is exact, so the products are the same and only the summation order may differ.
    """
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def online_softmax_step(logits, v, m_i, l_i, acc, UPCAST: tl.constexpr):
    """Fold one tile into a running softmax-weighted sum (Milakov and Gimelshein, "Online normalizer calculation
    for softmax", 2018): ``logits[rows, T]`` (``-inf`` where masked) and ``v[T, D]`` into the running maxima
    ``m_i[rows]``, sums ``l_i[rows]`` and unnormalised outputs ``acc[rows, D]``; returns the new three. Rows with
    nothing kept yet stay at zero."""
    m_new = tl.maximum(m_i, tl.max(logits, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(logits - m_safe[:, None])
    rescale = tl.exp(m_i - m_safe)
    l_i = l_i * rescale + tl.sum(p, axis=1)
    acc = acc * rescale[:, None] + dot_fp32(p.to(v.dtype), v, UPCAST)
    return m_new, l_i, acc


def interpreter_upcast(dtype) -> bool:
    """The ``UPCAST`` argument of ``dot_fp32`` for inputs of ``dtype``."""
    import torch

    return dtype == torch.bfloat16 and bool(triton.knobs.runtime.interpret)
