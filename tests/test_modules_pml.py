"""PML (``kvreuse.modules.pml``): parsing schemas and prompts, errors with line and column, round trips."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvreuse.errors import KVReuseError
from kvreuse.modules.pml import (
    Import,
    Module,
    ModuleUnion,
    Param,
    PMLError,
    Prompt,
    Role,
    Schema,
    Text,
    parse,
    parse_prompt,
    parse_schema,
    render,
)

TRAVEL = """<schema name="travel">
  <system>You are a travel agent.</system>
  <module name="doc-a">Doc A &amp; &lt;more&gt;</module>
  <union>
    <module name="paris">Paris <module name="louvre">The Louvre</module></module>
    <module name="rome">Rome</module>
  </union>
  <module name="trip-plan">Plan a trip of <param name="duration" len='4'/>.</module>
</schema>"""


def test_schema_parses_into_modules_unions_params_and_roles():
    schema = parse_schema(TRAVEL)
    assert schema.name == "travel"
    assert list(schema.modules()) == ["doc-a", "paris", "louvre", "rome", "trip-plan"]
    role, union = schema.children[1], schema.children[5]
    assert role == Role("system", (Text("You are a travel agent."),))
    assert isinstance(union, ModuleUnion) and [m.name for m in union.members] == ["paris", "rome"]
    assert schema.modules()["doc-a"].children == (Text("Doc A & <more>"),)
    assert schema.modules()["trip-plan"].children == (Text("Plan a trip of "), Param("duration", 4), Text("."))
    assert schema.modules()["louvre"].at == (5, 32)


def test_prompt_imports_modules_with_arguments_among_free_text():
    prompt = parse_prompt(
        '<prompt schema="travel"><doc-a/> and <paris><louvre/></paris><trip-plan duration="3 days"/> Where?</prompt>'
    )
    assert prompt == Prompt(
        "travel",
        (
            Import("doc-a"),
            Text(" and "),
            Import("paris", (), (Import("louvre"),)),
            Import("trip-plan", (("duration", "3 days"),)),
            Text(" Where?"),
        ),
    )


@pytest.mark.parametrize(
    ("text", "where", "problem"),
    [
        ('<schema name="x">\n  <module name="a">text', (2, 3), "unclosed tag <module>"),
        ("<schema name=x></schema>", (1, 14), "must be in quotes"),
        ('<schema name="x"><module name="a"/>\n<module name="a"/></schema>', (2, 1), "duplicate module name 'a'"),
        ('<schema name="x"><module name="a"><param name="p" len="0"/></module></schema>', (1, 35), "positive integer"),
        ('<schema name="x"><param name="p" len="3"/></schema>', (1, 18), "outside a module"),
        ('<schema name="x"><union>text</union></schema>', (1, 25), "only <module> members"),
        ('<schema name="x"><table/></schema>', (1, 18), "unknown tag <table>"),
        ('<schema name="x"><module name="a"></schema>', (1, 35), "</schema> closes <module>"),
        ('<schema name="x">a < b</schema>', (1, 20), "'<' must start a tag name"),
        ('<schema name="x">fish & chips</schema>', (1, 23), "'&' must start an entity"),
        ('<schema name="x" name="y"></schema>', (1, 18), "given twice"),
        ("<schema>\n</schema>", (1, 1), 'needs the attribute name="..."'),
        ('<prompt schema="x"><module name="a"/></prompt>', (1, 20), "cannot appear in a prompt"),
        ('<schema name="x"></schema><schema name="y"></schema>', (1, 27), "a second root element"),
        ("", (1, 1), "empty document"),
    ],
)
def test_errors_give_line_column_and_the_problem(text, where, problem):
    with pytest.raises(PMLError) as info:
        parse(text)
    assert (info.value.line, info.value.column) == where and problem in str(info.value)
    assert str(info.value).startswith(f"line {where[0]}, column {where[1]}: ")
    assert isinstance(info.value, KVReuseError) and isinstance(info.value, ValueError)


# -- round trips of random well-formed trees ---------------------------------------------------------------------

_texts = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=12)


def _merge(nodes):
    """Adjacent text runs parse as one; empty runs do not exist."""
    out = []
    for node in nodes:
        if isinstance(node, Text) and out and isinstance(out[-1], Text):
            out[-1] = Text(out[-1].text + node.text)
        elif not (isinstance(node, Text) and not node.text):
            out.append(node)
    return tuple(out)


def _schema_nodes(depth, in_module, in_role):
    leaves = [_texts.map(Text)]
    if in_module:
        leaves.append(st.builds(Param, st.just("p"), st.integers(1, 99)))
    if depth == 0:
        return st.one_of(*leaves)
    module = st.builds(
        lambda kids: Module("m", _merge(kids)), st.lists(_schema_nodes(depth - 1, True, in_role), max_size=4)
    )
    options = leaves + [module, st.lists(module, min_size=1, max_size=3).map(lambda ms: ModuleUnion(tuple(ms)))]
    if not in_role:
        options.append(
            st.builds(
                lambda role, kids: Role(role, _merge(kids)),
                st.sampled_from(["system", "user"]),
                st.lists(_schema_nodes(depth - 1, in_module, True), max_size=3),
            )
        )
    return st.one_of(*options)


def _name_uniquely(nodes, counter):
    """Module names m0, m1, ... in document order; param names unique within their module."""
    out = []
    params = itertools.count()
    for node in nodes:
        if isinstance(node, Module):
            out.append(Module(f"m{next(counter)}", _name_uniquely(node.children, counter)))
        elif isinstance(node, ModuleUnion):
            out.append(
                ModuleUnion(
                    tuple(Module(f"m{next(counter)}", _name_uniquely(m.children, counter)) for m in node.members)
                )
            )
        elif isinstance(node, Role):
            out.append(Role(node.role, _name_uniquely(node.children, counter)))
        elif isinstance(node, Param):
            out.append(Param(f"p{next(params)}", node.len))
        else:
            out.append(node)
    return tuple(out)


schemas = st.lists(_schema_nodes(3, False, False), max_size=5).map(
    lambda kids: Schema("s", _name_uniquely(_merge(kids), itertools.count()))
)

_imports = st.recursive(
    st.builds(
        Import,
        st.sampled_from(["doc-a", "trip_plan", "x.y"]),
        st.lists(
            st.tuples(st.sampled_from(["a", "b", "c"]), st.text(max_size=8)), max_size=3, unique_by=lambda kv: kv[0]
        ).map(tuple),
    ),
    lambda inner: st.builds(Import, st.just("parent"), st.just(()), st.lists(inner, min_size=1, max_size=2).map(tuple)),
    max_leaves=4,
)
prompts = st.lists(st.one_of(_texts.map(Text), _imports), max_size=6).map(lambda kids: Prompt("s", _merge(kids)))


@settings(max_examples=80, deadline=None)
@given(schemas)
def test_random_schemas_round_trip(schema):
    assert parse(render(schema)) == schema


@settings(max_examples=60, deadline=None)
@given(prompts)
def test_random_prompts_round_trip(prompt):
    assert parse(render(prompt)) == prompt


_garbage = st.lists(
    st.sampled_from(
        list("<>/=\"' &;!\nabmpx") + ["schema", "module", "union", "param", "prompt", "name", "len", "&amp;", "system"]
    ),
    max_size=40,
).map("".join)


def _parse_or_pml_error(text):
    try:
        parse(text)
    except PMLError as error:
        assert error.line >= 1 and error.column >= 1


@settings(max_examples=150, deadline=None)
@given(_garbage)
def test_garbage_gives_pml_error_never_another_exception(text):
    _parse_or_pml_error(text)


@settings(max_examples=100, deadline=None)
@given(schemas, st.data())
def test_damaged_documents_give_pml_error_never_another_exception(schema, data):
    text = render(schema)
    i = data.draw(st.integers(0, len(text)))
    j = data.draw(st.integers(i, min(len(text), i + 3)))
    _parse_or_pml_error(text[:i] + data.draw(st.sampled_from(["", "<", ">", '"', "&", "/"])) + text[j:])


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=80))
def test_any_text_gives_a_document_or_pml_error(text):
    _parse_or_pml_error(text)


def _word_ids(text: str) -> list[int]:
    """A stand-in tokenizer: one token per character (deterministic, never empty for non-empty text)."""
    return [ord(c) % 1000 for c in text]


_resolvable_imports = st.recursive(
    st.builds(
        Import,
        st.sampled_from([f"m{i}" for i in range(6)] + ["nope"]),
        st.lists(
            st.tuples(st.sampled_from(["p0", "p1", "q"]), st.text(max_size=120)), max_size=2, unique_by=lambda kv: kv[0]
        ).map(tuple),
    ),
    lambda inner: st.builds(
        Import, st.sampled_from(["m0", "m1"]), st.just(()), st.lists(inner, min_size=1, max_size=2).map(tuple)
    ),
    max_leaves=4,
)


@settings(max_examples=150, deadline=None)
@given(schemas, st.lists(st.one_of(_texts.map(Text), _resolvable_imports), max_size=6), st.booleans())
def test_any_prompt_against_any_schema_resolves_or_gives_kvreuses_own_error(schema, items, same_schema):
    """Layout, resolution and the prompt's token ids: a result, or a KVReuseError (PMLError) naming the problem."""
    from kvreuse.modules.layout import layout_schema, resolve_prompt
    from kvreuse.modules.linear import prompt_token_ids

    prompt = Prompt("s" if same_schema else "other", _merge(items))
    try:
        layout = layout_schema(schema, _word_ids)
        ids = prompt_token_ids(resolve_prompt(prompt, layout, _word_ids), layout)
    except KVReuseError:
        return
    assert all(isinstance(i, int) for i in ids)
