"""Read kvreuse's per-plugin settings from a vLLM configuration.

Users pass them with vLLM's own ``--additional-config '{"kvreuse": {"reorder": {"max_skips": 8}}}'`` (or
``LLM(additional_config=...)``); ``KVREUSE_*`` environment variables fill in what the flag leaves out. Whichever
plugin reads its section checks the whole ``kvreuse`` object (every section, and the variables), so a misspelt
section (``"reordr"``) or key (``"kvreuse_modul"``) is an error wherever it is read, not ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvreuse import config
from kvreuse.errors import ConfigError
from kvreuse.shape import shape_problem

KEY = "kvreuse"


def kvreuse_flags(additional_config: Any, plugin: str) -> Mapping[str, Any]:
    """The ``kvreuse.<plugin>`` section of vLLM's ``additional_config`` (empty when absent), after checking all of
    ``additional_config['kvreuse']`` (:func:`check_additional_config`)."""
    if not isinstance(additional_config, Mapping):
        return {}
    check_additional_config(additional_config)
    return additional_config.get(KEY, {}).get(plugin, {})


def check_additional_config(additional_config: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> dict:
    """Every kvreuse setting in vLLM's ``additional_config`` and the ``KVREUSE_*`` variables, loaded and checked:
    ``{plugin: settings}``. A top-level key that looks like ``kvreuse`` but is not is an error, too (other keys
    belong to vLLM or other plugins), and so is an ``additional_config`` past the shape bounds of
    :mod:`kvreuse.shape` (vLLM copies it to every engine process)."""
    problem = shape_problem(additional_config, "additional_config")
    if problem is not None:
        raise ConfigError(problem[1])
    for key in additional_config:
        if key != KEY and (str(key).lower().startswith(KEY) or config.suggest(str(key), [KEY])):
            raise ConfigError(f"additional_config key {key!r} is not kvreuse's; write {KEY!r}")
    return config.load_sections(additional_config.get(KEY), environ, where=f"additional_config['{KEY}']")
