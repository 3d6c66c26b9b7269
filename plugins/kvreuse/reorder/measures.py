"""How much of a job's prompts a prefix cache can reuse: in table cells (PHC) and in engine blocks (tokens).

:func:`prefix_hit_count` is the solvers' objective, computed on cells; :func:`block_hit_stats` replays token ids
through a model of vLLM's automatic prefix caching, so tests and benchmarks get the token hit rate of an order
with a real tokenizer and no engine.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from kvreuse.errors import ConfigError
from kvreuse.reorder.ordering import Ordering
from kvreuse.reorder.stats import encode_table


def prefix_hit_count(table: pd.DataFrame, ordering: Ordering) -> int:
    """Prefix Hit Count of sending a prepared ``table`` in ``ordering`` (Liu et al. 2024, Eq. 1-2).

    Row ``r`` (in send order) hits on the longest run of leading cells equal to row ``r-1``'s leading cells in
    the same positions, equal meaning the same field and the same value; it scores the sum of those values'
    squared lengths in characters. PHC is the sum over rows; the first row scores 0.
    """
    ordering.validate(*table.shape)
    if len(ordering.rows) < 2:
        return 0
    encoded = encode_table(table)
    rows = np.asarray(ordering.rows, dtype=np.int64)
    fields = np.array(ordering.fields, dtype=np.int64)
    values = encoded.codes[rows[:, None], fields]
    weights = encoded.cell_lengths()[rows[:, None], fields] ** 2
    equal = (fields[1:] == fields[:-1]) & (values[1:] == values[:-1])
    leading = np.cumprod(equal, axis=1, dtype=np.int64)
    return int((leading * weights[1:]).sum())


def hit_rate(cached_tokens: int, prompt_tokens: int) -> float:
    """Share of prompt tokens served from the prefix cache (0 for no prompt tokens): the one definition of a hit
    rate that kvreuse's figures, the engines' counters and the benchmarks report."""
    return cached_tokens / prompt_tokens if prompt_tokens else 0.0


@dataclass(frozen=True)
class BlockHitStats:
    """Token counts of a replay: prompt tokens, those served from the cache, and those computed."""

    prompt_tokens: int
    hit_tokens: int
    computed_tokens: int

    @property
    def hit_rate(self) -> float:
        """Share of prompt tokens served from the cache (0 for no tokens)."""
        return hit_rate(self.hit_tokens, self.prompt_tokens)


def block_hit_stats(
    token_ids: Sequence[Sequence[int]], block_size: int, capacity_blocks: int | None = None
) -> BlockHitStats:
    """Replay prompts, in order, through a model of vLLM's automatic prefix caching.

    As in vLLM, only full blocks of ``block_size`` tokens are cached, and block ``i`` is known by a hash chained
    over every token up to its end, so it matches only after the same whole prefix. A prompt hits its longest
    run of leading blocks found in the cache, but at most ``len(prompt) - 1`` tokens: a fully cached prompt
    recomputes its last block to produce logits. Then all of its full blocks are cached. ``capacity_blocks``
    bounds the cached blocks (``None``: unbounded); past it the least recently used are evicted, and a prompt's
    blocks are released last-block-first as vLLM frees them, so its tail is evicted before its head. Each
    prompt is assumed to finish before the next starts, and generated tokens are not cached.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ConfigError(f"block_size must be a positive integer, got {block_size!r}")
    if capacity_blocks is not None and (
        isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or capacity_blocks < 1
    ):
        raise ConfigError(f"capacity_blocks must be a positive integer or None, got {capacity_blocks!r}")
    cache: OrderedDict[int, None] = OrderedDict()
    prompt_tokens = hit_tokens = 0
    for prompt in token_ids:
        tokens = tuple(prompt)
        hashes = []
        parent = None
        for start in range(0, len(tokens) - block_size + 1, block_size):
            parent = hash((parent, tokens[start : start + block_size]))
            hashes.append(parent)
        cached = 0
        while cached < len(hashes) and hashes[cached] in cache:
            cached += 1
        usable = max(len(tokens) - 1, 0) // block_size
        hit_tokens += min(cached, usable) * block_size
        prompt_tokens += len(tokens)
        for block in reversed(hashes):
            cache[block] = None
            cache.move_to_end(block)
        while capacity_blocks is not None and len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return BlockHitStats(prompt_tokens, hit_tokens, prompt_tokens - hit_tokens)
