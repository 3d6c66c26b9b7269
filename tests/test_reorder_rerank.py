"""Reranking requests by their module sets: a greedy nearest-neighbour tour over module bitsets."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvreuse.errors import ConfigError, TableError
from kvreuse.reorder import rerank_by_module_sets, total_hamming_distance


def reference_tour(module_sets: list[set[int]]) -> list[int]:
    """The same greedy tour on Python sets: closest unvisited request next, the earliest among equals."""
    order, left = [0], list(range(1, len(module_sets)))
    while left:
        current = module_sets[order[-1]]
        nearest = min(left, key=lambda i: (len(current ^ module_sets[i]), i))
        order.append(nearest)
        left.remove(nearest)
    return order


@settings(max_examples=100, deadline=None)
@given(module_sets=st.lists(st.sets(st.integers(0, 19), max_size=8), min_size=1, max_size=25))
def test_the_tour_is_a_permutation_from_the_first_request_matching_the_reference(module_sets):
    order = rerank_by_module_sets(module_sets)
    assert order.dtype == np.int64 and sorted(order.tolist()) == list(range(len(module_sets)))
    assert order.tolist() == reference_tour(module_sets)


def test_clustered_requests_are_sent_cluster_by_cluster():
    rng = np.random.default_rng(3)
    clusters = [set(range(0, 6)), set(range(10, 16)), set(range(20, 26))]
    module_sets = [clusters[i % 3] ^ {int(rng.integers(30, 40))} for i in range(30)]
    order = rerank_by_module_sets(module_sets)
    before = total_hamming_distance(module_sets, range(30))
    after = total_hamming_distance(module_sets, order)
    print(f"total Hamming distance: {before} in arrival order, {after} reranked")
    assert after < before / 3
    clusters_sent = [i % 3 for i in order.tolist()]
    assert sum(a != b for a, b in zip(clusters_sent, clusters_sent[1:])) == 2  # each cluster in one run


def test_equally_close_requests_keep_their_original_order():
    # From {0, 1}, requests 2 and 3 are both 1 away: 2 goes first. From {0}, 1 and 3 are both 2 away: 1 first.
    assert rerank_by_module_sets([{0, 1}, {5}, {0}, {1}]).tolist() == [0, 2, 1, 3]


def test_no_requests_give_an_empty_order():
    assert rerank_by_module_sets([]).tolist() == []


def test_requests_without_modules_are_ordered_too():
    assert rerank_by_module_sets([set(), {4}, set()], n_modules=5).tolist() == [0, 2, 1]


@pytest.mark.parametrize(
    ("module_sets", "n_modules", "error", "message"),
    [
        ([{0}, {-1}], None, TableError, r"request 1 uses module ids \[-1\]; ids must be in \[0, n_modules=1\)"),
        ([{0, 3}], 2, TableError, r"request 0 uses module ids \[0, 3\]; ids must be in \[0, n_modules=2\)"),
        ([{"a"}], None, TableError, "request 0 has module ids .*; ids must be integers"),
        ([{0}], -1, ConfigError, "n_modules must be a non-negative integer or None, got -1"),
    ],
)
def test_bad_module_ids_are_named(module_sets, n_modules, error, message):
    with pytest.raises(error, match=message):
        rerank_by_module_sets(module_sets, n_modules)
