"""Which prompt tokens come from cached modules (``kvreuse.modules.splice``) and PML for contiguous positions
(``kvreuse.modules.linear``)."""

from __future__ import annotations

import pytest

from kvreuse.modules.layout import layout_schema, resolve_prompt
from kvreuse.modules.linear import prompt_token_ids, schema_runs
from kvreuse.modules.pml import parse_prompt, parse_schema
from kvreuse.modules.splice import (
    Piece,
    Skipped,
    SkipReason,
    block_modules,
    plan_splice,
    skipped_modules,
    token_slots,
)
from kvreuse.modules.trie import ModuleMatch, ModuleTrie

ALL = lambda name: True  # noqa: E731


def test_a_run_of_adjacent_modules_is_taken_from_the_prefix_hit_to_the_first_gap():
    matches = [ModuleMatch("a", 0, 10), ModuleMatch("b", 10, 25), ModuleMatch("c", 30, 40)]
    assert plan_splice(matches, 0, 99, ALL) == [Piece("a", 0, 0, 10), Piece("b", 0, 10, 15)]


def test_a_prefix_hit_inside_a_module_takes_the_rest_of_it_from_the_right_offset():
    matches = [ModuleMatch("a", 0, 40), ModuleMatch("b", 40, 50)]
    pieces = plan_splice(matches, 32, 99, ALL)
    assert pieces == [Piece("a", 32, 32, 8), Piece("b", 0, 40, 10)]
    assert pieces[0].delta(module_start=0) == 0 and pieces[1].delta(module_start=7) == 33


def test_the_run_stops_at_free_text_at_a_module_the_store_lacks_and_before_the_last_prompt_token():
    matches = [ModuleMatch("a", 5, 10), ModuleMatch("b", 10, 20)]
    assert plan_splice(matches, 0, 99, ALL) == []  # free text first: the engine computes from token 0
    assert plan_splice(matches, 5, 99, lambda n: n != "b") == [Piece("a", 0, 5, 5)]
    assert plan_splice(matches, 5, 14, ALL) == [Piece("a", 0, 5, 5), Piece("b", 0, 10, 4)]
    assert plan_splice(matches, 20, 99, ALL) == []


def test_plans_follow_the_trie_on_prompts_in_any_order():
    trie = ModuleTrie([("x", [1, 2, 3]), ("y", [4, 5]), ("z", [6, 7, 8, 9])])
    for prompt in ([1, 2, 3, 4, 5, 6, 7, 8, 9, 0], [6, 7, 8, 9, 1, 2, 3, 4, 5, 0]):
        pieces = plan_splice(trie.find(prompt), 0, len(prompt) - 1, ALL)
        assert sum(p.length for p in pieces) == 9
        for piece in pieces:
            assert (
                prompt[piece.prompt_start : piece.prompt_end]
                == {"x": [1, 2, 3], "y": [4, 5], "z": [6, 7, 8, 9]}[piece.name]
            )


def test_token_slots_follow_the_block_table_and_refuse_tokens_past_it():
    assert token_slots([7, 3], 4, 2, 7) == [30, 31, 12, 13, 14]
    with pytest.raises(ValueError, match="2 blocks"):
        token_slots([7], 4, 0, 6)


def _words(text):
    return [hash(w) % 1000 for w in text.split()]


SCHEMA = parse_schema(
    '<schema name="s"><system>be brief </system><module name="doc">a b c '
    '<module name="inner">d e </module>f g </module><union><module name="u1">h </module>'
    '<module name="u2">i j </module></union><module name="p">k <param name="x" len="3"/>'
    "l m </module>tail </schema>"
)


def test_schema_runs_split_modules_at_params_and_nested_modules_and_list_the_scaffold():
    layout = layout_schema(SCHEMA, _words)
    runs = schema_runs(layout)
    assert list(runs) == ["s:#0", "s:#1", "s:doc#0", "s:doc#1", "s:inner#0", "s:u1#0", "s:u2#0", "s:p#0", "s:p#1"]
    assert runs["s:doc#0"] == tuple(_words("a b c")) and runs["s:doc#1"] == tuple(_words("f g"))
    assert runs["s:p#0"] == tuple(_words("k")) and runs["s:p#1"] == tuple(_words("l m"))
    # The scaffold's runs: the system text and, at the schema's end, the closing text.
    assert runs["s:#0"] == tuple(_words("be brief")) and runs["s:#1"] == tuple(_words("tail"))


def test_a_prompt_becomes_the_scaffold_then_its_items_with_arguments_in_place_of_params():
    layout = layout_schema(SCHEMA, _words)
    prompt = parse_prompt('<prompt schema="s"><u2/><p x="two words"/>why <doc><inner/></doc></prompt>')
    ids = prompt_token_ids(resolve_prompt(prompt, layout, _words), layout)
    expected = "be brief tail i j k two words l m why a b c f g d e"
    assert ids == _words(expected)
    # Every cached run appears verbatim, so the token trie finds each one.
    found = {m.name for m in ModuleTrie(schema_runs(layout).items()).find(ids)}
    assert {"s:#0", "s:#1", "s:u2#0", "s:p#0", "s:p#1", "s:doc#0", "s:doc#1", "s:inner#0"} <= found


def test_every_module_found_but_not_spliced_is_reported_with_its_reason():
    matches = [
        ModuleMatch("cached", 0, 8),
        ModuleMatch("a", 8, 12),
        ModuleMatch("gone", 12, 20),
        ModuleMatch("b", 20, 30),
        ModuleMatch("c", 34, 40),
        ModuleMatch("last", 40, 45),
    ]
    available = lambda name: name != "gone"  # noqa: E731
    pieces = plan_splice(matches, 8, 40, available)
    assert pieces == [Piece("a", 0, 8, 4)]
    merged = [ModuleMatch("merged", 46, 52)]
    assert skipped_modules(matches, pieces, 8, 40, available, merged) == [
        Skipped("gone", 12, SkipReason.NOT_STORED),
        Skipped("b", 20, SkipReason.AFTER_FREE_TEXT),
        Skipped("c", 34, SkipReason.AFTER_FREE_TEXT),
        Skipped("last", 40, SkipReason.PROMPT_END),
        Skipped("merged", 46, SkipReason.TOKEN_BOUNDARY),
    ]
    assert skipped_modules(matches, plan_splice(matches, 0, 99, ALL), 0, 99, ALL) == [
        Skipped("c", 34, SkipReason.AFTER_FREE_TEXT),
        Skipped("last", 40, SkipReason.AFTER_FREE_TEXT),
    ]


def test_a_module_whose_last_token_merged_with_the_text_after_it_is_a_near_miss():
    trie = ModuleTrie([("table", [1, 2, 3, 4, 10]), ("doc", [5, 6, 7, 8, 9]), ("short", [7, 7, 10])])
    prompt = [0, 1, 2, 3, 4, 11, 5, 6, 7, 8, 9, 7, 7, 12]  # "table"'s last token merged into 11; "short" too short
    found = trie.find(prompt)
    assert found == [ModuleMatch("doc", 6, 11)]
    assert trie.near_misses(prompt, found) == [ModuleMatch("table", 1, 5)]
    assert trie.near_misses([1, 2, 3, 4, 10], trie.find([1, 2, 3, 4, 10])) == []


def test_with_a_real_tokenizer_a_module_followed_by_whitespace_is_a_near_miss_not_a_silent_miss(smollm2_model):
    """SmolLM2's tokenizer merges the module's closing newline with a blank line or a space after it."""
    from tokenizers import Tokenizer

    from kvreuse.modules.trie import module_text

    tokenizer = Tokenizer.from_file(str(smollm2_model / "tokenizer.json"))
    encode = lambda t: tokenizer.encode(t, add_special_tokens=False).ids  # noqa: E731
    text = module_text("CREATE TABLE movies (id INTEGER, title TEXT, year INTEGER)")
    trie = ModuleTrie([("movies", encode(text))])
    for after, merged in (("Question: how many?", False), ("\n\nQuestion: how many?", True), ("  Question", True)):
        prompt = encode("Schema:\n" + text + after)
        found = trie.find(prompt)
        assert bool(found) is not merged, after
        assert [m.name for m in trie.near_misses(prompt, found)] == (["movies"] if merged else []), after


def test_block_modules_gives_every_module_whose_tokens_lie_in_a_block_from_the_first_block_on():
    a, b, c = matches = [ModuleMatch("a", 0, 6), ModuleMatch("b", 6, 9), ModuleMatch("c", 12, 13)]
    # blocks of 4 tokens: a covers 0-1, b 1-2, c 3; the prompt has 3 full blocks (c's block is not full)
    assert block_modules(matches, 4, 0, 3) == {0: (a,), 1: (a, b), 2: (b,)}
    assert block_modules(matches, 4, 2, 4) == {2: (b,), 3: (c,)}
    assert block_modules([], 4, 0, 3) == {}


def test_piece_kv_moves_every_layers_keys_as_a_move_of_that_layer_alone_would_bit_for_bit():
    """piece_kv moves all layers at once (the layers as more heads); each key gets the same arithmetic as a move of
    its layer alone, so the spliced KV is the same to the last bit."""
    import torch

    from kvreuse.kernels.rerotate import RopeSpec, move_keys
    from kvreuse.modules.splice import Piece, piece_kv
    from kvreuse.modules.store import EncodedModule

    spec = RopeSpec(head_dim=8, rotary_dim=8)
    kv = torch.randn(3, 2, 7, 2, 8, generator=torch.Generator().manual_seed(0))
    module = EncodedModule("m", "model", "tok", tuple(range(7)), 4, kv)
    piece = Piece("m", 2, 30, 5)  # from the module's token 2, at prompt position 30
    deltas = torch.full((5,), 30 - (4 + 2), dtype=torch.int64)
    for layer, (keys, values) in enumerate(piece_kv(module, piece, spec, "cpu")):
        assert torch.equal(keys, move_keys(kv[layer, 0, 2:7], deltas, spec))
        assert torch.equal(values, kv[layer, 1, 2:7]) and keys.is_contiguous()
