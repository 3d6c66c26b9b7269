"""When an output counts as full prefill's (``kvreuse.modules.agreement``): the same tokens by default, or the same
text after the steps a user names, each step bounded and checked where it is parsed."""

from __future__ import annotations

import pytest

from kvreuse.errors import ConfigError
from kvreuse.modules.agreement import MAX_PATTERN, MAX_STEPS, Normaliser, same_output


def test_without_a_normaliser_outputs_agree_only_token_for_token():
    assert same_output([1, 2, 3], (1, 2, 3))
    assert not same_output([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="needs a decode function"):
        same_output([1], [1], Normaliser.parse("case"))


def test_first_line_case_and_whitespace_compare_what_a_reader_of_the_first_line_sees():
    normalise = Normaliser.parse(["first-line", "case", "whitespace"])
    assert normalise("  KX-4172.\nThe access code of Zorvik is KX-4172") == "kx-4172."
    assert normalise("Teal  Blue\n") == normalise("teal blue") == "teal blue"
    assert str(normalise) == "first-line then case then whitespace"
    decode = {(1,): "Amber.\nMore text", (2,): "amber.\nOther text", (3,): "Amber!"}.__getitem__
    assert same_output([1], [2], normalise, lambda ids: decode(tuple(ids)))
    assert not same_output([1], [3], normalise, lambda ids: decode(tuple(ids)))


def test_a_regex_step_takes_the_first_group_or_leaves_a_text_without_a_match():
    answer = Normaliser.parse(r"regex:code is ([A-Z]{2}-\d+)")
    assert answer("The code is KX-4172, I think.") == answer("code is KX-4172") == "KX-4172"
    assert answer("I do not know.") == "I do not know."  # no answer found: the whole text compares
    assert Normaliser.parse(r"regex:\d+")("port 8080 and 9090") == "8080"  # no group: the whole match


def test_a_json_step_takes_a_fields_value_or_leaves_a_text_without_it():
    field = Normaliser.parse("json:answer.sql")
    assert field('Here: {"answer": {"sql": "SELECT 1", "why": "x"}} done') == '"SELECT 1"'
    assert field('{"answer": {"sql": "SELECT 1"}}') == field('{"answer":{"sql":"SELECT 1","why":"y"}}')
    assert field('{"answer": {"sql": ') == '{"answer": {"sql": '  # cut off after 16 tokens: not JSON
    assert field('{"other": 1}') == '{"other": 1}'


def test_an_sql_step_compares_the_first_statement_apart_from_keyword_case_and_layout():
    query = Normaliser.parse("sql")
    assert (
        query("SELECT Name ,  COUNT(*)\nFROM t;")
        == query("select name, count(*) from t")
        == "select name,count(*)from t"
    )
    assert query("SELECT x FROM t```\nmore text") == query("select x from t")  # the first statement only
    assert query("SELECT x FROM t\n\nExplanation: it counts.") == "select x from t"
    assert query("SELECT x FROM t WHERE y = 'Ab  c'") != query("select x from t where y = 'ab c'")  # literals kept
    assert query("SELECT a FROM t") != query("SELECT b FROM t")


@pytest.mark.parametrize(
    ("steps", "problem"),
    [
        ("lowercase", "unknown normaliser step 'lowercase'; known: first-line, case"),
        ("regex:", "unknown normaliser step 'regex:'"),
        ("regex:(unclosed", r"regex:\(unclosed: not a regular expression"),
        ("regex:" + "a" * (MAX_PATTERN + 1), f"at most {MAX_PATTERN}"),
        ("json:" + ".".join(["k"] * 9), "a field is 1 to 8 keys"),
        ("json:a..b", "a field is 1 to 8 keys"),
        ("json:" + "k" * 65, "of 1 to 64 characters"),
        (["case"] * (MAX_STEPS + 1), f"at most {MAX_STEPS} steps"),
        ([], "at least one step"),
        ([3], "must be a string"),
        ("x" * 10_000, r"unknown normaliser step 'x{37}\.\.\.'"),  # a huge value is cut short in the message
    ],
)
def test_a_bad_step_is_refused_naming_it(steps, problem):
    with pytest.raises(ConfigError, match=problem):
        Normaliser.parse(steps)
