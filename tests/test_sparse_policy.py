"""Settings, per-layer rules and figures of the sparse plugin (engine-free, no kernel runs)."""

from __future__ import annotations

import math

import pytest
import torch

from kvreuse.errors import ConfigError
from kvreuse.sparse import (
    AttendedFractions,
    RuleBasedPolicy,
    SparseConfig,
    layer_beta,
    parse_layer_betas,
    recovery_ratio,
    sequence_betas,
    should_sample,
    uses_dipr,
)
from kvreuse.sparse.config import CPU_MIN_CONTEXT

INF = float("inf")


def test_defaults_apply_without_flags_or_variables():
    cfg = SparseConfig.load({}, environ={})
    assert cfg == SparseConfig()
    assert (cfg.beta, cfg.dense_layers, cfg.min_context, cfg.sink, cfg.local) == (8.0, 1, 512, 16, 64)


def test_a_cpu_engine_keeps_contexts_up_to_8k_dense_unless_min_context_is_set():
    assert SparseConfig.load({}, environ={}, cpu=True).min_context == CPU_MIN_CONTEXT == 8192
    assert SparseConfig.load({"beta": 4}, environ={}, cpu=True) == SparseConfig(beta=4, min_context=8192)
    assert SparseConfig.load({"min_context": 512}, environ={}, cpu=True).min_context == 512
    assert SparseConfig.load({}, environ={"KVREUSE_SPARSE_MIN_CONTEXT": "0"}, cpu=True).min_context == 0
    assert SparseConfig.load({}, environ={}, cpu=False).min_context == 512


def test_beta_accepts_inf_from_a_variable_and_a_flag():
    assert SparseConfig.load({}, environ={"KVREUSE_SPARSE_BETA": "inf"}).beta == INF
    assert SparseConfig.load({"beta": "inf"}, environ={"KVREUSE_SPARSE_BETA": "3"}).beta == INF


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"beta": -1.0}, r"sparse\.beta \(KVREUSE_SPARSE_BETA\): -1\.0 is outside the accepted range \[0\.0, inf\]"),
        ({"beta": "nan"}, r"sparse\.beta"),
        ({"dense_layers": -1}, r"sparse\.dense_layers .*outside the accepted range \[0, 1000000\]"),
        ({"min_context": "long"}, r"sparse\.min_context .*'long' is not a valid int"),
        ({"sink": 0, "local": 0}, r"sparse\.sink .* and sparse\.local .*at least one must be >= 1"),
        ({"layer_betas": "0:inf,x:3"}, r"sparse\.layer_betas \(KVREUSE_SPARSE_LAYER_BETAS\): 'x:3' is not LAYER:BETA"),
        ({"layer_betas": "1:-2"}, r"sparse\.layer_betas .*'1:-2'.*beta in \[0, inf\]"),
        ({"layer_betas": "0-3:6,2:inf"}, r"sparse\.layer_betas .*layer 2 is given twice"),
        ({"betta": 3}, r"unknown sparse setting\(s\) betta"),
    ],
)
def test_bad_values_name_the_setting_and_the_accepted_range(flags, message):
    with pytest.raises(ConfigError, match=message):
        SparseConfig.load(flags, environ={})


def test_layer_betas_parse_single_layers_and_ranges():
    assert parse_layer_betas("") == {}
    assert parse_layer_betas("0:inf, 3:6.5,8-10:2") == {0: INF, 3: 6.5, 8: 2.0, 9: 2.0, 10: 2.0}


def test_first_layers_are_dense_and_the_rest_use_the_global_beta():
    cfg = SparseConfig(beta=9.0, dense_layers=2)
    assert [layer_beta(cfg, layer) for layer in range(4)] == [INF, INF, 9.0, 9.0]


def test_a_listed_layer_uses_its_own_beta_even_among_the_dense_layers():
    cfg = SparseConfig(beta=9.0, dense_layers=2, layer_betas="1:4,3:inf")
    assert [layer_beta(cfg, layer) for layer in range(5)] == [INF, 4.0, 9.0, INF, 9.0]


def test_short_contexts_are_dense_in_every_layer():
    cfg = SparseConfig(beta=9.0, dense_layers=1, min_context=100)
    assert sequence_betas(cfg, 3, torch.tensor([1, 99, 100, 5000], dtype=torch.int32)).tolist() == [INF, INF, 9.0, 9.0]
    assert sequence_betas(cfg, 0, [5000]).tolist() == [INF]
    assert (uses_dipr(cfg, 3, 99), uses_dipr(cfg, 3, 100), uses_dipr(cfg, 0, 5000)) == (False, True, False)


def test_policy_object_gives_the_same_answers_as_the_functions():
    cfg = SparseConfig(beta=7.0, layer_betas="0:3", dense_layers=2)
    policy = RuleBasedPolicy(cfg)
    assert policy.name == "rules"
    assert [policy.layer_beta(layer) for layer in range(3)] == [layer_beta(cfg, layer) for layer in range(3)]
    assert policy.sequence_betas(2, [10, 4096]).tolist() == [INF, 7.0]
    assert policy.uses_dipr(0, 4096) and not policy.uses_dipr(1, 4096)


def test_recovery_samples_every_nth_step_and_never_when_zero():
    assert [should_sample(step, 3) for step in range(7)] == [True, False, False, True, False, False, True]
    assert not any(should_sample(step, 0) for step in range(5))


def test_recovery_ratio_is_the_dense_softmax_mass_on_the_attended_set():
    logits = torch.tensor([[0.0, 0.0, math.log(2.0)], [1.0, 1.0, 1.0]])
    attended = torch.tensor([[False, True, True], [True, True, True]])
    assert recovery_ratio(logits, attended).tolist() == pytest.approx([0.75, 1.0])


def test_fractions_sum_over_steps_per_layer():
    from kvreuse.kernels.dipr_decode import DIPRCounters

    figures = AttendedFractions()
    step = DIPRCounters(
        blocks_read=torch.tensor([[1, 3], [2, 2]]),
        blocks_total=torch.tensor([4, 2]),
        tokens_attended=torch.tensor([[10, 20, 30, 40], [5, 5, 5, 5]]),
        tokens_total=torch.tensor([60, 20]),
    )
    figures.add(5, step)
    figures.add(5, step)
    figures.add_recovery(5, torch.tensor([0.9, 1.0]))
    (row,) = figures.rows()
    assert row["layer"] == 5 and row["samples"] == 2
    assert row["block_fraction"] == pytest.approx(16 / 24)  # (1+3+2+2) * 2 / ((4+2) * 2 heads * 2 steps)
    assert row["token_fraction"] == pytest.approx(240 / 640)  # (100+20) * 2 / ((60+20) * 4 heads * 2 steps)
    assert (row["recovery_mean"], row["recovery_min"]) == (pytest.approx(0.95), pytest.approx(0.9))
