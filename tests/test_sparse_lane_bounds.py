"""The scan's vector code (``kvreuse.sparse.lane_bounds``) against the same arithmetic in numpy, bit for bit.

The bounds are the scalar scan's operation for operation (exact int32 dot products, then ``float32(dot) * sigma *
scale -+ slack * scale``), so every bound and every largest value must equal numpy's exactly, whatever the number of
query heads per call, the valid tokens of the row and the channels; extreme codes (+-127 against +-32767) check
that the pairwise products are summed exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvreuse.kernels.key_sketch import TOKEN_ROW
from kvreuse.sparse.lane_bounds import MAX_HEADS, TOKEN_LANES, token_bounds


def expected(q16, codes, base, stride, dim, sigma, slack, scales, tokens):
    """numpy's largest lower and upper bounds over the first ``tokens`` of the 16 tokens at ``base``."""
    rows = np.stack([codes[base + c * stride : base + c * stride + TOKEN_LANES] for c in range(dim)])  # [d, 16]
    dots = (q16.astype(np.int64) @ rows.astype(np.int64)).astype(np.int32)  # exact: within int32
    a = dots.astype(np.float32) * sigma[:, None] * scales[None, :]
    w = slack[:, None] * scales[None, :]
    lower = np.where(np.arange(TOKEN_LANES) < tokens, a - w, -np.inf).max(1).astype(np.float32)
    upper = np.where(np.arange(TOKEN_LANES) < tokens, a + w, -np.inf).max(1).astype(np.float32)
    return lower, upper


def test_the_lanes_are_the_layouts_rows():
    assert TOKEN_LANES == TOKEN_ROW


@pytest.mark.parametrize("heads", range(1, MAX_HEADS + 1))
@pytest.mark.parametrize("dim", [2, 64, 256])
def test_bounds_equal_numpys_bit_for_bit(heads, dim):
    rng = np.random.default_rng(heads * 1000 + dim)
    stride = 48  # a row of 48 tokens (three calls per row)
    codes = rng.integers(-127, 128, size=dim * stride + 64).astype(np.int8)
    q16 = rng.integers(-32767, 32768, size=(heads, dim)).astype(np.int16)
    q16[0, :2] = 32767  # the extremes: +-32767 * +-127 pairwise
    codes[: 2 * stride : stride] = -127
    pairs = np.stack([q16[:, 0::2], q16[:, 1::2]], axis=-1).transpose(1, 0, 2).reshape(-1).copy()  # [pair, head, 2]
    sigma = rng.random(heads + 1).astype(np.float32) * 1e-3  # the call's heads from the second on (heads_at 1)
    slack = rng.random(heads + 1).astype(np.float32) * 10
    scales = rng.random(stride).astype(np.float32)
    lower, upper = np.empty(heads, np.float32), np.empty(heads, np.float32)
    for first in (0, 16, 32):
        for tokens in (0, 1, 9, 16):
            offsets = (np.int32(first), np.int64(stride)) if tokens % 2 else (first, stride)  # any integer type
            args = (codes, *offsets, pairs, 0, dim // 2, sigma, slack, 1, scales, first, tokens, lower, upper)
            token_bounds(heads, *args)
            row_scales = scales[first : first + TOKEN_LANES]
            want_lower, want_upper = expected(q16, codes, first, stride, dim, sigma[1:], slack[1:], row_scales, tokens)
            assert np.array_equal(lower, want_lower) and np.array_equal(upper, want_upper), (first, tokens)
