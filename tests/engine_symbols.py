"""The checks behind ``test_engine_symbols.py`` (vLLM) and ``sglang/test_engine_symbols.py`` (SGLang): every symbol of
an engine's boundary manifest exists in the installed engine with the signature kvreuse expects.

The boundary module refuses an untested engine when it is imported, so it is imported here with
``KVREUSE_ALLOW_UNTESTED_ENGINE`` set: judging a new release by its symbols is what this check is for
(``make check-vllm-latest``).
"""

from __future__ import annotations

import importlib
import inspect
import os
from types import ModuleType

import pytest

from kvreuse.patches.symbols import EngineSymbol, check_symbol, unimportable
from kvreuse.patches.versions import OVERRIDE_VARIABLE


def boundary(name: str) -> ModuleType:
    """``kvreuse.patches.<name>``, imported even for an untested engine version."""
    saved = os.environ.get(OVERRIDE_VARIABLE)
    os.environ[OVERRIDE_VARIABLE] = "1"
    try:
        return importlib.import_module(f"kvreuse.patches.{name}")
    finally:
        if saved is None:
            del os.environ[OVERRIDE_VARIABLE]
        else:
            os.environ[OVERRIDE_VARIABLE] = saved


def symbol_id(symbol: EngineSymbol) -> str:
    return ("internal " if symbol.internal else "interface ") + symbol.path


def assert_symbol(symbol: EngineSymbol) -> None:
    reason = unimportable(symbol)
    if reason is not None:
        pytest.skip(reason)
    problem = check_symbol(symbol)
    assert problem is None, problem


def assert_every_boundary_function_is_in_the_manifest(module: ModuleType) -> None:
    """Each public function of the boundary module records the internal symbols it touches, and each recorded
    symbol names a function of the module."""
    functions = {
        name
        for name, value in vars(module).items()
        if inspect.isfunction(value) and value.__module__ == module.__name__ and not name.startswith("_")
    }
    recorded = {symbol.used_by for symbol in module.MANIFEST.internal}
    assert recorded == functions, (sorted(functions - recorded), sorted(recorded - functions))
    assert all(symbol.internal for symbol in module.MANIFEST.internal)
    assert not any(symbol.internal for symbol in module.MANIFEST.interface)
    assert all("Tested: " in (vars(module)[name].__doc__ or "") for name in functions), "each names its versions"
