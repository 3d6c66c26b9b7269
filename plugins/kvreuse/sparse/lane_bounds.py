"""DIPR's per-token logit bounds for a block's tokens, 16 per vector, as LLVM vector code inside the compiled scan.

Why vector code by hand. The scan (``kvreuse.sparse.sketch_scan``) bounds every key's logit from its int8 code:
per token and query head a 64-term integer dot product and a few fp32 operations. Written as numba loops, LLVM
vectorizes each dot product along the channels and then sums the lanes of every one (a horizontal reduction per
token and query head), and leaves the fp32 bounds and their maxima scalar; the scan then cost about half of the
dense attention it prunes. Here the codes of a block are laid out token-contiguous per channel (``TOKEN_LANES``
tokens side by side: ``kvreuse.kernels.key_sketch.KeySketch.allocate`` on a CPU), and one call computes, for a
block's tokens (16 at a time) and up to 4 query heads, the exact integer dot products with every token in its own
lane (no horizontal sums), their fp32 bounds, the block's largest upper bound and, lane by lane, the largest lower
bounds so far: one horizontal maximum per block for the upper bounds, and one per sequence for the lower ones
(a call per 16 tokens, each reducing both, took 5-10% longer over 8K-32K tokens).

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

TOKEN_LANES = 16  # tokens per vector: a block's codes are stored in rows of a multiple of this many tokens
MAX_HEADS = 4  # query heads per call (a KV head's group is taken in pieces of at most this many)

_I8, _I16, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
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
def _block_bounds_of(heads: int) -> Any:
    """``block_bounds`` for ``heads`` query heads, compiled (its accumulators are ``heads`` vector registers)."""

    @intrinsic
    def _block_bounds(
        typingctx, codes, base, channel_stride, pairs, pairs_at, n_pairs, sigma, slack, heads_at, scales, scales_at,
        tokens, lower, lower_at, upper,
    ):  # fmt: skip
        signature = numba.types.void(
            codes, base, channel_stride, pairs, pairs_at, n_pairs, sigma, slack, heads_at, scales, scales_at, tokens,
            lower, lower_at, upper,
        )  # fmt: skip

        def codegen(context, builder, sig, args):
            data = [context.make_array(sig.args[i])(context, builder, args[i]).data for i in (0, 3, 6, 7, 9, 12, 14)]
            codes_p, pairs_p, sigma_p, slack_p, scales_p, lower_p, upper_p = data
            # every count and offset as a 64-bit integer, whatever integer type the caller passed
            base_v, stride_v, pairs_at_v, n_v, heads_at_v, scales_at_v, tokens_v, lower_at_v = (
                context.cast(builder, args[i], sig.args[i], numba.types.int64) for i in (1, 2, 4, 5, 8, 10, 11, 13)
            )
            acc_type, scale_type = ir.VectorType(_I32, _LANES), ir.VectorType(_F32, _LANES)
            wide = ir.VectorType(_I32, 2 * _LANES)
            interleave = _lanes([i // 2 + (_LANES if i % 2 else 0) for i in range(2 * _LANES)])
            even, odd = _lanes(list(range(0, 2 * _LANES, 2))), _lanes(list(range(1, 2 * _LANES, 2)))
            pair_type = ir.VectorType(_I16, 2)
            zero = ir.Constant(acc_type, [0] * _LANES)
            floor = ir.Constant(scale_type, [float("-inf")] * _LANES)

            # per query head: its scale and half-width in every lane, and its running lower bounds (from memory)
            sigmas, slacks, lower_at, lowers = [], [], [], []
            for j in range(heads):
                head = builder.add(heads_at_v, _i64(j))
                sigmas.append(_splat(builder, builder.load(builder.gep(sigma_p, [head])), _LANES))
                slacks.append(_splat(builder, builder.load(builder.gep(slack_p, [head])), _LANES))
                lower_at.append(_pointer(builder, lower_p, builder.add(lower_at_v, _i64(j * _LANES)), scale_type))
                lowers.append(builder.load(lower_at[j], align=4))
            rows = builder.sdiv(builder.add(tokens_v, _i64(_LANES - 1)), _i64(_LANES))
            entry = builder.basic_block
            row_loop = builder.append_basic_block("rows")
            pair_loop = builder.append_basic_block("pairs")
            bounds = builder.append_basic_block("bounds")
            done = builder.append_basic_block("done")
            builder.cbranch(builder.icmp_signed(">", rows, _i64(0)), row_loop, done)

            # row by row (TOKEN_LANES tokens: a channel's next tokens), the row's largest bounds kept in registers
            builder.position_at_end(row_loop)
            r = builder.phi(_I64)
            r.add_incoming(_i64(0), entry)
            highs = [builder.phi(scale_type) for _ in range(heads)]
            lows = [builder.phi(scale_type) for _ in range(heads)]
            for high, low, first_low in zip(highs, lows, lowers):
                high.add_incoming(floor, entry)
                low.add_incoming(first_low, entry)
            row_base = builder.add(base_v, builder.mul(r, _i64(_LANES)))
            builder.branch(pair_loop)

            # the dot products: a loop over channel pairs, one accumulator per query head
            builder.position_at_end(pair_loop)
            p = builder.phi(_I64)
            p.add_incoming(_i64(0), row_loop)
            accs = [builder.phi(acc_type) for _ in range(heads)]
            for acc in accs:
                acc.add_incoming(zero, row_loop)
            row = builder.add(row_base, builder.mul(builder.shl(p, _i64(1)), stride_v))
            first = builder.load(_pointer(builder, codes_p, row, ir.VectorType(_I8, _LANES)), align=1)
            second = builder.load(
                _pointer(builder, codes_p, builder.add(row, stride_v), ir.VectorType(_I8, _LANES)), align=1
            )
            # token t's two codes side by side, as x86's pairwise multiply-add takes them
            both = builder.sext(builder.shuffle_vector(first, second, interleave), wide)
            dots = []
            for j, acc in enumerate(accs):
                at = builder.mul(builder.add(builder.mul(p, _i64(heads)), _i64(j)), _i64(2))
                pair = builder.load(_pointer(builder, pairs_p, builder.add(pairs_at_v, at), pair_type), align=2)
                halves = builder.shuffle_vector(pair, pair, _lanes([0, 1] * _LANES))  # the pair beside every token's
                products = builder.mul(both, builder.sext(halves, wide))
                summed = builder.add(
                    builder.shuffle_vector(products, products, even), builder.shuffle_vector(products, products, odd)
                )
                dots.append(builder.add(acc, summed))
            following = builder.add(p, _i64(1))
            for acc, dot in zip(accs, dots):
                acc.add_incoming(dot, pair_loop)
            p.add_incoming(following, pair_loop)
            builder.cbranch(builder.icmp_signed("<", following, n_v), pair_loop, bounds)

            # the row's bounds (lanes past the block's tokens left out), folded into the running largest values
            builder.position_at_end(bounds)
            offset = builder.mul(r, _i64(_LANES))
            s = builder.load(_pointer(builder, scales_p, builder.add(scales_at_v, offset), scale_type), align=4)
            valid = builder.icmp_signed(
                "<",
                builder.sext(_lanes(list(range(_LANES))), ir.VectorType(_I64, _LANES)),
                _splat(builder, builder.sub(tokens_v, offset), _LANES),
            )
            new_highs, new_lows = [], []
            for j, dot in enumerate(dots):
                # float32(dot) * sigma * s and slack * s, in that order (the roundings sketch_scan's proof bounds)
                a = builder.fmul(builder.fmul(builder.sitofp(dot, scale_type), sigmas[j]), s)
                w = builder.fmul(slacks[j], s)
                new_lows.append(_larger(builder, builder.select(valid, builder.fsub(a, w), floor), lows[j]))
                new_highs.append(_larger(builder, builder.select(valid, builder.fadd(a, w), floor), highs[j]))
            next_r = builder.add(r, _i64(1))
            r.add_incoming(next_r, bounds)
            for high, low, new_high, new_low in zip(highs, lows, new_highs, new_lows):
                high.add_incoming(new_high, bounds)
                low.add_incoming(new_low, bounds)
            builder.cbranch(builder.icmp_signed("<", next_r, rows), row_loop, done)

            # the block's largest upper bound per query head; the lower bounds' lanes back to memory
            builder.position_at_end(done)
            finals = []
            for j in range(heads):
                high, low = builder.phi(scale_type), builder.phi(scale_type)
                high.add_incoming(floor, entry)
                high.add_incoming(new_highs[j], bounds)
                low.add_incoming(lowers[j], entry)
                low.add_incoming(new_lows[j], bounds)
                finals.append((high, low))
            for j, (high, low) in enumerate(finals):
                builder.store(low, lower_at[j], align=4)
                builder.store(_max_lanes(builder, high), builder.gep(upper_p, [_i64(j)]))
            return context.get_dummy_value()

        return signature, codegen

    return _block_bounds


_BOUNDS_1, _BOUNDS_2, _BOUNDS_3, _BOUNDS_4 = (_block_bounds_of(heads) for heads in range(1, MAX_HEADS + 1))


@numba.njit(nogil=True, inline="always")
def block_bounds(
    heads, codes, base, channel_stride, pairs, pairs_at, n_pairs, sigma, slack, heads_at, scales, scales_at, tokens,
    lower, lower_at, upper,
):  # fmt: skip
    """For the first ``tokens`` tokens of a block's row (their channel ``c`` codes at ``codes[base + c *
    channel_stride :]``, int8, ``TOKEN_LANES`` tokens per vector; their scales at ``scales[scales_at:]``, float32)
    and ``heads`` (1 to ``MAX_HEADS``) query heads (head ``j``'s int16 codes of channels ``2p`` and ``2p + 1`` at
    ``pairs[pairs_at + 2 (p * heads + j) :][:2]``, ``p < n_pairs``; its scale ``sigma[heads_at + j]`` and
    half-width ``slack[heads_at + j]``): set ``upper[j]`` (float32) to the largest ``dot * sigma * s + slack * s``
    (``-inf`` when ``tokens`` is 0), and raise the lanes ``lower[lower_at + TOKEN_LANES j :][:TOKEN_LANES]`` to
    the tokens' ``dot * sigma * s - slack * s`` where larger (lane ``l`` holds tokens ``l``, ``l + 16``, ...: a
    sequence's largest lower bound is ``max_lanes`` of them once its blocks are scanned, one horizontal maximum per
    query head and sequence, not per row). Inlined into its caller (no call, no array references counted)."""
    if heads == 4:
        _BOUNDS_4(codes, base, channel_stride, pairs, pairs_at, n_pairs, sigma, slack, heads_at, scales, scales_at,
                  tokens, lower, lower_at, upper)  # fmt: skip
    elif heads == 3:
        _BOUNDS_3(codes, base, channel_stride, pairs, pairs_at, n_pairs, sigma, slack, heads_at, scales, scales_at,
                  tokens, lower, lower_at, upper)  # fmt: skip
    elif heads == 2:
        _BOUNDS_2(codes, base, channel_stride, pairs, pairs_at, n_pairs, sigma, slack, heads_at, scales, scales_at,
                  tokens, lower, lower_at, upper)  # fmt: skip
    else:
        _BOUNDS_1(codes, base, channel_stride, pairs, pairs_at, n_pairs, sigma, slack, heads_at, scales, scales_at,
                  tokens, lower, lower_at, upper)  # fmt: skip


@intrinsic
def max_lanes(typingctx, array, at):
    """The largest of the float32 ``array[at : at + TOKEN_LANES]`` (a greater-than tree, as ``block_bounds``'
    maxima)."""

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        index = context.cast(builder, args[1], sig.args[1], numba.types.int64)
        return _max_lanes(builder, builder.load(_pointer(builder, data, index, ir.VectorType(_F32, _LANES)), align=4))

    return numba.types.float32(array, at), codegen


def _i64(value: int) -> ir.Constant:
    return ir.Constant(_I64, value)


def _larger(builder: ir.IRBuilder, a: ir.Value, b: ir.Value) -> ir.Value:
    """Lane by lane ``a > b ? a : b``."""
    return builder.select(builder.fcmp_ordered(">", a, b), a, b)


def _max_lanes(builder: ir.IRBuilder, vector: ir.Value) -> ir.Value:
    """The largest lane of ``vector`` by halving (``a > b ? a : b`` at each step)."""
    count = vector.type.count
    while count > 1:
        count //= 2
        low = builder.shuffle_vector(vector, vector, _lanes(list(range(count))))
        high = builder.shuffle_vector(vector, vector, _lanes(list(range(count, 2 * count))))
        vector = _larger(builder, high, low)
    return builder.extract_element(vector, ir.Constant(_I32, 0))
