"""The parts of the documentation whose source is the code, and the pages as the site shows them.

A page marks where generated text goes with a comment, ``<!-- generated: NAME [ARGUMENT] -->``:

* ``cli``: every ``kvreuse`` command and option, from kvreuse's argparse parser (``kvreuse.cli.build_parser``);
* ``settings PLUGIN``: a plugin's settings from its settings dataclass (``kvreuse.config.PLUGINS``), and
  ``other-variables``: the ``KVREUSE_*`` variables that are not settings (``kvreuse.config.OTHER_VARIABLES``);
* ``metrics PLUGIN``: the Prometheus names the vLLM adapter registers for a plugin;
* ``compatibility``: the compatibility matrix that ``integration_tests/test_compatibility_matrix.py`` runs.

``docs/hooks.py`` replaces the markers when MkDocs builds the site (so a reference cannot drift from the code), and
the tests read the pages through :func:`pages` and :func:`commands` (so they check what the site shows). The
README is read as it is: it has no markers.
"""

from __future__ import annotations

import argparse
import ast
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
MARKER = re.compile(r"<!-- generated: ([a-z-]+)(?: ([a-z]+))? -->")


def cell(text: object) -> str:
    """``text`` made safe for one cell of a Markdown table."""
    return " ".join(str(text).split()).replace("|", "\\|")


# -- the command line -----------------------------------------------------------------------------------------------


def option_name(action: argparse.Action) -> str:
    """How a user writes ``action``: its flags and, where it takes one, its value (``--table TABLE``)."""
    flags = ", ".join(action.option_strings) or action.dest
    if action.nargs == 0:
        return flags
    metavar = action.metavar or (action.dest.upper() if action.option_strings else action.dest)
    if action.choices is not None and action.metavar is None:
        metavar = "{" + ",".join(map(str, action.choices)) + "}"
    return f"{flags} [{metavar}]" if action.nargs == "?" else f"{flags} {metavar}"


def option_help(action: argparse.Action) -> str:
    """``action``'s help with argparse's ``%(...)s`` expanded, marked where the option is required."""
    text = action.help % {**vars(action), "prog": "kvreuse"} if action.help else ""
    return cell(f"**required.** {text}" if action.required else text)


def command_section(name: str, parser: argparse.ArgumentParser) -> str:
    lines = [f"### `kvreuse {name}`", "", cell(parser.description or ""), ""]
    lines += ["```", parser.format_usage().strip(), "```", ""]
    for group in parser._mutually_exclusive_groups:
        if group.required:
            names = " or ".join(f"`{action.option_strings[0]}`" for action in group._group_actions)
            lines += [f"One of {names} is required.", ""]
    lines += ["| option | meaning |", "| --- | --- |"]
    for action in parser._actions:
        if not isinstance(action, argparse._HelpAction) and action.help != argparse.SUPPRESS:
            lines.append(f"| `{cell(option_name(action))}` | {option_help(action)} |")
    return "\n".join(lines)


def subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action


def cli_commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommands of ``parser``, by name."""
    return dict(subcommands(parser).choices)


def cli_reference(_: str | None = None) -> str:
    from kvreuse.cli import build_parser

    commands = subcommands(build_parser())
    summary = {choice.dest: choice.help for choice in commands._choices_actions}
    lines = ["| command | what it does |", "| --- | --- |"]
    lines += [f"| [`kvreuse {name}`](#kvreuse-{name}) | {cell(summary.get(name, ''))} |" for name in commands.choices]
    sections = [command_section(name, sub) for name, sub in commands.choices.items()]
    return "\n\n".join(["\n".join(lines), *sections])


# -- settings -------------------------------------------------------------------------------------------------------


def accepted(field: Any, kind: object) -> str:
    """What a setting accepts: its choices or its range (nothing where its type says all)."""
    import enum

    meta = field.metadata
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return ", ".join(f"`{member.value}`" if member.value else "empty" for member in kind)
    if meta.get("choices"):
        return ", ".join(f"`{choice}`" for choice in meta["choices"])
    low, high = meta.get("low"), meta.get("high")
    if low is None and high is None:
        return ""
    if high is None:
        return f">= {low}"
    return f"<= {high}" if low is None else f"{low} .. {high}"


def shown_default(value: object) -> str:
    """A default as a user writes it: ``true`` for True, the value of a choice, nothing for an empty string."""
    import enum

    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, enum.Enum):
        return str(value.value)
    return str(value)


def settings_table(plugin: str | None) -> str:
    import typing

    from kvreuse import config

    if plugin not in config.PLUGINS:
        raise ValueError(f"settings marker for unknown plugin {plugin!r}; plugins: {', '.join(config.PLUGINS)}")
    cls = config.plugin_config(plugin)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in config.settings_fields(cls)}
    lines = ["| setting | variable | default | accepts | meaning |", "| --- | --- | --- | --- | --- |"]
    for key, variable, default, doc in config.describe(cls, plugin):
        name = key.split(".", 1)[1]
        shown = f"{shown_default(default)} | {accepted(fields[name], hints[name])}"
        lines.append(f"| `{key}` | `{variable}` | {shown} | {cell(doc)} |")
    return "\n".join(lines)


def other_variables(_: str | None = None) -> str:
    from kvreuse.config import OTHER_VARIABLES

    lines = ["| variable | what it does |", "| --- | --- |"]
    lines += [f"| `{name}` | {cell(doc)} |" for name, doc in OTHER_VARIABLES.items()]
    return "\n".join(lines)


# -- metrics --------------------------------------------------------------------------------------------------------


def metrics_table(plugin: str | None) -> str:
    """The Prometheus names the vLLM adapter registers for ``plugin``, with their kind, labels and help text."""
    lines = ["| metric | kind | labels | what it counts |", "| --- | --- | --- | --- |"]
    if plugin == "reorder":
        from kvreuse.vllm.reorder.metrics import REORDER_METRICS

        lines += [
            f"| `{name}` | {kind} | `model_name`, `engine` | {cell(doc)} |"
            for name, kind, doc in REORDER_METRICS.values()
        ]
        return "\n".join(lines)
    if plugin == "modules":
        from kvreuse.vllm.modules.metrics import MODULE_COUNTERS as counters
    elif plugin == "sparse":
        from kvreuse.vllm.sparse.metrics import SPARSE_COUNTERS as counters
    else:
        raise ValueError(f"metrics marker for unknown plugin {plugin!r}")
    for name, doc, label in counters.values():
        lines.append(f"| `{name}` | counter | {f'`{label}`' if label else ''} | {cell(doc)} |")
    return "\n".join(lines)


# -- the compatibility matrix ---------------------------------------------------------------------------------------

MATRIX_SOURCE = ROOT / "integration_tests" / "test_compatibility_matrix.py"


MATRIX_NAMES = frozenset({"PLUGINS", "TESTED", "UNTESTED", "NOT_APPLICABLE", "MATRIX"})


def matrix_definitions(path: Path = MATRIX_SOURCE) -> dict[str, Any]:
    """The test module's ``MATRIX`` (with the constants it is written with) and its ``matrix_table`` function, run
    on their own: the module's imports start an engine's dependencies, which a docs build does not need."""
    tree = ast.parse(path.read_text())
    wanted = [
        node
        for node in tree.body
        if (isinstance(node, ast.Assign | ast.AnnAssign) and assigned_names(node) <= MATRIX_NAMES)
        or (isinstance(node, ast.FunctionDef) and node.name == "matrix_table")
    ]
    namespace: dict[str, Any] = {}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


def assigned_names(node: ast.Assign | ast.AnnAssign) -> set[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    names = {t.id for t in targets if isinstance(t, ast.Name)}
    names |= {e.id for t in targets if isinstance(t, ast.Tuple) for e in t.elts if isinstance(e, ast.Name)}
    return names or {""}


def compatibility_table(_: str | None = None) -> str:
    return str(matrix_definitions()["matrix_table"]())


# -- pages ----------------------------------------------------------------------------------------------------------

GENERATORS: dict[str, Callable[[str | None], str]] = {
    "cli": cli_reference,
    "settings": settings_table,
    "other-variables": other_variables,
    "metrics": metrics_table,
    "compatibility": compatibility_table,
}


def render(markdown: str) -> str:
    """``markdown`` with every marker replaced by its generated text."""

    def generated(match: re.Match[str]) -> str:
        name, argument = match.groups()
        if name not in GENERATORS:
            raise ValueError(f"unknown marker {match.group(0)}; known: {', '.join(GENERATORS)}")
        return GENERATORS[name](argument)

    return MARKER.sub(generated, markdown)


def markers(markdown: str) -> list[tuple[str, str | None]]:
    """The markers of ``markdown``: (name, argument) pairs."""
    return [match.groups() for match in MARKER.finditer(markdown)]


def pages() -> dict[str, str]:
    """Every page of the site as it shows it (markers replaced), by its path under ``docs/``, and ``README.md``."""
    out = {"README.md": (ROOT / "README.md").read_text()}
    for path in sorted(DOCS.rglob("*.md")):
        out[str(path.relative_to(DOCS))] = render(path.read_text())
    return out


def code_blocks(language: str, text: str) -> list[str]:
    """The fenced code blocks of ``language`` in ``text``."""
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL)


def commands(text: str) -> list[str]:
    """Every command of ``text``'s bash blocks, continuation lines joined, comments after two spaces dropped."""
    out = []
    for block in code_blocks("bash", text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line:
                out.append(line)
    return out
