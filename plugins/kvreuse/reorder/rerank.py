"""Order requests so that neighbours reuse the most cached modules (TableCache-style reranking).

When prompts are assembled from cached modules (a table's schema, a document, a tool description), a request
whose module set differs little from the previous request's finds more of its modules still cached. A greedy
nearest-neighbour tour over module sets gets most of that reuse at ``O(requests**2 * modules / 8)`` cost.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from kvreuse.errors import ConfigError, TableError

# Set bits of every byte value: the Hamming distance of packed bitsets is a table lookup and a sum.
_POPCOUNT = np.array([bin(byte).count("1") for byte in range(256)], dtype=np.int64)


def rerank_by_module_sets(module_sets: Sequence[Collection[int]], n_modules: int | None = None) -> np.ndarray:
    """A permutation of the requests: start from request 0, then repeatedly the closest unvisited request.

    ``module_sets[i]`` holds the module ids request ``i`` uses, integers in ``[0, n_modules)``; ``n_modules``
    defaults to the largest id plus one. Closeness is the Hamming distance between module bitsets (modules used
    by exactly one of the two requests); ties go to the request that came first.
    """
    if n_modules is not None and (isinstance(n_modules, bool) or not isinstance(n_modules, int) or n_modules < 0):
        raise ConfigError(f"n_modules must be a non-negative integer or None, got {n_modules!r}")
    n = len(module_sets)
    ids = []
    for i, modules in enumerate(module_sets):
        if not all(isinstance(m, (int, np.integer)) and not isinstance(m, bool) for m in modules):
            raise TableError(f"request {i} has module ids {sorted(map(repr, modules))}; ids must be integers")
        ids.append(sorted(int(m) for m in modules))
    largest = max((modules[-1] for modules in ids if modules), default=-1)
    n_modules = largest + 1 if n_modules is None else n_modules
    for i, modules in enumerate(ids):
        if modules and (modules[0] < 0 or modules[-1] >= n_modules):
            raise TableError(f"request {i} uses module ids {modules}; ids must be in [0, n_modules={n_modules})")
    order = np.zeros(n, dtype=np.int64)
    if n == 0:
        return order
    bits = np.zeros((n, max(n_modules, 1)), dtype=bool)
    for i, modules in enumerate(ids):
        bits[i, modules] = True
    packed = np.packbits(bits, axis=1)
    visited = np.zeros(n, dtype=bool)
    visited[0] = True
    unreachable = 8 * packed.shape[1] + 1
    for step in range(1, n):
        distance = _POPCOUNT[packed ^ packed[order[step - 1]]].sum(axis=1)
        distance[visited] = unreachable
        order[step] = int(np.argmin(distance))
        visited[order[step]] = True
    return order


def total_hamming_distance(module_sets: Sequence[Collection[int]], order: Sequence[int]) -> int:
    """Sum of the Hamming distances between the module sets of requests sent one after the other."""
    sets = [frozenset(module_sets[i]) for i in order]
    return sum(len(a ^ b) for a, b in zip(sets, sets[1:]))
