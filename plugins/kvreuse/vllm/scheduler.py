"""``--scheduler-cls kvreuse.vllm.PrefixAffinityScheduler``: vLLM's scheduler with a prefix-affinity waiting queue.

vLLM's scheduling pass takes new requests from ``self.waiting`` with ``peek_request``/``pop_request``, so the
whole policy is a different queue: :class:`AffinityRequestQueue` is the engine-free
:class:`~kvreuse.reorder.affinity.PrefixAffinityQueue` with vLLM's ``RequestQueue`` interface, probing vLLM's
prefix cache for each waiting request. Everything else (budgets, allocation, preemption, the queue of
requests that hold KV blocks) is vLLM's own. Settings come from ``additional_config["kvreuse"]["reorder"]``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from operator import attrgetter
from typing import Any

from vllm.config import VllmConfig
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import RequestQueue, SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.request import Request, RequestStatus

from kvreuse.reorder.affinity import PrefixAffinityQueue, PrefixProbe, ReorderCounters, room_to_finish
from kvreuse.reorder.config import ReorderConfig
from kvreuse.vllm.metrics import attach_reorder_counters
from kvreuse.vllm.settings import kvreuse_flags

logger = logging.getLogger("vllm.plugins.kvreuse.scheduler")

# Often enough to watch a long run, rarely enough not to crowd vLLM's own periodic lines.
LOG_EVERY_ADMISSIONS = 1000


class AffinityRequestQueue(PrefixAffinityQueue[Request], RequestQueue):
    """vLLM's ``RequestQueue`` interface over :class:`PrefixAffinityQueue`; ``priority`` only under that policy."""

    def __init__(
        self,
        config: ReorderConfig,
        policy: SchedulingPolicy,
        probe: Callable[[Request], PrefixProbe],
        room: Callable[[Request, PrefixProbe], bool] | None = None,
    ) -> None:
        super().__init__(
            config,
            probe,
            arrival_time=attrgetter("arrival_time"),
            priority=attrgetter("priority") if policy == SchedulingPolicy.PRIORITY else None,
            room=room,
        )


def _is_running(request: Request) -> bool:
    return request.status == RequestStatus.RUNNING


class PrefixAffinityScheduler(Scheduler):
    """vLLM's v1 scheduler admitting waiting requests by prefix affinity, with bounded waiting.

    Constructing it yields :class:`AsyncPrefixAffinityScheduler` (a subclass, so ``isinstance`` holds) when
    ``scheduler_config.async_scheduling`` is on: ``--scheduler-cls`` names one class, and vLLM's async
    scheduler is a different base.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> PrefixAffinityScheduler:
        vllm_config: VllmConfig = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        if cls is PrefixAffinityScheduler and vllm_config.scheduler_config.async_scheduling:
            cls = AsyncPrefixAffinityScheduler
        return super().__new__(cls)

    def __init__(self, vllm_config: VllmConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        self.reorder_config = ReorderConfig.load(kvreuse_flags(vllm_config.additional_config, "reorder"))
        room = self._room_to_finish if self.reorder_config.admit_to_completion else None
        self.waiting: AffinityRequestQueue = AffinityRequestQueue(
            self.reorder_config, self.policy, self._probe_prefix, room
        )
        self._next_log_at = LOG_EVERY_ADMISSIONS
        if not self.kv_cache_manager.enable_caching:
            logger.warning(
                "PrefixAffinityScheduler without prefix caching admits in arrival order: "
                "enable prefix caching for it to reorder anything"
            )
        logger.info(
            "%s: lookahead %d, max_skips %d, max_wait_s %g, admit_to_completion %s",
            type(self).__name__,
            self.reorder_config.lookahead,
            self.reorder_config.max_skips,
            self.reorder_config.max_wait_s,
            self.reorder_config.admit_to_completion,
        )

    def reorder_counters(self) -> ReorderCounters:
        """What the waiting queue has done so far (cumulative)."""
        return self.waiting.counters

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        output = super().schedule(*args, **kwargs)
        self.waiting.close_step(_is_running)
        counters = self.waiting.counters
        if counters.admissions >= self._next_log_at:
            self._next_log_at = (counters.admissions // LOG_EVERY_ADMISSIONS + 1) * LOG_EVERY_ADMISSIONS
            _log_counters(counters)
        return output

    def make_stats(self, *args: Any, **kwargs: Any) -> SchedulerStats | None:
        stats = super().make_stats(*args, **kwargs)
        # The carrier field is read by vLLM only with LoRA; see kvreuse.vllm.metrics.
        if stats is not None and self.lora_config is None:
            attach_reorder_counters(stats, self.waiting.counters)
        return stats

    def shutdown(self) -> None:
        _log_counters(self.waiting.counters)
        super().shutdown()

    def _probe_prefix(self, request: Request) -> PrefixProbe:
        """Look the request's block hashes up in the prefix cache as vLLM will at admission, but through the
        side-effect-free coordinator lookup: ``get_computed_blocks`` may publish KV-cache events (and in older
        vLLM counted a prefix-cache query) for a request that is then not admitted."""
        manager = self.kv_cache_manager
        hashes = request.block_hashes
        if not manager.enable_caching or not hashes:
            return PrefixProbe(0, None)
        cached_tokens = 0
        if manager.prefix_cache_lookup_enabled(request):
            # Like get_computed_blocks: the last token is always recomputed, for its logits.
            _, cached_tokens, _ = manager.coordinator.find_longest_cache_hit(hashes, request.num_tokens - 1)
        next_block = cached_tokens // self.hash_block_size
        next_key = hashes[next_block] if next_block < len(hashes) else None
        return PrefixProbe(cached_tokens // self.block_size, next_key)

    def _room_to_finish(self, request: Request, probe: PrefixProbe) -> bool:
        """Whether ``request`` and every running request fit in the free blocks up to their ``max_tokens``.

        An engine with nothing running always admits. Free blocks include cached blocks no request holds, which
        admitting evicts; the request's own cached leading blocks are not counted as new.
        """
        if not self.running:
            return True

        def blocks(tokens: int) -> int:
            return -(-tokens // self.block_size)

        growth = sum(max(blocks(r.num_prompt_tokens + r.max_tokens) - blocks(r.num_tokens), 0) for r in self.running)
        need = blocks(request.num_prompt_tokens + request.max_tokens) - probe.cached_blocks
        return room_to_finish(self.kv_cache_manager.block_pool.get_num_free_blocks(), need, growth)


class AsyncPrefixAffinityScheduler(PrefixAffinityScheduler, AsyncScheduler):
    """:class:`PrefixAffinityScheduler` over vLLM's ``AsyncScheduler`` (``async_scheduling`` on)."""


def _log_counters(c: ReorderCounters) -> None:
    logger.info(
        "kvreuse reorder: %d admissions, %d out of arrival order, %d with a cached prefix "
        "(%d cached blocks), %d forced by bounded waiting, at most %d skips of one request, "
        "%d passes held for room to finish",
        c.admissions,
        c.out_of_order,
        c.cached_prefix,
        c.cached_blocks,
        c.forced,
        c.max_skips,
        c.held,
    )
