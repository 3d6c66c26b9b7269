"""Typed configuration, one object per plugin.

Each plugin's settings are a frozen dataclass. Values come, in increasing precedence, from the dataclass
defaults, ``KVREUSE_<PLUGIN>_<SETTING>`` environment variables, and the engine's own flags (a dict the adapter
extracts, e.g. vLLM's ``--additional-config '{"kvreuse": {"reorder": {...}}}'``). Every value is checked against
the range declared beside it, so a wrong value fails at start-up with a message naming the setting.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any, TypeVar

from kvreuse.errors import ConfigError

T = TypeVar("T")

# How a boolean setting may be spelt in a KVREUSE_* variable.
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def setting(
    default: Any,
    doc: str,
    *,
    low: float | None = None,
    high: float | None = None,
    choices: tuple[str, ...] | None = None,
) -> Any:
    """Declare one setting: its default, a one-line description for the README, and its accepted range."""
    return dataclasses.field(default=default, metadata={"doc": doc, "low": low, "high": high, "choices": choices})


def env_name(plugin: str, name: str) -> str:
    """The environment variable that sets ``name`` of ``plugin``: ``KVREUSE_REORDER_MAX_SKIPS``."""
    return f"KVREUSE_{plugin.upper()}_{name.upper()}"


def _coerce(plugin: str, field: dataclasses.Field, raw: Any) -> Any:
    """Convert ``raw`` (from a string variable or a JSON flag) to the field's type and check its range."""
    kind = type(field.default)
    where = f"{plugin}.{field.name} ({env_name(plugin, field.name)})"
    try:
        if kind is bool:
            if isinstance(raw, str):
                if raw.lower() not in TRUE_WORDS + FALSE_WORDS:
                    raise ValueError(raw)
                value: Any = raw.lower() in TRUE_WORDS
            else:
                value = bool(raw)
        elif kind is int:
            value = int(raw)
        elif kind is float:
            value = float(raw)
        else:
            value = str(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {raw!r} is not a valid {kind.__name__}") from None
    meta = field.metadata
    if meta["choices"] is not None and value not in meta["choices"]:
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(meta['choices'])}")
    low, high = meta["low"], meta["high"]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if math.isnan(value) or (low is not None and value < low) or (high is not None and value > high):
            raise ConfigError(f"{where}: {value!r} is outside the accepted range [{low}, {high}]")
    return value


def load(
    cls: type[T], plugin: str, flags: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> T:
    """Build ``cls`` from defaults, then ``KVREUSE_*`` variables, then engine ``flags`` (highest precedence).

    Unknown keys in ``flags`` are an error: a misspelt setting must not be silently ignored.
    """
    environ = os.environ if environ is None else environ
    flags = dict(flags or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(flags) - set(fields))
    if unknown:
        raise ConfigError(f"unknown {plugin} setting(s) {', '.join(unknown)}; known: {', '.join(fields)}")
    values = {}
    for name, field in fields.items():
        if name in flags:
            values[name] = _coerce(plugin, field, flags[name])
        elif env_name(plugin, name) in environ:
            values[name] = _coerce(plugin, field, environ[env_name(plugin, name)])
    return cls(**values)


def describe(cls: type, plugin: str) -> list[tuple[str, str, Any, str]]:
    """Rows (flag key, variable, default, description) for the README's table of settings."""
    return [
        (f"{plugin}.{f.name}", env_name(plugin, f.name), f.default, f.metadata["doc"]) for f in dataclasses.fields(cls)
    ]
