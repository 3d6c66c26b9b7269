"""DIPR's per-token logit bounds for 16 tokens at a time, as LLVM vector code inside the compiled sketch scan.

Why vector code by hand. The scan (``kvreuse.sparse.sketch_scan``) bounds every key's logit from its int8 code:
per token and query head a 64-term integer dot product and a few fp32 operations. Written as numba loops, LLVM
vectorizes each dot product along the channels and then sums the lanes of every one (a horizontal reduction per
token and query head), and leaves the fp32 bounds and their maxima scalar; the scan then cost about half of the
dense attention it prunes. Here the codes of a block are laid out token-contiguous per channel (``TOKEN_LANES``
tokens side by side: ``kvreuse.kernels.key_sketch.KeySketch.allocate`` on a CPU), and one call computes, for 16
tokens and up to 4 query heads, the exact integer dot products with every token in its own lane (no horizontal
sums), their fp32 bounds, and the largest lower and upper bound of the valid tokens.

The code is LLVM's target-independent vector IR, so it runs on any CPU LLVM targets: the sign-extended products of
two channels summed pairwise are what x86's ``vpmaddwd`` computes (``vpdpwssd`` with AVX-512 VNNI, which LLVM then
fuses with the accumulation), and other targets get their own equivalent. The fp32 arithmetic is the bound's,
operation for operation (``np.float32(dot) * sigma * scale``, ``slack * scale``): the bounds are bit-identical to
numpy's (tests/test_sparse_lane_bounds.py) and keep the proof of exactness in ``sketch_scan``'s docstring.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numba
from llvmlite import ir
from numba.extending import intrinsic

TOKEN_LANES = 16  # tokens per call: a block's codes are stored in rows of a multiple of this many tokens
MAX_HEADS = 4  # query heads per call (a KV head's group is taken in pieces of at most this many)

_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
_LANES = TOKEN_LANES


def _splat(builder: ir.IRBuilder, value: ir.Value, count: int) -> ir.Value:
    """``value`` in every one of ``count`` lanes."""
    undefined = ir.Constant(ir.VectorType(value.type, count), ir.Undefined)
    first = builder.insert_element(undefined, value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(first, undefined, _lanes([0] * count))


def _lanes(indices: list[int]) -> ir.Constant:
    return ir.Constant(ir.VectorType(_I32, len(indices)), indices)


def _pointer(builder: ir.IRBuilder, base: ir.Value, index: ir.Value, kind: ir.Type) -> ir.Value:
    """The address of element ``index`` of the array at ``base`` (of elements of ``base``'s type), as a pointer to
    ``kind`` (a vector of them)."""
    return builder.bitcast(builder.gep(base, [index]), kind.as_pointer())


@cache
def _token_bounds_of(heads: int) -> Any:
    """``token_bounds`` for ``heads`` query heads, compiled (its accumulators are ``heads`` vector registers)."""

    @intrinsic
    def _token_bounds(
        typingctx, codes, base, channel_stride, pairs, pairs_at, n_pairs, sigma, slack, heads_at, scales, scales_at,
        tokens, lower, upper,
    ):  # fmt: skip
        signature = numba.types.void(
            codes, base, channel_stride, pairs, pairs_at, n_pairs, sigma, slack, heads_at, scales, scales_at, tokens,
            lower, upper,
        )  # fmt: skip

        def codegen(context, builder, sig, args):
            data = [context.make_array(sig.args[i])(context, builder, args[i]).data for i in (0, 3, 6, 7, 9, 12, 13)]
            codes_p, pairs_p, sigma_p, slack_p, scales_p, lower_p, upper_p = data
            # every count and offset as a 64-bit integer, whatever integer type the caller passed
            base_v, stride_v, pairs_at_v, n_v, heads_at_v, scales_at_v, tokens_v = (
                context.cast(builder, args[i], sig.args[i], numba.types.int64) for i in (1, 2, 4, 5, 8, 10, 11)
            )
            i64 = ir.IntType(64)
            acc_type = ir.VectorType(_I32, _LANES)
            wide = ir.VectorType(_I32, 2 * _LANES)
            interleave = _lanes([i // 2 + (_LANES if i % 2 else 0) for i in range(2 * _LANES)])
            even, odd = _lanes(list(range(0, 2 * _LANES, 2))), _lanes(list(range(1, 2 * _LANES, 2)))
            pair_type, two = ir.VectorType(_I16, 2), ir.Constant(i64, 2)

            # the dot products: a loop over channel pairs, one accumulator per query head (kept in registers)
            entry = builder.basic_block
            loop = builder.append_basic_block("pairs")
            done = builder.append_basic_block("bounds")
            zero = ir.Constant(acc_type, [0] * _LANES)
            builder.cbranch(builder.icmp_signed(">", n_v, ir.Constant(i64, 0)), loop, done)
            builder.position_at_end(loop)
            p = builder.phi(i64)
            p.add_incoming(ir.Constant(i64, 0), entry)
            accs = [builder.phi(acc_type) for _ in range(heads)]
            for acc in accs:
                acc.add_incoming(zero, entry)
            row = builder.add(base_v, builder.mul(builder.shl(p, ir.Constant(i64, 1)), stride_v))
            first = builder.load(_pointer(builder, codes_p, row, ir.VectorType(_I8, _LANES)), align=1)
            second = builder.load(
                _pointer(builder, codes_p, builder.add(row, stride_v), ir.VectorType(_I8, _LANES)), align=1
            )
            # token t's two codes side by side, as x86's pairwise multiply-add takes them
            both = builder.sext(builder.shuffle_vector(first, second, interleave), wide)
            updated = []
            for j, acc in enumerate(accs):
                at = builder.mul(builder.add(builder.mul(p, ir.Constant(i64, heads)), ir.Constant(i64, j)), two)
                pair = builder.load(_pointer(builder, pairs_p, builder.add(pairs_at_v, at), pair_type), align=2)
                halves = builder.shuffle_vector(pair, pair, _lanes([0, 1] * _LANES))  # the pair beside every token's
                products = builder.mul(both, builder.sext(halves, wide))
                summed = builder.add(
                    builder.shuffle_vector(products, products, even), builder.shuffle_vector(products, products, odd)
                )
                updated.append(builder.add(acc, summed))
            following = builder.add(p, ir.Constant(i64, 1))
            for acc, new in zip(accs, updated):
                acc.add_incoming(new, loop)
            p.add_incoming(following, loop)
            builder.cbranch(builder.icmp_signed("<", following, n_v), loop, done)

            # the bounds of the valid tokens and their largest values
            builder.position_at_end(done)
            scale_type = ir.VectorType(_F32, _LANES)
            dots = []
            for new in updated:
                final = builder.phi(acc_type)
                final.add_incoming(zero, entry)
                final.add_incoming(new, loop)
                dots.append(final)
            s = builder.load(_pointer(builder, scales_p, scales_at_v, scale_type), align=4)
            lane = _lanes(list(range(_LANES)))
            valid = builder.icmp_signed(
                "<", builder.sext(lane, ir.VectorType(i64, _LANES)), _splat(builder, tokens_v, _LANES)
            )
            floor = ir.Constant(scale_type, [float("-inf")] * _LANES)
            for j, dot in enumerate(dots):
                head = builder.add(heads_at_v, ir.Constant(i64, j))
                sigma_j = _splat(builder, builder.load(builder.gep(sigma_p, [head])), _LANES)
                slack_j = _splat(builder, builder.load(builder.gep(slack_p, [head])), _LANES)
                # float32(dot) * sigma * s and slack * s, in that order (the roundings sketch_scan's proof bounds)
                a = builder.fmul(builder.fmul(builder.sitofp(dot, scale_type), sigma_j), s)
                w = builder.fmul(slack_j, s)
                for out_p, value in ((lower_p, builder.fsub(a, w)), (upper_p, builder.fadd(a, w))):
                    largest = _max_lanes(builder, builder.select(valid, value, floor))
                    builder.store(largest, builder.gep(out_p, [ir.Constant(i64, j)]))
            return context.get_dummy_value()

        return signature, codegen

    return _token_bounds


_BOUNDS_1, _BOUNDS_2, _BOUNDS_3, _BOUNDS_4 = (_token_bounds_of(heads) for heads in range(1, MAX_HEADS + 1))


@numba.njit(nogil=True, inline="always")
def token_bounds(
    heads, codes, base, channel_stride, pairs, pairs_at, n_pairs, sigma, slack, heads_at, scales, scales_at, tokens,
    lower, upper,
):  # fmt: skip
    """For the ``TOKEN_LANES`` tokens whose channel ``c`` codes are at ``codes[base + c * channel_stride :][:16]``
    (int8) and whose scales are ``scales[scales_at:][:16]`` (float32), and ``heads`` (1 to ``MAX_HEADS``) query
    heads, head ``j``'s int16 codes of channels ``2p`` and ``2p + 1`` at ``pairs[pairs_at + 2 (p * heads + j) :][:2]``
    (``p < n_pairs``), its scale ``sigma[heads_at + j]`` and half-width ``slack[heads_at + j]``: set ``lower[j]``
    and ``upper[j]`` (float32) to the largest ``dot * sigma * s - slack * s`` and ``dot * sigma * s + slack * s``
    over the first ``tokens`` tokens (``-inf`` when ``tokens`` is 0). Inlined into its caller (no call, no array
    references counted per 16 tokens)."""
    if heads == 4:
        _BOUNDS_4(codes, base, channel_stride, pairs, pairs_at, n_pairs, sigma, slack, heads_at, scales, scales_at,
                  tokens, lower, upper)  # fmt: skip
    elif heads == 3:
        _BOUNDS_3(codes, base, channel_stride, pairs, pairs_at, n_pairs, sigma, slack, heads_at, scales, scales_at,
                  tokens, lower, upper)  # fmt: skip
    elif heads == 2:
        _BOUNDS_2(codes, base, channel_stride, pairs, pairs_at, n_pairs, sigma, slack, heads_at, scales, scales_at,
                  tokens, lower, upper)  # fmt: skip
    else:
        _BOUNDS_1(codes, base, channel_stride, pairs, pairs_at, n_pairs, sigma, slack, heads_at, scales, scales_at,
                  tokens, lower, upper)  # fmt: skip


def _max_lanes(builder: ir.IRBuilder, vector: ir.Value) -> ir.Value:
    """The largest lane of ``vector`` by halving (``a > b ? a : b`` at each step)."""
    count = vector.type.count
    while count > 1:
        count //= 2
        low = builder.shuffle_vector(vector, vector, _lanes(list(range(count))))
        high = builder.shuffle_vector(vector, vector, _lanes(list(range(count, 2 * count))))
        vector = builder.select(builder.fcmp_ordered(">", high, low), high, low)
    return builder.extract_element(vector, ir.Constant(_I32, 0))
