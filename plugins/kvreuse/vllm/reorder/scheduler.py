"""``--scheduler-cls kvreuse.vllm.PrefixAffinityScheduler``: vLLM's scheduler with a prefix-affinity waiting queue.

vLLM's scheduling pass takes new requests from its waiting queue with ``peek_request``/``pop_request``, so the
whole policy is a different queue: :class:`AffinityRequestQueue` is the engine-free
:class:`~kvreuse.reorder.affinity.PrefixAffinityQueue` with vLLM's ``RequestQueue`` interface, probing vLLM's
prefix cache for each waiting request (``kvreuse.patches.vllm_0_32.cached_prefix``), and it takes the place of
vLLM's own queue (``replace_waiting_queue``). Everything else (budgets, allocation, preemption, the queue of
requests that hold KV blocks) is vLLM's own. Settings come from ``additional_config["kvreuse"]["reorder"]``.

It warns when the KV block size keeps prompts from sharing anything (``kvreuse.reorder.block_size``): at start when
the block size is the platform's default and larger than 32 tokens (vLLM's CPU platform: 128), and once when at
least half of the first 32 admitted prompts are shorter than one block. Its counters are logged every 1,000
admissions and at shutdown here, in the engine core; ``vllm serve`` stops the engine core without its shutdown
(``mode=abort`` on Ctrl-C), so there the front end's stat logger (``kvreuse.vllm.reorder.metrics.ReorderStatLogger``)
logs the same line with vLLM's periodic figures.
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

from kvreuse.patches import vllm_0_32
from kvreuse.reorder.admission import counters_summary
from kvreuse.reorder.affinity import PrefixAffinityQueue, PrefixProbe, ReorderCounters, room_to_finish
from kvreuse.reorder.block_size import ShortPromptWatch, block_size_warning
from kvreuse.reorder.config import ReorderConfig
from kvreuse.vllm.reorder.metrics import attach_reorder_counters
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
        if cls is PrefixAffinityScheduler:
            cls = vllm_0_32.scheduler_class(cls, AsyncPrefixAffinityScheduler, args, kwargs)
        return super().__new__(cls)

    def __init__(self, vllm_config: VllmConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        self.reorder_config = ReorderConfig.load(kvreuse_flags(vllm_config.additional_config, "reorder"))
        room = self._room_to_finish if self.reorder_config.admit_to_completion else None
        self.affinity_queue = AffinityRequestQueue(
            self.reorder_config, vllm_0_32.scheduling_policy(self), self._probe_prefix, room
        )
        vllm_0_32.replace_waiting_queue(self, self.affinity_queue)
        self._next_log_at = LOG_EVERY_ADMISSIONS
        if not vllm_0_32.prefix_caching_enabled(self):
            logger.warning(
                "PrefixAffinityScheduler without prefix caching admits in arrival order: "
                "enable prefix caching for it to reorder anything"
            )
        cache = vllm_config.cache_config
        warning = block_size_warning(cache.block_size, cache.user_specified_block_size)
        if warning:
            logger.warning("%s", warning)
        self._short_prompts = ShortPromptWatch(cache.block_size)
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
        return self.affinity_queue.counters

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        output = super().schedule(*args, **kwargs)
        self.affinity_queue.close_step(_is_running)
        if not self._short_prompts.done:
            self._watch_prompt_lengths(output)
        counters = self.affinity_queue.counters
        if counters.admissions >= self._next_log_at:
            self._next_log_at = (counters.admissions // LOG_EVERY_ADMISSIONS + 1) * LOG_EVERY_ADMISSIONS
            logger.info("%s", counters_summary(counters, "blocks"))
        return output

    def make_stats(self, *args: Any, **kwargs: Any) -> SchedulerStats | None:
        stats = super().make_stats(*args, **kwargs)
        # The carrier field is read by vLLM only with LoRA; see kvreuse.vllm.reorder.metrics.
        if stats is not None and not vllm_0_32.lora_enabled(self):
            attach_reorder_counters(stats, self.affinity_queue.counters)
        return stats

    def shutdown(self) -> None:
        logger.info("%s", counters_summary(self.affinity_queue.counters, "blocks"))
        super().shutdown()

    def _watch_prompt_lengths(self, output: SchedulerOutput) -> None:
        """Feed the lengths of the step's newly admitted prompts to the short-prompt check (a warning, once)."""
        lengths = [len(new.prompt_token_ids) for new in output.scheduled_new_reqs if new.prompt_token_ids is not None]
        warning = self._short_prompts.observe(lengths)
        if warning:
            logger.warning("%s", warning)

    def _probe_prefix(self, request: Request) -> PrefixProbe:
        """The request's prompt in vLLM's prefix cache now, looked up as vLLM will at admission but without side
        effects (``kvreuse.patches.vllm_0_32.cached_prefix``)."""
        cached = vllm_0_32.cached_prefix(self, request)
        return PrefixProbe(cached.blocks, cached.next_block_hash)

    def _room_to_finish(self, request: Request, probe: PrefixProbe) -> bool:
        """Whether ``request`` and every running request fit in the free blocks up to their ``max_tokens``
        (``kvreuse.reorder.affinity.room_to_finish``); an engine with nothing running always admits."""
        room = vllm_0_32.kv_room(self, request, probe.cached_blocks)
        return room is None or room_to_finish(room.free_blocks, room.request_blocks, room.running_growth)


class AsyncPrefixAffinityScheduler(PrefixAffinityScheduler, AsyncScheduler):
    """:class:`PrefixAffinityScheduler` over vLLM's ``AsyncScheduler`` (``async_scheduling`` on)."""
