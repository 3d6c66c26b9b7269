"""kvreuse's waiting-queue orders as an SGLang schedule policy (``KVREUSE_SGLANG_SCHEDULE_POLICY``).

SGLang's scheduler asks its ``SchedulePolicy`` to sort the waiting list in place (``calc_priority``) before every
prefill pass, then admits requests from the front of the list until a budget runs out and drops them from the
list. :class:`KVReuseSchedulePolicy` is that class with two more orders; ``register()`` puts it in place of
SGLang's ``SchedulePolicy`` through SGLang's ``HookRegistry`` (a class REPLACE), and it behaves exactly like
SGLang's own class unless ``KVREUSE_SGLANG_SCHEDULE_POLICY`` names one of kvreuse's orders:

* ``prefix-affinity``: :class:`~kvreuse.reorder.affinity.PrefixAffinityQueue` (cached prefixes first, requests
  that share an uncached prefix together, bounded waiting by ``max_skips``/``max_wait_s``, priority first), probing
  SGLang's radix cache for each waiting request with ``match_kv_cache``, as SGLang's own ``lpm`` does;
* ``module-sets``: :func:`~kvreuse.reorder.admission.order_by_module_sets` over the modules each request uses,
  starting from the oldest request of the best priority.

The queue hands requests out one pick at a time, where SGLang sorts a list and admits a prefix of it;
:class:`~kvreuse.reorder.admission.AffinityOrder` bridges the two without changing what a pick or a skip means.
Settings: ``KVREUSE_REORDER_*`` (``ReorderConfig``) and ``KVREUSE_SGLANG_*`` (``SGLangConfig``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from typing import Any

from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.schedule_policy import SchedulePolicy

from kvreuse.errors import ConfigError
from kvreuse.modules.trie import ModuleTrie
from kvreuse.patches import sglang_0_5
from kvreuse.reorder.admission import AffinityOrder, counters_summary, order_by_module_sets
from kvreuse.reorder.affinity import PrefixProbe, ReorderCounters
from kvreuse.reorder.config import ReorderConfig
from kvreuse.sglang.names import SchedulePolicyName
from kvreuse.sglang.settings import SGLangConfig, read_modules_file

logger = logging.getLogger("sglang.plugins.kvreuse.scheduler")

LOG_EVERY_ADMISSIONS = 1000


def _token_bytes(ids: Any) -> bytes | tuple[int, ...]:
    return ids.tobytes() if hasattr(ids, "tobytes") else tuple(ids)  # SGLang keeps token ids in array("q")


class KVReuseSchedulePolicy(SchedulePolicy):
    """SGLang's ``SchedulePolicy`` with kvreuse's orders; SGLang's own unless ``KVREUSE_SGLANG_SCHEDULE_POLICY``
    names one (it then takes the place of ``--schedule-policy``, which still decides nothing else)."""

    # Seconds clock of the bounded wait, the one SGLang stamps ``wait_queue_entry_time`` with.
    clock: Callable[[], float] = staticmethod(time.perf_counter)

    def __init__(
        self,
        policy: str,
        tree_cache: Any,
        enable_hierarchical_cache: bool,
        enable_priority_scheduling: bool,
        schedule_low_priority_values_first: bool,
        *,
        settings: SGLangConfig | None = None,
        reorder: ReorderConfig | None = None,
    ) -> None:
        self.settings = settings or SGLangConfig.load()
        self.kvreuse_policy = self.settings.schedule_policy or None
        # SGLang's own policy state is built for fcfs when kvreuse orders the queue: the rest of SGLang asks the
        # policy object only for the chunk limit of shortest-prefill-first and whether the queue was matched.
        super().__init__(
            "fcfs" if self.kvreuse_policy else policy,
            tree_cache,
            enable_hierarchical_cache,
            enable_priority_scheduling,
            schedule_low_priority_values_first,
        )
        self.order: AffinityOrder[Req] | None = None
        if self.kvreuse_policy is None:
            return
        self.reorder_config = reorder or ReorderConfig.load()
        self._priority = self._signed_priority if enable_priority_scheduling else None
        self._next_log_at = LOG_EVERY_ADMISSIONS
        if sglang_0_5.cache_disabled(tree_cache):
            logger.warning(
                "kvreuse %s without the radix cache (--disable-radix-cache) orders requests as they arrived",
                self.kvreuse_policy,
            )
        if self.kvreuse_policy == SchedulePolicyName.PREFIX_AFFINITY:
            self.order = AffinityOrder(
                self.reorder_config, self._probe_prefix, sglang_0_5.arrival_time, self._priority, clock=type(self).clock
            )
            page = sglang_0_5.cache_page_size(tree_cache)
            self.block_tokens = -(-self.settings.affinity_block // page) * page
        else:
            self.module_trie = self._module_trie(tree_cache)
            self._module_ids: dict[Hashable, int] = {}
        logger.info(
            "kvreuse schedule policy %s (in place of --schedule-policy %s): lookahead %d, max_skips %d, max_wait_s %g",
            self.kvreuse_policy,
            policy,
            self.reorder_config.lookahead,
            self.reorder_config.max_skips,
            self.reorder_config.max_wait_s,
        )

    def calc_priority(
        self, waiting_queue: list[Req], running_batch: ScheduleBatch | None = None, processed_tokens: int = 0
    ) -> None:
        if self.kvreuse_policy is None:
            return super().calc_priority(waiting_queue, running_batch, processed_tokens)
        if self.order is not None:
            waiting_queue[:] = self.order.plan(waiting_queue)
            counters = self.order.counters
            if counters.admissions >= self._next_log_at:
                self._next_log_at = (counters.admissions // LOG_EVERY_ADMISSIONS + 1) * LOG_EVERY_ADMISSIONS
                logger.info("%s", counters_summary(counters, "pages"))
        elif waiting_queue:
            waiting_queue[:] = self._rerank_by_modules(waiting_queue)
        return None

    def reorder_counters(self) -> ReorderCounters | None:
        """What the prefix-affinity queue has done so far (``None`` under another order). A pass's admissions are
        counted when the next pass starts (they are seen leaving the waiting list)."""
        return None if self.order is None else self.order.counters

    # -- prefix-affinity ------------------------------------------------------------------------------------------

    def _signed_priority(self, req: Req) -> int:
        # SGLang admits higher priority values first unless --schedule-low-priority-values-first; the queue
        # admits smaller values first.
        return (req.priority or 0) * sglang_0_5.priority_direction(self)

    def _probe_prefix(self, req: Req) -> PrefixProbe:
        """SGLang's radix-cache look-up for ``req`` (``match_kv_cache``, as its ``lpm`` policy does before each
        pass; it only records the hit on the request), as the queue's :class:`PrefixProbe`.

        The 'next block' is the ``block_tokens`` tokens after the cached prefix: requests with the same prefix up
        to its end (and the same ``extra_key``/``cache_salt``, which partition SGLang's tree) get the same key.
        """
        cached = sglang_0_5.cached_prefix_tokens(req, self.tree_cache)
        page = sglang_0_5.cache_page_size(self.tree_cache)
        end = cached + self.block_tokens
        ids = req.origin_input_ids
        key = None
        if end <= len(ids) + len(req.output_ids):
            head = ids[:end] if end <= len(ids) else ids + req.output_ids[: end - len(ids)]
            key = hash((req.extra_key, req.cache_salt, _token_bytes(head)))
        return PrefixProbe(cached // page, key)

    # -- module-sets ----------------------------------------------------------------------------------------------

    def _module_trie(self, tree_cache: Any) -> ModuleTrie:
        trie = getattr(tree_cache, "module_trie", None)  # the kvreuse module cache shares what it learns
        if trie is None:
            trie = ModuleTrie()
        if self.settings.modules_file:
            for name, ids in read_modules_file(self.settings.modules_file):
                trie.add(name, ids)
        if not len(trie) and getattr(tree_cache, "module_trie", None) is None:
            raise ConfigError(
                "KVREUSE_SGLANG_SCHEDULE_POLICY=module-sets needs modules to compare: set "
                "KVREUSE_SGLANG_MODULES_FILE, or use --radix-cache-backend kvreuse_modules"
            )
        return trie

    def _module_set(self, req: Req) -> list[int]:
        ids = req.origin_input_ids
        return [self._module_ids.setdefault(match.name, len(self._module_ids)) for match in self.module_trie.find(ids)]

    def _rerank_by_modules(self, waiting: list[Req]) -> list[Req]:
        """Per priority class (best first), the oldest request then its nearest neighbours by module set, for the
        first ``lookahead`` requests; the rest after them in arrival order (``order_by_module_sets``)."""
        return order_by_module_sets(
            waiting, self._module_set, sglang_0_5.arrival_time, self._priority, self.reorder_config.lookahead
        )
