"""Read vLLM's own accounting of prefix-cache use, so benchmarks and tests report the engine's numbers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvreuse.reorder.measures import hit_rate


@dataclass(frozen=True)
class PrefixCacheCounters:
    """Cumulative ``vllm:prefix_cache_queries`` and ``vllm:prefix_cache_hits`` (tokens) of one engine."""

    queries: int
    hits: int

    def __sub__(self, other: PrefixCacheCounters) -> PrefixCacheCounters:
        return PrefixCacheCounters(self.queries - other.queries, self.hits - other.hits)

    @property
    def hit_rate(self) -> float:
        return hit_rate(self.hits, self.queries)


def prefix_cache_counters(llm: Any) -> PrefixCacheCounters:
    """Sum vLLM's prefix-cache counters over engines from ``LLM.get_metrics()`` (needs ``disable_log_stats=False``)."""
    totals = {"vllm:prefix_cache_queries": 0, "vllm:prefix_cache_hits": 0}
    for metric in llm.get_metrics():
        if metric.name in totals:
            totals[metric.name] += int(metric.value)
    return PrefixCacheCounters(totals["vllm:prefix_cache_queries"], totals["vllm:prefix_cache_hits"])


def sum_request_cached_tokens(outputs: list[Any]) -> int:
    """Total ``RequestOutput.num_cached_tokens`` (vLLM's per-request count of prompt tokens served from cache)."""
    return sum(int(o.num_cached_tokens or 0) for o in outputs)
