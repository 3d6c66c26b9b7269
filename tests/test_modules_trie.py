"""Finding registered modules in plain prompts (``kvreuse.modules.trie``) and their token boundaries."""

from __future__ import annotations

import pytest

from kvreuse.modules.trie import ModuleMatch, ModuleRegistrationError, ModuleTrie, module_text


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
