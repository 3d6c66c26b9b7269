"""The multi-document QA set of the module quality study (benchmarks/module_quality_data.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from module_quality_data import QA_SETS, is_correct, make_cases, tokenize_case  # noqa: E402

from kvreuse.modules.trie import ModuleTrie  # noqa: E402


@pytest.fixture(scope="module")
def encode(smollm2_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_model)
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def mixed(encode):
    return make_cases(QA_SETS["mixed"], encode)


def test_the_same_seed_gives_the_same_cases(encode, mixed):
    again = make_cases(QA_SETS["mixed"], encode)
    assert [(c.question, c.answer, [m.text for m in c.modules]) for c in again] == [
        (c.question, c.answer, [m.text for m in c.modules]) for c in mixed
    ]


def test_the_sets_have_their_sizes(encode, mixed):
    assert len(mixed) == 300 and {len(c.modules) for c in mixed} == {3, 4, 5, 6}
    assert {c.kind for c in mixed} == {"profile", "table", "config"}
    long = make_cases(QA_SETS["long"], encode)[:12]
    lengths = [len(ids) for c in long for ids in tokenize_case(c, encode).modules]
    assert {len(c.modules) for c in long} == {8} and 240 <= sum(lengths) / len(lengths) <= 260


def test_kvreuses_token_trie_finds_every_module_inside_the_prompt(encode, mixed):
    """Each module's ids are the same alone and inside the prompt, so the module cache serves all of them."""
    for case in mixed[:40]:
        tc = tokenize_case(case, encode)
        trie = ModuleTrie((i, ids) for i, ids in enumerate(tc.modules))
        found = trie.find(tc.prompt)
        assert [(m.name, m.start) for m in found] == list(enumerate(tc.module_starts()))


def test_only_the_target_module_holds_the_answer(mixed):
    for case in mixed:
        target = case.modules[case.target]
        assert target.fields[case.field] == case.answer and target.name in case.question
        assert case.answer not in case.distractors
        assert sum(case.field in m.fields and m.fields[case.field] == case.answer for m in case.modules) == 1


def test_an_answer_is_right_when_its_first_line_holds_the_value_before_any_distractor(mixed):
    case = next(c for c in mixed if c.distractors)
    other = case.distractors[0]
    assert is_correct(f" {case.answer}.", case)
    assert is_correct(f" {case.answer.upper()} (from the second document)", case)
    assert not is_correct(f" {other}, or {case.answer}", case)
    assert not is_correct(" I do not know.\n" + case.answer, case)
