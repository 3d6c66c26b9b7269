"""Plugin settings: defaults, KVREUSE_* variables, engine flags, and errors that name the setting."""

from __future__ import annotations

import math
import re
import typing
from enum import StrEnum
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvreuse.config import (
    PLUGINS,
    VLLM_PLUGINS,
    check_environment,
    describe,
    env_name,
    load_sections,
    plugin_config,
    settings_fields,
)
from kvreuse.errors import ConfigError
from kvreuse.modules.config import EvictionPolicy, ModulesConfig
from kvreuse.reorder.config import ReorderConfig
from kvreuse.sparse.config import SparseConfig
from kvreuse.vllm.settings import kvreuse_flags

INF = float("inf")


def test_defaults_apply_without_flags_or_variables():
    assert ReorderConfig.load({}, environ={}) == ReorderConfig()


def test_environment_variable_sets_a_value_and_flags_override_it():
    env = {"KVREUSE_REORDER_MAX_SKIPS": "3", "KVREUSE_REORDER_MAX_WAIT_S": "0.5"}
    assert ReorderConfig.load({}, environ=env).max_skips == 3
    cfg = ReorderConfig.load({"max_skips": 7}, environ=env)
    assert (cfg.max_skips, cfg.max_wait_s) == (7, 0.5)


def test_boolean_variables_accept_the_usual_spellings():
    assert ReorderConfig.load({}, environ={"KVREUSE_REORDER_DISCOVER_FDS": "off"}).discover_fds is False
    with pytest.raises(ConfigError, match="KVREUSE_REORDER_DISCOVER_FDS"):
        ReorderConfig.load({}, environ={"KVREUSE_REORDER_DISCOVER_FDS": "maybe"})


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"max_skips": -1}, r"reorder\.max_skips .*outside the accepted range \[0, 1000000\]"),
        ({"lookahead": 0}, r"reorder\.lookahead .*outside the accepted range \[1, 1000000\]"),
        ({"max_wait_s": "soon"}, r"reorder\.max_wait_s .*'soon' is not a valid float"),
        ({"max_wait_s": float("nan")}, r"reorder\.max_wait_s"),
        ({"max_skip": 3}, r"unknown reorder setting\(s\) max_skip \(did you mean 'max_skips'\?\)"),
    ],
)
def test_bad_values_name_the_setting_and_the_accepted_range(flags, message):
    with pytest.raises(ConfigError, match=message):
        ReorderConfig.load(flags, environ={})


def test_vllm_additional_config_section_is_read_and_checked():
    assert kvreuse_flags({"kvreuse": {"reorder": {"max_skips": 2}}}, "reorder") == {"max_skips": 2}
    assert kvreuse_flags({}, "reorder") == {}
    assert kvreuse_flags(None, "reorder") == {}
    with pytest.raises(ConfigError, match=r"the reorder settings must be a table/object of settings"):
        kvreuse_flags({"kvreuse": {"reorder": 3}}, "reorder")


def test_every_setting_is_documented():
    rows = describe(ReorderConfig, "reorder")
    assert rows and all(doc for *_, doc in rows)
    assert ("reorder.max_skips", "KVREUSE_REORDER_MAX_SKIPS", 64) == rows[0][:3]


# -- strict types: a value has the setting's type or is a string that spells one ------------------------------------


@pytest.mark.parametrize(
    ("flags", "environ", "message"),
    [
        ({"max_skips": 64.7}, {}, r"reorder\.max_skips .*64\.7 is not a valid int"),
        ({"max_skips": 64.0}, {}, r"reorder\.max_skips .*64\.0 is not a valid int"),
        ({}, {"KVREUSE_REORDER_MAX_SKIPS": "64.7"}, r"KVREUSE_REORDER_MAX_SKIPS\): '64\.7' is not a valid int"),
        ({"max_skips": True}, {}, r"reorder\.max_skips .*True is not a valid int"),
        ({"max_wait_s": False}, {}, r"reorder\.max_wait_s .*False is not a valid float"),
        ({"discover_fds": 5}, {}, r"reorder\.discover_fds .*5 is not a valid bool"),
        ({"discover_fds": "maybe"}, {}, r"reorder\.discover_fds .*'maybe' is not a valid bool"),
    ],
)
def test_wrong_types_are_errors_never_coerced(flags, environ, message):
    with pytest.raises(ConfigError, match=message):
        ReorderConfig.load(flags, environ=environ)


def test_numbers_from_strings_and_infinity_from_json_are_read():
    assert ReorderConfig.load({}, environ={"KVREUSE_REORDER_MAX_SKIPS": "12"}).max_skips == 12
    assert SparseConfig.load({"beta": "inf"}, environ={}).beta == float("inf")  # JSON cannot spell infinity
    assert SparseConfig.load({"beta": 6}, environ={}).beta == 6.0


def test_a_string_setting_refuses_a_number_and_a_choice_is_spelt_exactly():
    with pytest.raises(ConfigError, match=r"modules\.disk_dir .*5 is not a valid str"):
        ModulesConfig.load({"disk_dir": 5}, environ={})
    with pytest.raises(ConfigError, match=r"modules\.eviction .*'LRU' is not one of lru, lfu, fifo"):
        ModulesConfig.load({"eviction": "LRU"}, environ={})
    assert ModulesConfig.load({}, environ={"KVREUSE_MODULES_EVICTION": "lfu"}).eviction is EvictionPolicy.LFU


def test_every_choice_a_user_can_type_is_a_str_enum():
    for plugin in PLUGINS:
        cls = plugin_config(plugin)
        hints = typing.get_type_hints(cls)
        for f in settings_fields(cls):
            if f.metadata["choices"] is not None:
                pytest.fail(f"{plugin}.{f.name} lists its choices as strings; type it as a StrEnum")
            if isinstance(f.default, str) and isinstance(hints[f.name], type) and issubclass(hints[f.name], StrEnum):
                assert f.default in hints[f.name]


# -- unknown names: errors with the closest known name ---------------------------------------------------------------


def test_a_misspelt_variable_names_the_closest_setting():
    with pytest.raises(ConfigError, match=r"KVREUSE_REORDER_MAX_SKIP \(did you mean 'KVREUSE_REORDER_MAX_SKIPS'\?\)"):
        ReorderConfig.load({}, environ={"KVREUSE_REORDER_MAX_SKIP": "3"})
    with pytest.raises(ConfigError, match=r"KVREUSE_MODUL_GPU_BYTES \(did you mean 'KVREUSE_MODULES_GPU_BYTES'\?\)"):
        check_environment({"KVREUSE_MODUL_GPU_BYTES": "1"})
    check_environment({"KVREUSE_SPARSE_CPU_BACKEND": "1", "KVREUSE_DATASETS": "/data", "HOME": "/root"})


def test_a_misspelt_section_names_the_closest_plugin():
    with pytest.raises(ConfigError, match=r"unknown section 'reordr' .*\(did you mean 'reorder'\?\)"):
        load_sections({"reordr": {"max_skips": 3}}, environ={})
    with pytest.raises(ConfigError, match=r"additional_config key 'kvreuse_modul' is not kvreuse's"):
        kvreuse_flags({"kvreuse_modul": {"gpu_bytes": 1}}, "modules")
    # Whichever plugin reads its section checks the others: the scheduler does not ignore a sparse typo.
    with pytest.raises(ConfigError, match=r"unknown sparse setting\(s\) bta \(did you mean 'beta'\?\)"):
        kvreuse_flags({"kvreuse": {"sparse": {"bta": 3}}}, "reorder")


def test_a_plugin_section_that_is_not_a_table_is_a_config_error_not_a_type_error():
    with pytest.raises(ConfigError, match=r"the reorder settings must be a table/object of settings .*; got int 5"):
        load_sections({"reorder": 5}, environ={})
    with pytest.raises(ConfigError, match="must be a table/object of sections"):
        load_sections(5, environ={})


def test_every_plugin_section_is_accepted():
    loaded = load_sections({"reorder": {"max_skips": 1}, "sparse": {"beta": 2.0}, "modules": {"cpu_bytes": 0}}, {})
    assert (loaded["reorder"].max_skips, loaded["sparse"].beta, loaded["modules"].cpu_bytes) == (1, 2.0, 0)


def test_layer_betas_are_parsed_once_per_config(monkeypatch):
    import kvreuse.sparse.config as sparse_config
    from kvreuse.sparse.policy import RuleBasedPolicy, layer_beta

    calls = []
    real = sparse_config.parse_layer_betas
    monkeypatch.setattr(sparse_config, "parse_layer_betas", lambda text: calls.append(text) or real(text))
    cfg = SparseConfig.load({"layer_betas": "0:inf,3:6"}, environ={})
    policy = RuleBasedPolicy(cfg)
    # dense_layers defaults to 1: layer 0 dense, layer 3 from the overrides, the others at the default beta
    assert [policy.layer_beta(layer) for layer in range(5)] == [INF, 8.0, 8.0, 6.0, 8.0]
    assert [layer_beta(cfg, layer) for layer in range(5)] == [INF, 8.0, 8.0, 6.0, 8.0]
    assert len(calls) == 1


# -- property: whatever a user writes, the answer is a valid config or kvreuse's own error ---------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=5,
)


def _check_types(cfg, cls) -> None:
    hints = typing.get_type_hints(cls)
    for f in settings_fields(cls):
        value, kind = getattr(cfg, f.name), hints[f.name]
        assert isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool), (f.name, value)
        if kind in (int, float):
            assert not math.isnan(value)
            assert f.metadata["low"] is None or value >= f.metadata["low"]
            assert f.metadata["high"] is None or value <= f.metadata["high"]


@pytest.mark.parametrize("plugin", list(PLUGINS))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_flags_give_a_valid_config_or_a_config_error(plugin, data):
    cls = plugin_config(plugin)
    names = [f.name for f in settings_fields(cls)]
    keys = st.sampled_from(names) | st.text(max_size=10)
    flags = data.draw(st.dictionaries(keys, JSON_VALUES, max_size=3))
    try:
        cfg = cls.load(flags, environ={})
    except ConfigError:
        return
    _check_types(cfg, cls)


@pytest.mark.parametrize("plugin", list(PLUGINS))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_variables_give_a_valid_config_or_a_config_error(plugin, data):
    cls = plugin_config(plugin)
    names = [env_name(plugin, f.name) for f in settings_fields(cls)]
    printable = st.text(st.characters(min_codepoint=32, max_codepoint=0x2FFF), max_size=8)
    environ = data.draw(st.dictionaries(st.sampled_from(names) | printable.map("KVREUSE_".__add__), printable))
    try:
        check_environment(environ)
        cfg = cls.load({}, environ=environ)
    except ConfigError:
        return
    _check_types(cfg, cls)


@settings(max_examples=60, deadline=None)
@given(sections=st.dictionaries(st.sampled_from([*VLLM_PLUGINS, "reordr", "x"]), JSON_VALUES, max_size=3))
def test_any_sections_give_valid_configs_or_a_config_error(sections):
    try:
        loaded = load_sections(sections, environ={})
    except ConfigError:
        return
    for plugin, cfg in loaded.items():
        _check_types(cfg, plugin_config(plugin))


def test_every_kvreuse_variable_the_code_reads_is_known_to_the_environment_check():
    """A variable read somewhere in kvreuse but missing from the settings and OTHER_VARIABLES would make vLLM's
    plugin entry point refuse to start whoever sets it (as KVREUSE_MODULES_WRITE_KEY once did)."""
    root = Path(__file__).resolve().parents[1]
    sources = [*(root / "plugins" / "kvreuse").rglob("*.py"), *(root / "patches").rglob("*.py")]
    named = {m for path in sources for m in re.findall(r"\"(KVREUSE_[A-Z_]*[A-Z])\"", path.read_text())}
    assert "KVREUSE_MODULES_WRITE_KEY" in named
    values = {"KVREUSE_MODULES_WRITE_KEY": "k" * 64, "KVREUSE_MODULES_WRITE_KEY_FILE": __file__}
    for variable in sorted(named):
        check_environment({variable: values.get(variable, "1")})
