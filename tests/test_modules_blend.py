"""The encode-time token choice for selective recompute (``modules.recompute_share``, ``kvreuse.modules.blend``)
without an engine: how a module's tokens are ranked, which prompt positions a piece recomputes, what the
scheduler side plans with a ranking from the workers' report. The real engine:
``integration_tests/test_module_splice_quality.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_module_connector_pieces import module_scheduler, register

from kvreuse.errors import ModuleRegistrationError, RequestParameterError
from kvreuse.kernels.rerotate import RopeSpec
from kvreuse.modules.blend import encode_deviation, ranking, token_scores
from kvreuse.modules.splice import Piece, chosen_tokens, merge_positions, piece_kv
from kvreuse.modules.store import EncodedModule, ModuleKey
from kvreuse.vllm.modules.common import (
    ModuleCacheWorkerMeta,
    check_transfer_params,
    encode_params,
    encode_request,
    recompute_share,
)

SPEC = RopeSpec(head_dim=8, rotary_dim=8)


def module(kv, start=0, tokens=None):
    tokens = tokens or tuple(range(kv.shape[2]))
    return EncodedModule("m", "model", "tok", tokens, start, kv)


def test_chosen_tokens_are_each_modules_top_share_inside_the_piece_in_prompt_order():
    rankings = {"a": (3, 0, 5, 1, 2, 4), "b": (1, 0, 2, 3)}  # a: 6 tokens, b: 4
    pieces = [Piece("a", 0, 10, 6), Piece("b", 0, 16, 4)]
    assert chosen_tokens(pieces, rankings, 0.0) == ()
    assert chosen_tokens(pieces, rankings, 0.25) == (10, 13, 17)  # ceil(1.5) = 2 of a, 1 of b
    assert chosen_tokens(pieces, rankings, 0.5) == (10, 13, 15, 16, 17)
    assert chosen_tokens(pieces, rankings, 1.0) == tuple(range(10, 20))
    # a piece that starts inside its module (the engine's hit ended at a's token 2) keeps only what is left of it
    assert chosen_tokens([Piece("a", 2, 12, 4)], rankings, 0.5) == (13, 15)
    assert chosen_tokens([Piece("c", 0, 0, 5)], rankings, 1.0) == ()  # no ranking: encoded without a probe
    with pytest.raises(ValueError, match="between 0 and 1"):
        chosen_tokens(pieces, rankings, 1.5)


def test_merge_positions_is_the_ascending_union():
    assert merge_positions((10, 11, 16), (10, 13, 17), ()) == (10, 11, 13, 16, 17)
    assert merge_positions() == ()


def test_ranking_orders_by_score_then_position():
    assert ranking((0.5, 2.0, 0.5, 3.0)) == (3, 1, 0, 2)
    deviation = torch.tensor([[9.0, 9.0, 9.0], [1.0, 0.0, 2.0], [0.0, 5.0, 0.0]])
    assert token_scores(deviation, "first") == (1.0, 0.0, 2.0)
    assert token_scores(deviation, "all") == (1.0, 5.0, 2.0)  # layer 0 never counts
    assert token_scores(deviation, (0,)) == (9.0, 9.0, 9.0)
    with pytest.raises(ValueError, match="unknown layer set"):
        token_scores(deviation, "deep")


def test_a_module_encoded_elsewhere_with_the_same_kv_does_not_deviate():
    """The deviation compares KV at the same positions: the same KV encoded at another position (keys rotated
    there) deviates by rounding alone; a changed token's KV deviates where it changed."""
    torch.manual_seed(0)
    kv = torch.randn(3, 2, 5, 2, 8)
    alone = module(kv)
    moved = torch.stack([torch.stack(pair) for pair in piece_kv(alone, Piece("m", 0, 7, 5), SPEC, "cpu")])
    probe = module(moved, start=7)
    assert encode_deviation(alone, probe, SPEC).abs().max() < 1e-5
    changed = moved.clone()
    changed[1, 1, 3] += 1.0  # layer 1's values of token 3
    deviation = encode_deviation(alone, module(changed, start=7), SPEC)
    assert ranking(token_scores(deviation))[0] == 3 and deviation[0].abs().max() < 1e-5
    with pytest.raises(ValueError, match="other tokens"):
        encode_deviation(alone, module(moved, start=7, tokens=(9, 9, 9, 9, 9)), SPEC)


def test_a_request_sets_its_own_share_and_bad_values_name_the_problem():
    assert recompute_share(None, 0.1) == 0.1 and recompute_share({"other": 1}, 0.1) == 0.1
    assert recompute_share({"kvreuse_recompute_share": 0}, 0.1) == 0.0
    assert recompute_share({"kvreuse_recompute_share": 1}, 0.0) == 1.0
    for bad in (-0.1, 1.5, True, "0.1", float("nan"), float("inf")):
        with pytest.raises(RequestParameterError, match="kvreuse_recompute_share must be a number from 0 to 1"):
            recompute_share({"kvreuse_recompute_share": bad}, 0.0)


def test_a_probe_is_an_encode_request_that_replaces_nothing():
    write = encode_request(encode_params("doc", 3, probe=True), 10)
    assert write is not None and write.probe and write.context == 3
    assert not encode_request(encode_params("doc", 3), 10).probe
    with pytest.raises(ModuleRegistrationError, match="a probe replaces nothing"):
        encode_request(encode_params("doc", 3, replace=True, probe=True), 10)
    with pytest.raises(RequestParameterError, match="a probe replaces nothing") as refused:
        check_transfer_params(encode_params("doc", 3, replace=True, probe=True))
    assert refused.value.field == "kv_transfer_params.kvreuse_probe"
    with pytest.raises(ModuleRegistrationError, match="kvreuse_probe"):
        encode_request({"kvreuse_module": "doc", "kvreuse_probe": "yes"}, 10)


def test_tensor_parallel_scores_add_up():
    a, b = ModuleKey("a", 1), ModuleKey("b", 2)
    one = ModuleCacheWorkerMeta(scores={a: (1.0, 2.0), b: (1.0,)})
    two = ModuleCacheWorkerMeta(scores={a: (0.5, 0.5)})
    assert one.aggregate(two).scores == {a: (1.5, 2.5)}


def _blend_request(params, ranked=True, rid="r"):
    scheduler = module_scheduler(recompute_first=0)  # block size 4; the share alone unless a request asks for both
    a, b = ModuleKey("a", 1), ModuleKey("b", 2)
    # encoded after a context these prompts do not hold: neither is exact where it stands
    register(scheduler, (a, (1, 2, 3, 4, 5, 6), (99,), ""), (b, (7, 8, 9, 10), (99,), ""))
    if ranked:  # a's token 4 deviates most, then 2; b's token 3
        scheduler.worker_reported(ModuleCacheWorkerMeta(scores={a: (0, 0, 5, 0, 9, 0), b: (0, 0, 0, 1)}))
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 0]  # run [0, 10), question [10, 12)
    request = SimpleNamespace(
        request_id=rid, prompt_token_ids=prompt, num_tokens=len(prompt), kv_transfer_params=params, cache_salt=None
    )
    return scheduler, request


def test_the_scheduler_recomputes_each_modules_ranked_tokens_with_legolinks_first_tokens():
    scheduler, request = _blend_request({"kvreuse_recompute_share": 0.25})
    assert scheduler.matched_tokens(request, 0) == 10 - 3  # a: ceil(1.5) = 2 tokens (4, 2), b: 1 token (9)
    assert scheduler._plans["r"].recompute == (2, 4, 9)
    scheduler, request = _blend_request({"kvreuse_recompute_share": 0.25, "kvreuse_recompute_first": 1})
    assert scheduler.matched_tokens(request, 0) == 10 - 5
    assert scheduler._plans["r"].recompute == (0, 2, 4, 6, 9)  # the union with each module's first token


def test_a_module_without_a_ranking_recomputes_by_recompute_first_alone(caplog):
    scheduler, request = _blend_request({"kvreuse_recompute_share": 0.5, "kvreuse_recompute_first": 1}, ranked=False)
    with caplog.at_level("WARNING", logger="vllm.plugins.kvreuse"):
        assert scheduler.matched_tokens(request, 0) == 10 - 2
    assert scheduler._plans["r"].recompute == (0, 6)
    assert "has no token choice" in caplog.text
    scheduler, request = _blend_request({"kvreuse_recompute_share": 1.0})
    assert scheduler.matched_tokens(request, 0) == 0  # every token recomputed: nothing offered


def test_a_dropped_module_loses_its_ranking():
    scheduler, _ = _blend_request(None)
    a = ModuleKey("a", 1)
    assert scheduler.rankings[a][:2] == (4, 2)
    scheduler.worker_reported(ModuleCacheWorkerMeta(dropped={a}))
    assert a not in scheduler.rankings
