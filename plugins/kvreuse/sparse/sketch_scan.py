"""The key sketch's CPU work compiled with numba: one call per layer for the write, one for DIPR's decision.

Why compiled. In PyTorch, DIPR's decision over the sketch (``cpu_attention.dipr_read_blocks``) is ~200 calls per
layer and sequence (gathers, an int8 product mostly over the zeros of a block-diagonal query, ~20 fp32 passes),
which cost more than the attention they save; the sketch write was ~15 calls per layer. Here each is one call
that walks the codes once:

- ``write_sketch``: sketch every written key (exactly ``sketch_reference``: the same fp32 operations in the same
  order) and return the blocks the write starts without filling (``fresh``), which the engine's cache write zeroes
  first (``kvreuse.vllm.sparse.cpu_kernel``);
- ``prune_by_sketch``: for every decode sequence and KV head, the blocks DIPR reads, listed as a pruned block
  table (``kvreuse.sparse.pruned.PrunedTables``), straight from the int8 codes.

The decision is ``dipr_read_blocks``' (its PyTorch reference) with the query rounded to int16, so that the dot
products are exact integer sums in vector lanes (``kvreuse.sparse.lane_bounds``: ``vpmaddwd``/VNNI ``vpdpwssd`` on
x86, int8 codes x int16 -> int32, and no fp32 rounding of the sum). The rounding is bounded, not ignored (the
symmetric integer quantization of Jacob et al., CVPR 2018, with its error carried into the bounds): per query head
``q = sigma (q16 + e)`` with ``sigma = max_c |q_c| / 32767`` and ``e = q / sigma - q16`` (``|e_c| <= 1/2``, summed
in float64), and a key is ``k_j = s_j (u_j + r_j)`` with ``|r_jc| <= 1/2 + CODE_SLACK`` and ``|u_jc| <= 127``, so

    q . k_j = s_j sigma (q16 . u_j) + s_j sigma (e . u_j) + s_j (q . r_j)
    |s_j sigma (e . u_j) + s_j (q . r_j)| <= s_j (127 sigma ||e||_1 + ||q||_1 (1/2 + CODE_SLACK)) = s_j W

and the bounds are ``s_j sigma (q16 . u_j) +- s_j W`` (``query_codes`` computes ``sigma``, ``q16`` and ``W``,
rounded up). ``q16 . u_j`` is exact in int32 (at most ``256 * 32767 * 127 < 2**31``); the three fp32 roundings of
``s_j sigma D`` are within ``2**-22`` of ``127 ||q||_1 s_j``, far inside CODE_SLACK (sized for the fp32 dot product
this replaces). The widening is ``127 sigma ||e||_1 <= 0.12 max_c |q_c|`` (head_dim 64): ~2% of the half-width
on SmolLM2's queries, 0.4% more blocks read at beta = 4. ``tau_g = max_j L_gj - beta``, and a KV head reads a block
if it holds a window token or a key whose ``U_gj`` reaches ``tau_g`` for one of its query heads: no key within beta
of the largest logit is dropped, and every block the reference reads is read (the tests check both on real keys).

The scan walks the blocks once, all KV heads of a block together, in the order a CPU's sketch is stored
(``kvreuse.kernels.key_sketch.sketch_strides``: per block KV head by KV head, channel by channel with the channel's
tokens side by side; ``kvreuse.vllm.sparse.backend.layer_cache`` keeps every block's sketch in one region apart
from the keys and values, so that a sequence's sketches are read as a stream), a block's tokens (16 per vector) and
up to 4 query heads per call (``lane_bounds.block_bounds``: one token per lane, so no dot product is summed across
lanes; about 3x faster than summing each token's dot product along its channels, 0.76 -> 0.24 ms per layer over 16K
tokens of 3 KV heads of 64 channels with the sketch in the CPU's caches). Where the block table jumps, it fetches
the block after next ahead (``llvm.prefetch``), KV head by KV head; blocks that follow each other in memory
are left to the hardware prefetcher (fetching them too made a sequential scan slower).

Arrays are numpy views of the tensors' memory (no copy); the sketch is addressed through flat views of its storage
and its strides (``prune_by_sketch`` checks they are the CPU layout's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numba
import numpy as np
import torch
from llvmlite import ir
from numba.extending import intrinsic

from kvreuse.errors import KernelArgumentError
from kvreuse.sparse.lane_bounds import MAX_HEADS, TOKEN_LANES, block_bounds, max_lanes
from kvreuse.sparse.per_tensor import PerTensor
from kvreuse.sparse.pruned import PrunedTables

if TYPE_CHECKING:  # the kernels' modules import Triton; only their constants are read here, at call time
    from kvreuse.kernels.key_sketch import KeySketch

QUERY_MAX = 32767  # int16 query codes in [-32767, 32767]: q16 . u over <= 256 channels stays within int32
_AHEAD = 2  # blocks whose sketches are fetched ahead of the one scanned


@numba.njit(cache=True, nogil=True)
def _write(keys, slots, codes, scales, code_at, scale_at, block_size, code_max):
    """Sketch ``keys[t, kv, d]`` (fp32) at ``slots[t]`` (negative: skip) into the flat ``codes``/``scales`` (element
    offset and block, token, head (and channel) strides in ``code_at``/``scale_at``); return the blocks started and
    not filled."""
    tokens, kv, dim = keys.shape
    valid = np.empty(tokens, np.int64)
    count = 0
    for t in range(tokens):
        slot = slots[t]
        if slot < 0:
            continue
        valid[count] = slot
        count += 1
        block, offset = slot // block_size, slot % block_size
        for h in range(kv):
            largest = np.float32(0.0)
            for c in range(dim):
                a = abs(keys[t, h, c])
                if a > largest or a != a:  # NaN stays (PyTorch's amax propagates it)
                    largest = a
            scale = np.float32(np.float64(largest) / code_max)  # rounded once, as sketch_reference does
            base = code_at[0] + block * code_at[1] + offset * code_at[2] + h * code_at[3]
            for c in range(dim):
                code = np.float32(0.0)
                if scale > 0:
                    code = np.floor(keys[t, h, c] / scale + np.float32(0.5))
                    code = min(max(code, np.float32(-code_max)), np.float32(code_max))
                codes[base + c * code_at[4]] = np.int8(code)
            scales[scale_at[0] + block * scale_at[1] + offset * scale_at[2] + h * scale_at[3]] = scale
    # The blocks whose slot 0 the write fills while leaving others: sorted slots group by block, slot 0 first.
    ordered = np.sort(valid[:count])
    fresh = np.empty(count, np.int64)
    found, i = 0, 0
    while i < count:
        block = ordered[i] // block_size
        j = i
        while j < count and ordered[j] // block_size == block:
            j += 1
        if ordered[i] % block_size == 0 and j - i < block_size:
            fresh[found] = block
            found += 1
        i = j
    return fresh[:found]


@intrinsic
def _prefetch(typingctx, array, index):
    """Ask the CPU to bring ``array[index]``'s cache line in (LLVM's ``llvm.prefetch``: read, keep in all levels)."""

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        byte = ir.IntType(8).as_pointer()
        name = "llvm.prefetch." + ("p0" if str(byte) == "ptr" else "p0i8")  # opaque pointers from LLVM 15 on
        i32 = ir.IntType(32)
        function = builder.module.globals.get(name) or ir.Function(
            builder.module, ir.FunctionType(ir.VoidType(), [byte, i32, i32, i32]), name=name
        )
        address = builder.bitcast(builder.gep(data, [args[1]]), byte)
        builder.call(function, [address, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return numba.types.void(array, index), codegen


@numba.njit(cache=True, nogil=True)
def query_codes(q, out, sigma, slack, half_factor, code_max):
    """Quantise each query head ``q[g, d]`` to int16 codes ``out[g, d]`` on the scale ``sigma[g] = max_c |q_c| /
    QUERY_MAX`` and set ``slack[g]``, the half-width in units of a key's scale: ``||q||_1 * half_factor`` (the
    key's own rounding) plus ``code_max * sigma * sum_c |e_c|`` (the query's), ``e_c = q_c / sigma - out_c``."""
    group, dim = q.shape
    for g in range(group):
        largest = 0.0
        norm = 0.0
        for c in range(dim):
            a = abs(np.float64(q[g, c]))
            largest = max(largest, a)
            norm += a
        scale = np.float32(largest / QUERY_MAX)
        error = 0.0
        for c in range(dim):
            if scale > 0:
                x = np.float64(q[g, c]) / np.float64(scale)  # exact to 2**-29 of a code in float64
                code = np.floor(x + 0.5)
                error += abs(x - code) + 2.0**-20
                out[g, c] = np.int16(code)
            else:
                out[g, c] = 0
        if scale == 0:  # all zero, or too small for an fp32 scale: codes 0, the whole query is the error
            error = norm  # |q . u| <= code_max ||q||_1
            scale = np.float32(1.0)
        sigma[g] = scale
        # float64 sums of <= 256 terms, rounded up to fp32 with a margin far above their rounding
        slack[g] = np.float32((norm * half_factor + code_max * np.float64(scale) * error) * (1.0 + 2.0**-16))


@numba.njit(cache=True, nogil=True)
def _prune(
    q, codes, scales, code_at, scale_at, block_table, seq_lens, beta, sink, local, block_size, half_factor,
    top_pages, code_max, tables, lens, kept,
):  # fmt: skip
    """The kept blocks of every decode ``i`` and KV head ``h`` into ``tables[h, i]`` (in sequence order, then block
    0 of ``block_table[i]``), ``lens[h, i]`` (their tokens) and ``kept[h, i]``; ``q[m, kv, g, d]`` fp32 scaled, the
    sketch in the CPU layout (``key_sketch.sketch_strides``). ``top_pages > 0``: of the blocks outside the window,
    at most that many, those whose bound reaches furthest above ``tau``. Returns -1, or before anything is read
    the first decode whose length does not fit its row of ``block_table`` (the caller raises)."""
    m, kv, group, dim = q.shape
    width = block_table.shape[1]
    for i in range(m):
        if seq_lens[i] > width * block_size:
            return i
    n_pairs = dim // 2
    pieces = (group + MAX_HEADS - 1) // MAX_HEADS  # a KV head's query heads, at most MAX_HEADS per call
    reach = np.empty((kv, group, width), np.float32)  # per KV head, query head and block: its largest upper bound
    margin = np.empty(width, np.float32)  # per block, how far its bound reaches above tau (for top_pages)
    tau = np.empty((kv, group), np.float32)
    q16 = np.empty((kv, group, dim), np.int16)
    pairs = np.empty(kv * pieces * MAX_HEADS * dim, np.int16)  # per KV head and piece: [pair, head, 2]
    sigma = np.empty((kv, group), np.float32)
    slack = np.empty((kv, group), np.float32)
    lower = np.empty(kv * pieces * MAX_HEADS * TOKEN_LANES, np.float32)  # per query head, running lower bounds' lanes
    upper = np.empty(MAX_HEADS, np.float32)
    read = np.empty(width, np.bool_)
    sigma_flat, slack_flat = sigma.reshape(kv * group), slack.reshape(kv * group)
    block_codes, block_scales = code_at[1], scale_at[1]
    for i in range(m):
        n = seq_lens[i]
        n_blocks = (n + block_size - 1) // block_size
        for h in range(kv):
            query_codes(q[i, h], q16[h], sigma[h], slack[h], half_factor, code_max)
            for g in range(group):
                piece, j = g // MAX_HEADS, g % MAX_HEADS
                heads = min(group - piece * MAX_HEADS, MAX_HEADS)
                for p in range(n_pairs):
                    at = (h * pieces + piece) * MAX_HEADS * dim + 2 * (p * heads + j)
                    pairs[at] = q16[h, g, 2 * p]
                    pairs[at + 1] = q16[h, g, 2 * p + 1]
        lower[:] = -np.inf
        # every key's bounds, block by block, KV head by KV head (the sketch's order in memory): each block's largest
        # upper bound per query head, and lane by lane the largest lower bounds; the next blocks' sketches are
        # fetched meanwhile (the block table may jump)
        for b in range(n_blocks):
            block = block_table[i, b]
            tokens = min(n - b * block_size, block_size)
            ahead = block_table[i, b + _AHEAD] if b + _AHEAD < n_blocks else -1
            if ahead == block + _AHEAD:  # the blocks run on in memory: the hardware's prefetcher follows them
                ahead = -1
            for h in range(kv):
                if ahead >= 0:  # the same KV head's sketch in the block after next, a stretch at a time
                    start = code_at[0] + ahead * block_codes + h * code_at[3]
                    for at in range(start, start + code_at[3], 64):
                        _prefetch(codes, at)
                    start = scale_at[0] + ahead * block_scales + h * scale_at[3]
                    for at in range(start, start + scale_at[3], 16):
                        _prefetch(scales, at)
                base = code_at[0] + block * block_codes + h * code_at[3]
                scales_at = scale_at[0] + block * block_scales + h * scale_at[3]
                for piece in range(pieces):
                    g0 = piece * MAX_HEADS
                    heads = min(group - g0, MAX_HEADS)
                    block_bounds(
                        heads, codes, base, code_at[4], pairs, (h * pieces + piece) * MAX_HEADS * dim, n_pairs,
                        sigma_flat, slack_flat, h * group + g0, scales, scales_at, tokens,
                        lower, (h * pieces + piece) * MAX_HEADS * TOKEN_LANES, upper,
                    )  # fmt: skip
                    for j in range(heads):
                        reach[h, g0 + j, b] = upper[j]
        for h in range(kv):
            for g in range(group):  # the largest lower bound: the largest of its head's lanes
                tau[h, g] = max_lanes(lower, (h * pieces * MAX_HEADS + g) * TOKEN_LANES)
        for h in range(kv):
            # a block is read if one of its keys' upper bounds reaches tau = max L - beta, or it holds a window token
            candidates = 0
            for b in range(n_blocks):
                best = np.float32(-np.inf)
                for g in range(group):
                    best = max(best, reach[h, g, b] - (tau[h, g] - beta))
                margin[b] = best
                read[b] = best >= 0
                candidates += read[b]
            if top_pages > 0 and candidates > top_pages:
                _keep_top(margin[:n_blocks], read[:n_blocks], top_pages, sink, local, n, block_size)
            sink_end = min(sink, n)
            for j in range(sink_end):
                read[j // block_size] = True
            for j in range(max(n - local, sink_end), n):
                read[j // block_size] = True
            count = 0
            for b in range(n_blocks):
                if read[b]:
                    tables[h, i, count] = block_table[i, b]
                    count += 1
            for b in range(count, width):
                tables[h, i, b] = block_table[i, 0]
            kept[h, i] = count
            tokens = count * block_size
            if n_blocks > 0 and read[n_blocks - 1]:
                tokens -= n_blocks * block_size - n  # the last block's empty slots
            lens[h, i] = tokens
    return -1


@numba.njit(cache=True, nogil=True)
def _keep_top(margin, read, top_pages, sink, local, n, block_size):
    """Clear ``read`` of every block outside the window but the ``top_pages`` of largest ``margin`` (ties: the
    earlier block); the window's blocks are read anyway."""
    sink_blocks = (min(sink, n) + block_size - 1) // block_size
    first_local = max(n - local, 0) // block_size if local > 0 else len(read)
    order = np.argsort(-margin, kind="mergesort")  # stable: ties keep the earlier block first
    left = top_pages
    for b in order:
        if not read[b] or b < sink_blocks or b >= first_local:
            continue
        if left > 0:
            left -= 1
        else:
            read[b] = False


def _flat_view(tensor: torch.Tensor, dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The whole storage under ``tensor`` as a flat numpy array of ``dtype``, and ``tensor``'s element offset and
    strides in it (a tensor's view of its storage never changes)."""
    flat = torch.empty(0, dtype=dtype, device=tensor.device).set_(tensor.untyped_storage()).numpy()
    return flat, np.array([tensor.storage_offset(), *tensor.stride()], np.int64)


# Made once per sketch tensor (a few microseconds per layer and step otherwise): its codes as int8, its scales as
# float32.
_codes_flat = PerTensor(lambda codes: _flat_view(codes, torch.int8))
_scales_flat = PerTensor(lambda scales: _flat_view(scales, torch.float32))


def write_sketch(keys: torch.Tensor, sketch: KeySketch, slot_mapping: torch.Tensor, block_size: int) -> torch.Tensor:
    """Sketch ``keys[tokens, kv_heads, d]`` (as the cache stores them) at ``slot_mapping`` (int64, negative: skip);
    return the blocks (int64, ascending) whose slot 0 this write fills while leaving some of their slots unwritten:
    their other slots still hold what the block's previous request wrote, which the caller clears."""
    from kvreuse.kernels.key_sketch import CODE_MAX

    n = min(keys.shape[0], slot_mapping.shape[0])  # the compiled loop reads both without bounds checks
    codes, code_at = _codes_flat(sketch.codes)
    scales, scale_at = _scales_flat(sketch.scales)
    fresh = _write(
        keys[:n].float().numpy(), slot_mapping[:n].long().numpy(), codes, scales, code_at, scale_at, block_size,
        float(CODE_MAX),
    )  # fmt: skip
    return torch.from_numpy(fresh)


def prune_by_sketch(
    q: torch.Tensor,
    sketch: KeySketch,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    beta: float,
    sink: int,
    local: int,
    top_pages: int = 0,
) -> PrunedTables:
    """The blocks DIPR reads for decode queries ``q[m, kv, g, d]`` (fp32, times the softmax scale) over sequences
    of ``seq_lens[m]`` tokens in ``block_table[m, max_blocks]`` (int32), as per-KV-head pruned tables: what
    ``prune_block_table(dipr_read_blocks(...))`` gives, from one pass over the codes.

    ``top_pages > 0`` (``sparse.top_pages``, approximate): each KV head reads the window's blocks and, of the others
    DIPR would read, at most ``top_pages``, those whose sketch bound reaches furthest above ``tau`` for one of its
    query heads (Quest's top pages, Tang et al. 2024, ranked by DIPR's bounds); blocks holding a key within beta of
    the largest logit may then be dropped."""
    from kvreuse.kernels.key_sketch import CODE_MAX, CODE_SLACK, sketch_strides

    # Checked before the compiled loop, which reads the table and the sketch without bounds checks (the lengths
    # against the table: in it, before it reads); each message is built only on failure (this runs once per layer
    # and decode step).
    m, kv = q.shape[0], q.shape[1]
    width = block_table.shape[1]
    if not (q.dtype == torch.float32 and q.dim() == 4):
        raise KernelArgumentError(f"q must be float32 [m, kv, g, d], got {q.dtype} {list(q.shape)}")
    if sketch.codes.shape[2:] != (kv, q.shape[3]):
        raise KernelArgumentError(
            f"q {list(q.shape)} must have the sketch's KV heads and head_dim {list(sketch.codes.shape[2:])}"
        )
    if block_table.shape[0] != m or seq_lens.shape != (m,):
        raise KernelArgumentError(
            f"block_table {list(block_table.shape)} and seq_lens {list(seq_lens.shape)} must have {m} rows like q"
        )
    if q.shape[3] > 256:
        raise KernelArgumentError(f"head_dim {q.shape[3]} over 256: the int32 dot products could overflow")
    if q.shape[3] % 2:
        raise KernelArgumentError(f"head_dim {q.shape[3]} is odd: the scan multiplies channels in pairs")
    block_size = sketch.codes.shape[1]
    layout = sketch_strides(block_size, kv, q.shape[3], "cpu")
    if sketch.codes.stride() != layout.codes or sketch.scales.stride() != layout.scales:
        raise KernelArgumentError(
            f"the scan reads the CPU sketch layout (kvreuse.kernels.key_sketch.sketch_strides: codes strides "
            f"{layout.codes}, scales {layout.scales}), got codes {sketch.codes.stride()}, scales "
            f"{sketch.scales.stride()}"
        )
    seq_lens_np = seq_lens.to(torch.int32).numpy()  # whether they fit block_table: checked in the compiled call
    codes, code_at = _codes_flat(sketch.codes)
    scales, scale_at = _scales_flat(sketch.scales)
    tables = np.empty((kv, m, width), np.int32)
    lens = np.empty((kv, m), np.int32)
    kept = np.empty((kv, m), np.int64)
    unfit = _prune(
        q.numpy(), codes, scales, code_at, scale_at, block_table.to(torch.int32).numpy(), seq_lens_np,
        np.float32(beta), int(sink), int(local), block_size, 0.5 + CODE_SLACK, int(top_pages), float(CODE_MAX),
        tables, lens, kept,
    )  # fmt: skip
    if unfit >= 0:
        raise KernelArgumentError(f"seq_lens (up to {seq_lens_np.max()}) must fit block_table's {width} blocks")
    return PrunedTables(torch.from_numpy(tables), torch.from_numpy(lens), torch.from_numpy(kept))


def warm_up(num_kv_heads: int, head_dim: int, block_size: int) -> None:
    """Compile both functions now (or load numba's on-disk cache: about a second), for a model's shape, so that an
    engine pays for it at start, not on its first decode; keys contiguous and strided (a slice of a fused QKV)."""
    from kvreuse.kernels.key_sketch import KeySketch

    sketch = KeySketch.allocate(1, block_size, num_kv_heads, head_dim, "cpu")
    # dtypes named: vLLM builds the model, and with it this, under the model's default dtype (bfloat16 often)
    keys = torch.zeros(1, num_kv_heads, 2 * head_dim, dtype=torch.float32)
    slots = torch.zeros(1, dtype=torch.int64)
    write_sketch(keys[..., :head_dim], sketch, slots, block_size)
    write_sketch(keys[..., :head_dim].contiguous(), sketch, slots, block_size)
    q = torch.zeros(1, num_kv_heads, 1, head_dim, dtype=torch.float32)
    prune_by_sketch(q, sketch, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0, 0, 1)
