"""Tables become cells of prompt text, and a row's cells become a prefix-friendly prompt."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from kvreuse.errors import ConfigError, TableError
from kvreuse.reorder import prepare_table, render_prompt


def test_prepare_table_keeps_the_chosen_fields_in_the_given_order_as_text():
    df = pd.DataFrame({"id": [7, 8], "city": ["Oslo", "Bergen"], "zip": [150, 5003]}, index=[10, 20])
    table = prepare_table(df, ["zip", "city"])
    assert list(table.columns) == ["zip", "city"]
    assert table.to_numpy().tolist() == [["150", "Oslo"], ["5003", "Bergen"]]
    assert list(table.index) == [0, 1]


def test_prepare_table_without_fields_takes_every_column():
    df = pd.DataFrame({"a": ["x"], "b": ["y"]})
    assert list(prepare_table(df, None).columns) == ["a", "b"]


def test_nulls_become_the_empty_string():
    df = pd.DataFrame(
        {
            "text": ["a", None, np.nan, pd.NA],
            "number": [1.5, np.nan, None, 2.0],
            "when": pd.to_datetime(["2024-01-02", None, None, "2024-03-04"]),
        }
    )
    table = prepare_table(df, None)
    assert table["text"].tolist() == ["a", "", "", ""]
    assert table["number"].tolist() == ["1.5", "", "", "2.0"]
    assert table["when"].tolist() == ["2024-01-02 00:00:00", "", "", "2024-03-04 00:00:00"]


def test_non_string_cells_go_through_str_and_bytes_are_decoded_with_replacement():
    df = pd.DataFrame({"mixed": [3, 2.5, True, b"caf\xc3\xa9", b"bad \xff", ("t", 1)]})
    assert prepare_table(df, None)["mixed"].tolist() == ["3", "2.5", "True", "café", "bad \ufffd", "('t', 1)"]


def test_integer_and_boolean_columns_are_written_as_str_writes_their_values():
    df = pd.DataFrame(
        {
            "i": np.array([1, -2, 30], dtype=np.int32),
            "u": np.array([0, 7, 2**63], dtype=np.uint64),
            "b": [True, False, True],
            "nullable": pd.array([1, None, 3], dtype="Int64"),
        }
    )
    table = prepare_table(df, None)
    assert table.to_dict("list") == {
        "i": ["1", "-2", "30"],
        "u": ["0", "7", "9223372036854775808"],
        "b": ["True", "False", "True"],
        "nullable": ["1", "", "3"],
    }


def test_very_long_cells_are_kept_whole():
    long = "x" * 200_000
    assert prepare_table(pd.DataFrame({"doc": [long, "short"]}), None)["doc"][0] == long


def test_an_empty_table_gives_an_empty_table_with_the_fields():
    table = prepare_table(pd.DataFrame({"a": pd.Series([], dtype=str), "b": pd.Series([], dtype=float)}), ["b"])
    assert table.shape == (0, 1) and list(table.columns) == ["b"]


def test_an_unknown_field_is_named_with_the_known_ones():
    df = pd.DataFrame({"city": ["Oslo"], "zip": ["150"]})
    with pytest.raises(TableError, match=r"unknown field 'cty'; the table's fields are 'city', 'zip'"):
        prepare_table(df, ["cty"])


def test_a_field_listed_twice_is_an_error():
    with pytest.raises(TableError, match=r"field\(s\) 'a' listed more than once"):
        prepare_table(pd.DataFrame({"a": [1], "b": [2]}), ["a", "b", "a"])


def test_duplicate_column_names_in_the_table_are_an_error():
    df = pd.DataFrame([[1, 2]], columns=["a", "a"])
    with pytest.raises(TableError, match=r"duplicate column name\(s\) 'a'"):
        prepare_table(df, None)


def test_an_empty_field_list_is_an_error():
    with pytest.raises(TableError, match="field list .* is empty"):
        prepare_table(pd.DataFrame({"a": [1]}), [])
    with pytest.raises(TableError, match="is empty"):
        prepare_table(pd.DataFrame(index=[0, 1]), None)


def test_a_single_string_is_not_taken_as_a_field_list():
    with pytest.raises(TableError, match="not the single string 'ab'"):
        prepare_table(pd.DataFrame({"a": [1], "b": [2]}), "ab")


def test_lines_prompt_is_instruction_blank_line_then_one_line_per_field():
    prompt = render_prompt("Is this review positive?", ["title", "review"], ["Heat", "Great."])
    assert prompt == "Is this review positive?\n\ntitle: Heat\nreview: Great.\n"


def test_json_prompt_lists_the_fields_in_the_given_order():
    prompt = render_prompt("Classify.", ["b", "a"], ["2", 'é\n"q"'], fmt="json")
    assert prompt == 'Classify.\n\n{"b": "2", "a": "é\\n\\"q\\""}\n'
    assert list(json.loads(prompt.split("\n\n", 1)[1])) == ["b", "a"]


def test_rows_sharing_leading_fields_share_the_prompt_up_to_the_first_difference():
    a = render_prompt("Q", ["movie", "review"], ["Heat", "Tense."])
    b = render_prompt("Q", ["movie", "review"], ["Heat", "Long."])
    assert a[: len("Q\n\nmovie: Heat\nreview: ")] == b[: len("Q\n\nmovie: Heat\nreview: ")]


def test_reordering_fields_changes_the_layout_but_not_what_is_asked():
    a = render_prompt("Q", ["x", "y"], ["1", "2"], fmt="json")
    b = render_prompt("Q", ["y", "x"], ["2", "1"], fmt="json")
    assert a != b and json.loads(a[3:]) == json.loads(b[3:])


def test_an_unknown_prompt_format_names_the_accepted_ones():
    with pytest.raises(ConfigError, match="prompt format 'xml' is not one of lines, json"):
        render_prompt("Q", ["a"], ["1"], fmt="xml")


def test_fields_and_values_must_pair_up():
    with pytest.raises(TableError, match="2 field name\\(s\\) but 1 value\\(s\\)"):
        render_prompt("Q", ["a", "b"], ["1"])
    with pytest.raises(TableError, match="more than once"):
        render_prompt("Q", ["a", "a"], ["1", "2"])
