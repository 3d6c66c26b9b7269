"""Read kvreuse's per-plugin settings from a vLLM configuration.

Users pass them with vLLM's own ``--additional-config '{"kvreuse": {"reorder": {"max_skips": 8}}}'`` (or
``LLM(additional_config=...)``); ``KVREUSE_*`` environment variables fill in what the flag leaves out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvreuse.errors import ConfigError


def kvreuse_flags(additional_config: Any, plugin: str) -> Mapping[str, Any]:
    """The ``kvreuse.<plugin>`` section of vLLM's ``additional_config`` (empty when absent)."""
    if not isinstance(additional_config, Mapping):
        return {}
    section = additional_config.get("kvreuse", {})
    if not isinstance(section, Mapping):
        raise ConfigError(f"additional_config['kvreuse'] must be an object, got {type(section).__name__}")
    flags = section.get(plugin, {})
    if not isinstance(flags, Mapping):
        raise ConfigError(f"additional_config['kvreuse']['{plugin}'] must be an object, got {type(flags).__name__}")
    return flags
