"""``kvreuse serve``: one config file becomes the vLLM server command line, its kvreuse settings checked."""

from __future__ import annotations

import json
import shlex
import sys

import pytest

from kvreuse.cli import main
from kvreuse.errors import ConfigError
from kvreuse.vllm.serve import read_serve_config, serve_command

TOML = """
model = "build/models/small"
port = 8123
scheduler = "prefix-affinity"

[engine]
block_size = 32
enable_prompt_tokens_details = true
enable_prefix_caching = false

[kvreuse.reorder]
max_skips = 16
"""


def test_a_toml_config_becomes_the_server_command_line(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text(TOML)
    command = serve_command(read_serve_config(path), python="python")
    assert command == [
        "python",
        "-P",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "build/models/small",
        "--port",
        "8123",
        "--block-size",
        "32",
        "--enable-prompt-tokens-details",
        "--no-enable-prefix-caching",
        "--scheduler-cls",
        "kvreuse.vllm.PrefixAffinityScheduler",
        "--additional-config",
        '{"kvreuse":{"reorder":{"max_skips":16}}}',
    ]


def test_print_only_prints_the_equivalent_command(tmp_path, capsys):
    path = tmp_path / "serve.json"
    path.write_text(json.dumps({"model": "m", "engine": {"max_model_len": 1024}}))
    assert main(["serve", "--config", str(path), "--print-only"]) == 0
    assert shlex.split(capsys.readouterr().out) == [
        sys.executable,
        "-P",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "m",
        "--max-model-len",
        "1024",
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('model = "m"\n[kvreuse.reorder]\nmax_skips = -1\n', "reorder.max_skips"),
        ('model = "m"\n[kvreuse.modules]\nx = 1\n', "unknown kvreuse plugin 'modules'"),
        ('model = "m"\nscheduler = "fifo"\n', "scheduler 'fifo' is not one of prefix-affinity"),
        ("port = 1\n", "name the model"),
        ('model = "m"\nmodels = 2\n', "unknown key(s) models"),
    ],
)
def test_a_wrong_setting_is_named_before_anything_starts(tmp_path, text, message):
    path = tmp_path / "serve.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_serve_config(path)
