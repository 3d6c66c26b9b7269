"""Sparse attention over vLLM's plain paged KV cache, engine-free: cache write, key sketches, dense causal prefill
and DIPR decode, with the policy deciding per layer and per sequence.

Layouts are the kernels' (``kvreuse.kernels.paged_layout``, ``kvreuse.kernels.key_sketch``):
``key_cache``/``value_cache[num_blocks, block_size, num_kv_heads, head_dim]`` (any strides, last dimension
contiguous) and the keys' ``KeySketch`` (int8 codes indexed like the key cache, one fp32 scale per token and KV
head); a batch is vLLM's: ``query[num_tokens, num_q_heads, head_dim]`` with each request's tokens contiguous
(``query_start_loc[num_reqs + 1]``), ``seq_lens[num_reqs]`` counting the request's new tokens, ``block_table
[num_reqs, max_blocks]`` int32 and ``slot_mapping[num_tokens]`` (negative = padding).

``SparseAttention`` is one object per model shape: ``write`` stores a step's keys and values and sketches the keys
(so the sketch is current after every write, prefill and decode alike); ``attend`` computes a layer's attention
for the whole batch:

- a request with more than one new token (prefill, chunked prefill, speculative verification) gets dense causal
  attention over its cached context and its new tokens;
- a request with one new token (decode) gets DIPR if the policy makes the layer sparse (``dense_layers`` and
  ``layer_betas``) and the sequence is at least ``min_context`` tokens long; its beta may be ``inf``, which DIPR
  computes as exact dense attention. Otherwise it gets the dense path;
- a request whose batch entry carries APE spans (modules spliced with APE, ``kvreuse.sparse.ape``) is dense in
  every layer, prefill and decode, through ``ape_attend`` in PyTorch (the kernels know no APE bias);
- a request whose tokens the module cache moved to their own positions (``query_positions``: recompute inside a
  spliced run) is dense, each token over the keys at or before its position, in PyTorch (the kernels mask by
  order); the step's other requests run as they would without it.

On CUDA, everything runs the Triton launchers: ``PagedKVWrite`` and ``KeySketchWrite`` for the write,
``PagedCausalAttention`` for all the batch's dense requests in one launch per layer, ``DIPRDecode`` for the DIPR
decodes. Elsewhere (vLLM's CPU build, where Triton is off) the same work runs in PyTorch: the write by the
kernels' references, attention by ``kvreuse.sparse.cpu_attention`` (PyTorch's fused attention for prefill, the
paged cache read in place for decode, DIPR computing logits only for the blocks it reads), which attends the same
tokens as the kernels (``kernels=True`` runs the Triton path anyway, e.g. in Triton's interpreter for tests).
An engine's own kernel may take the exact attention instead, DIPR then only choosing the blocks: vLLM's CPU
attention ops (``paged_kernel``; the requests moved by position or with APE run the PyTorch path over the op's cache
read through plain views), or on a GPU its FlashAttention (``decode_kernel``, through
``kvreuse.sparse.filtered_decode``).

Every DIPR decode adds the blocks and tokens it attended to ``figures`` (``AttendedFractions``); dense decodes of
sequences the policy keeps dense add every block and token, so the fractions are over all decode work. Every
``sample_recovery``-th DIPR decode of a layer also adds the share of dense attention mass the attended set kept.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from kvreuse.errors import ConfigError
from kvreuse.errors import check_kernel_argument as _check
from kvreuse.sparse import cpu_attention
from kvreuse.sparse.ape import ApeSpans, ape_attend
from kvreuse.sparse.config import SparseConfig
from kvreuse.sparse.figures import AttendedFractions, sample_recovery, should_sample
from kvreuse.sparse.filtered_decode import FilteredDecode, PagedDecodeKernel
from kvreuse.sparse.policy import INF, RuleBasedPolicy
from kvreuse.sparse.pruned import PrunedTables
from kvreuse.sparse.sketch_scan import prune_by_sketch, write_sketch

if TYPE_CHECKING:  # the kernels' modules import Triton, which the CPU path needs only at call time
    from kvreuse.kernels.dipr_decode import DIPRCounters, DIPRDecode
    from kvreuse.kernels.key_sketch import KeySketch


class PagedKernel(Protocol):
    """An engine's own paged attention kernel and cache write, which ``SparseAttention`` runs behind DIPR's filter
    (``kvreuse.vllm.sparse.cpu_kernel`` for vLLM's CPU_ATTN ops). Caches are the engine's ``[num_blocks,
    kv_heads, block_size, head_dim]`` views (their inner layout is the kernel's own); ``key_cache[:, h : h + 1]``
    must present KV head ``h`` alone."""

    def write(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        clear: torch.Tensor,
    ) -> None:
        """Store ``key``/``value[tokens, kv_heads, head_dim]`` at ``slot_mapping`` (int64, negative: skip), first
        zeroing the blocks ``clear`` (int64): those the write starts without filling, whose other slots still hold
        what the block's previous request wrote (``sketch_scan.write_sketch`` finds them)."""

    def schedule(
        self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_heads: int, num_kv_heads: int
    ) -> object:
        """The kernel's plan for one call over a batch (int32 ``query_start_loc[n + 1]``, ``seq_lens[n]``)."""

    def attend(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        out: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        schedule: object,
    ) -> None:
        """Causal attention of ``query[tokens, heads, head_dim]`` over the first ``seq_lens[i]`` slots of each
        sequence's ``block_table[i]`` blocks (int32) into ``out`` (contiguous)."""

    def attend_pruned(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        out: torch.Tensor,
        tables: PrunedTables,
    ) -> None:
        """Decode attention of ``query[n, heads, head_dim]`` (one token per sequence) into ``out`` (contiguous),
        each KV head's query heads over that head's pruned ``tables`` (``[kv, n, ...]``) alone."""

    def plain_keys(self, key_cache: torch.Tensor) -> torch.Tensor:
        """``key_cache`` as a ``[num_blocks, block_size, kv_heads, head_dim]`` view (for sampled recovery and the
        requests that attend by position or with APE)."""

    def plain_values(self, value_cache: torch.Tensor) -> torch.Tensor:
        """``value_cache`` as a ``[num_blocks, block_size, kv_heads, head_dim]`` view."""


@dataclass(frozen=True)
class PagedBatch:
    """One engine step's batch, as vLLM's attention metadata gives it (see the module docstring).

    ``query_start_loc_cpu`` and ``seq_lens_cpu`` are host copies (per-request loops read them without a device
    sync); ``num_actual_tokens`` excludes padding.
    """

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_actual_tokens: int
    max_seq_len: int
    # Where given (module recompute moved some tokens of the step), each token's position in its sequence; dense
    # attention then masks by position instead of by order.
    query_positions: torch.Tensor | None = None
    # Where given (modules spliced with APE), per request of the batch its module spans, None for a request
    # without; such a request attends with APE (``kvreuse.sparse.ape``), densely, in PyTorch.
    ape: tuple[ApeSpans | None, ...] | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


@dataclass(frozen=True)
class SubBatch:
    """The requests of one step that one kernel serves, with their metadata gathered on the batch's device.

    ``query_starts``/``query_ends``/``seq_lens`` are int32 ``[n]``, ``block_table`` int32 ``[n, max_blocks]`` with
    contiguous rows; ``max_query_len`` is a host int that sizes a launch grid.
    """

    reqs: tuple[int, ...]
    query_starts: torch.Tensor
    query_ends: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    max_query_len: int


@dataclass(frozen=True)
class StepPlan:
    """How one step's batch splits in a layer: dense requests (their tokens in order), DIPR decodes, requests with
    APE (dense, prefill and decode alike), requests with tokens moved to their own positions (dense, by position),
    and the number, blocks and tokens of the decodes kept dense and of the DIPR decodes (for the figures)."""

    dense: SubBatch | None
    dipr: SubBatch | None
    dense_decodes: tuple[int, int, int]
    dipr_decodes: tuple[int, int, int] = (0, 0, 0)
    under_min_context: int = 0  # the longest context of a decode kept dense only for being under min_context
    ape: SubBatch | None = None
    moved: SubBatch | None = None


def gather(batch: PagedBatch, reqs: list[int], max_query_len: int) -> SubBatch:
    """``batch``'s metadata for requests ``reqs``. The request indices reach the device in one copy from pinned
    memory that does not wait for the device, so that planning a step never stalls the host."""
    device = batch.seq_lens.device
    index = torch.tensor(reqs, dtype=torch.long)
    if device.type == "cuda":
        index = index.pin_memory()
    index = index.to(device, non_blocking=True)
    return SubBatch(
        reqs=tuple(reqs),
        query_starts=batch.query_start_loc[:-1].index_select(0, index).to(torch.int32),
        query_ends=batch.query_start_loc[1:].index_select(0, index).to(torch.int32),
        seq_lens=batch.seq_lens.index_select(0, index).to(torch.int32),
        block_table=batch.block_table.index_select(0, index.to(batch.block_table.device)).to(torch.int32).contiguous(),
        max_query_len=max_query_len,
    )


def split_batch(batch: PagedBatch, dense_layer: bool, min_context: int, block_size: int) -> StepPlan:
    """Split ``batch`` as the policy decides for a layer: in a sparse layer (``dense_layer`` false) a request with
    one new token and at least ``min_context`` tokens in all is a DIPR decode; every other request with new tokens
    is dense. A request with APE spans is always dense, on its own path (DIPR's selection knows no APE bias), and so
    is a request whose tokens are not its last ones in order (``query_positions``: the module cache's recompute),
    which is not a decode even with one token. Reads only the batch's host copies."""
    starts = batch.query_start_loc_cpu.tolist()
    lens = batch.seq_lens_cpu.tolist()
    positions = batch.query_positions.tolist() if batch.query_positions is not None else None
    dense_reqs: list[int] = []
    dipr_reqs: list[int] = []
    ape_reqs: list[int] = []
    moved_reqs: list[int] = []
    dense_count = dense_blocks = dense_tokens = under_min_context = 0
    dipr_blocks = dipr_tokens = 0
    for req in range(batch.num_reqs):
        new_tokens = starts[req + 1] - starts[req]
        if new_tokens <= 0:
            continue
        with_ape = batch.ape is not None and batch.ape[req] is not None
        in_order = range(lens[req] - new_tokens, lens[req])
        if not with_ape and positions is not None and positions[starts[req] : starts[req + 1]] != list(in_order):
            moved_reqs.append(req)
            continue
        if new_tokens == 1 and not dense_layer and lens[req] >= min_context and not with_ape:
            dipr_reqs.append(req)
            dipr_blocks += -(-lens[req] // block_size)
            dipr_tokens += lens[req]
            continue
        (ape_reqs if with_ape else dense_reqs).append(req)
        if new_tokens == 1:
            if not dense_layer:
                under_min_context = max(under_min_context, lens[req])
            dense_count += 1
            dense_blocks += -(-lens[req] // block_size)
            dense_tokens += lens[req]
    max_query_len = max((starts[req + 1] - starts[req] for req in dense_reqs), default=0)
    return StepPlan(
        dense=gather(batch, dense_reqs, max_query_len) if dense_reqs else None,
        dipr=gather(batch, dipr_reqs, 1) if dipr_reqs else None,
        dense_decodes=(dense_count, dense_blocks, dense_tokens),
        dipr_decodes=(len(dipr_reqs), dipr_blocks, dipr_tokens),
        under_min_context=under_min_context,
        ape=gather(batch, ape_reqs, max(starts[r + 1] - starts[r] for r in ape_reqs)) if ape_reqs else None,
        moved=gather(batch, moved_reqs, max(starts[r + 1] - starts[r] for r in moved_reqs)) if moved_reqs else None,
    )


class SparseAttention:
    """Cache write, key sketches and attention for one model shape, under one ``SparseConfig``.

    ``configure`` swaps the settings between steps (e.g. to sweep beta on one engine); ``figures`` accumulates the
    attended fractions per layer. ``kernels``: run the Triton kernels (``None``: on CUDA tensors only).
    ``paged_kernel``: the engine's own kernel and cache write, which then do all exact attention over the engine's
    cache layout, DIPR being a filter in front (``_attend_engine``), but for the module cache's requests that attend
    by position or with APE (PyTorch over the kernel's plain views of its cache); ``kernels`` is then not used.
    ``decode_kernel``: a GPU engine's FlashAttention (``kvreuse.sparse.filtered_decode.PagedDecodeKernel``), which
    then computes, with the Triton kernels on, every step without DIPR decodes and, behind the filter, every DIPR
    decode (``_attend_engine``); ``max_seqs`` and ``max_context`` size the filter's buffers.
    """

    def __init__(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        scale: float,
        config: SparseConfig | None = None,
        *,
        kernels: bool | None = None,
        paged_kernel: PagedKernel | None = None,
        decode_kernel: PagedDecodeKernel | None = None,
        max_seqs: int = 256,
        max_context: int = 8192,
    ):
        _check(
            num_kv_heads >= 1 and num_q_heads % num_kv_heads == 0,
            f"num_q_heads ({num_q_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})",
        )
        self.num_q_heads, self.num_kv_heads, self.head_dim, self.block_size = (
            num_q_heads,
            num_kv_heads,
            head_dim,
            block_size,
        )
        self.scale = float(scale)
        self.kernels = kernels
        # Where set, the engine's own kernel computes every exact attention over the engine's cache layout, and
        # DIPR only decides which blocks each decode's KV heads read (``_attend_engine``).
        self.paged_kernel = paged_kernel
        # Where set (a GPU engine's FlashAttention), with the Triton kernels on: a step without DIPR decodes is one
        # call of it, as the stock backend makes it, and DIPR decodes are a filter in front of it
        # (``FilteredDecode``, buffers for ``max_seqs`` decodes of ``max_context`` tokens, made on first use).
        self.decode_kernel = decode_kernel
        self.max_seqs, self.max_context = max_seqs, max_context
        self._filtered: FilteredDecode | None = None
        self._schedule: tuple[PagedBatch, object] | None = None  # the kernel's plan of the current step's batch
        self.log = logging.getLogger("kvreuse.sparse")  # an adapter may hand its engine's logger instead
        self.figures = AttendedFractions()
        self._dipr_steps: dict[int, int] = {}  # DIPR decode calls per layer, for sample_recovery
        self._plans: tuple[PagedBatch, dict[bool, StepPlan]] | None = None  # the current step's, by dense_layer
        self.configure(config or SparseConfig())

    def configure(self, config: SparseConfig) -> None:
        if config.top_pages and self.paged_kernel is None:
            raise ConfigError(
                f"sparse.top_pages ({config.top_pages}) ranks pages in the compiled CPU decision only: it needs vLLM's "
                f"CPU engine with sparse.engine_kernel true (set sparse.top_pages 0)"
            )
        self.config = config
        self.policy = RuleBasedPolicy(config)
        self._plans = None
        self._told_min_context = False

    def allocate_sketch(self, num_blocks: int, device: torch.device | str) -> KeySketch:
        """A zero sketch for a cache of ``num_blocks`` blocks (for engines whose cache has no room for it)."""
        from kvreuse.kernels.key_sketch import KeySketch

        return KeySketch.allocate(num_blocks, self.block_size, self.num_kv_heads, self.head_dim, device)

    def dense_layer(self, layer: int) -> bool:
        """Whether ``layer`` is dense for every sequence (rule 2 of the policy, not overridden by rule 1)."""
        return layer < self.config.dense_layers and self.policy.layer_beta(layer) == INF

    def _use_kernels(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda if self.kernels is None else self.kernels

    # -- write ----------------------------------------------------------------------------------------------------

    def write(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        sketch: KeySketch,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store a step's keys and values and sketch the keys."""
        slots = slot_mapping[: key.shape[0]]
        if self.paged_kernel is not None:
            clear = write_sketch(key.to(key_cache.dtype), sketch, slots, self.block_size)
            self.paged_kernel.write(key, value, key_cache, value_cache, slots, clear)
        elif self._use_kernels(key_cache):
            from kvreuse.kernels.key_sketch import KeySketchWrite
            from kvreuse.kernels.paged_write import PagedKVWrite

            PagedKVWrite(self.block_size, self.num_kv_heads, self.head_dim).run(
                key, value, key_cache, value_cache, slots
            )
            KeySketchWrite(self.block_size, self.num_kv_heads, self.head_dim).run(key_cache, sketch, slots)
        else:
            cpu_attention.store_and_sketch(key, value, key_cache, value_cache, sketch, slots)

    # -- attention ------------------------------------------------------------------------------------------------

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        sketch: KeySketch,
        batch: PagedBatch,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Attention of every real token of ``batch`` in ``layer``, written into ``out[num_tokens, hq, d]``."""
        if self.paged_kernel is not None or (
            self.decode_kernel is not None
            and self._use_kernels(query)
            and batch.ape is None
            and batch.query_positions is None
        ):
            self._attend_engine(layer, query, key_cache, value_cache, sketch, batch, out)
            return out
        plan = self._plan(batch, self.dense_layer(layer))
        count, blocks, tokens = plan.dense_decodes
        if count:
            self.figures.add_dense(layer, blocks * self.num_kv_heads, tokens * self.num_q_heads, count)
        if plan.dense is not None:
            if self._dense_decodes_only(query, plan.dense):
                self._dense_decode_kernels(query, key_cache, value_cache, sketch, plan.dense, batch.max_seq_len, out)
            else:
                self._dense(query, key_cache, value_cache, plan.dense, out)
        if plan.dipr is not None:
            self._dipr_decode(layer, query, key_cache, value_cache, sketch, plan.dipr, batch.max_seq_len, out)
        self._by_position(query, key_cache, value_cache, plan, batch, out)
        return out

    def _plan(self, batch: PagedBatch, dense_layer: bool) -> StepPlan:
        """The step's split of ``batch`` for a dense layer or a sparse one, made by the first layer of each kind
        and reused by the others (a step has at most these two splits)."""
        if self._plans is None or self._plans[0] is not batch:
            self._plans = (batch, {})
        plans = self._plans[1]
        if dense_layer not in plans:
            plans[dense_layer] = split_batch(batch, dense_layer, self.config.min_context, self.block_size)
            if plans[dense_layer].under_min_context and not self._told_min_context:
                self._told_min_context = True
                self.log.info(
                    "kvreuse sparse: decodes of contexts shorter than min_context = %d tokens attend densely in every "
                    "layer (first one: %d tokens); lower sparse.min_context (KVREUSE_SPARSE_MIN_CONTEXT) to prune "
                    "them. Said once per setting.",
                    self.config.min_context,
                    plans[dense_layer].under_min_context,
                )
        return plans[dense_layer]

    def _dense(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        sub: SubBatch,
        out: torch.Tensor,
    ) -> None:
        """Dense causal attention of a sub-batch (prefill, chunked prefill, dense decode) into its rows."""
        if self._use_kernels(query):
            from kvreuse.kernels.paged_causal import PagedCausalAttention

            launcher = PagedCausalAttention(
                self.num_q_heads, self.num_kv_heads, self.head_dim, self.block_size, scale=self.scale
            )
            launcher.plan(sub.query_starts, sub.query_ends, sub.seq_lens, sub.block_table, sub.max_query_len)
            launcher.run(query, key_cache, value_cache, out)
            return
        for i, (first, last, seq_len) in enumerate(
            zip(sub.query_starts.tolist(), sub.query_ends.tolist(), sub.seq_lens.tolist())
        ):
            blocks = sub.block_table[i, : -(-seq_len // self.block_size)]
            if last - first == 1:
                result = cpu_attention.dense_decode(query[first], key_cache, value_cache, blocks, seq_len, self.scale)
            else:
                keys = cpu_attention.sequence_tokens(key_cache, blocks, seq_len)
                values = cpu_attention.sequence_tokens(value_cache, blocks, seq_len)
                result = cpu_attention.dense_causal(query[first:last], keys, values, self.scale)
            out[first:last] = result.to(out.dtype)

    def _dense_decodes_only(self, query: torch.Tensor, sub: SubBatch) -> bool:
        """Whether a dense sub-batch is decodes only (every step once prefills are done), on the kernels:
        then ``DIPRDecode`` at beta = inf, its dense case, serves it with split-K over the context, where
        ``PagedCausalAttention`` gives each sequence and head one program that walks the whole context (on an H200,
        0.6x FlashAttention's decode time against 0.01x at 64K-128K tokens, ``benchmarks/sparse_decode_gpu.py``)."""
        return sub.max_query_len == 1 and self._use_kernels(query)

    def _dense_decode_kernels(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        sketch: KeySketch,
        sub: SubBatch,
        max_seq_len: int,
        out: torch.Tensor,
    ) -> None:
        """Dense decode attention of a decodes-only sub-batch through ``DIPRDecode`` at beta = inf (no sketch read)."""
        rows = sub.query_starts.long()
        launcher = self._dipr_launcher(sub, max_seq_len)
        result = launcher.run(query.index_select(0, rows), key_cache, value_cache, sketch, float("inf"))
        out.index_copy_(0, rows, result.to(out.dtype))

    def _dipr_launcher(self, sub: SubBatch, max_seq_len: int) -> DIPRDecode:
        """The DIPR kernels' launcher for this model's shape and settings, planned for ``sub``'s decodes."""
        from kvreuse.kernels.dipr_decode import DIPRDecode

        launcher = DIPRDecode(
            self.num_q_heads,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
            scale=self.scale,
            sink=self.config.sink,
            local=self.config.local,
        )
        launcher.plan(sub.seq_lens, sub.block_table, max_seq_len=max_seq_len)
        return launcher

    def _by_position(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        plan: StepPlan,
        batch: PagedBatch,
        out: torch.Tensor,
    ) -> None:
        """The step's requests that attend by position (tokens moved by the module cache) or with APE, in PyTorch
        over ``key_cache``/``value_cache`` in the plain layout."""
        if plan.moved is not None:
            assert batch.query_positions is not None
            self._dense_at(query, key_cache, value_cache, plan.moved, out, batch.query_positions)
        if plan.ape is not None:
            assert batch.ape is not None
            self._ape(query, key_cache, value_cache, plan.ape, out, batch.query_positions, batch.ape)

    def _dense_at(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        sub: SubBatch,
        out: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """``_dense`` for a step whose tokens are not all in order: each query attends to the keys at or before
        its own position, read up to the furthest position a query of the request has (a recomputed token may lie
        beyond the request's scheduled length, among loaded keys)."""
        for i, (first, last, seq_len) in enumerate(
            zip(sub.query_starts.tolist(), sub.query_ends.tolist(), sub.seq_lens.tolist())
        ):
            where = positions[first:last]
            length = max(seq_len, int(where.max()) + 1)
            blocks = sub.block_table[i, : -(-length // self.block_size)]
            keys = cpu_attention.sequence_tokens(key_cache, blocks, length)
            values = cpu_attention.sequence_tokens(value_cache, blocks, length)
            result = cpu_attention.dense_at(query[first:last], keys, values, where.to(query.device), self.scale)
            out[first:last] = result.to(out.dtype)

    def _ape(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        sub: SubBatch,
        out: torch.Tensor,
        positions: torch.Tensor | None,
        spans: tuple[ApeSpans | None, ...],
    ) -> None:
        """Attention of the requests with APE spans (prefill, chunked prefill, decode) into their rows, in
        PyTorch on any device: each token at its position (``positions``, else in order after the cached ones)."""
        for i, (first, last, seq_len) in enumerate(
            zip(sub.query_starts.tolist(), sub.query_ends.tolist(), sub.seq_lens.tolist())
        ):
            where = positions[first:last] if positions is not None else torch.arange(seq_len - (last - first), seq_len)
            length = max(seq_len, int(where.max()) + 1)
            blocks = sub.block_table[i, : -(-length // self.block_size)]
            keys = cpu_attention.sequence_tokens(key_cache, blocks, length)
            values = cpu_attention.sequence_tokens(value_cache, blocks, length)
            request_spans = spans[sub.reqs[i]]
            assert request_spans is not None
            result = ape_attend(query[first:last], keys, values, where, request_spans, self.scale)
            out[first:last] = result.to(out.dtype)

    def _dipr_decode(
        self,
        layer: int,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        sketch: KeySketch,
        sub: SubBatch,
        max_seq_len: int,
        out: torch.Tensor,
    ) -> None:
        rows, seq_lens, block_table = sub.query_starts.long(), sub.seq_lens, sub.block_table
        q = query.index_select(0, rows)
        betas = torch.full((len(sub.reqs),), self.policy.layer_beta(layer), dtype=torch.float32, device=query.device)
        sink, local = self.config.sink, self.config.local
        step = self._dipr_steps.get(layer, 0)
        self._dipr_steps[layer] = step + 1
        sampled = should_sample(step, self.config.sample_recovery)
        if self._use_kernels(query):
            launcher = self._dipr_launcher(sub, max_seq_len)
            result, counters = launcher.run(q.contiguous(), key_cache, value_cache, sketch, betas, return_counters=True)
        else:
            result, counters = self._dipr_decode_cpu(q, key_cache, value_cache, sketch, sub, betas)
        if sampled:
            self.figures.add_recovery(
                layer, sample_recovery(q, key_cache, sketch, block_table, seq_lens, betas, self.scale, sink, local)
            )
        out.index_copy_(0, rows, result.to(out.dtype))
        self.figures.add(layer, counters)

    def _dipr_decode_cpu(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        sketch: KeySketch,
        sub: SubBatch,
        betas: torch.Tensor,
    ) -> tuple[torch.Tensor, DIPRCounters]:
        """``_dipr_decode``'s work in PyTorch, sequence by sequence (``cpu_attention.dipr_decode``)."""
        from kvreuse.kernels.dipr_decode import DIPRCounters

        seq_lens = sub.seq_lens.tolist()
        results = [
            cpu_attention.dipr_decode(
                q[i],
                key_cache,
                value_cache,
                sketch,
                sub.block_table[i],
                seq_len,
                beta,
                self.scale,
                self.config.sink,
                self.config.local,
            )
            for i, (seq_len, beta) in enumerate(zip(seq_lens, betas.tolist()))
        ]
        counters = DIPRCounters(
            torch.stack([r.blocks_read for r in results]).to(torch.int32),
            (sub.seq_lens + self.block_size - 1) // self.block_size,
            torch.stack([r.tokens_attended for r in results]).to(torch.int32),
            sub.seq_lens.clone(),
        )
        return torch.stack([r.out for r in results]), counters

    # -- DIPR as a filter in front of the engine's kernel ----------------------------------------------------------

    def _attend_engine(
        self,
        layer: int,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        sketch: KeySketch,
        batch: PagedBatch,
        out: torch.Tensor,
    ) -> None:
        """``attend`` through the engine's own kernel (``paged_kernel``: vLLM's CPU op; ``decode_kernel``: a GPU
        engine's FlashAttention): a layer without DIPR decodes (a dense layer, beta = inf, every decode under
        ``min_context``, prefill) is one call of the kernel over the whole batch, as the stock backend makes it;
        otherwise the dense requests run apart (one call of the CPU op; kvreuse's Triton path on a GPU) and the DIPR
        decodes read, per KV head, only the blocks the sketch keeps (``_pruned_decode``, ``_filtered_decode``). On
        the CPU op, requests moved by position or with APE run apart in PyTorch (``_by_position``)."""
        plan = self._plan(batch, self.dense_layer(layer))
        count, blocks, tokens = plan.dense_decodes
        if count:
            self.figures.add_dense(layer, blocks * self.num_kv_heads, tokens * self.num_q_heads, count)
        beta = self.policy.layer_beta(layer)
        count, blocks, tokens = plan.dipr_decodes
        if count and beta == INF:  # DIPR decodes at beta = inf read everything
            self.figures.add_full(layer, blocks * self.num_kv_heads, tokens * self.num_q_heads, count)
        kernel = self.paged_kernel
        if plan.moved is None and plan.ape is None and (plan.dipr is None or beta == INF):
            self._whole_batch(query, key_cache, value_cache, batch, out)
        elif kernel is not None:
            # the op serves the requests in order; those moved by position or with APE, which it cannot mask or
            # bias, run kvreuse's PyTorch attention over plain views of its tiles (requests that splice modules)
            if plan.dense is not None:
                self._dense_through(kernel, query, key_cache, value_cache, plan.dense, out)
            if plan.dipr is not None and beta == INF:
                self._dense_through(kernel, query, key_cache, value_cache, plan.dipr, out)
            elif plan.dipr is not None:
                self._pruned_decode(
                    layer, beta, query, key_cache, value_cache, sketch, plan.dipr, plan.dipr_decodes, out, kernel
                )
            # plain views only where read: on a variant whose key tiles kvreuse does not read they would refuse
            if plan.moved is not None or plan.ape is not None:
                keys, values = kernel.plain_keys(key_cache), kernel.plain_values(value_cache)
                self._by_position(query, keys, values, plan, batch, out)
        else:
            # (``attend`` gives a GPU step with positions or APE to kvreuse's own path)
            assert plan.dipr is not None and plan.moved is None and plan.ape is None
            if plan.dense is not None:
                self._dense(query, key_cache, value_cache, plan.dense, out)
            self._filtered_decode(layer, beta, query, key_cache, value_cache, sketch, plan.dipr, batch.max_seq_len, out)

    def _whole_batch(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        batch: PagedBatch,
        out: torch.Tensor,
    ) -> None:
        """Every request of ``batch`` in one call of the engine's kernel, exactly the stock backend's call."""
        n = batch.num_actual_tokens
        if self.paged_kernel is not None:
            if self._schedule is None or self._schedule[0] is not batch:  # one schedule per step, for every layer
                self._schedule = (
                    batch,
                    self.paged_kernel.schedule(
                        batch.query_start_loc, batch.seq_lens, self.num_q_heads, self.num_kv_heads
                    ),
                )
            self.paged_kernel.attend(
                query[:n],
                key_cache,
                value_cache,
                out[:n],
                batch.query_start_loc,
                batch.seq_lens,
                batch.block_table,
                self._schedule[1],
            )
            return
        assert self.decode_kernel is not None
        starts = batch.query_start_loc_cpu
        self.decode_kernel(
            query[:n],
            key_cache,
            value_cache,
            out[:n],
            batch.query_start_loc,
            batch.seq_lens,
            int((starts[1:] - starts[:-1]).max()),
            batch.max_seq_len,
            batch.block_table,
            self.scale,
        )

    def _dense_through(
        self,
        kernel: PagedKernel,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        sub: SubBatch,
        out: torch.Tensor,
    ) -> None:
        """The dense requests of a step that also has DIPR decodes: their rows gathered, one kernel call."""
        starts, ends = sub.query_starts.tolist(), sub.query_ends.tolist()
        rows = torch.cat([torch.arange(a, b) for a, b in zip(starts, ends)]).to(query.device)
        lengths = torch.tensor([b - a for a, b in zip(starts, ends)], dtype=torch.int32)
        query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
        result = torch.empty((len(rows), *query.shape[1:]), dtype=query.dtype, device=query.device)
        schedule = kernel.schedule(query_start_loc, sub.seq_lens, self.num_q_heads, self.num_kv_heads)
        kernel.attend(
            query.index_select(0, rows),
            key_cache,
            value_cache,
            result,
            query_start_loc,
            sub.seq_lens,
            sub.block_table,
            schedule,
        )
        out.index_copy_(0, rows, result.to(out.dtype))

    def _pruned_decode(
        self,
        layer: int,
        beta: float,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        sketch: KeySketch,
        sub: SubBatch,
        totals: tuple[int, int, int],
        out: torch.Tensor,
        kernel: PagedKernel,
    ) -> None:
        """DIPR decodes through the engine's kernel: the sketch decides, per sequence and KV head, which blocks to
        read (``sketch_scan.prune_by_sketch``, one compiled pass over the codes: window blocks and those with a key
        whose upper bound reaches ``tau``), and the kernel attends every token of those blocks, each KV head on its
        own pruned tables, in one call (``PagedKernel.attend_pruned``). Every key within beta of the largest logit
        is in a read block, so it is attended; the kernel also attends the read blocks' other tokens (a superset of
        the Triton kernel's set, at no extra bytes read). ``totals``: the decodes' number, blocks and tokens (the
        plan's ``dipr_decodes``); the figures are counted on the host, where the pruned tables are. Where the
        decodes are the batch's first requests (a step of decodes only), their rows are its first, one each, and the
        kernel reads their queries and writes their outputs in place: this runs once per layer and step, and every
        tensor call it saves is a few microseconds more of the step."""
        m, kv = len(sub.reqs), self.num_kv_heads
        in_place = sub.reqs == tuple(range(m)) and out.dtype == query.dtype and out.is_contiguous()
        rows = None if in_place else sub.query_starts.long()
        q = query[:m] if rows is None else query.index_select(0, rows)  # [m, hq, d]
        group = self.num_q_heads // kv
        sink, local = self.config.sink, self.config.local
        scaled = q.float().view(m, kv, group, self.head_dim) * self.scale
        pruned = prune_by_sketch(
            scaled, sketch, sub.block_table, sub.seq_lens, beta, sink, local, self.config.top_pages
        )
        if rows is None:
            kernel.attend_pruned(q, key_cache, value_cache, out[:m], pruned)
        else:
            result = torch.empty_like(q)
            kernel.attend_pruned(q, key_cache, value_cache, result, pruned)
            out.index_copy_(0, rows, result.to(out.dtype))
        self._sample_recovery(layer, beta, q, lambda: kernel.plain_keys(key_cache), sketch, sub)
        count, blocks, tokens = totals
        self.figures.add_read(
            layer,
            int(pruned.kept.numpy().sum()),
            blocks * kv,
            int(pruned.seq_lens.numpy().sum()) * group,
            tokens * self.num_q_heads,
            count,
        )

    # -- DIPR as a filter in front of a GPU engine's FlashAttention ------------------------------------------------

    def _filtered_decode(
        self,
        layer: int,
        beta: float,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        sketch: KeySketch,
        sub: SubBatch,
        max_seq_len: int,
        out: torch.Tensor,
    ) -> None:
        """DIPR decodes of ``sub`` through ``FilteredDecode`` (the kernel attends every token of the blocks read: a
        superset of ``DIPRDecode``'s set over the same bytes, so no key within beta of the largest is dropped)."""
        from kvreuse.kernels.dipr_decode import DIPRCounters

        assert self.decode_kernel is not None
        if self._filtered is None or self._filtered.block_size != self.block_size:
            self._filtered = FilteredDecode(
                self.num_q_heads,
                self.num_kv_heads,
                self.head_dim,
                self.block_size,
                self.scale,
                max_seqs=self.max_seqs,
                max_blocks=-(-self.max_context // self.block_size),
                kernel=self.decode_kernel,
            )
        rows = sub.query_starts.long()
        q = query.index_select(0, rows)
        result = torch.empty_like(q)
        sink, local = self.config.sink, self.config.local
        counts = self._filtered.run(
            q, key_cache, value_cache, sketch, sub.seq_lens, sub.block_table, max_seq_len, beta, sink, local, result
        )
        out.index_copy_(0, rows, result.to(out.dtype))
        self._sample_recovery(layer, beta, q, lambda: key_cache, sketch, sub)
        self.figures.add(
            layer,
            DIPRCounters(
                counts.blocks_read.to(torch.int32),
                (sub.seq_lens + self.block_size - 1) // self.block_size,
                # every token of the blocks read: the kernel attends them all
                counts.tokens_attended.repeat_interleave(self.num_q_heads // self.num_kv_heads, dim=1),
                sub.seq_lens.clone(),
            ),
        )

    def _sample_recovery(
        self,
        layer: int,
        beta: float,
        q: torch.Tensor,
        plain_keys: Callable[[], torch.Tensor],
        sketch: KeySketch,
        sub: SubBatch,
    ) -> None:
        """Every ``sample_recovery`` DIPR steps of ``layer``, the share of dense attention mass kept by the Triton
        kernel's set over ``plain_keys()`` (the cache in the plain ``[blocks, block_size, kv, d]`` layout, made only
        when sampled)."""
        step = self._dipr_steps.get(layer, 0)
        self._dipr_steps[layer] = step + 1
        if should_sample(step, self.config.sample_recovery):
            self.figures.add_recovery(
                layer,
                sample_recovery(
                    q.float(),
                    plain_keys(),
                    sketch,
                    sub.block_table,
                    sub.seq_lens,
                    beta,
                    self.scale,
                    self.config.sink,
                    self.config.local,
                ),
            )
