"""Prefix Hit Count on cells, and a replay of vLLM's block-level prefix cache on token ids."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvreuse.errors import ConfigError, TableError
from kvreuse.reorder import Ordering, block_hit_stats, prefix_hit_count, prepare_table


def ordering(rows: list[int], fields: list[tuple[int, ...]]) -> Ordering:
    return Ordering(np.array(rows, dtype=np.int64), tuple(fields))


TABLE = prepare_table(
    pd.DataFrame(
        {
            "country": ["Norway", "Norway", "Norway", "Chile"],
            "city": ["Oslo", "Oslo", "Bergen", "Oslo"],
            "name": ["Ann", "Bob", "Ann", "Ann"],
        }
    ),
    None,
)


def test_phc_of_a_hand_computed_order():
    # Row 1 after row 0 shares Norway, Oslo: 6**2 + 4**2 = 52. Row 2 after row 1 shares Norway: 36.
    # Row 3 after row 2 shares nothing in the leading position (Chile != Norway): 0.
    assert prefix_hit_count(TABLE, ordering([0, 1, 2, 3], [(0, 1, 2)] * 4)) == 52 + 36 + 0


def test_phc_counts_a_cell_only_in_the_same_position_and_field():
    # Leading with city: row 3 (Chile) now follows row 1 on Oslo (16); row 0 after row 3 shares Oslo (16);
    # row 2 (Bergen) after row 0 shares nothing in front, even though both are Norway and Ann.
    order = ordering([1, 3, 0, 2], [(1, 0, 2)] * 4)
    assert prefix_hit_count(TABLE, order) == 16 + 16 + 0
    swapped = ordering([0, 1], [(0, 1, 2), (1, 0, 2)])
    two = TABLE.iloc[:2].reset_index(drop=True)
    assert prefix_hit_count(two, swapped) == 0


def test_phc_stops_at_the_first_differing_cell():
    # Rows 0 and 2 share Norway and Ann, but city differs in between: only Norway counts.
    assert prefix_hit_count(TABLE, ordering([0, 2, 1, 3], [(0, 1, 2)] * 4)) == 36 + 36 + 0


def test_phc_of_fewer_than_two_rows_is_zero():
    assert prefix_hit_count(TABLE.iloc[:0], ordering([], [])) == 0
    assert prefix_hit_count(TABLE.iloc[:1], ordering([0], [(0, 1, 2)])) == 0


def test_phc_rejects_an_ordering_that_is_not_a_permutation():
    with pytest.raises(TableError, match="not a permutation of 0..3"):
        prefix_hit_count(TABLE, ordering([0, 0, 1, 2], [(0, 1, 2)] * 4))
    with pytest.raises(TableError, match=r"field order \(0, 0, 2\) at send position 1"):
        prefix_hit_count(TABLE, ordering([0, 1, 2, 3], [(0, 1, 2), (0, 0, 2), (0, 1, 2), (0, 1, 2)]))


def test_blocks_hit_only_after_the_same_whole_prefix_and_the_last_token_is_recomputed():
    stats = block_hit_stats(
        [
            [1, 2, 3, 4, 5],  # cold: 0 hits, caches blocks [1,2] and [1,2|3,4]
            [1, 2, 3, 4, 6],  # both full blocks cached: 4 hits
            [1, 2, 3, 4],  # wholly cached, but its last block is recomputed: 2 hits
            [9, 9, 3, 4],  # block [3,4] after a different prefix is a different block: 0 hits
            [1, 2, 3],  # one cached block, and a partial block that is never cached: 2 hits
        ],
        block_size=2,
    )
    assert (stats.prompt_tokens, stats.hit_tokens, stats.computed_tokens) == (21, 8, 13)
    assert stats.hit_rate == pytest.approx(8 / 21)


def test_a_bounded_cache_evicts_the_least_recently_used_blocks_tail_first():
    a, b = [1, 2, 3, 4, 0], [5, 6, 7, 8, 0]
    # Unbounded: the third prompt finds both of a's blocks.
    assert block_hit_stats([a, b, a], block_size=2).hit_tokens == 4
    # Two blocks: b's blocks evict both of a's.
    assert block_hit_stats([a, b, a], block_size=2, capacity_blocks=2).hit_tokens == 0
    # Three blocks: one of a's blocks goes, and it is the tail one, so a still hits its first block.
    assert block_hit_stats([a, b, a], block_size=2, capacity_blocks=3).hit_tokens == 2


def test_hits_in_the_empty_replay_are_zero():
    stats = block_hit_stats([], block_size=16)
    assert (stats.prompt_tokens, stats.hit_tokens, stats.hit_rate) == (0, 0, 0.0)
    assert block_hit_stats([[]], block_size=16).hit_rate == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 0}, "block_size must be a positive integer, got 0"),
        ({"block_size": 2.0}, "block_size must be a positive integer, got 2.0"),
        ({"block_size": 2, "capacity_blocks": 0}, "capacity_blocks must be a positive integer or None, got 0"),
    ],
)
def test_bad_cache_geometry_is_named(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        block_hit_stats([[1, 2]], **kwargs)


prompts_strategy = st.lists(st.lists(st.integers(0, 3), max_size=12), max_size=12)


@settings(max_examples=150, deadline=None)
@given(prompts=prompts_strategy, block_size=st.integers(1, 4), capacity=st.integers(1, 8))
def test_hits_are_whole_blocks_below_each_prompt_length_and_grow_with_capacity(prompts, block_size, capacity):
    unbounded = block_hit_stats(prompts, block_size)
    assert unbounded.hit_tokens % block_size == 0
    assert unbounded.hit_tokens <= sum(max(len(p) - 1, 0) for p in prompts)
    assert unbounded.prompt_tokens == sum(map(len, prompts))
    small = block_hit_stats(prompts, block_size, capacity)
    larger = block_hit_stats(prompts, block_size, capacity + 3)
    assert small.hit_tokens <= larger.hit_tokens <= unbounded.hit_tokens
