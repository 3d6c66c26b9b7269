"""Typed configuration, one object per plugin, validated by one pydantic model per plugin.

Each plugin's settings are a frozen dataclass whose fields are declared with :func:`setting` (default, one line
for the README, accepted range or choices). Values come, in increasing precedence, from the dataclass defaults,
``KVREUSE_<PLUGIN>_<SETTING>`` environment variables, and the engine's own flags (a dict the adapter extracts,
e.g. vLLM's ``--additional-config '{"kvreuse": {"reorder": {...}}}'``, or a ``[kvreuse.reorder]`` section of
``kvreuse serve``'s file).

The dataclass is the declaration; :func:`load` builds from it (once per class) a ``pydantic_settings.BaseSettings``
model, which maps the environment variables to fields and validates every value, and then returns the dataclass.
The rules, the same for every source:

* a value has the field's type, or is a string that spells one (environment variables are strings, and JSON has
  no way to write ``inf``): ``64.7``, ``true`` or ``"64.7"`` for an integer is an error, never ``64`` or ``1``;
  ``5`` for a string or a boolean is an error; NaN is an error;
* a choice is one of the values of the field's ``StrEnum`` (or of its ``choices``), spelt exactly;
* an unknown key, or an unknown ``KVREUSE_<PLUGIN>_*`` variable, is an error that names the closest known one.

Errors are :class:`~kvreuse.errors.ConfigError` naming the setting, its variable and the accepted values.
"""

from __future__ import annotations

import contextvars
import dataclasses
import difflib
import enum
import functools
import math
import os
import secrets
import typing
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Annotated, Any, Literal, TypeVar

import pydantic
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings.sources.utils import parse_env_vars

from kvreuse.errors import ConfigError

T = TypeVar("T")

# How a boolean setting may be spelt in a KVREUSE_* variable (pydantic accepts these and a few more).
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")

# KVREUSE_* variables that are not a plugin setting, with what they do. A variable of a plugin's prefix that is
# neither a setting nor listed here is an error (a misspelt setting must not be ignored).
OTHER_VARIABLES = {
    "KVREUSE_SPARSE_CPU_BACKEND": "on vLLM's CPU build, the sparse attention backend takes CPU_ATTN's place",
    "KVREUSE_DATASETS": "where the real tables of the benchmarks and tests are",
    "KVREUSE_MODULES_WRITE_KEY": "the module-write key of kvreuse.vllm.modules.guard (read from the environment only)",
    "KVREUSE_MODULES_WRITE_KEY_FILE": "a file holding the module-write key",
    "KVREUSE_ALLOW_UNTESTED_ENGINE": "start with an engine version kvreuse was not tested with (at your own risk)",
    "KVREUSE_MODULES_LOCAL_SECRET": "set by kvreuse for the engine's processes: the offline API's write proofs",
}
LOCAL_SECRET_VARIABLE = "KVREUSE_MODULES_LOCAL_SECRET"
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # an integer setting's range where it declares none
MAX_TOKENS = 2**31 - 1  # a setting that counts tokens (or steps) feeds vLLM's and PyTorch's int32 tensors


def setting(
    default: Any,
    doc: str,
    *,
    low: float | None = None,
    high: float | None = None,
    choices: tuple[str, ...] | None = None,
) -> Any:
    """Declare one setting: its default, a one-line description for the README, and its accepted range.

    A setting with a fixed set of values is typed as a ``StrEnum`` (its members are the choices); ``choices``
    restricts a plain string setting instead.
    """
    return dataclasses.field(default=default, metadata={"doc": doc, "low": low, "high": high, "choices": choices})


def env_name(plugin: str, name: str) -> str:
    """The environment variable that sets ``name`` of ``plugin``: ``KVREUSE_REORDER_MAX_SKIPS``."""
    return f"KVREUSE_{plugin.upper()}_{name.upper()}"


def settings_fields(cls: type) -> list[dataclasses.Field[Any]]:
    """The fields of a settings dataclass that are settings (declared with :func:`setting`)."""
    return [f for f in dataclasses.fields(cls) if "doc" in f.metadata]


def suggest(name: str, known: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the known name closest to ``name``, or ``""`` if none is close."""
    known = [str(k) for k in known]
    close = difflib.get_close_matches(name.lower(), [k.lower() for k in known], n=1, cutoff=0.6)
    if not close:
        return ""
    original = {k.lower(): str(k) for k in known}[close[0]]
    return f" (did you mean {original!r}?)"


def load(
    cls: type[T], plugin: str, flags: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> T:
    """Build ``cls`` from defaults, then ``KVREUSE_*`` variables, then engine ``flags`` (highest precedence).

    Unknown keys in ``flags`` and unknown ``KVREUSE_<PLUGIN>_*`` variables are errors: a misspelt setting must
    not be silently ignored.
    """
    environ = os.environ if environ is None else environ
    if flags is None:
        flags = {}
    if not isinstance(flags, Mapping):
        raise ConfigError(
            f"the {plugin} settings must be a table/object of settings ([kvreuse.{plugin}] in TOML, "
            f'{{"{plugin}": {{...}}}} in JSON); got {type(flags).__name__} {flags!r}'
        )
    names = [f.name for f in settings_fields(cls)]
    for key in flags:
        if key not in names:
            raise ConfigError(f"unknown {plugin} setting(s) {key}{suggest(str(key), names)}; known: {', '.join(names)}")
    check_variables(plugin, names, environ)
    model = _model(cls, plugin)  # type: ignore[arg-type]  # a class is hashable; mypy reads T as an instance
    token = _ENVIRON.set(environ)
    try:
        validated = model(**flags)
    except pydantic.ValidationError as error:
        raise ConfigError(_explain(error, cls, plugin, flags, environ)) from None
    finally:
        _ENVIRON.reset(token)
    return cls(**{name: getattr(validated, name) for name in names})


def check_variables(plugin: str, names: Iterable[str], environ: Mapping[str, str]) -> None:
    """Every ``KVREUSE_<PLUGIN>_*`` variable of ``environ`` names a setting of ``plugin`` (or is another known
    variable); raise ``ConfigError`` with the closest setting's variable otherwise."""
    prefix = f"KVREUSE_{plugin.upper()}_"
    known = [env_name(plugin, name) for name in names]
    for variable in environ:
        upper = variable.upper()
        if upper.startswith(prefix) and upper not in known and upper not in OTHER_VARIABLES:
            raise ConfigError(
                f"unknown variable {variable}{suggest(upper, known)}; the {plugin} settings are {', '.join(known)}"
            )


# Every plugin's settings class, imported when first needed (the classes import this module).
PLUGINS = {
    "reorder": ("kvreuse.reorder.config", "ReorderConfig"),
    "sparse": ("kvreuse.sparse.config", "SparseConfig"),
    "modules": ("kvreuse.modules.config", "ModulesConfig"),
    "sglang": ("kvreuse.sglang.settings", "SGLangConfig"),
}
# The sections vLLM's --additional-config '{"kvreuse": {...}}' (and `kvreuse serve`'s [kvreuse.*]) may hold.
VLLM_PLUGINS = ("reorder", "sparse", "modules")


def plugin_config(plugin: str) -> type:
    """The settings dataclass of ``plugin`` (``"reorder"`` -> ``ReorderConfig``)."""
    import importlib

    module, name = PLUGINS[plugin]
    cls: type = getattr(importlib.import_module(module), name)
    return cls


def load_sections(
    sections: Any,
    environ: Mapping[str, str] | None = None,
    *,
    plugins: tuple[str, ...] = VLLM_PLUGINS,
    where: str = "the kvreuse settings",
) -> dict[str, Any]:
    """Every plugin's settings from ``sections`` (``{"reorder": {...}, ...}``) and the environment, checked.

    What a front end calls before it starts an engine, so a wrong section, key, type or range is reported at
    once, in the process the user started, not by an engine process half a minute later.
    """
    if sections is None:
        sections = {}
    if not isinstance(sections, Mapping):
        raise ConfigError(
            f"{where} must be a table/object of sections ({', '.join(plugins)}); got {type(sections).__name__} "
            f"{sections!r}"
        )
    for name in sections:
        if name not in plugins:
            hint = suggest(str(name), plugins)
            other = "" if name not in PLUGINS else f" ({name} settings are read from KVREUSE_{name.upper()}_*)"
            raise ConfigError(f"unknown section {name!r} in {where}{hint}{other}; sections: {', '.join(plugins)}")
    check_environment(environ)
    return {plugin: load(plugin_config(plugin), plugin, sections.get(plugin), environ) for plugin in plugins}


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Every ``KVREUSE_*`` variable is a setting of some plugin, with a valid value, or one of
    :data:`OTHER_VARIABLES`; raise ``ConfigError`` naming the closest known variable otherwise.

    Only the plugins that variables name (or nearly name) are imported, so a process that sets none pays nothing.
    """
    environ = os.environ if environ is None else environ
    named: dict[str, None] = {}
    for variable in environ:
        upper = variable.upper()
        if not upper.startswith("KVREUSE_") or upper in OTHER_VARIABLES:
            continue
        word = upper.removeprefix("KVREUSE_").split("_", 1)[0].lower()
        close = difflib.get_close_matches(word, PLUGINS, n=1, cutoff=0.6)
        plugin = word if word in PLUGINS else (close[0] if close else None)
        known = list(OTHER_VARIABLES)
        if plugin is not None:
            known += [env_name(plugin, f.name) for f in settings_fields(plugin_config(plugin))]
        if plugin is None or upper not in known:
            raise ConfigError(f"unknown variable {variable}{suggest(upper, known)}; see the README's settings tables")
        named[plugin] = None
    for plugin in named:
        load(plugin_config(plugin), plugin, {}, environ)


def share_local_secret(environ: MutableMapping[str, str] | None = None) -> str:
    """This process tree's local secret (``kvreuse.modules.writes``: the offline module API signs its writes with
    it): the inherited one, or a new random one put into ``environ`` (default ``os.environ``) for the engine
    processes started from here to inherit. Cheap: ``kvreuse.vllm.register`` calls it in every vLLM process."""
    environ = os.environ if environ is None else environ
    if len(environ.get(LOCAL_SECRET_VARIABLE, "")) < 32:
        environ[LOCAL_SECRET_VARIABLE] = secrets.token_urlsafe(32)
    return environ[LOCAL_SECRET_VARIABLE]


def describe(cls: type, plugin: str) -> list[tuple[str, str, Any, str]]:
    """Rows (flag key, variable, default, description) for the README's table of settings."""
    return [
        (f"{plugin}.{f.name}", env_name(plugin, f.name), f.default, f.metadata["doc"]) for f in settings_fields(cls)
    ]


# -- the pydantic model behind a settings dataclass -------------------------------------------------------------------

# The variables a model being instantiated reads (a context variable, so tests and `kvreuse serve` can pass
# their own mapping in place of os.environ).
_ENVIRON: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar("kvreuse_environ")


class _MappingEnvSource(EnvSettingsSource):
    """pydantic-settings' environment source, reading the mapping given to :func:`load`."""

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return parse_env_vars(_ENVIRON.get(os.environ), self.case_sensitive, self.env_ignore_empty)


class _PluginSettings(BaseSettings):
    model_config = SettingsConfigDict(extra="forbid", case_sensitive=False, validate_default=False)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Flags over variables; no .env or secrets files: kvreuse reads only what the user passed.
        return init_settings, _MappingEnvSource(settings_cls)


@functools.cache
def _model(cls: type, plugin: str) -> type[BaseSettings]:
    """The pydantic-settings model of a settings dataclass (made once per class)."""
    hints = typing.get_type_hints(cls)
    fields: dict[str, Any] = {}
    for f in settings_fields(cls):
        fields[f.name] = (_field_type(hints[f.name], f), f.default)
    base = type(
        f"{cls.__name__}Base",
        (_PluginSettings,),
        {"model_config": SettingsConfigDict(env_prefix=f"KVREUSE_{plugin.upper()}_")},
    )
    return pydantic.create_model(f"{cls.__name__}Settings", __base__=base, __module__=__name__, **fields)


def _field_type(kind: Any, f: dataclasses.Field[Any]) -> Any:
    """The annotated pydantic type of one setting (see the module's rules)."""
    low, high, choices = f.metadata["low"], f.metadata["high"], f.metadata["choices"]
    bounds = pydantic.Field(ge=low, le=high)
    if kind is bool:
        return Annotated[bool, pydantic.BeforeValidator(_only(bool, str))]
    if kind is int:  # at most int64 where no tighter bound is declared: the widest integer tensors hold
        bounds = pydantic.Field(ge=INT64_MIN if low is None else low, le=INT64_MAX if high is None else high)
        return Annotated[int, pydantic.BeforeValidator(_only(int, str)), bounds]
    if kind is float:
        return Annotated[
            float, pydantic.BeforeValidator(_only(int, float, str)), pydantic.AfterValidator(_not_nan), bounds
        ]
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return Annotated[kind, pydantic.BeforeValidator(_only(str))]
    if kind is str and choices is not None:
        return Annotated[Literal[tuple(choices)], pydantic.BeforeValidator(_only(str))]
    if kind is str:
        return Annotated[str, pydantic.Strict()]
    raise TypeError(f"setting {f.name}: type {kind!r} is not supported (bool, int, float, str or a StrEnum)")


def _only(*kinds: type) -> Any:
    """A validator that lets through values of ``kinds`` (never a bool where a number is wanted)."""

    def check(value: Any) -> Any:
        if isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool)):
            return value
        raise ValueError(f"a {type(value).__name__} is not accepted")

    return check


class _NotANumber(ValueError):
    pass


def _not_nan(value: float) -> float:
    if math.isnan(value):
        raise _NotANumber("NaN is in no range")
    return value


def _explain(
    error: pydantic.ValidationError, cls: type, plugin: str, flags: Mapping[str, Any], environ: Mapping[str, str]
) -> str:
    """The first of pydantic's errors as a sentence naming the setting, its variable and what it accepts."""
    problem = error.errors(include_url=False)[0]
    name = str(problem["loc"][0]) if problem["loc"] else "?"
    f = next((f for f in settings_fields(cls) if f.name == name), None)
    variable = env_name(plugin, name)
    where = f"{plugin}.{name} ({variable})"
    if name in flags:
        value = flags[name]
    else:
        value = next((v for k, v in environ.items() if k.upper() == variable), problem.get("input"))
    if f is None:
        return f"{where}: {problem['msg']}"
    kind = typing.get_type_hints(cls)[name]
    low, high = f.metadata["low"], f.metadata["high"]
    out_of_range = problem["type"] in ("greater_than_equal", "less_than_equal")
    if out_of_range or isinstance(problem.get("ctx", {}).get("error"), _NotANumber):
        lowest, highest = ("-inf" if low is None else low), ("inf" if high is None else high)
        return f"{where}: {value!r} is outside the accepted range [{lowest}, {highest}]"
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return f"{where}: {value!r} is not one of {', '.join(m.value for m in kind)}"
    if f.metadata["choices"] is not None:
        return f"{where}: {value!r} is not one of {', '.join(f.metadata['choices'])}"
    return f"{where}: {value!r} is not a valid {getattr(kind, '__name__', kind)}"
