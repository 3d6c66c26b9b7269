"""Figures of DIPR sparse attention: how much of the context each layer attends, and how much attention it keeps.

- *Fraction of blocks attended*: KV blocks whose keys and values were loaded, over all blocks of the batch's
  sequences (per KV head); 1 - this is the share of K/V bytes saved.
- *Fraction of tokens attended*: tokens in the attended set over all tokens (per query head).
- *Recovery ratio*: the share of the dense attention mass ``sum_{j in A} softmax(l)_j`` that the attended set
  ``A`` keeps (1 = nothing of weight dropped). It needs every logit, so it is computed by the PyTorch reference
  on sampled steps (``SparseConfig.sample_recovery``), not by the kernel.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the kernels need Triton; the figures import them only when sampling
    from kvreuse.kernels.dipr_decode import DIPRCounters
    from kvreuse.kernels.key_sketch import KeySketch


def should_sample(step: int, every: int) -> bool:
    """Whether decode step ``step`` (counted from 0) measures the recovery ratio; ``every = 0`` never does."""
    return every > 0 and step % every == 0


def recovery_ratio(logits: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """Share of the dense softmax mass of ``logits[..., n]`` that lies on ``attended[..., n]`` (fp32 ``[...]``)."""
    weights = torch.softmax(logits.float(), dim=-1)
    return (weights * attended).sum(-1)


def sample_recovery(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    sketch: KeySketch,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    beta: float | torch.Tensor,
    scale: float,
    sink: int,
    local: int,
) -> torch.Tensor:
    """Recovery ratio ``[num_seqs, num_q_heads]`` of the set the DIPR kernel attends, by the reference."""
    from kvreuse.kernels.dipr_decode import dipr_selection_reference

    sel = dipr_selection_reference(query, key_cache, sketch, block_table, seq_lens, beta, scale, sink, local)
    if not sel.logits:
        return torch.zeros(0, query.shape[1])
    return torch.stack([recovery_ratio(lg, at) for lg, at in zip(sel.logits, sel.attended)])


COUNTERS = ("blocks_read", "blocks_total", "tokens_attended", "tokens_total")
# Cumulative figures per layer: the kernel's COUNTERS, the number of decodes (sequence x layer) that ran DIPR and
# that the policy kept dense, then the sum of the sampled recovery ratios and their number.
DECODES = ("dipr_decodes", "dense_decodes")
FIGURES = COUNTERS + DECODES + ("recovery_kept", "recovery_samples")


@dataclass
class _LayerSums:
    counts: torch.Tensor | None = None  # DIPR decodes' int64 [len(COUNTERS)], on the device the kernel ran on
    # COUNTERS counted on the host: decodes kept dense and DIPR decodes at beta = inf (they read every block x KV
    # head and token x query head), and DIPR decodes whose blocks were chosen on the host (a CPU engine's op)
    host: list[int] = field(default_factory=lambda: [0] * len(COUNTERS))
    dipr_decodes: int = 0  # host ints: how many sequences decoded with DIPR / densely in this layer
    dense_decodes: int = 0
    recovery_kept: float = 0.0
    recovery_samples: int = 0
    recovery_min: float = math.inf

    def add_host(self, blocks_read: int, blocks_total: int, tokens_attended: int, tokens_total: int) -> None:
        for at, value in enumerate((blocks_read, blocks_total, tokens_attended, tokens_total)):
            self.host[at] += value


class AttendedFractions:
    """Per-layer sums of the kernel's counters and of sampled recovery ratios.

    ``add`` keeps the sums on the counters' device (no host read per layer and step); ``add_dense`` (decodes the
    policy kept dense: they read everything), ``add_full`` (beta = inf) and ``add_read`` (counts the host already
    holds) sum on the host; ``rows`` reads both, and ``FigureIncrements`` copies the device sums to the host without
    waiting for the device.
    """

    def __init__(self) -> None:
        self._layers: dict[int, _LayerSums] = {}

    def add(self, layer: int, counters: DIPRCounters) -> None:
        sums = self._layers.setdefault(layer, _LayerSums())
        kv_heads, q_heads = counters.blocks_read.shape[1], counters.tokens_attended.shape[1]
        step = torch.stack(
            (
                counters.blocks_read.sum(dtype=torch.int64),
                counters.blocks_total.sum(dtype=torch.int64) * kv_heads,
                counters.tokens_attended.sum(dtype=torch.int64),
                counters.tokens_total.sum(dtype=torch.int64) * q_heads,
            )
        )
        sums.counts = step if sums.counts is None else sums.counts + step
        sums.dipr_decodes += counters.blocks_total.shape[0]  # a shape: known on the host without a device read

    def add_dense(self, layer: int, blocks: int, tokens: int, decodes: int) -> None:
        """``decodes`` dense decodes of ``layer`` that read ``blocks`` KV blocks x KV heads and ``tokens`` tokens x
        query heads (all of their contexts)."""
        sums = self._layers.setdefault(layer, _LayerSums())
        sums.add_host(blocks, blocks, tokens, tokens)
        sums.dense_decodes += decodes

    def add_full(self, layer: int, blocks: int, tokens: int, decodes: int) -> None:
        """``decodes`` DIPR decodes of ``layer`` at beta = inf, which read all their ``blocks`` KV blocks x KV heads
        and ``tokens`` tokens x query heads: counted on the host like ``add_dense``'s, as DIPR decodes (no counter
        tensors per layer and step for what the plan already knows)."""
        self.add_read(layer, blocks, blocks, tokens, tokens, decodes)

    def add_read(
        self, layer: int, blocks_read: int, blocks_total: int, tokens_attended: int, tokens_total: int, decodes: int
    ) -> None:
        """``decodes`` DIPR decodes of ``layer`` whose ``COUNTERS`` the host already holds (a CPU engine's pruned
        tables): summed on the host, without the tensor arithmetic ``add`` makes per layer and step."""
        sums = self._layers.setdefault(layer, _LayerSums())
        sums.add_host(blocks_read, blocks_total, tokens_attended, tokens_total)
        sums.dipr_decodes += decodes

    def add_recovery(self, layer: int, ratios: torch.Tensor) -> None:
        ratios = ratios.detach().flatten().double().cpu()
        if ratios.numel():
            sums = self._layers.setdefault(layer, _LayerSums())
            sums.recovery_kept += float(ratios.sum())
            sums.recovery_samples += ratios.numel()
            sums.recovery_min = min(sums.recovery_min, float(ratios.min()))

    def counter_totals(self) -> tuple[tuple[int, ...], torch.Tensor]:
        """The layers DIPR ran in and their cumulative ``COUNTERS``, ``int64 [layers, len(COUNTERS)]`` on the
        kernels' device: stacked there, not read, so that the caller decides when the host waits."""
        layers = tuple(layer for layer in sorted(self._layers) if self._layers[layer].counts is not None)
        if not layers:
            return (), torch.zeros(0, len(COUNTERS), dtype=torch.int64)
        return layers, torch.stack([counts for layer in layers if (counts := self._layers[layer].counts) is not None])

    def host_totals(self) -> dict[int, tuple[int, ...]]:
        """Per layer with decodes counted on the host (``add_dense``, ``add_full``, ``add_read``): their cumulative
        ``COUNTERS`` (host values)."""
        return {layer: tuple(sums.host) for layer, sums in sorted(self._layers.items()) if any(sums.host)}

    def decode_totals(self) -> dict[int, tuple[int, int]]:
        """Per layer: how many decodes ran DIPR and how many the policy kept dense (``DECODES``, host values)."""
        return {layer: (sums.dipr_decodes, sums.dense_decodes) for layer, sums in sorted(self._layers.items())}

    def recovery_totals(self) -> dict[int, tuple[float, int]]:
        """Per layer with samples: the sum of the sampled recovery ratios and their number (host values)."""
        return {
            layer: (sums.recovery_kept, sums.recovery_samples)
            for layer, sums in sorted(self._layers.items())
            if sums.recovery_samples
        }

    def rows(self) -> list[dict[str, float | int | None]]:
        """One row per layer: ``layer``, its ``COUNTERS`` (DIPR and dense decodes) and ``DECODES``, ``block_fraction``,
        ``token_fraction``, ``recovery_mean``, ``recovery_min``, ``samples``."""
        rows = []
        for layer in sorted(self._layers):
            sums = self._layers[layer]
            counts = [0] * len(COUNTERS) if sums.counts is None else sums.counts.tolist()
            blocks_read, blocks_total, tokens_attended, tokens_total = (a + b for a, b in zip(counts, sums.host))
            sampled = sums.recovery_samples > 0
            rows.append(
                {
                    "layer": layer,
                    "blocks_read": blocks_read,
                    "blocks_total": blocks_total,
                    "tokens_attended": tokens_attended,
                    "tokens_total": tokens_total,
                    "dipr_decodes": sums.dipr_decodes,
                    "dense_decodes": sums.dense_decodes,
                    "block_fraction": blocks_read / blocks_total if blocks_total else None,
                    "token_fraction": tokens_attended / tokens_total if tokens_total else None,
                    "recovery_mean": sums.recovery_kept / sums.recovery_samples if sampled else None,
                    "recovery_min": sums.recovery_min if sampled else None,
                    "samples": sums.recovery_samples,
                }
            )
        return rows


@dataclass
class _HostCopy:
    """Counter totals on their way to host memory; ``event`` is ``None`` when ``values`` is already readable."""

    layers: tuple[int, ...]
    values: torch.Tensor
    event: torch.cuda.Event | None

    def done(self) -> bool:
        return self.event is None or bool(self.event.query())  # type: ignore[no-untyped-call]


def _copy_to_host(layers: tuple[int, ...], totals: torch.Tensor) -> _HostCopy:
    if not totals.is_cuda:
        return _HostCopy(layers, totals, None)
    # Pinned memory from PyTorch's caching host allocator (reused, not allocated anew each step).
    values = torch.empty(totals.shape, dtype=totals.dtype, pin_memory=True)
    values.copy_(totals, non_blocking=True)
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    event.record()
    return _HostCopy(layers, values, event)


class FigureIncrements:
    """How much each of ``FIGURES`` grew, per layer, since the last call: the per-step increments an engine's
    metrics want.

    Reading GPU counters on the host every step would make the engine's CPU wait for its GPU and undo the overlap
    of scheduling and compute that engines build (vLLM's async scheduling). So each call queues a copy of the
    current totals to pinned host memory behind the work that updated them, and reports up to the newest copy
    that has landed, usually the previous step's: on a GPU the figures arrive a step late, never lost. On the CPU
    the copy is the tensor itself and the figures are current. A new ``AttendedFractions`` (figures reset) starts
    the counts again from zero.
    """

    MAX_IN_FLIGHT = 4  # copies queued before new ones are skipped (a GPU this far behind gets them later)

    def __init__(self) -> None:
        self._source: AttendedFractions | None = None
        self._reported: dict[tuple[str, int], float] = {}
        self._landed: dict[tuple[str, int], float] = {}  # the device sums as of the newest copy that landed
        self._copies: deque[_HostCopy] = deque()

    def take(self, fractions: AttendedFractions) -> dict[tuple[str, int], float]:
        """``{(figure, layer): increment}`` for the figures that grew (``figure`` in ``FIGURES``)."""
        if fractions is not self._source:
            self._source, self._reported, self._landed, self._copies = fractions, {}, {}, deque()
        layers, totals = fractions.counter_totals()
        if layers and len(self._copies) < self.MAX_IN_FLIGHT:
            self._copies.append(_copy_to_host(layers, totals))
        landed = None
        while self._copies and self._copies[0].done():
            landed = self._copies.popleft()
        if landed is not None:
            for layer, row in zip(landed.layers, landed.values.tolist()):
                self._landed.update({(name, layer): value for name, value in zip(COUNTERS, row)})
        now = dict(self._landed)
        for layer, host in fractions.host_totals().items():
            for name, value in zip(COUNTERS, host):
                now[(name, layer)] = now.get((name, layer), 0) + value
        for layer, decodes in fractions.decode_totals().items():
            now.update({(name, layer): value for name, value in zip(DECODES, decodes)})
        for layer, (kept, samples) in fractions.recovery_totals().items():
            now.update({("recovery_kept", layer): kept, ("recovery_samples", layer): samples})
        grown = {key: value - self._reported.get(key, 0) for key, value in now.items()}
        self._reported.update(now)
        return {key: value for key, value in grown.items() if value}
