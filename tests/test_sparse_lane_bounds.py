"""The scan's vector code (``kvreuse.sparse.lane_bounds``) against the same arithmetic in numpy, bit for bit.

The bounds are the scalar scan's operation for operation (exact int32 dot products, then ``float32(dot) * sigma *
scale -+ slack * scale``), so every bound and every largest value must equal numpy's exactly, whatever the number of
query heads per call, the valid tokens of the block and the channels; extreme codes (+-127 against +-32767) check
that the pairwise products are summed exactly.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

from kvreuse.kernels.key_sketch import TOKEN_ROW
from kvreuse.sparse.lane_bounds import MAX_HEADS, TOKEN_LANES, block_bounds, max_lanes


def expected(q16, codes, stride, dim, sigma, slack, scales, tokens):
    """numpy's bounds of the first ``tokens`` of a row (``stride`` tokens from ``codes[0]``): ``[heads, tokens]``
    lower and upper."""
    rows = np.stack([codes[c * stride : c * stride + tokens] for c in range(dim)])  # [d, tokens]
    dots = (q16.astype(np.int64) @ rows.astype(np.int64)).astype(np.int32)  # exact: within int32
    a = dots.astype(np.float32) * sigma[:, None] * scales[None, :tokens]
    w = slack[:, None] * scales[None, :tokens]
    return a - w, a + w


def test_the_lanes_are_the_layouts_rows():
    assert TOKEN_LANES == TOKEN_ROW


@pytest.mark.parametrize("heads", range(1, MAX_HEADS + 1))
@pytest.mark.parametrize("dim", [2, 64, 256])
def test_bounds_equal_numpys_bit_for_bit(heads, dim):
    """A block's largest upper bounds, and the lower bounds folded lane by lane into what the lanes held."""
    rng = np.random.default_rng(heads * 1000 + dim)
    stride = 48  # a row of 48 tokens: three vectors
    codes = rng.integers(-127, 128, size=dim * stride + 64).astype(np.int8)
    q16 = rng.integers(-32767, 32768, size=(heads, dim)).astype(np.int16)
    q16[0, :2] = 32767  # the extremes: +-32767 * +-127 pairwise
    codes[: 2 * stride : stride] = -127
    pairs = np.stack([q16[:, 0::2], q16[:, 1::2]], axis=-1).transpose(1, 0, 2).reshape(-1).copy()  # [pair, head, 2]
    sigma = rng.random(heads + 1).astype(np.float32) * 1e-3  # the call's heads from the second on (heads_at 1)
    slack = rng.random(heads + 1).astype(np.float32) * 10
    scales = rng.random(stride).astype(np.float32)
    upper = np.empty(MAX_HEADS, np.float32)
    for tokens in (0, 1, 9, 16, 17, 33, 48):
        before = (rng.standard_normal(TOKEN_LANES * heads) * 1e3).astype(np.float32)  # what the lanes held
        lower = np.concatenate([np.zeros(5, np.float32), before])  # at lower_at 5
        offsets = (np.int32(0), np.int64(stride)) if tokens % 2 else (0, stride)  # any integer type
        args = (codes, *offsets, pairs, 0, dim // 2, sigma, slack, 1, scales, 0, tokens, lower, 5, upper)
        block_bounds(heads, *args)
        want_lower, want_upper = expected(q16, codes, stride, dim, sigma[1:], slack[1:], scales, tokens)
        assert np.array_equal(upper[:heads], want_upper.max(1, initial=-np.inf)), tokens
        lanes = np.full((heads, stride), -np.inf, np.float32)
        lanes[:, :tokens] = want_lower
        want_lanes = np.maximum(before.reshape(heads, TOKEN_LANES), lanes.reshape(heads, -1, TOKEN_LANES).max(1))
        assert np.array_equal(lower[5:], want_lanes.reshape(-1)) and not lower[:5].any(), tokens


@numba.njit
def _largest(values, at):
    return max_lanes(values, at)


def test_the_largest_lane_is_numpys():
    rng = np.random.default_rng(0)
    values = rng.standard_normal(3 * TOKEN_LANES).astype(np.float32)
    values[TOKEN_LANES + 7] = 50.0
    for at in (0, 3, TOKEN_LANES):
        assert _largest(values, at) == values[at : at + TOKEN_LANES].max()
