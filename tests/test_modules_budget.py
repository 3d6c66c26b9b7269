"""One budget of recomputed tokens for a whole spliced run (``modules.recompute_budget``,
``kvreuse.modules.splice.budgeted_tokens``) without an engine: how it is spread over modules and tokens, and what
the scheduler side plans with it. The real engine: ``integration_tests/test_module_splice_quality.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_module_connector_pieces import module_scheduler, register

from kvreuse.errors import RequestParameterError
from kvreuse.modules.splice import Piece, budget_positions, budgeted_tokens
from kvreuse.modules.store import ModuleKey
from kvreuse.vllm.modules.common import ModuleCacheWorkerMeta, recompute_budget

NONE_EXACT = lambda piece: False  # noqa: E731


def test_the_budget_is_a_share_of_the_runs_module_tokens():
    run = [Piece("a", 0, 10, 10), Piece("b", 0, 20, 10)]
    chosen = budgeted_tokens(run, 0.25, NONE_EXACT, {})
    assert sum(len(indices) for indices in chosen.values()) == 5
    assert budgeted_tokens(run, 0.0, NONE_EXACT, {}) == {10: (), 20: ()}
    assert budgeted_tokens(run, 1.0, NONE_EXACT, {}) == {10: tuple(range(10)), 20: tuple(range(10))}


def test_without_scores_a_module_recomputes_its_first_tokens_and_later_modules_get_more():
    run = [Piece("a", 0, 10, 10), Piece("b", 0, 20, 10), Piece("c", 0, 30, 10)]
    chosen = budgeted_tokens(run, 0.3, NONE_EXACT, {})
    assert chosen == {10: (0,), 20: (0, 1, 2), 30: (0, 1, 2, 3, 4)}  # needs s / (s + i + 1)


def test_a_probed_modules_most_deviating_tokens_go_first():
    run = [Piece("a", 0, 10, 4)]
    chosen = budgeted_tokens(run, 0.5, NONE_EXACT, {"a": (0.0, 1.0, 0.0, 5.0)})
    assert chosen == {10: (1, 3)}


def test_an_exact_module_gets_nothing_and_its_tokens_share_goes_to_the_others():
    run = [Piece("h", 0, 0, 10), Piece("a", 0, 10, 10)]
    chosen = budgeted_tokens(run, 0.5, lambda piece: piece.name == "h", {})
    assert chosen == {0: (), 10: tuple(range(10))}  # half of 20 tokens, all of them in a


def test_the_budget_never_exceeds_the_inexact_tokens():
    run = [Piece("h", 0, 0, 10), Piece("a", 0, 10, 4)]
    assert budgeted_tokens(run, 1.0, lambda piece: piece.name == "h", {}) == {0: (), 10: (0, 1, 2, 3)}


def test_a_budget_outside_0_to_1_is_refused():
    with pytest.raises(ValueError, match="between 0 and 1"):
        budgeted_tokens([Piece("a", 0, 0, 4)], 1.5, NONE_EXACT, {})


def test_a_piece_that_starts_inside_its_module_keeps_the_chosen_tokens_left_in_it():
    pieces = [Piece("a", 3, 13, 7), Piece("b", 0, 20, 10)]  # a starts at 10, vLLM's hit ended at 13
    assert budget_positions(pieces, {10: (0, 1, 4, 9), 20: (2,)}) == (14, 19, 22)


def test_a_request_sets_its_own_budget_and_bad_values_name_the_problem():
    assert recompute_budget(None, 0.1) == 0.1 and recompute_budget({"other": 1}, 0.1) == 0.1
    assert recompute_budget({"kvreuse_recompute_budget": 0}, 0.1) == 0.0
    assert recompute_budget({"kvreuse_recompute_budget": 1}, 0.0) == 1.0
    for bad in (-0.1, 1.01, "0.2", True, None, float("nan")):
        with pytest.raises(RequestParameterError, match="kvreuse_recompute_budget must be a number from 0 to 1"):
            recompute_budget({"kvreuse_recompute_budget": bad}, 0.0)


def _budget_request(params, scored=True, rid="r", **engine):
    scheduler = module_scheduler(recompute_first=0, **engine)  # block size 4
    h, a = ModuleKey("h", 1), ModuleKey("a", 2)
    register(scheduler, (h, (1, 2, 3, 4)), (a, (5, 6, 7, 8, 9, 10)))  # both encoded alone
    if scored:  # a's token 4 deviates most
        scheduler.worker_reported(ModuleCacheWorkerMeta(scores={a: (1.0, 1.0, 1.0, 1.0, 9.0, 1.0)}))
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 0]  # h exact at 0, a at 4, question [10, 12)
    request = SimpleNamespace(
        request_id=rid, prompt_token_ids=prompt, num_tokens=len(prompt), kv_transfer_params=params, cache_salt=None
    )
    return scheduler, request


def test_the_scheduler_recomputes_the_budgeted_tokens_of_inexact_modules_only():
    scheduler, request = _budget_request({"kvreuse_recompute_budget": 0.2})  # 2 of the run's 10 tokens
    assert scheduler.matched_tokens(request, 0) == 10 - 2
    assert scheduler._plans["r"].recompute == (4, 8)  # a's first token and its most deviating one; none of h


def test_a_request_without_its_own_budget_takes_the_engines():
    scheduler, request = _budget_request(None, scored=False, recompute_budget=0.2)
    assert scheduler.matched_tokens(request, 0) == 10 - 2
    assert scheduler._plans["r"].recompute == (4, 5)  # unprobed: a's first tokens


def test_the_budgeted_choice_names_its_modules_blocks_in_vllms_prefix_cache(monkeypatch):
    from kvreuse.patches import vllm_0_32

    folded: dict = {}
    monkeypatch.setattr(vllm_0_32, "caches_prefixes", lambda manager: True)
    monkeypatch.setattr(vllm_0_32, "prefix_cache_hit", lambda manager, request: 0)
    monkeypatch.setattr(vllm_0_32, "fold_into_block_hashes", lambda c, m, r, first, keys: folded.update(keys) or True)
    names = {}
    for budget in (0.2, 0.3):
        scheduler, request = _budget_request({"kvreuse_recompute_budget": budget}, rid=f"r{budget}")
        scheduler.kv_cache_manager = object()
        scheduler.matched_tokens(request, 0)
        names[budget] = dict(folded)
    h = ModuleKey("h", 1).identity
    assert names[0.2][0] == names[0.3][0] == (h,)  # h's block: a plain splice's
    assert names[0.2][1] != names[0.3][1]  # a's blocks differ by its chosen tokens
    assert any(str(key).startswith("recompute_budget=") for key in names[0.2][1])
