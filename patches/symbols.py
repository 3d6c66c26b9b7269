"""The manifest of engine symbols kvreuse touches, and the check of one symbol against the installed engine.

Each engine's boundary module lists two kinds of symbols:

* **internal** ones, which no public engine API promises (a private registry, an attribute of an engine object that
  vLLM sets for itself, a field used for another purpose than its own). Only the boundary module touches them, each
  inside one small function decorated with :meth:`Manifest.touches`, which records them with the function's name;
* **interface** ones, which an engine hands to plugins or lets them name in its flags (the classes a plugin
  subclasses, the methods it overrides, the data its callbacks receive). Adapters use them directly; the manifest
  lists them so that a new engine release shows every change kvreuse depends on, not only the internal ones.

``tests/test_engine_symbols.py`` (and ``tests/sglang/test_engine_symbols.py``) check every symbol with
:func:`check_symbol`; ``python -m kvreuse.patches`` prints the manifests.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class SymbolKind(StrEnum):
    VALUE = "value"  # a module-level object, class or enum member exists
    CALLABLE = "callable"  # a function or method whose leading parameters are these
    ATTRIBUTE = "attribute"  # instances of a class have this attribute (field, property, or set in the class's code)


@dataclass(frozen=True)
class EngineSymbol:
    """One engine name: ``path`` is ``"module:Qualified.name"``, e.g.
    ``"vllm.v1.core.sched.scheduler:Scheduler.waiting"``."""

    path: str
    kind: SymbolKind
    params: tuple[str, ...] = ()  # CALLABLE: the parameter names kvreuse passes or receives, in order
    internal: bool = True
    used_by: str = ""  # internal: the boundary function that touches it

    @property
    def name(self) -> str:
        """The last part of the path (the attribute, method or function name)."""
        return self.path.rpartition(":")[2].rpartition(".")[2]


def value(path: str) -> EngineSymbol:
    """A module-level object (class, function, enum member, constant) that must exist."""
    return EngineSymbol(path, SymbolKind.VALUE)


def call(path: str, *params: str) -> EngineSymbol:
    """A callable whose parameters start with ``params`` (any further ones must be optional)."""
    return EngineSymbol(path, SymbolKind.CALLABLE, tuple(params))


def attribute(path: str) -> EngineSymbol:
    """An attribute of instances of a class: ``"module:Class.name"``."""
    return EngineSymbol(path, SymbolKind.ATTRIBUTE)


@dataclass
class Manifest:
    """The engine symbols of one boundary module."""

    engine: str
    tested: str  # the versions the module was tested with, for the printed manifest
    interface: tuple[EngineSymbol, ...] = ()
    internal: list[EngineSymbol] = field(default_factory=list)

    def touches(self, *symbols: EngineSymbol) -> Callable[[F], F]:
        """Record that the decorated boundary function touches these internal symbols."""

        def record(function: F) -> F:
            for symbol in symbols:
                self.internal.append(dataclasses.replace(symbol, internal=True, used_by=function.__name__))
            return function

        return record

    def declare_interface(self, *symbols: EngineSymbol) -> None:
        self.interface = tuple(dataclasses.replace(symbol, internal=False) for symbol in symbols)

    def symbols(self) -> list[EngineSymbol]:
        return [*self.internal, *self.interface]


def resolve(path: str) -> Any:
    """The object at ``"module:Qualified.name"`` (``"module"`` alone: the module)."""
    module_name, _, qualified = path.partition(":")
    target: Any = importlib.import_module(module_name)
    for part in filter(None, qualified.split(".")):
        target = getattr(target, part)
    return target


def unimportable(symbol: EngineSymbol) -> str | None:
    """Why ``symbol``'s module cannot be imported here for want of a package other than its engine (e.g. SGLang's
    server modules need ``uvloop``, which its CPU test environment leaves out) or of the engine's CUDA build (vLLM's
    FlashAttention on its CPU build), else ``None``. Such a symbol cannot be checked in this environment; a missing
    module of the engine itself is a finding of :func:`check_symbol`."""
    module_name = symbol.path.partition(":")[0]
    engine = module_name.partition(".")[0]
    try:
        importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and error.name.partition(".")[0] != engine:
            return f"{module_name} needs {error.name}, which is not installed here"
    except ImportError as error:
        if "CUDA" in str(error):  # e.g. vllm.vllm_flash_attn on vLLM's CPU build: the module needs the GPU build
            return f"{module_name} needs the engine's CUDA build ({error})"
        return None
    return None


def check_symbol(symbol: EngineSymbol) -> str | None:
    """``None`` if the installed engine has ``symbol`` as kvreuse expects it, else what is wrong (one line)."""
    try:
        if symbol.kind == SymbolKind.ATTRIBUTE:
            owner_path, _, name = symbol.path.rpartition(".")
            return None if has_attribute(resolve(owner_path), name) else f"{symbol.path}: no such attribute"
        target = resolve(symbol.path)
    except (ImportError, AttributeError) as error:
        return f"{symbol.path}: {type(error).__name__}: {error}"
    if symbol.kind == SymbolKind.CALLABLE:
        return _check_parameters(symbol, target)
    return None


def _check_parameters(symbol: EngineSymbol, target: Any) -> str | None:
    if not callable(target):
        return f"{symbol.path}: not callable"
    try:
        parameters = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError) as error:
        return f"{symbol.path}: no signature ({error})"
    names = [p.name for p in parameters]
    if tuple(names[: len(symbol.params)]) != symbol.params:
        return f"{symbol.path}: parameters {names}, kvreuse expects them to start with {list(symbol.params)}"
    required = [
        p.name
        for p in parameters[len(symbol.params) :]
        if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if required:
        return f"{symbol.path}: new required parameters {required}"
    return None


def has_attribute(owner: Any, name: str) -> bool:
    """Whether instances of class ``owner`` have attribute ``name``: a class attribute, property, dataclass or
    msgspec field, an annotation, or an assignment ``self.<name> = ...`` in the code of a class of its MRO."""
    if not inspect.isclass(owner):
        return hasattr(owner, name)
    if hasattr(owner, name):
        return True
    assigned = re.compile(rf"\bself\.{re.escape(name)}\s*(:[^=\n]+)?=(?!=)")
    for cls in inspect.getmro(owner):
        if name in getattr(cls, "__annotations__", {}) or name in getattr(cls, "__struct_fields__", ()):
            return True
        if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
            return True
        if cls.__module__ == "builtins":
            continue
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        if assigned.search(source):
            return True
    return False
