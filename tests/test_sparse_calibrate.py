"""Calibrating ``sparse.top_pages`` (the approximate page budget): the choice, its setting's bounds, the command's
refusals. The engine run, ``kvreuse.vllm.sparse.calibrate``, is tested in ``integration_tests/test_sparse_backend.py``.
"""

from __future__ import annotations

import math

import pytest

from kvreuse.cli import main
from kvreuse.errors import ConfigError
from kvreuse.sparse.calibrate import EXACT, BudgetMeasured, cheapest_budget
from kvreuse.sparse.config import SparseConfig


def test_the_budget_reading_fewest_blocks_that_keeps_the_floor_is_chosen():
    curve = [
        BudgetMeasured(4, 15, 20, 0.05),  # 75%: under a 90% floor
        BudgetMeasured(8, 18, 20, 0.08),  # 90%: keeps it
        BudgetMeasured(16, 20, 20, 0.12),
    ]
    assert cheapest_budget(curve, 0.9) == curve[1]
    assert cheapest_budget(curve, 1.0) == curve[2]
    assert cheapest_budget(curve, 0.0) == curve[0]


def test_no_budget_is_chosen_where_none_keeps_the_floor():
    assert cheapest_budget([BudgetMeasured(4, 1, 2, 0.05)], 0.9) is None
    assert cheapest_budget([], 0.5) is None
    with pytest.raises(ValueError, match="between 0 and 1"):
        cheapest_budget([], 1.5)


def test_a_measured_budget_bounds_its_agreement_as_the_module_calibration_does():
    measured = BudgetMeasured(8, 20, 20, 0.1)
    assert measured.agreement == 1.0 and 0.87 < measured.lower_bound() < 0.89  # Wilson, 20 of 20 at 95%
    assert BudgetMeasured(EXACT, 0, 0, 1.0).agreement == 0.0


@pytest.mark.parametrize("bad", [-1, 1_000_001, 2.5, "nan", "inf", "1e400", True])
def test_top_pages_outside_its_bounds_is_refused_naming_the_setting(bad):
    with pytest.raises(ConfigError, match="top_pages"):
        SparseConfig.load({"top_pages": bad}, environ={})


def test_top_pages_is_off_by_default_on_every_device():
    assert SparseConfig.load({}, environ={}).top_pages == 0
    assert SparseConfig.load({}, environ={}, cpu=True).top_pages == 0
    assert SparseConfig.load({"top_pages": 16}, environ={}).top_pages == 16


def test_the_kernels_path_refuses_a_page_budget_it_cannot_rank():
    from kvreuse.sparse.paged import SparseAttention

    with pytest.raises(ConfigError, match=r"sparse.top_pages \(8\).*engine_kernel"):
        SparseAttention(9, 3, 64, 32, 0.125, SparseConfig(top_pages=8))


def test_calibrate_sparse_refuses_bad_inputs_naming_them(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"A question?"\n')
    command = ["calibrate-sparse", "--model", "m", "--prompts", str(prompts)]
    assert main([*command, "--min-agreement", "1.5"]) == 1
    assert "--min-agreement must be between 0 and 1, got 1.5" in capsys.readouterr().err
    assert main([*command, "--beta", "inf"]) == 1
    assert "--beta must be a finite number" in capsys.readouterr().err
    assert main([*command, "--beta", str(-math.pi)]) == 1
    assert "--beta must be a finite number" in capsys.readouterr().err
    prompts.write_text("[1, 2]\n")
    assert main(command) == 1
    assert "must hold one JSON string (a sample prompt) per line" in capsys.readouterr().err
    for bad in ("0,8", "8,x", "2000000"):
        with pytest.raises(SystemExit):
            main([*command, "--top-pages", bad])
