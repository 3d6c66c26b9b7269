"""kvreuse's own source tree as modules and their imports, read with ``ast`` (nothing is imported), for the tests of
its layout (``test_import_graph.py``, ``test_engine_private_names.py``)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Import package -> folder, as pyproject.toml's [tool.setuptools] package-dir maps them.
ROOTS = {
    "kvreuse": REPO / "plugins" / "kvreuse",
    "kvreuse.kernels": REPO / "triton_kernels",
    "kvreuse.patches": REPO / "patches",
}


@dataclass(frozen=True)
class Module:
    name: str  # dotted import name; a package's __init__ is the package's name
    path: Path
    tree: ast.Module

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"


def modules() -> dict[str, Module]:
    """Every module of the ``kvreuse`` distribution by import name."""
    found: dict[str, Module] = {}
    for root_name, root in ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((root_name, *parts))
            if root_name == "kvreuse" and name.startswith(("kvreuse.kernels", "kvreuse.patches")):
                continue
            found[name] = Module(name, path, ast.parse(path.read_text(), str(path)))
    return found


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and (
        (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")
    )


def runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:`` (imports for annotations only)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(child for child in ast.iter_child_nodes(node) if not _type_checking_only(child))


def imported_names(module: Module, known: dict[str, Module] | None = None) -> Iterator[str]:
    """The dotted names ``module`` imports at run time (module level or inside functions). ``from a import b``
    names ``a.b`` when that is a module of ``known``, else ``a`` (``b`` is then defined in ``a``)."""
    for node in runtime_nodes(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = module.name if module.is_package else module.name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{node.module}" if node.module else package
            else:
                base = node.module or ""
            for alias in node.names:
                yield f"{base}.{alias.name}" if known is not None and f"{base}.{alias.name}" in known else base


def kvreuse_imports(module: Module, known: dict[str, Module]) -> set[str]:
    """The kvreuse modules ``module`` imports (its explicit imports: a module's parent packages, which Python
    imports first, are not counted, so that a package may re-export its submodules)."""
    targets: set[str] = set()
    for name in imported_names(module, known):
        if name.startswith("kvreuse"):
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                targets.add(name)
    targets.discard(module.name)
    return targets


def third_party_imports(module: Module) -> set[str]:
    """The top-level names of the packages other than kvreuse that ``module`` imports at run time."""
    return {name.partition(".")[0] for name in imported_names(module) if name and not name.startswith("kvreuse")}
