"""Prompt Markup Language (PML): schemas of reusable prompt modules and prompts that import them.

After Gim et al., "Prompt Cache: Modular Attention Reuse for Low-Latency Inference" (MLSys 2024). A *schema*
declares modules, each encoded once and cached; a *prompt* names a schema, imports some of its modules and adds
free text::

    <schema name="travel">
      <system>You are a travel agent.</system>
      <module name="doc-a">...</module>
      <union>                                   members share one start position; a prompt imports at most one
        <module name="paris">...</module>
        <module name="rome">...</module>
      </union>
      <module name="trip-plan">Plan a trip of <param name="duration" len="4"/>.</module>
    </schema>

    <prompt schema="travel"><doc-a/><trip-plan duration="3 days"/> Where should I go?</prompt>

Tags: ``<schema name>``, ``<module name>`` (nestable), ``<union>`` (modules only), ``<param name len/>`` (a
placeholder of ``len`` tokens inside a module), the role tags ``<system>``, ``<user>``, ``<assistant>`` (kept in the
tree; a later layer maps them onto the model's chat template), and in prompts ``<prompt schema>`` and imports
``<MODULE attr="argument" .../>`` (or ``<MODULE>...nested imports...</MODULE>``) whose attributes fill the
module's params. Text outside modules is part of every prompt. Attribute values are quoted (``"`` or ``'``);
text and values escape ``&``, ``<``, ``>``, ``"`` as ``&amp; &lt; &gt; &quot;``. Module names are unique in a
schema, so an import names one module wherever it is nested.

Every error is a :class:`PMLError` with the line and column (1-based) where the problem is.

:func:`layout_schema` gives each module its token span and start position; :func:`resolve_prompt` says which
modules a prompt uses, in what order, at what positions, and with what free text between them.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from kvreuse.errors import PMLError

ROLES = ("system", "user", "assistant")
RESERVED_NAMES = ("schema", "module", "union", "param", "prompt") + ROLES
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.:-]*")
_ENTITIES = {"amp": "&", "lt": "<", "gt": ">", "quot": '"', "apos": "'"}


# ----------------------------------------------------------------------------------------------------------------
# The parsed tree. ``at`` is (line, column) of the node's tag, for later errors; it is not part of equality.


@dataclass(frozen=True)
class Text:
    text: str
    at: tuple[int, int] = field(default=(0, 0), compare=False)


@dataclass(frozen=True)
class Param:
    name: str
    len: int
    at: tuple[int, int] = field(default=(0, 0), compare=False)


@dataclass(frozen=True)
class Role:
    """``<system>``, ``<user>`` or ``<assistant>`` around part of a schema or prompt."""

    role: str
    children: tuple[Node, ...]
    at: tuple[int, int] = field(default=(0, 0), compare=False)


@dataclass(frozen=True)
class Module:
    name: str
    children: tuple[Node, ...]
    at: tuple[int, int] = field(default=(0, 0), compare=False)


@dataclass(frozen=True)
class ModuleUnion:
    """``<union>``: alternative modules that share a start position."""

    members: tuple[Module, ...]
    at: tuple[int, int] = field(default=(0, 0), compare=False)


@dataclass(frozen=True)
class Schema:
    name: str
    children: tuple[Node, ...]
    at: tuple[int, int] = field(default=(0, 0), compare=False)

    def modules(self) -> dict[str, Module]:
        """Every module of the schema by name, nested ones included, in document order."""
        found: dict[str, Module] = {}

        def walk(nodes: Iterable[Node]) -> None:
            for node in nodes:
                if isinstance(node, Module):
                    found[node.name] = node
                    walk(node.children)
                elif isinstance(node, ModuleUnion):
                    walk(node.members)
                elif isinstance(node, Role):
                    walk(node.children)

        walk(self.children)
        return found


@dataclass(frozen=True)
class Import:
    """``<name arg="value"/>`` in a prompt: use module ``name`` with ``args`` filling its params; ``children``
    are imports of its nested modules (and whitespace)."""

    name: str
    args: tuple[tuple[str, str], ...] = ()
    children: tuple[Node, ...] = ()
    at: tuple[int, int] = field(default=(0, 0), compare=False)


@dataclass(frozen=True)
class Prompt:
    schema: str
    children: tuple[Node, ...]
    at: tuple[int, int] = field(default=(0, 0), compare=False)


Node = Text | Param | Role | Module | ModuleUnion | Import


# ----------------------------------------------------------------------------------------------------------------
# Lexer: text and tags with their offsets.


@dataclass
class _Tag:
    name: str
    attrs: list[tuple[str, str, int]]  # name, value, offset
    closing: bool
    self_closing: bool
    offset: int
    end: int  # offset just past '>'


@dataclass
class _Element:
    name: str
    attrs: list[tuple[str, str, int]]
    offset: int
    children: list[_Element | tuple[str, int]] = field(default_factory=list)


class _Source:
    def __init__(self, text: str):
        self.text = text
        self._lines = [0] + [i + 1 for i, c in enumerate(text) if c == "\n"]

    def where(self, offset: int) -> tuple[int, int]:
        line = bisect.bisect_right(self._lines, offset)
        return line, offset - self._lines[line - 1] + 1

    def error(self, message: str, offset: int) -> PMLError:
        return PMLError(message, *self.where(offset))


def _unescape(src: _Source, raw: str, offset: int) -> str:
    out, i = [], 0
    while True:
        j = raw.find("&", i)
        if j < 0:
            out.append(raw[i:])
            return "".join(out)
        out.append(raw[i:j])
        end = raw.find(";", j)
        name = raw[j + 1 : end] if end > 0 else ""
        if name not in _ENTITIES:
            raise src.error("'&' must start an entity (&amp; &lt; &gt; &quot; &apos;)", offset + j)
        out.append(_ENTITIES[name])
        i = end + 1


def _lex(src: _Source) -> Iterator[tuple[str, int] | _Tag]:
    text, i, n = src.text, 0, len(src.text)
    while i < n:
        j = text.find("<", i)
        if j < 0:
            j = n
        if j > i:
            yield _unescape(src, text[i:j], i), i
        if j == n:
            return
        tag = _lex_tag(src, j)
        yield tag
        i = tag.end


def _lex_tag(src: _Source, start: int) -> _Tag:
    text, n = src.text, len(src.text)
    i = start + 1
    closing = i < n and text[i] == "/"
    i += closing
    m = _NAME.match(text, i)
    if not m:
        raise src.error("'<' must start a tag name (write &lt; for a literal '<')", start)
    name, i = m.group(), m.end()
    attrs: list[tuple[str, str, int]] = []
    while True:
        k = i
        while i < n and text[i].isspace():
            i += 1
        if i >= n:
            raise src.error(f"tag <{'/' if closing else ''}{name}> is not closed with '>'", start)
        if text[i] == ">":
            return _Tag(name, attrs, closing, False, start, i + 1)
        if text.startswith("/>", i):
            if closing:
                raise src.error(f"closing tag </{name}> cannot end with '/>'", i)
            return _Tag(name, attrs, closing, True, start, i + 2)
        if closing:
            raise src.error(f"closing tag </{name}> cannot have attributes", i)
        if i == k:
            raise src.error(f"expected a space before the attribute in <{name}>", i)
        m = _NAME.match(text, i)
        if not m:
            raise src.error(f"unexpected {text[i]!r} in tag <{name}>", i)
        attr, at = m.group(), i
        i = m.end()
        while i < n and text[i].isspace():
            i += 1
        if i >= n or text[i] != "=":
            raise src.error(f'attribute {attr!r} of <{name}> needs a value: {attr}="..."', at)
        i += 1
        while i < n and text[i].isspace():
            i += 1
        if i >= n or text[i] not in "\"'":
            raise src.error(f"the value of attribute {attr!r} of <{name}> must be in quotes", i)
        quote, i = text[i], i + 1
        end = text.find(quote, i)
        if end < 0:
            raise src.error(f"the value of attribute {attr!r} of <{name}> has no closing {quote}", i - 1)
        if "<" in text[i:end]:
            raise src.error(f"'<' in the value of attribute {attr!r} (write &lt;)", i + text[i:end].index("<"))
        if any(a == attr for a, _, _ in attrs):
            raise src.error(f"attribute {attr!r} given twice in <{name}>", at)
        attrs.append((attr, _unescape(src, text[i:end], i), at))
        i = end + 1


def _tree(src: _Source) -> _Element:
    root: _Element | None = None
    stack: list[_Element] = []
    for item in _lex(src):
        if isinstance(item, tuple):
            if stack:
                stack[-1].children.append(item)
            elif item[0].strip():
                raise src.error("text outside the root <schema> or <prompt> element", item[1])
            continue
        tag = item
        if tag.closing:
            if not stack:
                raise src.error(f"closing tag </{tag.name}> without an open tag", tag.offset)
            if stack[-1].name != tag.name:
                open_ = stack[-1]
                raise src.error(
                    f"</{tag.name}> closes <{open_.name}> opened at line "
                    f"{src.where(open_.offset)[0]}, column {src.where(open_.offset)[1]}",
                    tag.offset,
                )
            done = stack.pop()
            if not stack:
                root = done
            continue
        element = _Element(tag.name, tag.attrs, tag.offset)
        if stack:
            stack[-1].children.append(element)
        elif root is not None:
            raise src.error(f"a second root element <{tag.name}>: a document holds one schema or prompt", tag.offset)
        if tag.self_closing:
            if not stack:
                root = element
        else:
            stack.append(element)
    if stack:
        raise src.error(f"unclosed tag <{stack[-1].name}>", stack[-1].offset)
    if root is None:
        raise src.error('empty document: expected <schema name="..."> or <prompt schema="...">', len(src.text))
    return root


# ----------------------------------------------------------------------------------------------------------------
# Tree -> schema / prompt, with the checks that need the tag's meaning.


def _attrs(src: _Source, el: _Element, required: Sequence[str], optional: Sequence[str] = ()) -> dict[str, str]:
    got = {}
    for name, value, at in el.attrs:
        if name not in required and name not in optional:
            allowed = ", ".join(list(required) + list(optional)) or "none"
            raise src.error(f"unknown attribute {name!r} of <{el.name}> (allowed: {allowed})", at)
        got[name] = value
    for name in required:
        if name not in got:
            raise src.error(f'<{el.name}> needs the attribute {name}="..."', el.offset)
    return got


class _SchemaBuilder:
    def __init__(self, src: _Source):
        self.src = src
        self.names: dict[str, int] = {}

    def children(self, el: _Element, *, in_module: bool, in_role: bool) -> tuple[Node, ...]:
        out: list[Node] = []
        for child in el.children:
            if isinstance(child, tuple):
                out.append(Text(child[0], self.src.where(child[1])))
            else:
                out.append(self.node(child, in_module=in_module, in_role=in_role))
        return tuple(out)

    def node(self, el: _Element, *, in_module: bool, in_role: bool) -> Node:
        src, at = self.src, self.src.where(el.offset)
        if el.name == "module":
            name = _attrs(src, el, ["name"])["name"]
            if not _NAME.fullmatch(name) or name in RESERVED_NAMES:
                raise src.error(
                    f"module name {name!r} must be a tag name and not one of {', '.join(RESERVED_NAMES)}", el.offset
                )
            if name in self.names:
                first = src.where(self.names[name])
                raise src.error(
                    f"duplicate module name {name!r} (first at line {first[0]}, column {first[1]})", el.offset
                )
            self.names[name] = el.offset
            children = self.children(el, in_module=True, in_role=in_role)
            params = [c for c in children if isinstance(c, Param)]
            seen: set[str] = set()
            for p in params:
                if p.name in seen:
                    raise PMLError(f"duplicate param {p.name!r} in module {name!r}", *p.at)
                seen.add(p.name)
            return Module(name, children, at)
        if el.name == "union":
            _attrs(src, el, [])
            members: list[Module] = []
            for child in el.children:
                if isinstance(child, tuple):
                    if child[0].strip():
                        raise src.error("a <union> holds only <module> members (text found)", child[1])
                elif child.name != "module":
                    raise src.error(f"a <union> holds only <module> members, not <{child.name}>", child.offset)
                else:
                    member = self.node(child, in_module=in_module, in_role=in_role)
                    assert isinstance(member, Module)  # a <module> element builds a Module
                    members.append(member)
            if not members:
                raise src.error("empty <union>: it needs at least one <module>", el.offset)
            return ModuleUnion(tuple(members), at)
        if el.name == "param":
            attrs = _attrs(src, el, ["name", "len"])
            if not in_module:
                raise src.error(f"<param name={attrs['name']!r}> outside a module", el.offset)
            if el.children:
                raise src.error('<param> must be empty: <param name="..." len="..."/>', el.offset)
            if not re.fullmatch(r"[0-9]+", attrs["len"].strip()) or int(attrs["len"]) < 1:
                raise src.error(
                    f"len of <param name={attrs['name']!r}> must be a positive integer, got {attrs['len']!r}", el.offset
                )
            return Param(attrs["name"], int(attrs["len"]), at)
        if el.name in ROLES:
            _attrs(src, el, [])
            if in_role:
                raise src.error(f"<{el.name}> inside another role tag", el.offset)
            return Role(el.name, self.children(el, in_module=in_module, in_role=True), at)
        if el.name in ("schema", "prompt"):
            raise src.error(f"<{el.name}> must be the root element", el.offset)
        raise src.error(
            f"unknown tag <{el.name}> in a schema (expected module, union, param, system, user or assistant)", el.offset
        )


def _import(src: _Source, el: _Element) -> Import:
    for child in el.children:
        if isinstance(child, tuple) and child[0].strip():
            raise src.error(f"text inside the import <{el.name}>: only nested module imports go there", child[1])
    children = tuple(_import(src, c) for c in el.children if not isinstance(c, tuple))
    return Import(el.name, tuple((a, v) for a, v, _ in el.attrs), children, src.where(el.offset))


def _prompt_children(src: _Source, el: _Element, in_role: bool) -> tuple[Node, ...]:
    out: list[Node] = []
    for child in el.children:
        if isinstance(child, tuple):
            out.append(Text(child[0], src.where(child[1])))
        elif child.name in ROLES:
            _attrs(src, child, [])
            if in_role:
                raise src.error(f"<{child.name}> inside another role tag", child.offset)
            out.append(Role(child.name, _prompt_children(src, child, True), src.where(child.offset)))
        elif child.name in RESERVED_NAMES:
            raise src.error(
                f"<{child.name}> cannot appear in a prompt (only module imports, text and role tags)", child.offset
            )
        else:
            out.append(_import(src, child))
    return tuple(out)


def parse(text: str) -> Schema | Prompt:
    """Parse a PML document: a ``<schema>`` or a ``<prompt>``. Raises :class:`PMLError`."""
    src = _Source(text)
    root = _tree(src)
    if root.name == "schema":
        name = _attrs(src, root, ["name"])["name"]
        return Schema(name, _SchemaBuilder(src).children(root, in_module=False, in_role=False), src.where(root.offset))
    if root.name == "prompt":
        schema = _attrs(src, root, ["schema"])["schema"]
        return Prompt(schema, _prompt_children(src, root, False), src.where(root.offset))
    raise src.error(f"the root element must be <schema> or <prompt>, not <{root.name}>", root.offset)


def parse_schema(text: str) -> Schema:
    doc = parse(text)
    if not isinstance(doc, Schema):
        raise PMLError("expected a <schema>, got a <prompt>", *doc.at)
    return doc


def parse_prompt(text: str) -> Prompt:
    doc = parse(text)
    if not isinstance(doc, Prompt):
        raise PMLError("expected a <prompt>, got a <schema>", *doc.at)
    return doc


# ----------------------------------------------------------------------------------------------------------------
# Rendering (the inverse of parse).


def escape(text: str, quote: bool = False) -> str:
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return text.replace('"', "&quot;") if quote else text


def render(doc: Schema | Prompt | Node) -> str:
    """PML text of a tree; ``parse(render(t)) == t``."""

    def attr(name: str, value: str) -> str:
        return f' {name}="{escape(value, quote=True)}"'

    def inner(nodes: Iterable[Node]) -> str:
        return "".join(render(n) for n in nodes)

    if isinstance(doc, Text):
        return escape(doc.text)
    if isinstance(doc, Param):
        return f"<param{attr('name', doc.name)}{attr('len', str(doc.len))}/>"
    if isinstance(doc, Role):
        return f"<{doc.role}>{inner(doc.children)}</{doc.role}>"
    if isinstance(doc, Module):
        return f"<module{attr('name', doc.name)}>{inner(doc.children)}</module>"
    if isinstance(doc, ModuleUnion):
        return f"<union>{inner(doc.members)}</union>"
    if isinstance(doc, Import):
        args = "".join(attr(a, v) for a, v in doc.args)
        return f"<{doc.name}{args}>{inner(doc.children)}</{doc.name}>" if doc.children else f"<{doc.name}{args}/>"
    if isinstance(doc, Schema):
        return f"<schema{attr('name', doc.name)}>{inner(doc.children)}</schema>"
    if isinstance(doc, Prompt):
        return f"<prompt{attr('schema', doc.schema)}>{inner(doc.children)}</prompt>"
    raise TypeError(f"not a PML node: {doc!r}")
