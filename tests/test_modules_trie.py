"""Finding registered modules in plain prompts (``kvreuse.modules.trie``) and their token boundaries."""

from __future__ import annotations

import math
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvreuse.errors import ModuleIndexFull
from kvreuse.modules import trie as trie_module
from kvreuse.modules.trie import (
    MODULE_BYTES,
    TOKEN_BYTES,
    ModuleMatch,
    ModuleRegistrationError,
    ModuleTrie,
    module_text,
)


def reference_find(modules: dict, prompt: list[int], preferred: dict | None = None) -> list[ModuleMatch]:
    """The specification, by brute force: at each position the longest module starting there, then jump past it;
    between equally long ones, a module of ``preferred`` (a tenant's) wins."""
    preferred = preferred or {}
    candidates = [*preferred.items(), *modules.items()]
    found, i = [], 0
    while i < len(prompt):
        best = max(  # max keeps the first of equals: the preferred ones come first
            ((len(ids), name) for name, ids in candidates if prompt[i : i + len(ids)] == list(ids)),
            default=None,
            key=lambda pair: pair[0],
        )
        if best is None:
            i += 1
        else:
            found.append(ModuleMatch(best[1], i, i + best[0]))
            i += best[0]
    return found


def test_longest_module_wins_at_a_start_and_matches_never_overlap():
    trie = ModuleTrie([("ab", [1, 2]), ("abc", [1, 2, 3]), ("cd", [3, 4]), ("d", [4])])
    assert trie.find([9, 1, 2, 3, 4, 1, 2, 9, 4]) == [
        ModuleMatch("abc", 1, 4),
        ModuleMatch("d", 4, 5),
        ModuleMatch("ab", 5, 7),
        ModuleMatch("d", 8, 9),
    ]


def test_a_prompt_without_modules_gives_nothing_and_a_partial_module_is_no_match():
    trie = ModuleTrie([("t", [5, 6, 7])])
    assert trie.find([]) == [] and trie.find([5, 6, 8, 5, 6]) == []


def test_registration_refuses_empty_and_conflicting_modules():
    trie = ModuleTrie([("a", [1, 2])])
    trie.add("a", [1, 2])  # same again: fine
    with pytest.raises(ModuleRegistrationError, match="same token ids"):
        trie.add("b", [1, 2])
    with pytest.raises(ModuleRegistrationError, match="other token ids"):
        trie.add("a", [1, 3])
    with pytest.raises(ModuleRegistrationError, match="no tokens"):
        trie.add("c", [])
    assert len(trie) == 1 and "a" in trie


def test_a_long_prompt_among_many_modules_yields_its_one_match():
    trie = ModuleTrie((f"m{k}", list(range(k * 100, k * 100 + 50))) for k in range(200))
    prompt = [7] * 100_000 + list(range(500, 550)) + [3] * 100_000
    assert trie.find(prompt) == [ModuleMatch("m5", 100_000, 100_050)]


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ("", "Question: how many singers?"),
        ("Database concert_singer.\n", "Question: how many?"),
        ("Tables:\n", ""),
        ("x\n", "CREATE TABLE b (x int)\n"),
    ],
)
def test_a_module_has_the_same_tokens_alone_and_inside_a_prompt(before, after, local_tokenizer):
    tok = local_tokenizer
    encode = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    module = module_text("  CREATE TABLE singer (Singer_ID int, Name text, PRIMARY KEY (Singer_ID))  ")
    ids = encode(module)
    prompt = encode(before + module + after)
    [match] = ModuleTrie([("singer", ids)]).find(prompt)
    assert prompt[match.start : match.end] == ids and match.start == len(encode(before))


@settings(max_examples=150, deadline=None)
@given(
    modules=st.dictionaries(
        st.text("abcdefgh", min_size=1, max_size=2), st.lists(st.integers(0, 3), min_size=1, max_size=6), max_size=12
    ),
    prompt=st.lists(st.integers(0, 3), max_size=60),
    removed=st.sets(st.text("abcdefgh", min_size=1, max_size=2), max_size=4),
)
def test_matches_are_the_leftmost_longest_of_a_brute_force_scan_after_adds_and_removals(modules, prompt, removed):
    # a 4-token alphabet makes modules nest, overlap and share suffixes; duplicates of ids are left out
    unique = {}
    for name, ids in modules.items():
        if tuple(ids) not in {tuple(v) for v in unique.values()}:
            unique[name] = ids
    trie = ModuleTrie()
    with mock.patch.object(trie_module, "SMALL_SEGMENT", 0):  # small automata stay apart, as large ones do
        for name, ids in unique.items():
            trie.add(name, ids)
            trie.find(prompt)  # a find between adds makes several segments, merged as they grow
        for name in removed:
            assert trie.remove(name) == (name in unique)
            unique.pop(name, None)
        assert trie.find(prompt) == reference_find(unique, prompt)


@settings(max_examples=100, deadline=None)
@given(
    shared=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=4), max_size=6, unique_by=tuple),
    own=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=4), max_size=6, unique_by=tuple),
    prompt=st.lists(st.integers(0, 2), max_size=40),
)
def test_a_tenants_lookup_is_the_brute_force_scan_of_the_global_and_its_own_modules(shared, own, prompt):
    trie = ModuleTrie()
    glob = {f"g{k}": ids for k, ids in enumerate(shared)}
    mine = {f"t{k}": ids for k, ids in enumerate(own)}
    for name, ids in glob.items():
        trie.add(name, ids)
    for name, ids in mine.items():
        trie.add(name, ids, namespace="salt")
        trie.add(name + "-other", ids + [0], namespace="other-salt")  # never seen by these look-ups
    assert trie.find(prompt, namespace="salt") == reference_find(glob, prompt, preferred=mine)
    assert trie.find(prompt) == reference_find(glob, prompt)


def test_a_removed_module_is_not_found_and_its_tokens_register_under_another_name_at_once():
    trie = ModuleTrie([("old", [5, 6, 7]), ("other", [8, 9])])
    assert trie.find([5, 6, 7, 8, 9]) == [ModuleMatch("old", 0, 3), ModuleMatch("other", 3, 5)]
    assert trie.remove("old") and not trie.remove("old") and "old" not in trie
    assert trie.find([5, 6, 7, 8, 9]) == [ModuleMatch("other", 3, 5)]
    trie.add("new", [5, 6, 7])  # the stale entry used to block this: "same token ids"
    assert trie.find([5, 6, 7, 8, 9]) == [ModuleMatch("new", 0, 3), ModuleMatch("other", 3, 5)]
    assert len(trie) == 2


def test_a_lookup_sees_the_global_modules_and_its_own_namespace_only():
    trie = ModuleTrie([("system", [1, 2])])
    trie.add("a-doc", [3, 4], namespace="salt-a")
    trie.add("b-doc", [3, 4], namespace="salt-b")  # the same tokens in another namespace: allowed
    trie.add("b-long", [1, 2, 3], namespace="salt-b")
    prompt = [1, 2, 3, 4]
    assert trie.find(prompt) == [ModuleMatch("system", 0, 2)]  # no salt: global only
    assert trie.find(prompt, namespace="salt-a") == [ModuleMatch("system", 0, 2), ModuleMatch("a-doc", 2, 4)]
    assert trie.find(prompt, namespace="salt-b") == [ModuleMatch("b-long", 0, 3)]
    assert trie.find(prompt, namespace="salt-c") == [ModuleMatch("system", 0, 2)]
    assert trie.holds("a-doc", "salt-a") and not trie.holds("a-doc", "salt-b") and "a-doc" not in trie


def test_a_tenant_module_with_a_global_modules_tokens_wins_for_that_tenant_only():
    trie = ModuleTrie([("global", [1, 2])])
    trie.add("mine", [1, 2], namespace="s")
    assert trie.find([1, 2], namespace="s") == [ModuleMatch("mine", 0, 2)]
    assert trie.find([1, 2]) == [ModuleMatch("global", 0, 2)]


def test_a_module_past_the_budget_is_refused_and_removals_make_room_again():
    budget = 2 * (TOKEN_BYTES * 100 + MODULE_BYTES)
    trie = ModuleTrie(budget_bytes=budget)
    trie.add("a", range(0, 100))
    trie.add("b", range(100, 200))
    trie.find([1])  # both built into the automaton
    with pytest.raises(ModuleIndexFull, match=r"module 'c' \(1 tokens, 288 bytes\) does not fit .*index_bytes"):
        trie.add("c", [7])
    assert trie.charged_bytes == budget and "c" not in trie
    trie.remove("a")  # still counted while the automaton holds it; the refused add rebuilds it away
    trie.add("c", [7])
    assert trie.charged_bytes == budget - TOKEN_BYTES * 99
    assert trie.find([150, 7]) == [ModuleMatch("c", 1, 2)] and trie.nbytes <= trie.charged_bytes


def test_one_at_a_time_registration_keeps_logarithmically_many_automata():
    trie = ModuleTrie()
    with mock.patch.object(trie_module, "SMALL_SEGMENT", 0):
        for k in range(512):
            trie.add(k, [k, k + 1000])
            assert trie.segments() <= math.log2(k + 1) + 1
    trie.add("one more", [1, 2])
    assert trie.segments() == 1  # the whole namespace is under SMALL_SEGMENT tokens: one automaton
    assert trie.find([5, 1005, 6, 1006]) == [ModuleMatch(5, 0, 2), ModuleMatch(6, 2, 4)]


def test_the_adversarial_prompt_of_sevens_finds_nothing_against_a_module_ending_in_an_eight():
    trie = ModuleTrie([("m", [7] * 4095 + [8])])
    assert trie.find([7] * 8192) == []
    assert trie.find([7] * 8192 + [8]) == [ModuleMatch("m", 8192 - 4095, 8193)]


@pytest.mark.parametrize("bad", [[-1], [2**31], [1.5], [[1, 2]]])
def test_token_ids_outside_the_index_range_are_refused(bad):
    with pytest.raises(ModuleRegistrationError, match="token ids must be"):
        ModuleTrie().add("x", bad)
