"""Plugin settings: defaults, KVREUSE_* variables, engine flags, and errors that name the setting."""

from __future__ import annotations

import pytest

from kvreuse.config import describe
from kvreuse.errors import ConfigError
from kvreuse.reorder.config import ReorderConfig
from kvreuse.vllm.settings import kvreuse_flags


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
        ({"max_skip": 3}, r"unknown reorder setting\(s\) max_skip"),
    ],
)
def test_bad_values_name_the_setting_and_the_accepted_range(flags, message):
    with pytest.raises(ConfigError, match=message):
        ReorderConfig.load(flags, environ={})


def test_vllm_additional_config_section_is_read_and_checked():
    assert kvreuse_flags({"kvreuse": {"reorder": {"max_skips": 2}}}, "reorder") == {"max_skips": 2}
    assert kvreuse_flags({}, "reorder") == {}
    assert kvreuse_flags(None, "reorder") == {}
    with pytest.raises(ConfigError, match=r"additional_config\['kvreuse'\]\['reorder'\] must be an object"):
        kvreuse_flags({"kvreuse": {"reorder": 3}}, "reorder")


def test_every_setting_is_documented():
    rows = describe(ReorderConfig, "reorder")
    assert rows and all(doc for *_, doc in rows)
    assert ("reorder.max_skips", "KVREUSE_REORDER_MAX_SKIPS", 64) == rows[0][:3]
