"""Pinned fields: they lead every prompt in the order given, under every method, and the rest is still solved
(exactly by OPHR, near it by GGR) among the orders that keep them leading."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvreuse.errors import ConfigError, TableError
from kvreuse.reorder import METHODS, field_pin, prefix_hit_count, prepare_table, prompts, solve

cells = st.sampled_from(["", "a", "bb", "a b", "ccc"])
tables = st.integers(2, 4).flatmap(
    lambda n_cols: st.lists(st.lists(cells, min_size=n_cols, max_size=n_cols), max_size=9).map(
        lambda rows: pd.DataFrame(rows, columns=[f"f{c}" for c in range(n_cols)], dtype=object)
    )
)


@settings(max_examples=60, deadline=None)
@given(table=tables, data=st.data())
def test_pinned_fields_lead_every_row_in_the_given_order_under_every_method(table, data):
    pin = data.draw(st.lists(st.sampled_from(list(table.columns)), unique=True, min_size=1))
    lead = tuple(int(name[1:]) for name in pin)
    for method in METHODS:
        ordering = solve(table, method, pin=pin)
        ordering.validate(*table.shape)
        assert all(order[: len(lead)] == lead for order in ordering.fields), method


@settings(max_examples=40, deadline=None)
@given(table=tables)
def test_pinning_every_field_sends_exactly_the_original_prompts_and_reorders_rows_only(table):
    prepared = prepare_table(table, None)
    original = prompts(solve(prepared, "original"), prepared, "Q")
    for method in ("sorted", "stats", "ggr", "ophr"):
        ordering = solve(prepared, method, pin=list(prepared.columns))
        sent = prompts(ordering, prepared, "Q")
        assert [original[row] for row in ordering.rows.tolist()] == sent, method


@settings(max_examples=40, deadline=None)
@given(table=tables, data=st.data())
def test_rows_with_equal_pinned_values_are_sent_together_in_sorted_runs(table, data):
    pin = data.draw(st.lists(st.sampled_from(list(table.columns)), unique=True, min_size=1))
    prepared = prepare_table(table, None)
    for method in ("sorted", "stats", "ggr"):
        keys = [tuple(prepared[name][row] for name in pin) for row in solve(prepared, method, pin=pin).rows.tolist()]
        runs = [key for key, _ in itertools.groupby(keys)]
        assert runs == sorted(set(keys)), method


def brute_force_pinned_phc(table: pd.DataFrame, lead: tuple[int, ...]) -> int:
    """The best PHC over every row order and every per-row field order that starts with ``lead``."""
    cells = table.to_numpy().tolist()
    n, m = table.shape
    rest = [c for c in range(m) if c not in lead]
    orders = [lead + tail for tail in itertools.permutations(rest)]
    best = 0
    for rows in itertools.permutations(range(n)):
        for chosen in itertools.product(orders, repeat=n):
            total = 0
            for (a, fa), (b, fb) in zip(zip(rows, chosen), zip(rows[1:], chosen[1:])):
                for x, y in zip(fa, fb):
                    if x != y or cells[a][x] != cells[b][y]:
                        break
                    total += len(cells[b][y]) ** 2
            best = max(best, total)
    return best


def test_ophr_with_pins_is_the_optimum_among_orders_that_keep_them_leading():
    rng = np.random.default_rng(5)
    for n_rows, n_cols in [(4, 2)] * 8 + [(3, 3)] * 8:
        table = pd.DataFrame({f"f{c}": rng.choice(["a", "bb", "ccc"], n_rows) for c in range(n_cols)}, dtype=object)
        prepared = prepare_table(table, None)
        best = prefix_hit_count(prepared, solve(prepared, "ophr", pin=["f1"]))
        assert best == brute_force_pinned_phc(prepared, (1,)), table
        assert prefix_hit_count(prepared, solve(prepared, "ggr", pin=["f1"])) <= best


def test_ggr_moves_a_unique_name_to_the_back_and_a_pin_keeps_it_first():
    vega = pytest.importorskip("vega_datasets")
    cars = prepare_table(vega.data.cars(), None)
    name = list(cars.columns).index("Name")
    moved = solve(cars, "ggr")
    assert sum(order.index(name) == 7 for order in moved.fields) == 400  # 8th of 9 in 400 of 406 rows
    pinned = solve(cars, "ggr", pin=["Name"])
    assert all(order[0] == name for order in pinned.fields)


@pytest.mark.parametrize(
    ("pin", "message"),
    [
        (["title", "town"], "cannot pin unknown field\\(s\\) 'town'; the prompt's fields are 'title', 'year'"),
        (["year", "year"], "pinned field\\(s\\) 'year' listed more than once"),
        ("title", "pin must be a list of field names, not the single string 'title'; write pin=\\['title'\\]"),
    ],
)
def test_a_bad_pin_is_an_error_that_names_it(pin, message):
    with pytest.raises(TableError, match=message):
        solve(pd.DataFrame({"title": ["Heat"], "year": ["1995"]}), "ggr", pin=pin)


@settings(max_examples=40, deadline=None)
@given(table=tables, data=st.data())
def test_field_order_keep_pins_every_field_in_the_tables_order_after_the_users_pin(table, data):
    pin = data.draw(st.lists(st.sampled_from(list(table.columns)), unique=True))
    prepared = prepare_table(table, None)
    pinned = field_pin(prepared, "keep", pin)
    assert pinned == pin + [name for name in prepared.columns if name not in pin]


def test_field_order_global_pins_every_field_in_the_statistics_based_order():
    table = prepare_table(pd.DataFrame({"id": ["1", "2", "3", "4"], "kind": ["a", "a", "b", "b"]}), None)
    assert field_pin(table, "global", None) == ["kind", "id"]  # fewest distinct values first
    assert field_pin(table, "global", ["id"]) == ["id", "kind"]


def test_field_order_free_leaves_the_users_pin_as_it_is():
    table = prepare_table(pd.DataFrame({"a": ["1"], "b": ["2"]}), None)
    assert field_pin(table, "free", None) is None
    assert field_pin(table, "free", ["b"]) == ["b"]


def test_an_unknown_field_order_is_a_config_error_naming_the_choices():
    with pytest.raises(ConfigError, match="unknown field order 'moved'; field orders: keep, global, free"):
        field_pin(prepare_table(pd.DataFrame({"a": ["1"]}), None), "moved", None)
