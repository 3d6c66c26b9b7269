"""Aho-Corasick automaton over token ids, compiled with numba: the longest pattern starting at every prompt position.

Why Aho-Corasick, and why reversed. Splicing (``kvreuse.modules.splice.plan_splice``) needs the modules at
*any* token position: a module follows free text of any length, and the next module starts where the previous one
ends, not on a block boundary. Hashes of block-aligned chunks find only modules that start on a chunk boundary of
the prompt (a prefix-cache question), or, with rolling hashes of every window, need a verification per candidate
that an adversary can multiply (many modules sharing a first chunk, a prompt repeating it). An automaton reads
each prompt token once, whatever the modules are.

:class:`~kvreuse.modules.trie.ModuleTrie` wants, at each start position, the *longest* module starting there
(leftmost-longest, as before). Aho-Corasick reports matches by their end. So the automaton is built over the
*reversed* modules and reads the prompt backwards: a match that ends at reversed position ``j`` is a module that
starts at prompt position ``j``, and the longest of them is the state's own module or, through its output link,
the longest module among its suffixes; one array read per position. :func:`longest_at` is therefore O(n) steps of
the automaton (amortised: each failure link taken was paid for by an earlier step) plus O(n) output reads,
independent of how many modules nest inside each other, and :func:`select` turns the per-position longest matches
into the leftmost-longest non-overlapping ones in O(n). Per-position results of two automata merge by taking the
longer at each position, so an index may split its modules into several automata (segments, namespaces) and still
give exactly the matches of one automaton over all of them.

Layout (all ``int32``; nodes numbered depth-first, so the prompt's walk along one module's path reads
consecutive nodes, and a node's first child, the one with the smallest token, is the next node): ``labels[v]``
the token on the edge into ``v``, ``children[first[v]:first[v + 1]]`` ``v``'s children sorted by token,
``fail[v]`` its failure link, ``term[v]`` the module (local id) ending at ``v`` or -1, and ``out[v]`` the longest
live module among ``v`` and its failure chain, or -1: 24 bytes per node, and a module adds at most one node per
token. The root, where every mismatch returns, is also a direct table ``root[token]`` (child or -1) when that table
is no longer than the automaton has nodes (at most 4 bytes per node more); other nodes try their first child, then
binary-search the rest.
"""

from __future__ import annotations

import numba
import numpy as np

NODE_BYTES = 28  # first, labels, children, fail, term, out: one int32 each per node; the root table at most one more
MAX_TOKEN_ID = 2**31 - 1


@numba.njit(inline="always")
def _child(first, children, labels, node, token):
    lo, hi = first[node], first[node + 1]
    if lo == hi:
        return -1
    if labels[node + 1] == token:  # the first child, next in depth-first order: the common case, no search
        return node + 1
    lo += 1
    end = hi
    while lo < hi:
        mid = (lo + hi) >> 1
        if labels[children[mid]] < token:
            lo = mid + 1
        else:
            hi = mid
    if lo < end and labels[children[lo]] == token:
        return children[lo]
    return -1


@numba.njit(inline="always")
def _step(first, children, labels, root, node, token):
    """The child of ``node`` on ``token``, or -1; the root through its direct table when it has one."""
    if node == 0 and root.shape[0]:
        return root[token] if 0 <= token < root.shape[0] else -1
    return _child(first, children, labels, node, token)


@numba.njit(cache=True, nogil=True)
def build(flat, offsets):
    """Automaton of ``len(offsets) - 1`` patterns, ``flat[offsets[k]:offsets[k + 1]]``, sorted lexicographically.

    Returns ``(first, labels, children, fail, term, term_node, root)``; ``term_node[k]`` is the node where pattern
    ``k`` ends, ``root`` the root's direct table (empty when it would be longer than the automaton has nodes).
    Patterns must be distinct and non-empty (the caller checks).
    """
    count = offsets.shape[0] - 1
    longest = 0
    for k in range(count):
        longest = max(longest, offsets[k + 1] - offsets[k])
    total = offsets[count]
    # 1. the trie in depth-first order: sorted patterns share their common prefix with the previous one, so new
    #    nodes are created in depth-first order and each node's children in token order
    parent = np.empty(total + 1, np.int32)
    depth = np.zeros(total + 1, np.int32)
    labels = np.empty(total + 1, np.int32)
    term = np.full(total + 1, -1, np.int32)
    term_node = np.empty(count, np.int32)
    path = np.zeros(longest + 1, np.int32)
    parent[0] = -1
    labels[0] = -1
    nodes = 1
    prev_start, prev_end = 0, 0
    for k in range(count):
        start, end = offsets[k], offsets[k + 1]
        length = end - start
        common = 0
        while common < length and common < prev_end - prev_start and flat[start + common] == flat[prev_start + common]:
            common += 1
        for d in range(common, length):
            parent[nodes] = path[d]
            depth[nodes] = d + 1
            labels[nodes] = flat[start + d]
            path[d + 1] = nodes
            nodes += 1
        term[path[length]] = k
        term_node[k] = path[length]
        prev_start, prev_end = start, end
    labels = labels[:nodes].copy()
    term = term[:nodes].copy()
    # 2. children lists, in creation (token) order
    first = np.zeros(nodes + 1, np.int32)
    for v in range(1, nodes):
        first[parent[v] + 1] += 1
    for v in range(nodes):
        first[v + 1] += first[v]
    children = np.empty(max(nodes - 1, 1), np.int32)
    filled = first[:nodes].copy()
    for v in range(1, nodes):
        children[filled[parent[v]]] = v
        filled[parent[v]] += 1
    width = labels[children[first[1] - 1]] + 1 if first[1] > 0 else 0  # the root's largest child token, plus one
    root = np.full(width if width <= nodes else 0, -1, np.int32)
    if root.shape[0]:
        for i in range(first[0], first[1]):
            root[labels[children[i]]] = children[i]
    # 3. failure links, shallower nodes first (a stable counting sort by depth)
    at = np.zeros(longest + 2, np.int64)
    for v in range(nodes):
        at[depth[v] + 1] += 1
    for d in range(1, longest + 2):
        at[d] += at[d - 1]
    order = np.empty(nodes, np.int32)
    for v in range(nodes):
        order[at[depth[v]]] = v
        at[depth[v]] += 1
    fail = np.zeros(nodes, np.int32)
    for i in range(1, nodes):
        w = order[i]
        p = parent[w]
        if p == 0:
            continue
        token, f = labels[w], fail[p]
        while True:
            c = _step(first, children, labels, root, f, token)
            if c >= 0:
                fail[w] = c
                break
            if f == 0:
                break
            f = fail[f]
    return first, labels, children, fail, term, term_node, root


@numba.njit(cache=True, nogil=True)
def outputs(fail, term):
    """``out[v]``: the longest module among ``term`` at ``v`` and along its failure chain.

    A node's own module is longer than any on its failure chain (those are proper suffixes), so it wins. Each
    chain is followed until a node whose answer is known, then the answer is written along it: one pass in all.
    """
    nodes = fail.shape[0]
    out = np.full(nodes, -2, np.int32)  # -2: not known yet
    out[0] = -1
    chain = np.empty(nodes, np.int32)
    for v in range(1, nodes):
        top, u = 0, v
        while out[u] == -2:
            if term[u] >= 0:
                out[u] = term[u]
                break
            chain[top] = u
            top += 1
            u = fail[u]
        for i in range(top):
            out[chain[i]] = out[u]
    return out


@numba.njit(cache=True, nogil=True)
def longest_at(first, labels, children, fail, term, term_node, out, root, lengths, slots, prompt, best_len, best_slot):
    """For every position ``j`` of ``prompt``, raise ``best_len[j]``/``best_slot[j]`` to the longest live module
    of this automaton starting at ``j`` when it is strictly longer (so the automaton scanned first wins ties).

    ``out`` was computed when every module was live; a module removed since (``term`` -1 at its node) is skipped
    for the next longest on its failure chain, so a removal costs nothing here until the automaton is rebuilt."""
    state = 0
    for j in range(prompt.shape[0] - 1, -1, -1):
        token = prompt[j]
        while True:
            c = _step(first, children, labels, root, state, token)
            if c >= 0:
                state = c
                break
            if state == 0:
                break
            state = fail[state]
        o = out[state]
        while o >= 0 and term[term_node[o]] < 0:
            o = out[fail[term_node[o]]]
        if o >= 0 and lengths[o] > best_len[j]:
            best_len[j] = lengths[o]
            best_slot[j] = slots[o]


@numba.njit(cache=True, nogil=True)
def select(best_len, best_slot):
    """Leftmost-longest non-overlapping matches: ``(starts, lengths, slots)``, left to right."""
    n = best_len.shape[0]
    starts = np.empty(n, np.int64)
    lengths = np.empty(n, np.int32)
    slots = np.empty(n, np.int32)
    found, i = 0, 0
    while i < n:
        length = best_len[i]
        if length > 0:
            starts[found], lengths[found], slots[found] = i, length, best_slot[i]
            found += 1
            i += length
        else:
            i += 1
    return starts[:found], lengths[:found], slots[:found]


_warm = False


def warm_up() -> None:
    """Compile every function now (or load numba's cache), so that an engine pays for it at start, not on the
    first request it looks up; once per process."""
    global _warm
    if _warm:
        return
    offsets = np.array([0, 2], np.int64)
    first, labels, children, fail, term, term_node, root = build(np.array([2, 1], np.int32), offsets)
    best_len, best_slot = np.zeros(2, np.int32), np.full(2, -1, np.int32)
    lengths, slots, prompt = np.array([2], np.int32), np.array([0], np.int32), np.array([1, 2])
    out = outputs(fail, term)
    longest_at(first, labels, children, fail, term, term_node, out, root, lengths, slots, prompt, best_len, best_slot)
    select(best_len, best_slot)
    _warm = True
