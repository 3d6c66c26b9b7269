"""Tolerances for the tests' numeric comparisons, derived once, here, from floating-point arithmetic.

Why a tolerance is never picked by running a test. Every operation in a format with unit roundoff ``u`` (half the
machine epsilon: 2**-24 for float32, 2**-11 for float16, 2**-8 for bfloat16) returns the exact result times
``1 + d``, ``|d| <= u``, so a sum or dot product of ``n`` terms, in any order, lands within
``gamma_n * sum_i |a_i b_i|`` of the exact value, ``gamma_n = n u / (1 - n u)`` (Higham, "Accuracy and Stability of
Numerical Algorithms", 2nd ed., 2002, eq. 3.5). The order is the implementation's choice and it varies: numpy's
OpenBLAS picks a kernel, and with it a summation order, per CPU family and thread count (Triton's interpreter runs
``tl.dot`` through numpy), PyTorch dispatches per CPU, kernels split sums across programs. Two correct
implementations may differ by anything up to about twice the bound; a difference seen on one machine is one sample
of that spread, not a bound, and a suite tuned to it fails on the next CPU.

The rules the tests follow:

1. A kernel against its reference: ``assert_close_to_exact``. The reference evaluated in float64 stands for the
   exact result (its own error, ~1e-16 relative, is negligible here). The reference evaluated in the kernel's working
   precision shows, on this very data, how far an honest implementation in that precision lands from the exact
   result, conditioning included: a softmax over logits ~30 turns each logit's rounding error (~30 gamma_d) into an
   output error of that times ``|v|``, far above ``u |output|``. One evaluation is one sample of that error, and with
   few ill-conditioned outputs (two heavy hitters per head) a lucky one can be several times smaller than another
   order's; so the reference is evaluated in ``ORDERINGS`` summation orders (``summation_orders``: the head_dim
   coordinates of queries and keys permuted alike, the same logits summed in another order) and its error is the
   largest over them. The kernel performs the same operations in yet another order, so its largest error is within
   ``ORDER_FACTOR`` times that (room for the extra roundings of a blocked online softmax, or of an FPU without fused
   multiply-add), plus a floor of ``FLOOR_ULPS`` units in the last place of the kernel's *output* dtype on the
   magnitude of the terms summed: conversions the fp32 reference does not make (softmax weights converted to the
   value dtype before the weighted sum, the output converted to fp16 or bf16: two, each within one unit in the last
   place, as Triton's interpreter converts fp32 to bf16 by truncation), twice over, which also covers data on which
   the reference happens to be exact.
2. A decision (a comparison ``x >= t``: DIPR's keep rule, a block's bound against its threshold, a greedy argmax) is
   *settled* when ``|x - t|`` exceeds what rounding can move ``x`` and ``t`` by. Tests assert exact agreement on
   settled decisions only, and planted data keeps every decision settled: the tests check that premise
   (``settled_dipr_selection``), so a seed that plants a tie fails here, with a message, instead of on another CPU.
3. No tolerance at all (``torch.equal``, ``atol=0, rtol=0``) only where no rounding happens or it happens identically:
   copies, max and min, integer counts, one correctly rounded conversion, the same operations in the same order.
   Each such assertion says which.
"""

from __future__ import annotations

import torch

from kvreuse.kernels.dipr_decode import DIPRSelection, dipr_selection_reference
from kvreuse.kernels.key_sketch import KeySketch

ORDERINGS = 8
ORDER_FACTOR = 4.0
FLOOR_ULPS = 4.0

# Where the kernel tests put their tensors: a CUDA GPU when there is one (the compiled kernels), else the CPU, where
# conftest.py has Triton interpret the kernels. References run on their inputs' device, and some return CPU tensors
# whatever it is (the rotation references, in float64 on the host), so the comparisons below move what they compare
# to the CPU first.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u``: the largest relative error of one rounding to ``dtype`` (round to nearest)."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)``: the relative error bound of ``n`` successive roundings."""
    nu = n * unit_roundoff(dtype)
    assert nu < 1, f"gamma_{n} is unbounded in {dtype}"
    return nu / (1 - nu)


def summation_orders(dim: int, count: int = ORDERINGS) -> list[torch.Tensor]:
    """``count`` orders of ``dim`` coordinates, the identity first: a reference evaluated on queries and keys whose last
    dimension is indexed by one computes the same dot products, summed in that order (rule 1)."""
    generator = torch.Generator().manual_seed(0)
    return [torch.arange(dim)] + [torch.randperm(dim, generator=generator) for _ in range(count - 1)]


def assert_within(actual: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor | float, what: str) -> None:
    """``|actual - exact| <= bound`` elementwise (``bound`` broadcasts); a NaN anywhere fails. The message names the
    worst element, its error and its bound."""
    assert actual.shape == exact.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(exact.shape)}"
    if actual.numel() == 0:
        return
    error = (actual.detach().cpu().double() - exact.detach().cpu().double()).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64).cpu().expand_as(error)
    ratio = torch.where(error <= bound, error / bound.clamp_min(1e-300), torch.inf)  # NaN error: not <= bound
    worst = int(ratio.flatten().argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), error.shape))
    assert bool((error <= bound).all()), (
        f"{what}: |actual - exact| = {error.flatten()[worst]:.3g} at {index} exceeds its bound "
        f"{bound.flatten()[worst]:.3g} (actual {actual.flatten()[worst].item():.8g}, exact "
        f"{exact.flatten()[worst].item():.8g}); {int((~(error <= bound)).sum())} of {error.numel()} elements out"
    )


def assert_close_to_exact(
    actual: torch.Tensor,
    references: list[torch.Tensor],
    exact: torch.Tensor,
    *,
    magnitude: torch.Tensor | float | None = None,
    what: str = "kernel",
) -> None:
    """Rule 1: ``actual`` (a kernel's output, in its own dtype) is within ``ORDER_FACTOR`` times the largest error of
    ``references`` (the same computation in the reference's working precision, in the ``summation_orders``) plus
    ``FLOOR_ULPS`` units in the last place of ``actual``'s dtype on ``magnitude``, of ``exact`` (the reference in
    float64).

    ``magnitude``: the size of the terms summed per element, e.g. attention over ``|v|`` (softmax weights converted
    to the value dtype err relative to that, not to the output, which cancellation can make small); default: the
    largest ``|exact|``.
    """
    assert exact.dtype == torch.float64, f"{what}: the exact result must be float64, got {exact.dtype}"
    assert references, f"{what}: no reference evaluation"
    for reference in references:
        assert reference.shape == exact.shape, f"{what}: reference {tuple(reference.shape)} != {tuple(exact.shape)}"
    if exact.numel() == 0:
        assert actual.numel() == 0, f"{what}: {actual.numel()} elements where none were expected"
        return
    exact = exact.detach().cpu()
    reference_error = max(float((reference.detach().cpu().double() - exact).abs().max()) for reference in references)
    assert reference_error == reference_error, f"{what}: the reference itself is NaN"
    if magnitude is None:
        magnitude = float(exact.abs().max())
    magnitude = torch.as_tensor(magnitude, dtype=torch.float64).cpu()
    bound = ORDER_FACTOR * reference_error + FLOOR_ULPS * torch.finfo(actual.dtype).eps * magnitude
    assert_within(
        actual, exact, bound, f"{what} (reference's own largest error {reference_error:.3g}, output {actual.dtype})"
    )


def rotation_bound(keys: torch.Tensor, moves: int = 1) -> torch.Tensor:
    """How far ``moves`` rounded RoPE rotations (kernel moves, or a key rounded to its dtype) can put keys from their
    exact rotation, per (token, head) row of ``keys[..., head_dim]`` (rule 1 worked out by hand: the rotation has no
    fp32 reference to measure against).

    A move computes each pair as ``x1 cos - x2 sin``, ``x2 cos + x1 sin`` in fp32 with ``cos, sin`` rounded to fp32:
    three roundings on terms of size ``|x1| + |x2|``, ``gamma_3 (|x1| + |x2|)``, then one rounding to the keys'
    dtype, ``u |y| <= u (|x1| + |x2|)``. Rotations keep each pair's length, so ``|x1| + |x2| <= 2 max|x|`` of the
    row all along, and an earlier move's error grows by at most sqrt(2) < 1.5 when later moves rotate it.
    """
    row = keys.double().abs().amax(-1, keepdim=True)
    return moves * 1.5 * (gamma(3) + unit_roundoff(keys.dtype)) * 2 * row


def dipr_rounding_reach(query: torch.Tensor, key_cache: torch.Tensor, beta: float, scale: float) -> float:
    """How far fp32 rounding can move either side of any DIPR decision on this data (rule 2).

    Each decision compares a sum of ``head_dim`` products with ``tau = L - beta``, ``L`` the largest lower bound
    of a logit: a token's logit ``l_j = scale q . k_j``, or a bound of it from the key sketch, ``s_j (q . u_j) +/-
    s_j ||q||_1 (1/2 + CODE_SLACK)`` with ``q`` scaled, ``|u_ji| <= 127`` and ``127 s_j = max_i |k_ji|`` (see
    ``kvreuse.kernels.key_sketch``). No term of these sums exceeds ``|q_i| K`` in size, ``K`` the largest
    ``|k|`` in the cache, so with ``S = scale max_h sum_i |q_hi| K`` each sum is within ``gamma_{d+4} S`` of its
    exact value (``d`` products summed, the scale, the scale ``s_j`` and the final sum each round once), the
    half-width term, at most ``S / 127`` in size, within ``gamma_{d+4} S`` again, and ``tau`` once more on ``|tau|
    <= 2 S + beta``. Inputs of fp16/bf16 are widened exactly and their products are exact in fp32, so fp32's ``u``
    applies to every dtype.
    """
    head_dim = query.shape[-1]
    largest_key = float(key_cache.detach().abs().double().max()) if key_cache.numel() else 0.0
    reach = scale * float(query.detach().abs().double().sum(-1).max()) * largest_key
    u = unit_roundoff(torch.float32)
    return 2 * 2 * gamma(head_dim + 4) * reach + u * (2 * reach + beta)


def settled_dipr_selection(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    sketch: KeySketch,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    beta: float | torch.Tensor,
    scale: float,
    sink: int,
    local: int,
) -> DIPRSelection:
    """The exact (float64) DIPR selection, after checking that rounding can change none of its decisions.

    Moving ``beta`` by ``delta = dipr_rounding_reach`` moves every threshold by ``delta``, so the decisions are
    settled, the same in every fp32 implementation (the reference, the kernel, on any CPU or GPU), iff the
    selections at ``beta - delta`` and ``beta + delta`` agree. Fails, naming the sequence, head and token or block,
    when planted data puts a decision within rounding of its threshold.
    """
    args = (query, key_cache, block_table, seq_lens)
    q, k, table, lens = (t.double() if t.is_floating_point() else t for t in args)
    exact = (q, k, sketch, table, lens)  # the sketch is data (int8 codes, fp32 scales), read alike by all
    betas = torch.as_tensor(beta, dtype=torch.float64).expand(len(seq_lens))
    if bool(torch.isinf(betas).all()):
        return dipr_selection_reference(*exact, betas, scale, sink, local)
    delta = dipr_rounding_reach(query, key_cache, float(betas[torch.isfinite(betas)].max()), scale)
    assert delta < float("inf"), f"rounding reach {delta}: the key cache holds non-finite values"  # NaN too
    low, high = (
        dipr_selection_reference(*exact, torch.where(torch.isinf(betas), betas, betas + shift), scale, sink, local)
        for shift in (-delta, delta)
    )
    for seq in range(len(seq_lens)):
        for name in ("attended", "blocks_read"):
            a, b = getattr(low, name)[seq], getattr(high, name)[seq]
            where = (a != b).nonzero().tolist()
            assert not where, (
                f"sequence {seq}: DIPR decision(s) within rounding ({delta:.2g}) of their threshold, "
                f"{name}[head, index] {where[:5]}: the planted data ties; give it a margin"
            )
    return dipr_selection_reference(*exact, betas, scale, sink, local)
