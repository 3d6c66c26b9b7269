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

The decision is ``dipr_read_blocks``' (its PyTorch reference): the bounds of key ``j`` for query head ``g`` are
``s_j (q_g . u_j) +- s_j ||q_g||_1 (1/2 + CODE_SLACK)`` (``logit_bounds_reference``), ``tau_g = max_j L_gj -
beta``, and a KV head reads a block if it holds a window token or a key whose ``U_gj`` reaches ``tau_g`` for one of
its query heads. The products run in fp32, in whatever order the compiler vectorizes them; CODE_SLACK was sized for
exactly that (an fp32 dot product over up to 256 channels, in any order, is within ``256 * 127 * 2**-24 < 2e-3``
of ``||q||_1`` of the real one), so the bounds enclose every key's real logit and no key within beta of the largest
is dropped. Only the roundings differ from the reference's, so the two can differ on a bound that ties ``tau``
within a few fp32 units (the tests compare them on random and real keys).

Arrays are numpy views of the tensors' memory (no copy); the sketch is addressed through flat views of its storage
and its strides, so the innermost loop over a key's channels is contiguous for the compiler.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import numba
import numpy as np
import torch

from kvreuse.errors import check_kernel_argument as _check
from kvreuse.sparse.pruned import PrunedTables

if TYPE_CHECKING:  # the kernels' modules import Triton; only their constants are read here, at call time
    from kvreuse.kernels.key_sketch import KeySketch

# LLVM may reorder the fp32 sums (to vectorize them); no flag that assumes finite values, so NaN compares as it does
# in PyTorch.
_FAST = {"reassoc", "contract"}


@numba.njit(cache=True, nogil=True)
def _write(keys, slots, codes, scales, code_at, scale_at, block_size, code_max):
    """Sketch ``keys[t, kv, d]`` (fp32) at ``slots[t]`` (negative: skip) into the flat ``codes``/``scales`` (element
    offset and block, token, head strides in ``code_at``/``scale_at``); return the blocks started and not filled."""
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
                codes[base + c] = np.int8(code)
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


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def _prune(
    q, codes, scales, code_at, scale_at, block_table, seq_lens, beta, sink, local, block_size, half_factor,
    top_pages, tables, lens, kept,
):  # fmt: skip
    """The kept blocks of every decode ``i`` and KV head ``h`` into ``tables[h, i]`` (in sequence order, then block
    0 of ``block_table[i]``), ``lens[h, i]`` (their tokens) and ``kept[h, i]``; ``q[m, kv, g, d]`` fp32 scaled.
    ``top_pages > 0``: of the blocks outside the window, at most that many, those whose bound reaches furthest
    above ``tau``."""
    m, kv, group, dim = q.shape
    width = block_table.shape[1]
    reach = np.empty((group, width), np.float32)  # per query head and block, its keys' largest upper bound
    margin = np.empty(width, np.float32)  # per block, how far its bound reaches above tau (for top_pages)
    tau = np.empty(group, np.float32)
    norms = np.empty(group, np.float32)
    dots = np.empty((group, block_size), np.float32)
    token_scales = np.empty(block_size, np.float32)
    read = np.empty(width, np.bool_)
    for i in range(m):
        n = seq_lens[i]
        n_blocks = (n + block_size - 1) // block_size
        for h in range(kv):
            qh = q[i, h]
            for g in range(group):
                norms[g] = 0.0
                for c in range(dim):
                    norms[g] += abs(qh[g, c])
                tau[g] = -np.inf
            # every key's bounds, block by block: first the block's dot products (contiguous rows of codes, a loop
            # that vectorizes), then the largest lower bound per query head and the block's largest upper bound
            for b in range(n_blocks):
                block = block_table[i, b]
                tokens = min(n - b * block_size, block_size)
                for t in range(tokens):
                    base = code_at[0] + block * code_at[1] + t * code_at[2] + h * code_at[3]
                    row = codes[base : base + dim]
                    token_scales[t] = scales[scale_at[0] + block * scale_at[1] + t * scale_at[2] + h * scale_at[3]]
                    for g in range(group):
                        dot = np.float32(0.0)
                        for c in range(dim):
                            dot += qh[g, c] * np.float32(row[c])
                        dots[g, t] = dot
                for g in range(group):
                    lower, upper = tau[g], np.float32(-np.inf)
                    for t in range(tokens):
                        a = dots[g, t] * token_scales[t]
                        w = norms[g] * token_scales[t] * half_factor  # in the reference's order
                        lower = max(lower, a - w)
                        upper = max(upper, a + w)
                    tau[g] = lower
                    reach[g, b] = upper
            # a block is read if one of its keys' upper bounds reaches tau = max L - beta, or it holds a window token
            candidates = 0
            for b in range(n_blocks):
                best = np.float32(-np.inf)
                for g in range(group):
                    best = max(best, reach[g, b] - (tau[g] - beta))
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


# Per sketch tensor (by id), its storage as a flat numpy array and its offset and strides in it: made once (a few
# microseconds per layer and step otherwise); an entry goes when the tensor it was made for does.
_FLAT: dict[int, tuple[weakref.ref[torch.Tensor], np.ndarray, np.ndarray]] = {}


def _flat(tensor: torch.Tensor, dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The whole storage under ``tensor`` as a flat numpy array of ``dtype``, and ``tensor``'s element offset and
    strides in it (a tensor's view of its storage never changes)."""
    key = id(tensor)
    entry = _FLAT.get(key)
    if entry is None or entry[0]() is not tensor:
        storage = tensor.untyped_storage()
        flat = torch.empty(0, dtype=dtype, device=tensor.device).set_(storage).numpy()
        at = np.array([tensor.storage_offset(), *tensor.stride()], np.int64)
        entry = _FLAT[key] = (weakref.ref(tensor, lambda _: _FLAT.pop(key, None)), flat, at)
    return entry[1], entry[2]


def write_sketch(keys: torch.Tensor, sketch: KeySketch, slot_mapping: torch.Tensor, block_size: int) -> torch.Tensor:
    """Sketch ``keys[tokens, kv_heads, d]`` (as the cache stores them) at ``slot_mapping`` (int64, negative: skip);
    return the blocks (int64, ascending) whose slot 0 this write fills while leaving some of their slots unwritten:
    their other slots still hold what the block's previous request wrote, which the caller clears."""
    from kvreuse.kernels.key_sketch import CODE_MAX

    n = min(len(keys), len(slot_mapping))  # the compiled loop reads both without bounds checks
    codes, code_at = _flat(sketch.codes, torch.int8)
    scales, scale_at = _flat(sketch.scales, torch.float32)
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
    from kvreuse.kernels.key_sketch import CODE_SLACK

    m, kv = q.shape[0], q.shape[1]
    width = block_table.shape[1]
    _check(q.dtype == torch.float32 and q.dim() == 4, f"q must be float32 [m, kv, g, d], got {q.dtype} {list(q.shape)}")
    _check(
        tuple(sketch.codes.shape[2:]) == tuple(q.shape[1:2]) + tuple(q.shape[3:]),
        f"q {list(q.shape)} must have the sketch's KV heads and head_dim {list(sketch.codes.shape[2:])}",
    )
    _check(
        block_table.shape[0] == m and seq_lens.shape == (m,),
        f"block_table {list(block_table.shape)} and seq_lens {list(seq_lens.shape)} must have {m} rows like q",
    )
    # the compiled loop reads the table and the sketch without bounds checks
    _check(
        m == 0 or int(seq_lens.max()) <= width * sketch.codes.shape[1],
        f"seq_lens (up to {int(seq_lens.max()) if m else 0}) must fit block_table's {width} blocks",
    )
    codes, code_at = _flat(sketch.codes, torch.int8)
    scales, scale_at = _flat(sketch.scales, torch.float32)
    tables = torch.empty(kv, m, width, dtype=torch.int32)
    lens = torch.empty(kv, m, dtype=torch.int32)
    kept = torch.empty(kv, m, dtype=torch.int64)
    _prune(
        q.numpy(), codes, scales, code_at, scale_at, block_table.to(torch.int32).numpy(),
        seq_lens.to(torch.int32).numpy(), np.float32(beta), int(sink), int(local), sketch.codes.shape[1],
        np.float32(0.5 + CODE_SLACK), int(top_pages), tables.numpy(), lens.numpy(), kept.numpy(),
    )  # fmt: skip
    return PrunedTables(tables, lens, kept)


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
