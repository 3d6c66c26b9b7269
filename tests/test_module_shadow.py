"""Shadow checks without an engine: pairing a spliced request with its full-prefill copy
(``kvreuse.modules.shadow``), the request parameter, and the scheduler side's counts. The real engine:
``integration_tests/test_module_calibrate.py``."""

from __future__ import annotations

import asyncio
import itertools
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


def test_a_pair_compared_after_a_normaliser_agrees_where_the_texts_do():
    from kvreuse.modules.agreement import Normaliser, same_output

    texts = {(1, 2): "Amber.\nMore", (3, 4): "amber.\nOther", (5, 6): "Teal."}
    answer = Normaliser.parse(["first-line", "case"])
    seen = []

    def same(full, served):
        seen.append((tuple(full), tuple(served)))
        return same_output(full, served, answer, lambda ids: texts[tuple(ids)])

    pairs = ShadowPairs(same=same)
    pairs.finished("p", False, [3, 4])
    assert pairs.finished("p", True, [1, 2]) is True  # other tokens, the same first line after case folding
    pairs.finished("q", True, [1, 2])
    assert pairs.finished("q", False, [5, 6]) is False
    assert seen == [((1, 2), (3, 4)), ((1, 2), (5, 6))]  # the full half first, whichever finished first


def test_the_engines_shadow_normaliser_is_a_json_list_of_steps_checked_at_start():
    from kvreuse.errors import ConfigError
    from kvreuse.modules.config import ModulesConfig

    assert ModulesConfig.load({}, {}).shadow_normaliser() is None
    found = ModulesConfig.load({"shadow_normalise": '["first-line", "case"]'}, {}).shadow_normaliser()
    assert found is not None and found("  Amber.\nx") == "amber."
    for bad, said in (
        ("first-line", "must be a JSON list of normaliser steps"),
        ('{"a": 1}', "must be a JSON list of normaliser steps, got dict"),
        ('["lowercase"]', "unknown normaliser step 'lowercase'"),
    ):
        with pytest.raises(ConfigError, match=said):
            ModulesConfig.load({"shadow_normalise": bad}, {})


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


def _finished(scheduler, pair, full, tokens, spliced=True):
    """Half ``pair`` finished with ``tokens``; a served half took KV from modules where ``spliced``."""
    if spliced and not full:
        scheduler._spliced.add(f"{pair}-{full}")  # as ModuleScheduler.allocated records a load
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


def test_a_pair_whose_served_half_spliced_nothing_is_no_check():
    scheduler = module_scheduler()
    _finished(scheduler, "a", False, [1, 2], spliced=False)  # no module in its prompt, or every token recomputed
    _finished(scheduler, "a", True, [1, 2])
    assert scheduler.take_stats() == {}


def _params(**fields):
    from vllm import SamplingParams

    return SamplingParams(**{"temperature": 0.0, "max_tokens": 64, **fields})


def test_the_server_pairs_every_nth_request_that_can_be_checked():
    from kvreuse.vllm.modules import shadow

    shadow._server_sent = itertools.count()
    pairs = [shadow.server_halves(_params(), every=3) for _ in range(7)]
    assert [p is not None for p in pairs] == [True, False, False, True, False, False, True]
    served, full = pairs[0]
    assert shadow_half(served.extra_args["kv_transfer_params"]) == (
        shadow_half(full.extra_args["kv_transfer_params"])[0],
        False,
    )
    assert full.skip_reading_prefix_cache and full.max_tokens == 16 and not served.skip_reading_prefix_cache
    assert served.max_tokens == 64  # the served request is unchanged but for its half's name


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 0.7},  # sampled without a seed: the halves may differ by chance
        {"n": 2, "temperature": 0.7, "seed": 1},
        {"skip_reading_prefix_cache": True},
        {"extra_args": {"kv_transfer_params": {"kvreuse_module": "doc", "kvreuse_context": 0}}},
        {"extra_args": {"kv_transfer_params": {"kvreuse_shadow": {"pair": "x", "full": False}}}},
    ],
)
def test_the_server_leaves_requests_that_cannot_be_checked_alone_and_does_not_count_them(fields):
    from kvreuse.vllm.modules import shadow

    shadow._server_sent = itertools.count()
    assert shadow.server_halves(_params(**fields), every=1) is None
    assert shadow.server_halves(_params(temperature=0.7, seed=3), every=1) is not None  # seeded: the same path


def test_the_api_servers_generate_sends_the_copy_in_the_background_and_yields_the_served_request_only(monkeypatch):
    from vllm.v1.engine.async_llm import AsyncLLM

    from kvreuse.patches import vllm_0_32

    sent = []

    async def generate(self, prompt, sampling_params, request_id, *args, **kwargs):
        sent.append((request_id, sampling_params))
        yield f"out-{request_id}"

    monkeypatch.setattr(AsyncLLM, "generate", generate)
    vllm_0_32.shadow_requests(lambda config, params: (f"served-{params}", f"full-{params}") if config else None)
    engine = SimpleNamespace(vllm_config=True)

    async def run(engine):
        outputs = [out async for out in AsyncLLM.generate(engine, "prompt", "p", "r1")]
        await asyncio.gather(*vllm_0_32._SHADOW_TASKS)
        return outputs

    assert asyncio.run(run(engine)) == ["out-r1"]
    assert sorted(sent) == [("r1", "served-p"), ("r1-kvreuse-shadow", "full-p")]
    sent.clear()
    assert asyncio.run(run(SimpleNamespace(vllm_config=False))) == ["out-r1"]  # off: the request alone
    assert sent == [("r1", "p")]
