"""Choosing a splice's recompute setting from a sample of prompts (``kvreuse.modules.calibrate``): the cheapest
setting keeping an agreement floor, and what a sample of a given size can show (the Wilson bound). The real model
in the engine: ``integration_tests/test_module_calibrate.py``."""

from __future__ import annotations

import pytest

from kvreuse.modules.calibrate import (
    ALL_TOKENS,
    Measured,
    Setting,
    agreement_lower_bound,
    cheapest,
    prompts_needed,
)


def test_the_cheapest_setting_keeping_the_floor_is_chosen():
    curve = [
        Measured(Setting(0), 10, 20, 0.04),
        Measured(Setting(16), 18, 20, 0.15),
        Measured(Setting(32), 19, 20, 0.25),
        Measured(Setting(64), 20, 20, 0.45),
    ]
    assert cheapest(curve, 0.95).setting == Setting(32)  # 19/20 = 95% keeps a 95% floor
    assert cheapest(curve, 0.9).setting == Setting(16)
    assert cheapest(curve, 0.0).setting == Setting(0)
    assert cheapest(curve[:2], 0.95) is None  # none keeps it: the caller recomputes everything


def test_the_choice_is_by_tokens_computed_not_by_order_or_agreement():
    curve = [Measured(Setting(64), 20, 20, 0.45), Measured(Setting(16, 0.1), 19, 20, 0.2)]
    assert cheapest(curve, 0.95).setting == Setting(16, 0.1)


def test_a_setting_has_an_engine_form_and_a_per_request_form():
    setting = Setting(32, 0.1)
    assert setting.additional_config() == {
        "kvreuse": {
            "modules": {
                "recompute_first": 32,
                "recompute_share": 0.1,
                "recompute_budget": 0.0,
                "recompute_blend": 0.0,
                "blend_layers": 1,
            }
        }
    }
    assert setting.transfer_params() == {
        "kvreuse_recompute_first": 32,
        "kvreuse_recompute_share": 0.1,
        "kvreuse_recompute_budget": 0.0,
        "kvreuse_recompute_blend": 0.0,
        "kvreuse_blend_layers": 1,
    }
    assert str(Setting(ALL_TOKENS)) == "recompute_first all, recompute_share 0"
    assert str(Setting(0, 0.0, 0.15)) == "recompute_first 0, recompute_share 0, recompute_budget 0.15"
    assert str(Setting(0, 0.0, 0.0, 0.2, 2)) == "recompute_first 0, recompute_share 0, recompute_blend 0.2 after 2"


def test_every_form_of_a_setting_passes_the_engines_checks():
    from kvreuse.modules.config import ModulesConfig
    from kvreuse.vllm.modules.common import check_transfer_params

    setting = Setting(16, 0.1, 0.15, 0.2, 2)
    check_transfer_params(setting.transfer_params())
    assert ModulesConfig.load(setting.additional_config()["kvreuse"]["modules"], {}).recompute_blend == 0.2


def test_the_wilson_bound_at_full_agreement_is_n_over_n_plus_z_squared():
    z2 = 1.6448536269514722**2  # one-sided 95%
    for n in (1, 10, 52, 300):
        assert agreement_lower_bound(n, n) == pytest.approx(n / (n + z2))
    assert agreement_lower_bound(0, 0) == 0.0
    assert agreement_lower_bound(0, 20) == 0.0


def test_the_wilson_bound_lies_below_the_sampled_agreement_and_rises_with_the_sample():
    assert agreement_lower_bound(19, 20) < 0.95
    assert agreement_lower_bound(19, 20) < agreement_lower_bound(190, 200) < agreement_lower_bound(1900, 2000) < 0.95
    assert agreement_lower_bound(19, 20) == pytest.approx(
        0.8040, abs=1e-4
    )  # (0.95 + z²/40 - 0.1049) / (1 + z²/20), z = 1.645


def test_prompts_needed_is_the_smallest_all_agreeing_sample_that_shows_the_floor():
    for floor, confidence in ((0.95, 0.95), (0.9, 0.95), (0.95, 0.99), (0.8, 0.9)):
        n = prompts_needed(floor, confidence)
        assert agreement_lower_bound(n, n, confidence) >= floor > agreement_lower_bound(n - 1, n - 1, confidence)
    assert prompts_needed(0.95) == 52 and prompts_needed(0.9) == 25 and prompts_needed(0.95, 0.99) == 103


def test_bad_floors_and_counts_name_the_problem():
    with pytest.raises(ValueError, match="agreement floor 1.5 is not between 0 and 1"):
        cheapest([], 1.5)
    with pytest.raises(ValueError, match="agreement floor 1.0"):
        prompts_needed(1.0)
    with pytest.raises(ValueError, match="21 agreements of 20 prompts"):
        agreement_lower_bound(21, 20)
    with pytest.raises(ValueError, match="confidence 1 is not"):
        agreement_lower_bound(1, 2, 1)


def test_the_command_checks_its_inputs_before_an_engine_starts(tmp_path, capsys):
    from kvreuse.cli import main

    modules, prompts = tmp_path / "modules.json", tmp_path / "prompts.jsonl"
    modules.write_text('{"doc": "A profile."}')
    prompts.write_text('"A profile.\\nQuestion?"\n')
    command = ["calibrate-modules", "--model", "m", "--modules", str(modules), "--prompts", str(prompts)]
    assert main([*command, "--min-agreement", "1.5"]) == 1
    assert "--min-agreement must be between 0 and 1, got 1.5" in capsys.readouterr().err
    modules.write_text('["not", "an object"]')
    assert main(command) == 1
    assert "must be a JSON object of module name -> text" in capsys.readouterr().err
    modules.write_text('{"doc": "A profile."}')
    prompts.write_text("not json\n")
    assert main(command) == 1
    assert "calibration inputs: Expecting value" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*command, "--shares", "0.1,2"])
    assert "each share must be above 0 and at most 1" in capsys.readouterr().err
    for bad, said in (
        (["--blends", "0.2,nan"], "each share must be above 0 and at most 1"),
        (["--blend-layers", "0"], "'0' is not a comma-separated list of layer counts from 1 to 1024"),
        (["--blend-layers", "1,99999"], "layer counts from 1 to 1024"),
    ):
        with pytest.raises(SystemExit):
            main([*command, *bad])
        assert said in capsys.readouterr().err
    prompts.write_text('"A profile.\\nQuestion?"\n')
    assert main([*command, "--normalise", "first-line", "--normalise", "regex:(unclosed"]) == 1
    assert "regex:(unclosed: not a regular expression" in capsys.readouterr().err
