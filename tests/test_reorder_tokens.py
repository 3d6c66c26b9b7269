"""Token-exact solving: each distinct cell tokenized once gives the engine's tokens of every prompt, the block
hits of any order follow without tokenizing again, and GGR keeps the best of its candidates on them."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from kvreuse.reorder import prepare_table, prompts, solve, token_hit_measure
from kvreuse.reorder.stats import encode_table
from kvreuse.reorder.tokens import order_block_hits, sorted_neighbour_order, tokenize_lines

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
