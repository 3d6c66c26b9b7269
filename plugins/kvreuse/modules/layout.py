"""Token layout of a PML schema, and which cached modules a prompt uses at which positions.

:func:`layout_schema` walks a parsed schema once with a position counter and a tokenizer: each text run is
tokenized on its own (so a module's tokens never depend on its neighbours; see ``trie.py`` for keeping them the
same inside a plain prompt), a ``<param len=N>`` reserves ``N`` positions, a module starts where the counter is
and ends where its content (nested modules included) ends, and the members of a ``<union>`` all start at the
union's start; the union ends at its longest member's end. Role tags add the marker text a chat template gives
(``roles``, by default nothing). Text outside modules is the *scaffold*, part of every prompt.

Invariants: segments of one module are disjoint and increasing; a nested module lies inside its parent's span;
modules outside a common union never overlap.

:func:`resolve_prompt` lists, in the prompt's order, the modules it imports (at their schema positions, with
argument tokens at their params' positions) and its free text; free text starts at the highest position used
before it, as if it continued the prompt, so it never shares a position with anything before it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvreuse.errors import PMLError
from kvreuse.modules.pml import Import, Module, ModuleUnion, Node, Param, Prompt, Role, Schema, Text

Tokenize = Callable[[str], Sequence[int]]


@dataclass(frozen=True)
class Segment:
    """A run of positions ``[start, start + length)`` of a schema.

    ``kind``: ``"text"`` (``token_ids`` of a text run), ``"role"`` (``token_ids`` of a role marker; ``name`` is the
    role) or ``"param"`` (``length`` reserved positions, no tokens; ``name`` is the param). ``module``: the
    innermost module that owns it, ``None`` for the scaffold.
    """

    kind: str
    module: str | None
    start: int
    length: int
    token_ids: tuple[int, ...] = ()
    name: str = ""


@dataclass(frozen=True)
class ModuleSpan:
    """Where a module lies: positions ``[start, end)`` (nested modules included), its own segments, its parent
    module and its union (index in document order, ``None`` outside unions)."""

    name: str
    start: int
    end: int
    parent: str | None
    union: int | None
    segments: tuple[Segment, ...]

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The tokens cached for the module (its text and role markers; params excluded)."""
        return tuple(t for s in self.segments if s.kind != "param" for t in s.token_ids)

    @property
    def positions(self) -> tuple[int, ...]:
        """The position of each of :attr:`token_ids`."""
        return tuple(s.start + i for s in self.segments if s.kind != "param" for i in range(s.length))

    @property
    def params(self) -> dict[str, Segment]:
        return {s.name: s for s in self.segments if s.kind == "param"}


@dataclass(frozen=True)
class SchemaLayout:
    name: str
    modules: dict[str, ModuleSpan]
    scaffold: tuple[Segment, ...]
    length: int  # positions the whole schema spans


def layout_schema(
    schema: Schema, tokenize: Tokenize, roles: Mapping[str, tuple[str, str]] | None = None
) -> SchemaLayout:
    """Assign every module of ``schema`` its span and start position (see the module docstring).

    ``roles`` maps ``system``/``user``/``assistant`` to the (opening, closing) text of the model's chat template.
    """
    roles = roles or {}
    segments: dict[str | None, list[Segment]] = {None: []}
    spans: dict[str, tuple[int, int, str | None, int | None]] = {}
    unions = 0

    def text(run: str, owner: str | None, pos: int, kind: str = "text", name: str = "") -> int:
        ids = tuple(tokenize(run)) if run else ()
        if ids:
            segments[owner].append(Segment(kind, owner, pos, len(ids), ids, name))
        return pos + len(ids)

    def walk(nodes: Sequence[Node], owner: str | None, pos: int, union: int | None = None) -> int:
        nonlocal unions
        for node in nodes:
            if isinstance(node, Text):
                pos = text(node.text, owner, pos)
            elif isinstance(node, Param):
                segments[owner].append(Segment("param", owner, pos, node.len, (), node.name))
                pos += node.len
            elif isinstance(node, Role):
                opening, closing = roles.get(node.role, ("", ""))
                pos = text(opening, owner, pos, "role", node.role)
                pos = walk(node.children, owner, pos)
                pos = text(closing, owner, pos, "role", node.role)
            elif isinstance(node, Module):
                segments[node.name] = []
                start = pos
                pos = walk(node.children, node.name, pos)
                spans[node.name] = (start, pos, owner, union)
            elif isinstance(node, ModuleUnion):
                index, unions = unions, unions + 1
                start, end = pos, pos
                for member in node.members:
                    end = max(end, walk((member,), owner, start, index))
                pos = end
        return pos

    length = walk(schema.children, None, 0)
    modules = {
        name: ModuleSpan(name, start, end, parent, union, tuple(segments[name]))
        for name, (start, end, parent, union) in spans.items()
    }
    modules = {name: modules[name] for name in schema.modules()}  # document order
    return SchemaLayout(schema.name, modules, tuple(segments[None]), length)


@dataclass(frozen=True)
class UsedModule:
    """A cached module placed at its schema positions; ``args`` maps a param to its argument's token ids, which
    take the param's first positions (the rest of the param's positions stay unused)."""

    name: str
    start: int
    end: int
    args: dict[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class FreeText:
    """Prompt text encoded fresh at positions ``start, start + 1, ...``; ``role`` is its enclosing role tag."""

    text: str
    token_ids: tuple[int, ...]
    start: int
    role: str | None = None


@dataclass(frozen=True)
class Resolution:
    """What a prompt is made of: the schema's scaffold (always, at its positions), then ``items`` in the
    prompt's order."""

    schema: str
    scaffold: tuple[Segment, ...]
    items: tuple[UsedModule | FreeText, ...]

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(i.name for i in self.items if isinstance(i, UsedModule))


def resolve_prompt(
    prompt: Prompt,
    layouts: SchemaLayout | Mapping[str, SchemaLayout],
    tokenize: Tokenize,
    roles: Mapping[str, tuple[str, str]] | None = None,
) -> Resolution:
    """Resolve a parsed prompt against its schema's layout. Raises :class:`PMLError` (at the offending tag) for an
    unknown schema, module or argument, an argument longer than its param, a module imported twice, two members
    of one union, or a nested import under a module that is not its parent."""
    if isinstance(layouts, SchemaLayout):
        layouts = {layouts.name: layouts}
    if prompt.schema not in layouts:
        raise PMLError(f"unknown schema {prompt.schema!r} (known: {', '.join(sorted(layouts)) or 'none'})", *prompt.at)
    layout = layouts[prompt.schema]
    roles = roles or {}
    items: list[UsedModule | FreeText] = []
    used: dict[str, Import] = {}
    union_member: dict[int, str] = {}
    high = max((s.start + s.length for s in layout.scaffold), default=0)

    def free(text: str, role: str | None) -> None:
        nonlocal high
        ids = tuple(tokenize(text)) if text else ()
        if ids:
            items.append(FreeText(text, ids, high, role))
            high += len(ids)

    def use(imp: Import, parent: str | None) -> None:
        nonlocal high
        span = layout.modules.get(imp.name)
        if span is None:
            raise PMLError(f"unknown module {imp.name!r} in schema {layout.name!r}", *imp.at)
        if parent is not None and span.parent != parent:
            raise PMLError(f"module {imp.name!r} is not nested in {parent!r}", *imp.at)
        if imp.name in used:
            raise PMLError(
                f"module {imp.name!r} imported twice (first at line {used[imp.name].at[0]}, "
                f"column {used[imp.name].at[1]})",
                *imp.at,
            )
        if span.union is not None:
            other = union_member.setdefault(span.union, imp.name)
            if other != imp.name:
                raise PMLError(f"modules {other!r} and {imp.name!r} are members of one union: import one", *imp.at)
        used[imp.name] = imp
        params = span.params
        args = {}
        for name, value in imp.args:
            if name not in params:
                raise PMLError(
                    f"module {imp.name!r} has no param {name!r} (params: {', '.join(params) or 'none'})", *imp.at
                )
            ids = tuple(tokenize(value)) if value else ()
            if len(ids) > params[name].length:
                raise PMLError(
                    f"argument {name}={value!r} of module {imp.name!r} is {len(ids)} tokens, longer "
                    f"than its param (len={params[name].length})",
                    *imp.at,
                )
            args[name] = ids
        items.append(UsedModule(imp.name, span.start, span.end, args))
        high = max(high, span.end)
        for child in imp.children:
            use(_as_import(child), imp.name)

    def walk(nodes: Sequence[Node], role: str | None) -> None:
        for node in nodes:
            if isinstance(node, Text):
                free(node.text, role)
            elif isinstance(node, Role):
                opening, closing = roles.get(node.role, ("", ""))
                free(opening, node.role)
                walk(node.children, node.role)
                free(closing, node.role)
            else:
                use(_as_import(node), None)

    walk(prompt.children, None)
    return Resolution(layout.name, layout.scaffold, tuple(items))


def _as_import(node: Node) -> Import:
    """A prompt's node that is neither text nor a role: ``parse_prompt`` builds only imports there."""
    if not isinstance(node, Import):
        raise TypeError(f"a prompt holds text, roles and imports, not {node!r}")
    return node
