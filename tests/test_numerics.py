"""The tolerance helpers themselves (``numerics.py``): each must fail where it should, or every test using it could
pass vacuously."""

from __future__ import annotations

import pytest
import torch
from numerics import assert_close_to_exact, assert_within, settled_dipr_selection, summation_orders

from kvreuse.kernels.key_sketch import KeySketch, logit_bounds_reference, sketch_reference


def test_a_result_off_by_more_than_rounding_or_nan_fails():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(50, 64, generator=g), torch.randn(64, 30, generator=g)
    exact = a.double() @ b.double()
    references = [a[:, o] @ b[o] for o in summation_orders(64)]
    assert_close_to_exact(a @ b, references, exact)
    with pytest.raises(AssertionError, match="exceeds its bound"):
        assert_close_to_exact((a @ b) * (1 + 1e-5), references, exact)
    broken = a @ b
    broken[3, 4] = float("nan")
    with pytest.raises(AssertionError, match=r"1 of 1500 elements out"):
        assert_close_to_exact(broken, references, exact)
    with pytest.raises(AssertionError, match=r"at \(1, 2\)"):
        assert_within(torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 1.0]]), torch.zeros(2, 3), 0.5, "worst element named")


def test_a_dipr_decision_on_its_threshold_is_refused_and_one_with_a_margin_is_not():
    """One sequence of two 16-token blocks; the window is token 0. The threshold is token 0's lower bound from the
    key sketch minus ``beta``; ``beta`` is set so that token 20's logit lies exactly on it, a keep decision that
    rounding decides."""
    g = torch.Generator().manual_seed(1)
    keys = 0.05 * torch.randn(2, 16, 1, 8, generator=g)
    query = torch.randn(1, 1, 8, generator=g)
    keys[0, 0, 0] = query[0, 0]
    keys[1, 4, 0] = 0.5 * query[0, 0]  # token 20: logit half of token 0's
    table, lens = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([32], dtype=torch.int32)
    codes, scales = sketch_reference(keys)
    _, lower = logit_bounds_reference(query[0].double(), codes[0, 0], scales[0, 0])  # token 0's, in float64
    logit = float(query[0, 0].double() @ query[0, 0].double())
    tie = float(lower[0, 0]) - float(query[0, 0].double() @ keys[1, 4, 0].double())
    args = (query, keys, KeySketch(codes, scales), table, lens)
    settled_dipr_selection(*args, tie - 0.25 * logit, 1.0, 1, 0)  # token 20 well outside
    settled_dipr_selection(*args, tie + 0.25 * logit, 1.0, 1, 0)  # well inside
    with pytest.raises(AssertionError, match=r"within rounding .* of their threshold"):
        settled_dipr_selection(*args, tie, 1.0, 1, 0)
