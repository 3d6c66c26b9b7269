"""The README documents every setting with its variable and default."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from kvreuse.config import describe
from kvreuse.modules.config import ModulesConfig
from kvreuse.reorder.config import ReorderConfig
from kvreuse.sglang.settings import SGLangConfig
from kvreuse.sparse.config import SparseConfig

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


@pytest.mark.parametrize(
    ("config", "plugin"),
    [(ReorderConfig, "reorder"), (SparseConfig, "sparse"), (ModulesConfig, "modules"), (SGLangConfig, "sglang")],
)
def test_every_setting_is_in_the_readme_table_with_its_default(config, plugin):
    for key, variable, default, _ in describe(config, plugin):
        shown = str(default).lower() if isinstance(default, bool) else str(default)
        assert f"| `{key}` | `{variable}` | {shown} |" in README, key


# -- the README's commands run as written on a CPU machine (integration_tests/test_readme_commands.py runs them) ---


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.DOTALL)


def commands() -> list[str]:
    """Every command of the README's bash blocks, continuation lines joined, comments dropped."""
    out = []
    for block in code_blocks("bash"):
        for command in block.replace("\\\n", " ").splitlines():
            command = command.split("  #")[0].strip()
            if command:
                out.append(command)
    return out


def test_every_kvreuse_command_in_the_readme_parses_as_written():
    from kvreuse.cli import build_parser

    found = [c for c in commands() if c.startswith("kvreuse ")]
    assert len(found) >= 3
    for command in found:
        build_parser().parse_args(shlex.split(command)[1:])  # exits (SystemExit) on any flag it does not know


def test_the_readmes_serve_file_is_accepted(monkeypatch):
    from kvreuse.vllm.engine_args import check_model
    from kvreuse.vllm.serve import read_serve_config

    (toml,) = code_blocks("toml")
    monkeypatch.chdir(ROOT)
    path = ROOT / "build" / "readme-serve.toml"
    path.write_text(toml)
    try:
        config = read_serve_config(path, environ={})
    finally:
        path.unlink()
    check_model(config["model"])


def test_every_vllm_server_command_for_a_cpu_gives_the_kv_cache_size_the_cpu_needs():
    servers = [c for c in commands() if "vllm.entrypoints.openai.api_server" in c]
    assert servers
    for command in servers:
        assert "--kv-cache-memory-bytes" in command, command
    assert "**On a CPU machine, vLLM needs `--kv-cache-memory-bytes`**" in README
