"""Token-exact solving: each distinct cell tokenized once gives the engine's tokens of every prompt, the block
hits of any order follow without tokenizing again, and GGR keeps the best of its candidates on them."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from kvreuse.errors import TableError
from kvreuse.reorder import prepare_table, prompts, solve, token_hit_measure
from kvreuse.reorder.stats import encode_table
from kvreuse.reorder.tokens import order_block_hits, shared_start_order, sorted_neighbour_order, tokenize_lines

INSTRUCTION = "Describe this car in one sentence."
BLOCK = 8


@pytest.fixture(scope="module")
def tokenize(local_tokenizer):
    return lambda texts: [e.ids for e in local_tokenizer.encode_batch(list(texts))]


def cars() -> pd.DataFrame:
    rng = np.random.default_rng(0)
    makers = ["chevrolet", "ford", "toyota", "volkswagen", "amc"]
    return pd.DataFrame(
        {
            "Name": [f"{rng.choice(makers)} model {i}" for i in range(60)],
            "Origin": rng.choice(["USA", "Europe", "Japan"], 60),
            "Cylinders": rng.choice(["4", "6", "8"], 60),
            "Year": rng.choice(["1970-01-01", "1971-01-01", "1972-01-01"], 60),
            "Note": rng.choice(["", "  ", "rebuilt engine"], 60),  # empty and blank values: trailing spaces
        }
    )


def previous_prompt_hits(token_ids: list[list[int]], block: int) -> int:
    """Hit tokens when the cache holds only the previous prompt: full blocks of the common prefix, not the last."""
    hits = 0
    for before, ids in zip(token_ids, token_ids[1:]):
        common = 0
        while common < min(len(before), len(ids)) and before[common] == ids[common]:
            common += 1
        hits += min(common, len(ids) - 1) // block * block
    return hits


def test_line_tokens_give_every_orders_block_hits_as_tokenizing_its_prompts_would(tokenize):
    table = prepare_table(cars(), None)
    encoded = encode_table(table)
    tokens = tokenize_lines(table, encoded, INSTRUCTION, tokenize)
    assert tokens is not None
    rng = np.random.default_rng(1)
    for method in ("original", "sorted", "stats", "ggr"):
        ordering = solve(table, method)
        if method == "original":  # and random field orders per row
            ordering = type(ordering)(ordering.rows, tuple(tuple(rng.permutation(5).tolist()) for _ in range(60)))
        ids = tokenize(prompts(ordering, table, INSTRUCTION))
        stats = order_block_hits(encoded, tokens, ordering, BLOCK)
        assert stats.hit_tokens == previous_prompt_hits(ids, BLOCK), method
        assert abs(stats.prompt_tokens - sum(map(len, ids))) <= 60  # a blank last value: a token at most per prompt


def test_a_tokenizer_that_merges_across_line_breaks_falls_back_to_whole_prompts():
    def pairs(texts):  # one token per two characters: line breaks fall inside tokens
        return [[hash(text[i : i + 2]) % 1000 for i in range(0, len(text), 2)] for text in texts]

    table = prepare_table(cars(), None)
    assert tokenize_lines(table, encode_table(table), INSTRUCTION, pairs) is None
    measure = token_hit_measure(table, INSTRUCTION, "lines", pairs, BLOCK)
    assert measure.line_tokens is None
    assert 0.0 <= measure(solve(table, "ggr", measure=measure)) <= 1.0


def test_with_the_engines_measure_ggr_is_at_least_every_candidate_on_it(tokenize):
    table = prepare_table(cars(), None)
    measure = token_hit_measure(table, INSTRUCTION, "lines", tokenize, BLOCK)
    assert measure.line_tokens is not None
    chosen = measure(solve(table, "ggr", measure=measure))
    for method in ("ggr", "stats", "sorted", "original"):
        assert chosen >= measure(solve(table, method)), method


def test_pins_hold_under_the_engines_measure(tokenize):
    table = prepare_table(cars(), None)
    measure = token_hit_measure(table, INSTRUCTION, "lines", tokenize, BLOCK)
    ordering = solve(table, "ggr", pin=["Name"], measure=measure)
    assert all(order[0] == 0 for order in ordering.fields)


def test_fields_whose_sorted_values_share_leading_tokens_come_first_in_the_neighbour_order(tokenize):
    rng = np.random.default_rng(2)
    table = prepare_table(
        pd.DataFrame(
            {
                "code": [f"{rng.integers(0, 10**6):06d}x" for _ in range(200)],  # no common starts worth a token
                "latitude": [f"61.{rng.integers(10**5, 10**6)}" for _ in range(200)],  # "latitude: 61." shared
            }
        ),
        None,
    )
    encoded = encode_table(table)
    tokens = tokenize_lines(table, encoded, INSTRUCTION, tokenize)
    assert sorted_neighbour_order(encoded, tokens) == (1, 0)


def test_fields_that_lead_a_group_together_go_first_by_the_starts_their_values_share(tokenize):
    # Each film's link, title and plot determine each other: its rows share all three whatever their order.
    # Links share "link: m/movies/film-" at their start, plots and titles little past "plot: ", so the link leads,
    # which lets a film's first prompt share the link's start with an earlier film's.
    rng = np.random.default_rng(3)
    words = ["Quiet", "Bright", "Long", "Dark", "Old", "Red", "Seven", "Winter", "Harbor", "Paper", "Iron", "Glass"]
    films = [(f"m/movies/film-{w.lower()}", f"{w} Story", f"{w} people meet, {i} times") for i, w in enumerate(words)]
    picks = rng.integers(0, len(films), 90)
    df = pd.DataFrame(
        {
            "plot": [films[k][2] for k in picks],
            "title": [films[k][1] for k in picks],
            "link": [films[k][0] for k in picks],
            "review": [f"review {i}" for i in range(90)],
        }
    )
    table = prepare_table(df, None)
    encoded = encode_table(table)
    tokens = tokenize_lines(table, encoded, INSTRUCTION, tokenize)
    assert shared_start_order(encoded, tokens, (0, 1, 2, 3))[0] == 2
    measure = token_hit_measure(table, INSTRUCTION, "lines", tokenize, BLOCK)
    ordering = solve(table, "ggr", measure=measure)
    assert all(order[0] == 2 and set(order[:3]) == {0, 1, 2} for order in ordering.fields)


def characters(texts):
    """One token per character: a tokenizer whose line tokens add up, so GGR also solves on tokens."""
    return [[ord(c) for c in text] for text in texts]


def test_a_token_measure_built_for_another_table_is_a_table_error_naming_both():
    small = prepare_table(pd.DataFrame({"a": ["x", "y"]}), None)
    large = prepare_table(pd.DataFrame({"a": ["x", "y", "z"], "b": ["1", "2", "3"]}), None)
    measure = token_hit_measure(small, "Q", "lines", characters, 4)
    with pytest.raises(TableError, match=r"built for another table \(2 rows, fields a\), not this one \(3 rows"):
        solve(large, "ggr", measure=measure)
    with pytest.raises(TableError, match="ordering has 3 row position"):
        measure(solve(large, "original"))


def test_with_a_token_measure_ggr_on_characters_stays_among_the_candidates(monkeypatch):
    import kvreuse.reorder.solvers as solvers

    table = prepare_table(pd.DataFrame({"a": ["x", "y", "x"], "b": ["1", "2", "1"]}), None)
    measure = token_hit_measure(table, "Q", "lines", characters, 1)
    assert measure.line_tokens is not None
    runs: list[bool] = []  # per GGR run: whether it solved on tokens
    real = solvers.ggr_order
    monkeypatch.setattr(solvers, "ggr_order", lambda *a, **k: runs.append("weights" in k) or real(*a, **k))
    scored: list = []
    solvers.solve(table, "ggr", measure=lambda ordering: scored.append(ordering) or measure(ordering))
    assert runs == [False] and len(scored) == 3  # a plain callable: GGR on characters, stats, sorted
    runs.clear()
    solvers.solve(table, "ggr", measure=measure)
    assert runs == [True, False]  # on tokens, then on characters
