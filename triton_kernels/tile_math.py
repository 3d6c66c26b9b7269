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


def interpreter_upcast(dtype) -> bool:
    """The ``UPCAST`` argument of ``dot_fp32`` for inputs of ``dtype``."""
    import torch

    return dtype == torch.bfloat16 and bool(triton.knobs.runtime.interpret)
