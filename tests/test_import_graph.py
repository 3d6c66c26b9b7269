"""The layout of ``plugins/kvreuse``, ``triton_kernels/`` (``kvreuse.kernels``) and ``patches/``
(``kvreuse.patches``), checked on their imports (read with ``ast``, nothing run): no import cycle, and every import
goes down the layers (the README's "Layout and imports" section)."""

from __future__ import annotations

import tomllib

import pytest
from source_tree import REPO, kvreuse_imports, modules, third_party_imports

MODULES = modules()
GRAPH = {name: kvreuse_imports(module, MODULES) for name, module in MODULES.items()}

# Layers, lowest first, by module name prefix.
LAYERS = {
    "base": ("kvreuse", "kvreuse.errors", "kvreuse.config"),
    "kernels": ("kvreuse.kernels",),
    "cores": ("kvreuse.reorder", "kvreuse.modules", "kvreuse.sparse"),
    "front ends": ("kvreuse.batch",),
    "boundary": ("kvreuse.patches",),
    "adapters": ("kvreuse.vllm", "kvreuse.sglang"),
    "tools": ("kvreuse.cli", "kvreuse.localmodel"),
}
# What each layer may import (besides itself).
MAY_IMPORT = {
    "base": {"base"},
    "kernels": {"base"},
    "cores": {"base", "kernels"},
    "front ends": {"base", "kernels", "cores"},
    "boundary": {"base"},
    "adapters": {"base", "kernels", "cores", "front ends", "boundary"},
    "tools": set(LAYERS),
}
ENGINES = {"vllm", "sglang"}


def layer_of(name: str) -> str:
    """The layer of the longest prefix that names ``name`` or a package above it."""
    best, best_length = "", -1
    for layer, prefixes in LAYERS.items():
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best_length:
                best, best_length = layer, len(prefix)
    return best


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_tree_is_read_whole():
    assert {"kvreuse.vllm.modules.connector", "kvreuse.kernels.rerotate", "kvreuse.patches.vllm_0_32"} <= set(MODULES)
    assert all(layer_of(name) for name in MODULES), [name for name in MODULES if not layer_of(name)]


def test_no_import_cycle():
    assert cycles(GRAPH) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_go_down_the_layers(name):
    layer = layer_of(name)
    upward = sorted(t for t in GRAPH[name] if layer_of(t) != layer and layer_of(t) not in MAY_IMPORT[layer])
    assert upward == [], f"{name} ({layer}) imports {upward}"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if layer_of(n) == "adapters"))
def test_one_engines_adapter_never_imports_the_others(name):
    engine = name.split(".")[1]
    assert not [t for t in GRAPH[name] if layer_of(t) == "adapters" and t.split(".")[1] != engine]


@pytest.mark.parametrize(
    "name", sorted(n for n in MODULES if layer_of(n) in {"base", "kernels", "cores", "front ends"})
)
def test_cores_kernels_and_front_ends_import_no_engine(name):
    assert not third_party_imports(MODULES[name]) & ENGINES


def test_the_module_connector_sides_import_common_never_each_other_nor_the_facade():
    base = "kvreuse.vllm.modules"
    for side in ("scheduler", "worker"):
        imported = GRAPH[f"{base}.{side}"]
        assert f"{base}.common" in imported
        assert not imported & {f"{base}.scheduler", f"{base}.worker", f"{base}.connector"} - {f"{base}.{side}"}


def test_every_package_folder_ships():
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert sorted(packages) == sorted(name for name, module in MODULES.items() if module.is_package)
