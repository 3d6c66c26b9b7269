"""DIPR sparse decode attention over vLLM's paged KV cache: whole KV blocks are skipped by their keys' sketches.

The query (AlayaDB, Deng et al., "AlayaDB: The Data Foundation for Efficient and Effective Long-context LLM
Inference", SIGMOD 2025, the Dynamic Inner Product Range query): for a query, keep every key
whose score is within ``beta`` of the largest score. Here scores are the softmax *logits*
``l_j = scale * (q . k_j)`` (``scale`` is the model's softmax scale, usually ``1/sqrt(head_dim)``), so the
DIPR set is ``D = {j : l_j >= max_i l_i - beta}``: the tokens whose attention weight is at least
``alpha = exp(-beta)`` times the largest weight. The paper's ``beta`` is on raw inner products; it equals ours
divided by ``scale`` (``beta_raw = beta * sqrt(head_dim)``). ``beta = inf`` is dense attention.

What the kernels compute, per sequence and query head (all query heads of one KV head together, so each KV block
is loaded once for the group):

1. ``_sketch_scan_kernel`` reads every token's key sketch (``key_sketch.py``: int8 codes and a scale, a quarter
   to a half of the key's bytes, never the key or the value) and bounds its logit from above, ``U_j``, and from
   below, ``L_j``. It keeps the largest ``U_j`` of each block and the largest ``L_j`` of each split.
2. ``tau = max_j L_j - beta``: ``max_j L_j <= max_j l_j``, so ``tau`` is at or below the DIPR threshold.
3. ``_dipr_split_kernel`` reads the keys and values of a block only if the block holds a window token (the first
   ``sink`` and last ``local`` tokens, always attended) or its largest ``U_j`` reaches ``tau`` for at least one
   query head of the group. In read blocks, a token is attended if it is in the window or ``l_j >= tau``;
   attention is the softmax over the attended set ``A = W ∪ {j : l_j >= tau}``, with flash-decoding's split-K
   (Dao et al., "Flash-Decoding for long-context inference", 2023): each program covers a range of blocks with an
   online softmax (Milakov and Gimelshein, "Online normalizer calculation for softmax", 2018) and
   ``_merge_splits_kernel`` combines them.

``A`` contains ``D`` (no false negatives): a token with ``l_j >= max - beta >= tau`` has ``U_j >= l_j >= tau``, so
its block is read and the token kept. ``A`` depends only on ``tau``, not on which blocks are read nor on the order
they are processed in, so the output is the same for any split (and equals the CPU path's, which computes ``A``
its own way).

Layouts: ``query[num_seqs, num_q_heads, head_dim]`` (one decode token per sequence; query head ``h`` uses KV head
``h // (num_q_heads // num_kv_heads)``, as in vLLM), ``key_cache``/``value_cache[num_blocks, block_size,
num_kv_heads, head_dim]`` (``paged_layout.py``), the sketch's ``codes``/``scales`` indexed like the key cache
(``key_sketch.py``), ``block_table[num_seqs, max_blocks]`` int32 and ``seq_lens[num_seqs]`` int32 (including the
token being decoded, whose key is already in the cache and sketched), as in vLLM's attention metadata.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvreuse.errors import check_kernel_argument as _check
from kvreuse.kernels.key_sketch import CODE_SLACK, KeySketch, logit_bounds_reference
from kvreuse.kernels.paged_layout import check_paged_kv
from kvreuse.kernels.tile_math import dot_fp32, interpreter_upcast, online_softmax_step

# Lanes (token slots) per tile: a tile gathers LANES // block_size KV blocks through the block table (one block when
# blocks are that large), so a loop iteration issues that many blocks' loads at once. One 16-token block per
# iteration left the kernels latency-bound on an H200 (2-8% of its copy bandwidth). Measured there (16-token blocks):
# the sketch scan ran fastest with 128 lanes, the split kernel, which holds a tile of keys and one of values, with 64.
SCAN_LANES = 128
SPLIT_LANES = 64
# Programs per SM the split-K layout aims at when ``plan`` chooses the splits: several resident programs per SM keep
# enough gathered loads in flight to approach the memory bandwidth.
PROGRAMS_PER_SM = 4


@triton.jit
def _sketch_scan_kernel(
    q_ptr,
    codes_ptr,
    scales_ptr,
    block_table_ptr,
    seq_lens_ptr,
    beta_ptr,
    upper_ptr,
    lower_ptr,
    scale,
    blocks_per_split,
    num_splits,
    max_blocks,
    stride_qs,
    stride_qh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_cd,
    stride_sb,
    stride_st,
    stride_sh,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # next power of two >= max(GROUP, 2) (no tl.dot here)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM: one tile holds a whole code row
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    BLOCK_T: tl.constexpr,  # next power of two >= BLOCK_SIZE: a block's lanes in a tile
    PAGES: tl.constexpr,  # KV blocks per tile (SCAN_LANES // BLOCK_T; see DIPRDecode.run)
    HALF: tl.constexpr,  # 1/2 + CODE_SLACK: the bound's half-step
):
    # One program per (sequence, KV head, split): per block, the largest upper bound U_j of each query head of the
    # group (-inf past the sequence); per split, the largest lower bound L_j. A dense sequence (beta = inf) needs
    # neither and reads nothing. Blocks are taken PAGES at a time, gathered through the block table into one tile.
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.where(tl.load(beta_ptr + seq) < float("inf"), tl.load(seq_lens_ptr + seq), 0)
    g, d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
    lane = tl.arange(0, PAGES * BLOCK_T)
    page_of, t = lane // BLOCK_T, lane % BLOCK_T  # a lane's block in the tile and its token in the block
    heads = kv_head * GROUP + g
    num_q_heads = GROUP * tl.num_programs(1)
    q = tl.load(
        q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :],
        mask=(g < GROUP)[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    ).to(tl.float32)
    q = q * scale
    half_width = tl.sum(tl.abs(q), axis=1) * HALF  # [BLOCK_G]: ||q||_1 (1/2 + CODE_SLACK), times s_j below
    best_lower = tl.full([BLOCK_G], float("-inf"), tl.float32)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(seq_len, BLOCK_SIZE))
    for b0 in range(first, last, PAGES):
        b = b0 + page_of
        pos = b * BLOCK_SIZE + t
        valid = (t < BLOCK_SIZE) & (b < last) & (pos < seq_len)
        block = tl.load(block_table_ptr + seq * stride_bt + b, mask=b < last, other=0).to(tl.int64)
        codes = tl.load(
            codes_ptr
            + block[:, None] * stride_cb
            + t[:, None] * stride_ct
            + kv_head * stride_ch
            + d[None, :] * stride_cd,
            mask=valid[:, None] & (d < HEAD_DIM)[None, :],
            other=0,
        ).to(tl.float32)
        scales = tl.load(scales_ptr + block * stride_sb + t * stride_st + kv_head * stride_sh, mask=valid, other=0.0)
        # q . u per query head of the group as fp32 products summed over head_dim (CUDA cores): exact products, as
        # the bound's CODE_SLACK assumes. tl.dot in fp32 ("ieee") computed the same 25-35x slower on an H200.
        approx = tl.zeros([BLOCK_G, PAGES * BLOCK_T], tl.float32)
        for h in tl.static_range(GROUP):
            q_h = tl.sum(tl.where(g[:, None] == h, q, 0.0), axis=0)  # row h of q (adding zeros is exact)
            approx = tl.where(g[:, None] == h, tl.sum(codes * q_h[None, :], axis=1)[None, :], approx)
        approx = approx * scales[None, :]  # [BLOCK_G, PAGES * BLOCK_T]
        width = half_width[:, None] * scales[None, :]
        upper = tl.where(valid[None, :], approx + width, float("-inf"))
        upper = tl.max(tl.reshape(upper, [BLOCK_G, PAGES, BLOCK_T]), axis=2)  # [BLOCK_G, PAGES]
        best_lower = tl.maximum(best_lower, tl.max(tl.where(valid[None, :], approx - width, float("-inf")), axis=1))
        pages = b0 + tl.arange(0, PAGES)
        tl.store(
            upper_ptr + (seq * num_q_heads + heads)[:, None] * max_blocks + pages[None, :],
            upper,
            mask=(g < GROUP)[:, None] & (pages < last)[None, :],
        )
    tl.store(lower_ptr + (seq * num_q_heads + heads) * num_splits + split, best_lower, mask=g < GROUP)


@triton.jit
def _dipr_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    upper_ptr,
    block_table_ptr,
    seq_lens_ptr,
    tau_ptr,
    beta_ptr,
    acc_ptr,
    m_ptr,
    l_ptr,
    blocks_read_ptr,
    tokens_ptr,
    scale,
    sink,
    local,
    blocks_per_split,
    num_splits,
    max_blocks,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,  # as in _sketch_scan_kernel
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,  # next power of two >= BLOCK_SIZE: a block's lanes in a tile
    PAGES: tl.constexpr,  # KV blocks per tile, as in _sketch_scan_kernel; the KV block stays the unit of pruning
    UPCAST: tl.constexpr,  # see dot_fp32
):
    # One program per (sequence, KV head, split); the split covers blocks [split, split + 1) * blocks_per_split,
    # taken PAGES at a time: the tile's blocks that are read are gathered into one tile of keys and values (the
    # lanes of pruned blocks are masked, so their memory is never loaded).
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    beta = tl.load(beta_ptr + seq)
    prune = beta < float("inf")
    g, d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
    lane = tl.arange(0, PAGES * BLOCK_T)
    page_of, t = lane // BLOCK_T, lane % BLOCK_T
    heads = kv_head * GROUP + g
    num_q_heads = GROUP * tl.num_programs(1)
    q = tl.load(
        q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :],
        mask=(g < GROUP)[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )
    tau = tl.load(tau_ptr + seq * num_q_heads + heads, mask=g < GROUP, other=float("inf"))  # padding rows ask nothing
    tau = tl.where(prune, tau, float("-inf"))
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    n_blocks_read = tl.zeros([], tl.int32)
    n_tokens = tl.zeros([BLOCK_G], tl.int32)
    sink_blocks = tl.cdiv(tl.minimum(sink, seq_len), BLOCK_SIZE)
    first_local_block = tl.where(local > 0, tl.maximum(seq_len - local, 0) // BLOCK_SIZE, 1 << 30)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(seq_len, BLOCK_SIZE))
    for b0 in range(first, last, PAGES):
        # Which of the tile's blocks are read: window blocks always (every block when not pruning); others when
        # the block's largest sketch bound reaches tau for at least one query head of the group.
        pages = b0 + tl.arange(0, PAGES)
        in_split = pages < last
        window_page = (pages < sink_blocks) | (pages >= first_local_block) | (prune == 0)
        upper = tl.load(
            upper_ptr + (seq * num_q_heads + heads)[:, None] * max_blocks + pages[None, :],
            mask=(g < GROUP)[:, None] & (in_split & (window_page == 0))[None, :],
            other=float("-inf"),
        )  # [BLOCK_G, PAGES]
        hit = tl.max((upper >= tau[:, None]).to(tl.int32), axis=0) > 0
        read_page = in_split & (window_page | hit)
        n_read = tl.sum(read_page.to(tl.int32), axis=0)
        if n_read > 0:
            read = tl.reshape(tl.broadcast_to(read_page.to(tl.int32)[:, None], [PAGES, BLOCK_T]), [PAGES * BLOCK_T]) > 0
            b = b0 + page_of
            pos = b * BLOCK_SIZE + t
            live = read & (t < BLOCK_SIZE) & (pos < seq_len)  # the lanes loaded
            block = tl.load(block_table_ptr + seq * stride_bt + b, mask=read, other=0).to(tl.int64)
            kv_mask = live[:, None] & (d < HEAD_DIM)[None, :]
            k = tl.load(
                k_ptr + block[:, None] * stride_kb + t[:, None] * stride_kt + kv_head * stride_kh + d[None, :],
                mask=kv_mask,
                other=0.0,
            )
            v = tl.load(
                v_ptr + block[:, None] * stride_vb + t[:, None] * stride_vt + kv_head * stride_vh + d[None, :],
                mask=kv_mask,
                other=0.0,
            )
            logits = dot_fp32(q, tl.trans(k), UPCAST) * scale  # [BLOCK_G, PAGES * BLOCK_T]
            window = (pos < sink) | (pos >= seq_len - local)
            keep = live[None, :] & (window[None, :] | (logits >= tau[:, None]))
            logits = tl.where(keep, logits, float("-inf"))
            m_i, l_i, acc = online_softmax_step(logits, v, m_i, l_i, acc, UPCAST)
            n_blocks_read += n_read
            n_tokens += tl.sum(keep.to(tl.int32), axis=1)
    part = (seq * num_q_heads + heads) * num_splits + split
    tl.store(acc_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=(g < GROUP)[:, None])
    tl.store(m_ptr + part, m_i, mask=g < GROUP)
    tl.store(l_ptr + part, l_i, mask=g < GROUP)
    tl.store(tokens_ptr + part, n_tokens, mask=g < GROUP)
    tl.store(blocks_read_ptr + (seq * tl.num_programs(1) + kv_head) * num_splits + split, n_blocks_read)


@triton.jit
def _merge_splits_kernel(
    acc_ptr,
    m_ptr,
    l_ptr,
    out_ptr,
    num_splits,
    stride_os,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # next power of two >= num_splits: all partial results of one head in one tile
):
    # One program per (sequence, query head): o = sum_k e^(m_k - M) acc_k / sum_k e^(m_k - M) l_k.
    seq, head = tl.program_id(0), tl.program_id(1)
    s, d = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
    part = (seq * tl.num_programs(1) + head) * num_splits + s
    m = tl.load(m_ptr + part, mask=s < num_splits, other=float("-inf"))
    l = tl.load(l_ptr + part, mask=s < num_splits, other=0.0)
    acc = tl.load(acc_ptr + part[:, None] * BLOCK_D + d[None, :], mask=(s < num_splits)[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # an empty sequence: every split is empty
    w = tl.where(m > float("-inf"), tl.exp(m - m_max), 0.0)  # empty splits (m = -inf) weigh nothing
    total = tl.sum(l * w, axis=0)
    o = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


# ----------------------------------------------------------------------------------------------------------------
# PyTorch references


@dataclass(frozen=True)
class DIPRSelection:
    """Which blocks and tokens DIPR reads and attends, per sequence (lists indexed by sequence).

    ``logits[s]``: ``[num_q_heads, seq_len]`` fp32; ``blocks_read[s]``: ``[num_kv_heads, num_blocks]`` bool;
    ``attended[s]``: ``[num_q_heads, seq_len]`` bool, the set the kernel attends; ``exact[s]``: the same shape,
    the exact DIPR set ``{j : l_j >= max - beta}``.
    """

    logits: list[torch.Tensor]
    blocks_read: list[torch.Tensor]
    attended: list[torch.Tensor]
    exact: list[torch.Tensor]


def _working(dtype: torch.dtype) -> torch.dtype:
    """The references' arithmetic: fp32, or float64 for float64 inputs (the exact yardstick tests compare with)."""
    return torch.promote_types(dtype, torch.float32)


def _sequence_kv(cache: torch.Tensor, block_table: torch.Tensor, seq: int, seq_len: int) -> torch.Tensor:
    """``[num_kv_heads, seq_len, head_dim]`` of one sequence in ``_working`` precision, gathered through its block
    table."""
    block_size = cache.shape[1]
    blocks = block_table[seq, : -(-seq_len // block_size)].long()
    return cache[blocks].flatten(0, 1)[:seq_len].to(_working(cache.dtype)).transpose(0, 1)


def dipr_selection_reference(
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
    """The blocks and tokens the kernels read and attend, and the exact DIPR set, computed plainly in fp32 (float64
    for float64 inputs), on the inputs' device."""
    num_q_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    group, block_size = num_q_heads // num_kv_heads, key_cache.shape[1]
    betas = torch.as_tensor(beta, dtype=torch.float32).expand(len(seq_lens)).tolist()
    out = DIPRSelection([], [], [], [])
    device = query.device
    for seq, seq_len in enumerate(seq_lens.tolist()):
        q = query[seq].to(_working(query.dtype)) * scale  # [heads, dim]
        keys = _sequence_kv(key_cache, block_table, seq, seq_len).repeat_interleave(group, dim=0)
        logits = torch.einsum("hd,hjd->hj", q, keys)
        if seq_len == 0:
            for part, rows in zip(out.__dict__.values(), (num_q_heads, num_kv_heads, num_q_heads, num_q_heads)):
                part.append(logits.new_zeros(rows, 0, dtype=logits.dtype if part is out.logits else torch.bool))
            continue
        pos = torch.arange(seq_len, device=device)
        window = (pos < sink) | (pos >= seq_len - local)
        n_blocks = -(-seq_len // block_size)
        block_of = pos // block_size
        read = torch.zeros(num_kv_heads, n_blocks, dtype=torch.bool, device=device)
        read[:, block_of[window].unique()] = True
        if betas[seq] == float("inf"):
            read[:] = True
            tau = torch.full((num_q_heads, 1), float("-inf"), device=device)
        else:
            codes = _sequence_kv(sketch.codes, block_table, seq, seq_len)  # [kv, n, d] (as floats)
            scales = _sequence_kv(sketch.scales[..., None], block_table, seq, seq_len)[..., 0]  # [kv, n]
            upper, lower = zip(
                *(
                    logit_bounds_reference(q[h * group : (h + 1) * group], codes[h], scales[h])
                    for h in range(num_kv_heads)
                )
            )
            upper, lower = torch.cat(upper), torch.cat(lower)  # [heads, n]
            tau = lower.amax(dim=1, keepdim=True) - betas[seq]
            padded = torch.full((num_q_heads, n_blocks * block_size), float("-inf"), dtype=upper.dtype, device=device)
            padded[:, :seq_len] = upper
            hit = padded.view(num_q_heads, n_blocks, block_size).amax(-1) >= tau
            read |= hit.view(num_kv_heads, group, n_blocks).any(dim=1)
        attended = read.repeat_interleave(group, dim=0)[:, block_of] & (window[None, :] | (logits >= tau))
        exact = logits >= logits.amax(dim=1, keepdim=True) - betas[seq]
        out.logits.append(logits)
        out.blocks_read.append(read)
        out.attended.append(attended)
        out.exact.append(exact)
    return out


def masked_decode_reference(
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    logits: list[torch.Tensor],
    masks: list[torch.Tensor],
) -> torch.Tensor:
    """``[num_seqs, num_q_heads, head_dim]`` fp32 (float64 for float64 values): softmax over the tokens in
    ``masks[s]`` of ``logits[s]``."""
    num_q_heads = logits[0].shape[0] if logits else 0
    group = num_q_heads // value_cache.shape[2] if num_q_heads else 1
    outs = []
    for seq, seq_len in enumerate(seq_lens.tolist()):
        values = _sequence_kv(value_cache, block_table, seq, seq_len).repeat_interleave(group, dim=0)
        weights = torch.softmax(logits[seq].masked_fill(~masks[seq], float("-inf")), dim=1).nan_to_num(0.0)
        outs.append(torch.einsum("hj,hjd->hd", weights, values))
    return torch.stack(outs) if outs else torch.zeros(0, num_q_heads, value_cache.shape[3], device=value_cache.device)


def dense_decode_reference(query, key_cache, value_cache, block_table, seq_lens, scale) -> torch.Tensor:
    """Dense paged decode attention, ``[num_seqs, num_q_heads, head_dim]`` fp32 (float64 for float64 inputs)."""
    sketch = KeySketch.allocate(*key_cache.shape, device=key_cache.device)  # unread at beta = inf
    sel = dipr_selection_reference(query, key_cache, sketch, block_table, seq_lens, float("inf"), scale, 0, 1)
    return masked_decode_reference(value_cache, block_table, seq_lens, sel.logits, sel.attended)


# ----------------------------------------------------------------------------------------------------------------
# Launcher


@dataclass(frozen=True)
class DIPRCounters:
    """What one ``run`` read and attended (int32 tensors on the query's device).

    ``blocks_read[num_seqs, num_kv_heads]``: KV blocks whose keys and values were loaded (window blocks included);
    ``blocks_total[num_seqs]``: ``ceil(seq_len / block_size)``; ``tokens_attended[num_seqs, num_q_heads]``: tokens
    in the attended set; ``tokens_total[num_seqs]``: ``seq_len``.
    """

    blocks_read: torch.Tensor
    blocks_total: torch.Tensor
    tokens_attended: torch.Tensor
    tokens_total: torch.Tensor


class DIPRDecode:
    """DIPR decode attention for one model's attention shape, called with vLLM's decode metadata.

    ``plan(seq_lens, block_table)`` once per engine step (shared by all layers), then per layer
    ``run(query, key_cache, value_cache, sketch, beta)``. ``beta`` is a float or a ``[num_seqs]`` tensor (e.g.
    ``inf`` for sequences a policy keeps dense); a sequence with ``beta = inf`` reads no sketch.
    Nothing is read back to the host, so the launches can be captured in a CUDA graph once the grid (the number of
    sequences and of splits) is fixed.
    """

    def __init__(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        *,
        scale: float | None = None,
        sink: int = 16,
        local: int = 64,
        max_splits: int = 128,
    ):
        _check(
            num_kv_heads >= 1 and num_q_heads % num_kv_heads == 0,
            f"num_q_heads ({num_q_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})",
        )
        _check(head_dim >= 1 and block_size >= 1, f"head_dim and block_size must be >= 1, got {head_dim}, {block_size}")
        _check(
            sink >= 0 and local >= 0 and sink + local >= 1,
            f"sink ({sink}) and local ({local}) must be >= 0 with at least one window token",
        )
        _check(max_splits >= 1, f"max_splits must be >= 1, got {max_splits}")
        self.num_q_heads, self.num_kv_heads, self.head_dim, self.block_size = (
            num_q_heads,
            num_kv_heads,
            head_dim,
            block_size,
        )
        self.group = num_q_heads // num_kv_heads
        self.scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
        self.sink, self.local, self.max_splits = sink, local, max_splits
        # KV blocks per tile of the split kernel and of the sketch scan (see SPLIT_LANES, SCAN_LANES).
        self.pages = max(1, SPLIT_LANES // triton.next_power_of_2(block_size))
        self.scan_pages = max(1, SCAN_LANES // triton.next_power_of_2(block_size))
        self._plan: tuple[torch.Tensor, torch.Tensor, int, int] | None = None

    def plan(
        self,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        *,
        max_seq_len: int | None = None,
        num_splits: int | None = None,
    ) -> None:
        """Fix the step's sequences and the split-K layout. ``max_seq_len`` (a host int, as in vLLM's metadata)
        bounds the blocks per sequence without reading ``seq_lens`` back; ``num_splits`` overrides the choice."""
        _check(
            seq_lens.dim() == 1 and seq_lens.dtype == torch.int32,
            f"seq_lens must be a 1-D int32 tensor, got {tuple(seq_lens.shape)} {seq_lens.dtype}",
        )
        _check(
            block_table.dim() == 2
            and block_table.dtype == torch.int32
            and block_table.shape[0] == len(seq_lens)
            and block_table.stride(1) == 1,
            f"block_table must be an int32 [num_seqs={len(seq_lens)}, max_blocks] tensor with contiguous rows, "
            f"got {tuple(block_table.shape)} {block_table.dtype}",
        )
        _check(
            seq_lens.device == block_table.device,
            f"seq_lens is on {seq_lens.device} but block_table is on {block_table.device}",
        )
        max_blocks = block_table.shape[1] if max_seq_len is None else -(-max_seq_len // self.block_size)
        max_blocks = max(1, min(max_blocks, block_table.shape[1]))
        if num_splits is None:
            # Enough programs to keep every SM busy (PROGRAMS_PER_SM each), never more splits than tiles.
            sms = torch.cuda.get_device_properties(seq_lens.device).multi_processor_count if seq_lens.is_cuda else 1
            num_splits = -(-PROGRAMS_PER_SM * sms // max(1, len(seq_lens) * self.num_kv_heads))
        _check(num_splits >= 1, f"num_splits must be >= 1, got {num_splits}")
        num_splits = min(num_splits, self.max_splits, -(-max_blocks // self.pages))
        self._plan = (seq_lens, block_table, num_splits, -(-max_blocks // num_splits))

    def run(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        sketch: KeySketch,
        beta: float | torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        return_counters: bool = False,
    ):
        """Attention output ``[num_seqs, num_q_heads, head_dim]`` (in ``out`` if given) and, if asked, counters."""
        _check(self._plan is not None, "DIPRDecode.run called before plan(seq_lens, block_table)")
        seq_lens, block_table, num_splits, blocks_per_split = self._plan
        num_seqs, device = len(seq_lens), seq_lens.device
        self._check_inputs(query, key_cache, value_cache, sketch, num_seqs, device)
        betas = self._betas(beta, num_seqs, device)
        if out is None:
            out = torch.empty_like(query)
        _check(
            out.shape == query.shape and out.dtype == query.dtype and out.stride(-1) == 1,
            f"out must be {list(query.shape)} {query.dtype} with contiguous rows, got {list(out.shape)} {out.dtype}",
        )
        block_g = max(16, triton.next_power_of_2(self.group))
        block_d = triton.next_power_of_2(self.head_dim)
        block_t = triton.next_power_of_2(self.block_size)
        max_blocks = num_splits * blocks_per_split
        dense = not isinstance(beta, torch.Tensor) and beta == float("inf")  # known on the host: no sketch pass
        acc = torch.empty(num_seqs, self.num_q_heads, num_splits, block_d, dtype=torch.float32, device=device)
        m = torch.empty(num_seqs, self.num_q_heads, num_splits, dtype=torch.float32, device=device)
        l = torch.empty_like(m)
        tokens = torch.empty(num_seqs, self.num_q_heads, num_splits, dtype=torch.int32, device=device)
        blocks_read = torch.empty(num_seqs, self.num_kv_heads, num_splits, dtype=torch.int32, device=device)
        if num_seqs == 0:
            return (out, self._counters(blocks_read, tokens, seq_lens)) if return_counters else out
        shape = dict(GROUP=self.group, BLOCK_G=block_g, HEAD_DIM=self.head_dim, BLOCK_D=block_d)
        grid = (num_seqs, self.num_kv_heads, num_splits)
        if dense:
            upper = torch.empty(0, dtype=torch.float32, device=device)
            tau = torch.full((num_seqs, self.num_q_heads), float("-inf"), dtype=torch.float32, device=device)
        else:
            upper = torch.empty(num_seqs, self.num_q_heads, max_blocks, dtype=torch.float32, device=device)
            lower = torch.empty(num_seqs, self.num_q_heads, num_splits, dtype=torch.float32, device=device)
            _sketch_scan_kernel[grid](
                query,
                sketch.codes,
                sketch.scales,
                block_table,
                seq_lens,
                betas,
                upper,
                lower,
                self.scale,
                blocks_per_split,
                num_splits,
                max_blocks,
                query.stride(0),
                query.stride(1),
                *sketch.codes.stride(),
                *sketch.scales.stride(),
                block_table.stride(0),
                BLOCK_SIZE=self.block_size,
                BLOCK_T=block_t,
                PAGES=self.scan_pages,
                HALF=0.5 + CODE_SLACK,
                **dict(shape, BLOCK_G=max(2, triton.next_power_of_2(self.group))),
            )
            tau = lower.amax(-1) - betas[:, None]  # on the device: the host never waits
        _dipr_split_kernel[grid](
            query,
            key_cache,
            value_cache,
            upper,
            block_table,
            seq_lens,
            tau,
            betas,
            acc,
            m,
            l,
            blocks_read,
            tokens,
            self.scale,
            self.sink,
            self.local,
            blocks_per_split,
            num_splits,
            max_blocks,
            query.stride(0),
            query.stride(1),
            *key_cache.stride()[:3],
            *value_cache.stride()[:3],
            block_table.stride(0),
            BLOCK_SIZE=self.block_size,
            BLOCK_T=block_t,
            PAGES=self.pages,
            UPCAST=interpreter_upcast(query.dtype),
            **shape,
        )
        _merge_splits_kernel[(num_seqs, self.num_q_heads)](
            acc,
            m,
            l,
            out,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=self.head_dim,
            BLOCK_D=block_d,
            BLOCK_S=triton.next_power_of_2(num_splits),
        )
        return (out, self._counters(blocks_read, tokens, seq_lens)) if return_counters else out

    def _counters(self, blocks_read, tokens, seq_lens) -> DIPRCounters:
        return DIPRCounters(
            blocks_read.sum(-1, dtype=torch.int32),
            (seq_lens + self.block_size - 1) // self.block_size,
            tokens.sum(-1, dtype=torch.int32),
            seq_lens.clone(),
        )

    def _betas(self, beta: float | torch.Tensor, num_seqs: int, device: torch.device) -> torch.Tensor:
        if isinstance(beta, torch.Tensor):
            _check(
                beta.shape == (num_seqs,),
                f"beta must be a float or a [num_seqs={num_seqs}] tensor, got shape {tuple(beta.shape)}",
            )
            return beta.to(device=device, dtype=torch.float32).contiguous()
        _check(not math.isnan(beta) and beta >= 0, f"beta must be >= 0 (inf = dense), got {beta}")
        return torch.full((num_seqs,), float(beta), dtype=torch.float32, device=device)

    def _check_inputs(self, query, key_cache, value_cache, sketch, num_seqs, device) -> None:
        expected = (num_seqs, self.num_q_heads, self.head_dim)
        _check(
            tuple(query.shape) == expected,
            f"query must be [num_seqs, num_q_heads, head_dim] = {list(expected)}, got {list(query.shape)}",
        )
        check_paged_kv(query, key_cache, value_cache, self.block_size, self.num_kv_heads, self.head_dim, device)
        sketch.check(key_cache)
