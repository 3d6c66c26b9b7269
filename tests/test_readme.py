"""The README and the docs (docs/) document what the code does: every setting with its variable and default, every
command as it parses, every setting a page names as one that exists.

The settings, command-line, metrics and compatibility references are generated from the code when the site is
built (docs/docs_reference.py); these tests read the pages as the site shows them (``docs_reference.pages``).
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

from kvreuse import config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))

import docs_reference  # noqa: E402 - docs/ holds the generator the site's build runs

PAGES = docs_reference.pages()
SETTINGS_PAGE = "reference/settings.md"


def all_commands() -> list[str]:
    return [command for text in PAGES.values() for command in docs_reference.commands(text)]


@pytest.mark.parametrize("plugin", sorted(config.PLUGINS))
def test_every_setting_is_in_the_settings_reference_with_its_variable_default_and_meaning(plugin):
    page = PAGES[SETTINGS_PAGE]
    rows = config.describe(config.plugin_config(plugin), plugin)
    assert rows, plugin
    for key, variable, default, doc in rows:
        assert doc.strip(), f"{key} has no description (setting(default, doc=...))"
        shown = docs_reference.shown_default(default)
        assert f"| `{key}` | `{variable}` | {shown} |" in page, key


def test_the_settings_reference_generates_every_plugins_table_and_the_other_variables():
    source = (ROOT / "docs" / SETTINGS_PAGE).read_text()
    assert sorted(plugin for name, plugin in docs_reference.markers(source) if name == "settings") == sorted(
        config.PLUGINS
    )
    for variable in config.OTHER_VARIABLES:
        assert f"| `{variable}` |" in PAGES[SETTINGS_PAGE], variable


SETTING_NAME = re.compile(r"`(reorder|sparse|modules|sglang)\.([a-z_0-9]+)`")
NOT_SETTINGS = {"modules.json"}  # a file name the module-sets examples use


def test_every_setting_a_page_names_exists():
    known = {key for plugin in config.PLUGINS for key, *_ in config.describe(config.plugin_config(plugin), plugin)}
    for page, text in PAGES.items():
        for match in SETTING_NAME.finditer(text):
            name = f"{match.group(1)}.{match.group(2)}"
            assert name in known or name in NOT_SETTINGS, f"{page} names {name}, which is not a setting"


def test_the_metrics_reference_lists_every_metric_the_adapters_register():
    from kvreuse.vllm.modules.metrics import MODULE_COUNTERS
    from kvreuse.vllm.reorder.metrics import REORDER_METRICS
    from kvreuse.vllm.sparse.metrics import SPARSE_COUNTERS

    page = PAGES["reference/metrics.md"]
    names = [name for name, *_ in [*REORDER_METRICS.values(), *MODULE_COUNTERS.values(), *SPARSE_COUNTERS.values()]]
    for name in names:
        assert f"| `{name}` |" in page, name


def test_the_cli_reference_shows_every_option_of_every_command():
    page = PAGES["reference/cli.md"]
    from kvreuse.cli import build_parser

    for name, parser in docs_reference.cli_commands(build_parser()).items():
        assert f"### `kvreuse {name}`" in page
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}" in page, (name, flag)


def test_no_user_page_names_an_issue_number():
    for page, text in PAGES.items():
        assert not re.search(r"\bissues? \d+", text, flags=re.IGNORECASE), page


def test_the_readme_stays_a_front_page():
    assert len(PAGES["README.md"].splitlines()) < 250


# -- the commands run as written on a CPU machine (integration_tests/test_readme_commands.py runs them) -------------


def test_every_kvreuse_command_in_the_readme_and_the_docs_parses_as_written():
    from kvreuse.cli import build_parser

    found = [c for c in all_commands() if re.match(r"(\.venv/bin/)?kvreuse ", c)]
    assert len(found) >= 5
    for command in found:
        build_parser().parse_args(shlex.split(command)[1:])  # exits (SystemExit) on any flag it does not know


def test_every_serve_file_in_the_docs_is_accepted(monkeypatch):
    from kvreuse.vllm.engine_args import check_model
    from kvreuse.vllm.serve import read_serve_config

    files = [toml for text in PAGES.values() for toml in docs_reference.code_blocks("toml", text)]
    assert files
    monkeypatch.chdir(ROOT)
    path = ROOT / "build" / "docs-serve.toml"
    path.parent.mkdir(exist_ok=True)
    for toml in files:
        path.write_text(toml)
        try:
            config_ = read_serve_config(path, environ={})
        finally:
            path.unlink()
        check_model(config_["model"])


def test_every_vllm_server_command_gives_the_kv_cache_size_a_cpu_needs_and_a_block_size():
    servers = [c for c in all_commands() if "vllm.entrypoints.openai.api_server" in c or "vllm serve" in c]
    assert len(servers) >= 4
    for command in servers:
        if "--attention-backend CUSTOM" in command:
            continue  # a GPU-only command (vLLM's CPU platform has no attention-backend choice)
        assert "--kv-cache-memory-bytes" in command, command
        assert "--block-size" in command, command
    assert "**On a CPU machine, vLLM needs `--kv-cache-memory-bytes`**" in PAGES["guides/serving-vllm.md"]
