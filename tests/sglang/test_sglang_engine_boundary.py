"""kvreuse's boundary with SGLang (``kvreuse.patches.sglang_0_5``): every SGLang symbol kvreuse touches exists in the
installed SGLang with the expected signature, and an untested SGLang is refused in one line before SGLang goes on.
The version lookup is faked; the refusal, through SGLang's own plugin loader, is real."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/engine_symbols.py, shared with vLLM's check

from engine_symbols import (  # noqa: E402
    assert_every_boundary_function_is_in_the_manifest,
    assert_symbol,
    boundary,
    symbol_id,
)

import kvreuse.patches  # noqa: E402
from kvreuse.patches import versions  # noqa: E402
from kvreuse.patches.versions import OVERRIDE_VARIABLE  # noqa: E402

SGLANG = boundary("sglang_0_5")


@pytest.mark.parametrize("symbol", SGLANG.MANIFEST.symbols(), ids=symbol_id)
def test_the_installed_sglang_has_the_symbol(symbol):
    assert_symbol(symbol)


def test_every_boundary_function_records_the_internals_it_touches():
    assert_every_boundary_function_is_in_the_manifest(SGLANG)


def _refuse(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    """Fake the installed SGLang and make the next import of the boundary module check it afresh."""
    from kvreuse.sglang import registration

    monkeypatch.setattr(versions, "installed_version", lambda engine: version)
    monkeypatch.delenv(OVERRIDE_VARIABLE, raising=False)
    monkeypatch.delitem(sys.modules, "kvreuse.patches.sglang_0_5", raising=False)
    monkeypatch.delattr(kvreuse.patches, "sglang_0_5", raising=False)
    monkeypatch.setattr(registration, "_REGISTERED_PIDS", set())


def test_an_untested_sglang_stops_the_plugin_entry_point_with_one_line(monkeypatch):
    from kvreuse.sglang import registration

    _refuse(monkeypatch, "0.5.24")
    with pytest.raises(SystemExit) as stopped:
        registration.register()
    message = str(stopped.value.code)
    assert "\n" not in message
    assert "tested with sglang ==0.5.23, but sglang 0.5.24 is installed" in message
    assert "pip install 'sglang==0.5.23'" in message and f"set {OVERRIDE_VARIABLE}=1" in message
    assert os.getpid() not in registration.registered_pids()


def test_sglangs_plugin_loader_does_not_swallow_the_refusal(monkeypatch):
    """SGLang's ``load_plugins`` logs and ignores a plugin's exceptions; the refusal gets through it."""
    import sglang.srt.plugins as plugins

    _refuse(monkeypatch, "0.6.0")
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    monkeypatch.setenv("SGLANG_PLUGINS", "kvreuse")
    with pytest.raises(SystemExit, match="sglang 0.6.0 is installed"):
        plugins.load_plugins()
