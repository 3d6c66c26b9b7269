"""SmolLM2 past its trained 8K positions through vLLM's own model overrides (``localmodel.extended_context``)."""

from __future__ import annotations

import json

import pytest

from kvreuse.errors import ConfigError
from kvreuse.localmodel import extended_context


@pytest.mark.parametrize(("scaling", "factor"), [("linear", 2.0), ("linear", 4.0), ("yarn", 2.0), ("yarn", 4.0)])
def test_vllm_takes_the_overrides_and_runs_the_model_at_factor_times_its_context(smollm2_model, scaling, factor):
    """vLLM's model config applies the overrides: the RoPE scaling its rotary embedding is built from, and a longest
    context of 8192 x factor (vLLM scales a linear factor itself and takes YaRN's as already applied)."""
    from vllm.config import ModelConfig

    args = extended_context(smollm2_model, scaling, factor)
    config = ModelConfig(model=str(smollm2_model), dtype="float32", **args)
    rope = config.hf_config.rope_parameters
    assert (rope["rope_type"], rope["factor"], rope["rope_theta"]) == (scaling, factor, 100000.0)
    assert config.max_model_len == int(8192 * factor) == args["max_model_len"]
    if scaling == "yarn":
        assert rope["original_max_position_embeddings"] == 8192


@pytest.mark.parametrize("scaling", ["dynamic", "ntk", "longrope", "llama3", ""])
def test_an_unsupported_scaling_is_refused_naming_it(smollm2_model, scaling):
    with pytest.raises(ConfigError, match=f"RoPE scaling {scaling!r} is not supported.*linear, yarn"):
        extended_context(smollm2_model, scaling, 2.0)


@pytest.mark.parametrize("factor", [1.0, 0.5, -2.0, float("nan"), float("inf"), 65.0])
def test_a_factor_that_does_not_extend_is_refused(smollm2_model, factor):
    with pytest.raises(ConfigError, match="RoPE scaling factor must be a number in"):
        extended_context(smollm2_model, "linear", factor)


def test_a_model_already_scaled_is_refused(tmp_path):
    config = {"max_position_embeddings": 16384, "rope_parameters": {"rope_type": "linear", "factor": 2.0}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="plain RoPE"):
        extended_context(tmp_path, "yarn", 2.0)
