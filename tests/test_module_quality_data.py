"""The multi-document QA sets and the schema workload of the module quality study (module_quality_data.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from module_quality_data import (  # noqa: E402
    QA_SETS,
    SCHEMA_HEADER,
    SCHEMA_SETS,
    is_correct,
    make_cases,
    make_schema_cases,
    normalise_sql,
    schema_question_text,
    tokenize_case,
    tokenize_schema_case,
)

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


@pytest.fixture(scope="module")
def spider():
    from kvreuse.localmodel import DATASETS
    from kvreuse.modules.schemas import spider_schemas

    return spider_schemas(DATASETS / "spider" / "tables.json")


@pytest.mark.parametrize("name", sorted(SCHEMA_SETS))
def test_schema_cases_are_tables_of_one_database_in_foreign_key_order_found_by_the_trie(encode, spider, name):
    schema_set = SCHEMA_SETS[name]
    cases = make_schema_cases(schema_set, spider)
    again = make_schema_cases(schema_set, spider)
    assert [(c.tables, c.question) for c in again] == [(c.tables, c.question) for c in cases]  # deterministic
    assert len(cases) == schema_set.num_cases and {len(c.tables) for c in cases} == {schema_set.num_tables}
    assert len({c.database for c in cases}) == schema_set.databases  # each database's tables recur
    for case in cases[:20]:
        schema = spider[case.database]
        for i, table in enumerate(case.tables):  # every table after the tables of the prompt it references
            assert {r for r in case.references[i] if r in case.tables} <= set(case.tables[:i])
            assert case.modules[i] == schema.table(table).ddl()
        assert any(t in case.question for t in case.tables)  # the question is about the prompt's own tables
        tc = tokenize_schema_case(case, encode)
        trie = ModuleTrie((i, ids) for i, ids in enumerate(tc.modules))
        assert [(m.name, m.start) for m in trie.find(tc.prompt)] == list(enumerate(tc.module_starts()))
        assert list(tc.prompt) == encode(SCHEMA_HEADER + "".join(case.modules) + schema_question_text(case.question))
        assert [len(c) for c in tc.contexts] == [sum(len(encode(t)) for t in texts) for texts in case.reference_texts]


def test_most_schema_questions_join_two_of_the_prompts_tables(spider):
    for name in ("schema-4", "schema-8"):
        cases = make_schema_cases(SCHEMA_SETS[name], spider)
        assert sum(c.template.startswith("join") for c in cases) >= len(cases) // 2


def test_normalised_sql_compares_queries_as_a_user_would():
    assert (
        normalise_sql(" Name ,  COUNT(*)\nFROM t;")
        == normalise_sql(" name, count(*) from t")
        == ("select name,count(*)from t")
    )
    assert normalise_sql(" x FROM t WHERE y = 'Ab  c'") != normalise_sql(" x FROM t WHERE y = 'ab c'")  # literals kept
    assert normalise_sql(" x FROM t```\nmore text") == normalise_sql(" x from t")  # the first statement only
    assert normalise_sql(" x FROM t\n\nExplanation: ...") == "select x from t"
    assert normalise_sql(" a FROM t") != normalise_sql(" b FROM t")
