"""Schema layout and prompt resolution (``kvreuse.modules.layout``): spans, shared union starts, params."""

from __future__ import annotations

import pytest

from kvreuse.modules.layout import FreeText, UsedModule, layout_schema, resolve_prompt
from kvreuse.modules.pml import PMLError, parse_prompt, parse_schema


def chars(text):
    """One token per character: positions are easy to read off."""
    return [ord(c) for c in text]


SCHEMA = parse_schema(
    '<schema name="travel"><system>Agent.</system><module name="doc-a">Doc A</module>'
    '<union><module name="paris">Paris<module name="louvre">L</module></module>'
    '<module name="rome">Rome!!!</module></union>'
    '<module name="trip-plan">Plan <param name="duration" len="4"/>.</module></schema>'
)
LAYOUT = layout_schema(SCHEMA, chars)


def test_modules_follow_each_other_and_union_members_share_a_start():
    spans = {name: (m.start, m.end) for name, m in LAYOUT.modules.items()}
    assert spans == {"doc-a": (6, 11), "paris": (11, 17), "louvre": (16, 17), "rome": (11, 18), "trip-plan": (18, 28)}
    assert LAYOUT.length == 28 and LAYOUT.modules["louvre"].parent == "paris"
    assert LAYOUT.modules["paris"].union == LAYOUT.modules["rome"].union == 0


def test_a_module_caches_its_own_tokens_and_skips_its_params_and_nested_modules():
    plan, paris = LAYOUT.modules["trip-plan"], LAYOUT.modules["paris"]
    assert plan.token_ids == tuple(chars("Plan .")) and plan.positions == (18, 19, 20, 21, 22, 27)
    assert plan.params["duration"].start == 23 and plan.params["duration"].length == 4
    assert paris.token_ids == tuple(chars("Paris")) and paris.positions == tuple(range(11, 16))


def test_role_markers_come_from_the_chat_template_mapping():
    layout = layout_schema(SCHEMA, chars, roles={"system": ("<s>", "</s>\n")})
    assert [s.token_ids for s in layout.scaffold] == [
        tuple(chars("<s>")),
        tuple(chars("Agent.")),
        tuple(chars("</s>\n")),
    ]
    assert layout.modules["doc-a"].start == 3 + 6 + 5


def test_prompt_resolution_lists_modules_in_prompt_order_with_arguments_and_free_text():
    prompt = parse_prompt('<prompt schema="travel">Hi <trip-plan duration="3 d"/><paris><louvre/></paris> Go?</prompt>')
    res = resolve_prompt(prompt, LAYOUT, chars)
    assert res.modules == ("trip-plan", "paris", "louvre")
    assert res.items == (
        FreeText("Hi ", tuple(chars("Hi ")), 6),
        UsedModule("trip-plan", 18, 28, {"duration": tuple(chars("3 d"))}),
        UsedModule("paris", 11, 17),
        UsedModule("louvre", 16, 17),
        FreeText(" Go?", tuple(chars(" Go?")), 28),
    )


@pytest.mark.parametrize(
    ("prompt", "problem"),
    [
        ('<prompt schema="travel"><trip-plan duration="3 days"/></prompt>', "6 tokens, longer than its param (len=4)"),
        ('<prompt schema="hotel"/>', "unknown schema 'hotel' (known: travel)"),
        ('<prompt schema="travel">\n <nope/></prompt>', "unknown module 'nope' in schema 'travel'"),
        ('<prompt schema="travel"><paris/><rome/></prompt>', "members of one union"),
        ('<prompt schema="travel"><doc-a/><doc-a/></prompt>', "imported twice"),
        ('<prompt schema="travel"><doc-a when="now"/></prompt>', "has no param 'when'"),
        ('<prompt schema="travel"><rome><louvre/></rome></prompt>', "'louvre' is not nested in 'rome'"),
    ],
)
def test_resolution_errors_name_the_problem_at_the_tag(prompt, problem):
    with pytest.raises(PMLError) as info:
        resolve_prompt(parse_prompt(prompt), LAYOUT, chars)
    assert problem in str(info.value) and info.value.line >= 1 and info.value.column >= 1


def test_layout_with_the_local_byte_level_bpe_tokenizer(local_tokenizer):
    tok = local_tokenizer
    encode = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    layout = layout_schema(SCHEMA, encode)
    doc = layout.modules["doc-a"]
    assert doc.token_ids == tuple(encode("Doc A")) and doc.start == len(encode("Agent."))
    assert tok.decode(list(layout.modules["rome"].token_ids)) == "Rome!!!"
