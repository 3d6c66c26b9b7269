"""Free-form request values bounded in shape where they are parsed: nesting depth, elements and text, each refusal
naming the field and the limit; and every ``kvreuse_*`` key checked whether or not a module is named."""

from __future__ import annotations

import pytest

from kvreuse.errors import ConfigError, RequestParameterError
from kvreuse.shape import MAX_DEPTH, MAX_ELEMENTS, MAX_TEXT, ShapeLimits, shape_problem
from kvreuse.vllm.modules.common import check_transfer_params
from kvreuse.vllm.registration import extra_args_refusal
from kvreuse.vllm.settings import check_additional_config


def nested(depth: int) -> dict:
    """An object ``depth`` levels deep: ``{"foo": {"foo": ... {}}}`` (the top level is level 1)."""
    value: dict = {}
    for _ in range(depth - 1):
        value = {"foo": value}
    return value


def test_the_object_that_ended_the_engine_600_deep_is_refused_naming_the_field_and_the_limit():
    field, message = extra_args_refusal({"kv_transfer_params": {"foo": nested(600)}})
    assert field.startswith("kv_transfer_params.foo")
    assert message.startswith("kv_transfer_params.foo") and f"nested more than {MAX_DEPTH} levels deep" in message
    assert f"kvreuse accepts at most {MAX_DEPTH}" in message


def test_depth_is_measured_past_pythons_recursion_limit():
    assert shape_problem(nested(100_000), "x") is not None


def test_32_levels_pass_and_33_do_not():
    assert shape_problem(nested(MAX_DEPTH), "x") is None
    assert shape_problem(nested(MAX_DEPTH + 1), "x") is not None
    lists: list = []
    for _ in range(MAX_DEPTH):
        lists = [lists]
    assert shape_problem(lists, "x") is not None  # lists nest as objects do (33 levels)


def test_kvreuses_own_parameters_and_a_connectors_block_ids_pass():
    params = {
        "kvreuse_module": "doc",
        "kvreuse_context": 3,
        "kvreuse_ape": {"temperature": 0.5, "scale": 0.8},
        "remote_block_ids": [list(range(65_536)) for _ in range(4)],  # 2^20 tokens in blocks of 16, 4 groups
        "remote_host": "10.0.0.1",
    }
    assert extra_args_refusal({"kv_transfer_params": params}) is None


def test_too_many_elements_are_refused_over_the_whole_value():
    field, message = extra_args_refusal({"kv_transfer_params": {"ids": [0] * MAX_ELEMENTS}})
    assert field == "kv_transfer_params" and f"more than {MAX_ELEMENTS:,} values" in message


def test_too_much_text_is_refused_keys_included():
    assert extra_args_refusal({"kv_transfer_params": {"s": "x" * (MAX_TEXT + 1)}})[0] == "kv_transfer_params"
    many_keys = {f"key-{k:08d}": 0 for k in range(MAX_TEXT // 12 + 1)}  # 12 characters each, no long string
    field, message = extra_args_refusal({"kv_transfer_params": many_keys})
    assert field == "kv_transfer_params" and "characters of keys and strings" in message


def test_vllm_xargs_are_bounded_as_a_whole_however_many_keys_they_spread_over():
    """Every entry of extra_args other than the transfer parameters came from the request's vllm_xargs: a
    million small keys are one field over its bound, not a million fields each within it."""
    xargs = {str(k): [0] * 8 for k in range(1 << 17)}  # 10 values a key (key, list, 8 numbers): 1.3 million
    field, message = extra_args_refusal(xargs)
    assert field == "vllm_xargs" and f"more than {MAX_ELEMENTS:,} values" in message
    assert extra_args_refusal({"session_id": "abc", "kv_transfer_params": {"x": 1}}) is None


def test_ec_transfer_params_are_bounded_too():
    assert extra_args_refusal({"ec_transfer_params": nested(40)})[0].startswith("ec_transfer_params")


def test_limits_can_be_given_for_other_values():
    assert shape_problem([1, 2, 3], "x", ShapeLimits(elements=3)) is not None
    assert shape_problem([1, 2], "x", ShapeLimits(elements=3)) is None


def test_an_additional_config_past_the_bounds_is_a_config_error():
    with pytest.raises(ConfigError, match="additional_config"):
        check_additional_config({"other_plugin": nested(MAX_DEPTH + 1)})


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"kvreuse_context": 3}, "kvreuse_context"),
        ({"kvreuse_context": {"foo": {}}}, "kvreuse_context"),
        ({"kvreuse_probe": True}, "kvreuse_probe"),
        ({"kvreuse_probe": "yes"}, "kvreuse_probe"),
        ({"kvreuse_replace": False}, "kvreuse_replace"),
    ],
)
def test_an_encodes_key_without_its_module_is_refused_whatever_its_value(params, field):
    with pytest.raises(RequestParameterError) as refused:
        check_transfer_params(params)
    assert refused.value.field == f"kv_transfer_params.{field}"
    assert "add kvreuse_module or leave" in str(refused.value)
    assert extra_args_refusal({"kv_transfer_params": params})[0] == f"kv_transfer_params.{field}"
