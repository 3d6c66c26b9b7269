"""Shadow checks without an engine: pairing a spliced request with its full-prefill copy
(``kvreuse.modules.shadow``), the request parameter, and the scheduler side's counts. The real engine:
``integration_tests/test_module_calibrate.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_module_connector_pieces import module_scheduler

from kvreuse.errors import RequestParameterError
from kvreuse.modules.shadow import COMPARED_TOKENS, ShadowPairs
from kvreuse.vllm.modules.common import check_transfer_params, shadow_half


def test_a_pair_agrees_when_both_halves_give_the_same_tokens_as_far_as_the_shorter_goes():
    pairs = ShadowPairs()
    assert pairs.finished("p", False, [1, 2, 3, 4]) is None  # the first half waits
    assert pairs.finished("p", True, [1, 2, 3]) is True and len(pairs) == 0
    assert pairs.finished("q", True, [1, 2]) is None
    assert pairs.finished("q", False, [1, 5, 6]) is False


def test_only_the_first_tokens_of_a_half_are_kept_and_compared():
    pairs = ShadowPairs()
    pairs.finished("p", False, [1] * COMPARED_TOKENS + [2])
    assert pairs.finished("p", True, [1] * COMPARED_TOKENS + [3]) is True  # they differ after the compared tokens


def test_a_pair_with_nothing_to_compare_or_two_halves_of_one_kind_is_no_check():
    pairs = ShadowPairs()
    pairs.finished("p", False, [])
    assert pairs.finished("p", True, [1]) is None
    pairs.finished("q", True, [1])
    assert pairs.finished("q", True, [1]) is None


def test_halves_whose_other_half_never_finishes_are_forgotten_oldest_first():
    pairs = ShadowPairs(limit=2)
    for name in "abc":
        pairs.finished(name, False, [1])
    assert len(pairs) == 2
    assert pairs.finished("a", True, [1]) is None  # forgotten: waits again as a new first half
    assert pairs.finished("c", True, [1]) is True


def test_the_shadow_parameter_is_a_pair_name_and_a_role_and_bad_values_name_the_field():
    assert shadow_half(None) is None and shadow_half({"other": 1}) is None
    assert shadow_half({"kvreuse_shadow": {"pair": "x1", "full": True}}) == ("x1", True)
    check_transfer_params({"kvreuse_shadow": {"pair": "x1", "full": False}})
    for bad in (
        {"pair": "", "full": True},
        {"pair": "x" * 129, "full": True},
        {"pair": "x", "full": 1},
        {"pair": 3, "full": True},
        {"pair": "x"},
        "x",
    ):
        with pytest.raises(RequestParameterError, match="kvreuse_shadow must be an object") as refused:
            check_transfer_params({"kvreuse_shadow": bad})
        assert refused.value.field == "kv_transfer_params.kvreuse_shadow"


def _finished(scheduler, pair, full, tokens):
    request = SimpleNamespace(
        request_id=f"{pair}-{full}",
        kv_transfer_params={"kvreuse_shadow": {"pair": pair, "full": full}},
        output_token_ids=tokens,
    )
    scheduler.shadow_finished(request)


def test_the_scheduler_counts_checks_and_agreements_once_per_pair_until_taken():
    scheduler = module_scheduler()
    _finished(scheduler, "a", False, [1, 2])
    assert "shadow_checks" not in scheduler.take_stats()  # half a pair: nothing yet
    _finished(scheduler, "a", True, [1, 2])
    _finished(scheduler, "b", True, [1, 2])
    _finished(scheduler, "b", False, [1, 3])
    assert scheduler.take_stats() == {"shadow_checks": 2, "shadow_agreed": 1}
    assert scheduler.take_stats() == {}
    scheduler.shadow_finished(SimpleNamespace(request_id="r", kv_transfer_params=None, output_token_ids=[1]))
    assert scheduler.take_stats() == {}  # not a shadow half
