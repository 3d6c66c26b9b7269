"""Recompute chosen from the request's own context (``modules.recompute_blend``) without an engine: the choice's pure
parts (``kvreuse.modules.blend``: deviation, count, top tokens, attention by position), the worker's pass
(``kvreuse.vllm.modules.blend.choose``) over a fake model and paged cache, what the scheduler side plans, folds into
vLLM's prefix-cache hashes and refuses, and the request fields' bounds. The real engine against the offline reference:
``integration_tests/test_module_splice_quality.py``."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from test_module_connector_pieces import module_scheduler, register
from test_module_recompute_pieces import _place, _splice_request, _step

from kvreuse.errors import ConfigError, RequestParameterError
from kvreuse.modules.blend import attend_before, blend_count, kv_deviation, top_tokens
from kvreuse.modules.store import ModuleKey
from kvreuse.sparse import cpu_attention
from kvreuse.vllm.modules.common import (
    BlendSpec,
    LoadSpec,
    ModuleCacheWorkerMeta,
    blend_layers,
    check_transfer_params,
    recompute_blend,
)

# -- the pure parts -------------------------------------------------------------------------------------------------


def test_kv_deviation_is_cacheblends_distance_normalised_by_the_spliced_kv():
    spliced_k, spliced_v = torch.ones(3, 2, 4), 2 * torch.ones(3, 2, 4)  # squared norms 8 and 32 per token
    fresh_k, fresh_v = spliced_k.clone(), spliced_v.clone()
    fresh_k[1] += 1.0  # token 1's keys off by 1 in all 8 numbers: 8 / 8
    fresh_v[2, 0, 0] += 4.0  # token 2's values off by 4 in one number: 16 / 32
    assert kv_deviation(fresh_k, fresh_v, spliced_k, spliced_v).tolist() == [0.0, 1.0, 0.5]
    with pytest.raises(ValueError, match="one shape"):
        kv_deviation(fresh_k[:2], fresh_v, spliced_k, spliced_v)


def test_blend_count_is_the_rounded_share_of_the_runs_inexact_tokens():
    assert blend_count(0.2, 100) == 20 and blend_count(0.15, 10) == 2 and blend_count(0.0, 50) == 0
    assert blend_count(1.0, 37) == 37
    for share in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="between 0 and 1"):
            blend_count(share, 10)


def test_top_tokens_are_the_highest_scores_outside_the_fixed_ones_ties_to_the_earlier():
    scores = [0.5, 3.0, 1.0, 3.0, 0.1]
    assert top_tokens(scores, 2) == (1, 3)
    assert top_tokens(scores, 1) == (1,)  # a tie: the earlier token
    assert top_tokens(scores, 2, fixed=(1,)) == (2, 3)  # 1 is recomputed already: the union is 1, 2, 3
    assert top_tokens(scores, 9, fixed=(0,)) == (1, 2, 3, 4)  # fewer left than asked
    assert top_tokens(scores, 0) == ()
    with pytest.raises(ValueError, match="NaN"):
        top_tokens([0.1, math.nan], 1)
    with pytest.raises(ValueError, match="cannot choose"):
        top_tokens(scores, -1)


def test_attention_before_a_position_is_causal_attention_of_those_tokens():
    torch.manual_seed(0)
    query, keys, values = torch.randn(10, 4, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    causal = cpu_attention.dense_causal(query, keys, values, 0.3)
    order = torch.tensor([2, 5, 6, 9])  # a run's candidates: gaps where exact tokens sit
    got = attend_before(query[order], keys, values, order, 0.3)
    assert torch.allclose(got, causal[order], atol=1e-6)


# -- the worker's pass ------------------------------------------------------------------------------------------------


class FakeLayers:
    """A two-layer "model" whose steps are simple and known: embedding = token id in every number, keys and values
    = the hidden state plus the layer number, queries zero (uniform attention), a layer's output = its input plus the
    attention's; records what each step saw."""

    num_heads, num_kv_heads, head_dim, scale = 2, 1, 2, 1.0
    num_layers = 3

    def __init__(self):
        self.seen: list[tuple[int, list[int]]] = []

    def embed(self, ids):
        return ids.float()[:, None].repeat(1, 2)

    def attention_inputs(self, layer, positions, hidden, residual):
        self.seen.append((layer, positions.tolist()))
        kv = (hidden + layer)[:, None, :]
        return torch.zeros(len(hidden), 2, 2), kv, kv.clone(), hidden

    def finish_layer(self, layer, attended, residual):
        return residual + attended[:, 0, :], residual


def test_the_pass_writes_exact_kv_of_its_layers_and_adds_the_most_deviating_open_candidates():
    from kvreuse.vllm.modules.blend import choose, split_kv

    # Prompt positions 0-1 came from vLLM's prefix cache (slots 40, 41), the piece holds 2-7 (slots 12-17); the
    # module at 2 is exact, so the candidates are 3-7; 5 is recomputed already; 2 more to choose, after 1 layer.
    spec = LoadSpec(
        "r",
        (),
        ((12, 13, 14, 15, 16, 17),),
        ((),),
        recompute=(5,),
        start=5,
        blend=BlendSpec(2, 1, (3, 4, 5, 6, 7), (40, 41)),
    )
    caches = [torch.zeros(16, 1, 4, 4) for _ in range(3)]  # [blocks, kv_heads, block_size 4, 2 * head_dim]
    # Layer 0: the candidates' fresh values are their ids (30 .. 70), the others' 0; the queries are zero, so each
    # candidate at p averages the values of positions 0 .. p: 7.5, 14, 20, 25.71, 31.25. Its layer-1 keys and
    # values are then id + that + 1: 38.5, 55, 71, 86.71, 102.25. The spliced layer-1 KV, by slot:
    for slot, value in {13: 38.5, 14: 0.0, 15: 71.0, 16: 0.0, 17: 100.0}.items():
        caches[1][slot // 4, 0, slot % 4] = value
    writes = []

    def write(layer, keys, values, slots):
        writes.append((layer, slots.tolist()))
        for slot, k, v in zip(slots.tolist(), keys, values):
            caches[layer][slot // 4, 0, slot % 4] = torch.cat([k[0], v[0]])

    model = FakeLayers()
    chosen = choose(spec, [30, 40, 50, 60, 70], model, [split_kv(cache) for cache in caches], write)
    assert chosen == (4, 6)  # the farthest from their spliced layer-1 KV (by 55 and 86.7) besides 5 (fixed)
    assert writes == [(0, [13, 14, 15, 16, 17]), (1, [13, 14, 15, 16, 17])]  # fresh KV before each attention
    assert model.seen == [(0, [3, 4, 5, 6, 7]), (1, [3, 4, 5, 6, 7])]
    fresh = [float(caches[1][slot // 4, 0, slot % 4, 0]) for slot in range(13, 18)]
    assert fresh == pytest.approx([38.5, 55.0, 71.0, 86.0 + 5 / 7, 102.25])  # layer 1 is a full prefill's now
    assert float(caches[0][3, 0, 1, 0]) == 30.0 and float(caches[0][10, 0, 0, 0]) == 0.0  # context untouched


def test_the_pass_takes_every_open_candidate_without_running_when_the_count_covers_them():
    from kvreuse.vllm.modules.blend import choose

    spec = LoadSpec("r", (), ((4, 5, 6),), ((),), recompute=(1,), start=0, blend=BlendSpec(5, 1, (0, 1, 2), ()))
    model = FakeLayers()
    assert choose(spec, [1, 2, 3], model, [], lambda *a: None) == (0, 2)
    assert model.seen == []


# -- the scheduler side -----------------------------------------------------------------------------------------------


def _blend_request(share, layers=None, k=0, **engine):
    scheduler, request = _splice_request(k, **engine)
    request.kv_transfer_params["kvreuse_recompute_blend"] = share
    if layers is not None:
        request.kv_transfer_params["kvreuse_blend_layers"] = layers
    return scheduler, request


def test_the_scheduler_offers_the_run_less_the_blend_count_and_hands_the_worker_the_candidates():
    scheduler, request = _blend_request(0.3)  # run [0, 10): 10 inexact tokens, 3 chosen by the worker
    assert scheduler.matched_tokens(request, 0) == 10 - 3
    scheduler.allocated(request, [5, 6, 7], 7)
    (load,) = scheduler.build_metadata(_step("r", 5, 7)).loads  # 3 chosen + the 2 question tokens
    assert load.recompute == () and load.start == 7
    assert load.blend == BlendSpec(3, 1, tuple(range(10)), ())


def test_an_exact_module_is_no_candidate_and_the_union_with_first_tokens_adds_up():
    scheduler, request = _blend_request(0.5, layers=2, k=1)
    _place(scheduler, a=(), b=())  # a exact at the prompt's start: b's 4 are candidates
    assert scheduler.matched_tokens(request, 0) == 10 - 2 - 2  # recompute_first: a's 1 and b's 1 to b (6, 7); 2 more
    scheduler.allocated(request, [5, 6, 7], 6)
    (load,) = scheduler.build_metadata(_step("r", 6, 6)).loads
    assert load.recompute == (6, 7) and load.start == 6
    assert load.blend == BlendSpec(2, 2, (6, 7, 8, 9), ())


def test_a_hit_past_the_first_inexact_token_computes_the_rest_of_the_run():
    scheduler, request = _blend_request(0.3)
    assert scheduler.matched_tokens(request, 4) == 0  # the choice was over the whole run: never over a part of it
    scheduler, request = _blend_request(0.5)
    _place(scheduler, a=(), b=())
    assert scheduler.matched_tokens(request, 4) == 2 + 4 - 2  # the hit holds exact tokens only: a's last 2 loaded
    scheduler.allocated(request, [5, 6, 7], 4)
    (load,) = scheduler.build_metadata(_step("r", 4, 8)).loads
    assert load.blend == BlendSpec(2, 1, (6, 7, 8, 9), (20, 21, 22, 23))  # block 5's slots: the context


def test_an_identical_request_whose_hit_ends_inside_the_run_recomputes_what_the_first_one_chose(monkeypatch):
    """The first request's blocks hold its choice; a request with the same run and setting whose prefix hit ends
    inside the run recomputes the positions the first one chose in the rest (from the worker's report), after a pass
    over the rest's candidates without a choice of its own; another setting finds no such blocks (computed)."""
    from kvreuse.patches import vllm_0_32

    hits = {"r": 0, "s": 4}
    monkeypatch.setattr(vllm_0_32, "caches_prefixes", lambda manager: True)
    monkeypatch.setattr(vllm_0_32, "prefix_cache_hit", lambda manager, request: hits[request.request_id])
    monkeypatch.setattr(vllm_0_32, "fold_into_block_hashes", lambda *args: True)
    monkeypatch.setattr(vllm_0_32, "request_block_ids", lambda manager, rid: [5, 6, 7])
    scheduler, request = _blend_request(0.3)  # 10 inexact tokens, 3 chosen
    scheduler.kv_cache_manager = object()
    assert scheduler.matched_tokens(request, 0) == 7
    scheduler.allocated(request, [5, 6, 7], 7)
    scheduler.build_metadata(_step("r", 5, 7))
    scheduler.worker_reported(ModuleCacheWorkerMeta(blended={"r": (1, 5, 8)}))
    scheduler.finished("r")
    again = SimpleNamespace(**{**vars(request), "request_id": "s"})
    assert scheduler.matched_tokens(again, 0) is None  # folded: vLLM looks it up again and finds blocks 0 (4 tokens)
    assert scheduler.matched_tokens(again, 4) == 6 - 2  # the run's rest less what the first request chose there
    plan = scheduler._plans["s"]
    assert plan.recompute == (5, 8) and plan.blend == BlendSpec(0, 1, (4, 5, 6, 7, 8, 9), ())
    scheduler.allocated(again, [5, 6, 7], 4)
    (load,) = scheduler.build_metadata(_step("s", 4, 8)).loads
    assert load.start == 8 and load.blend == BlendSpec(0, 1, (4, 5, 6, 7, 8, 9), (20, 21, 22, 23))
    hits["t"] = 4
    other = SimpleNamespace(
        **{**vars(request), "request_id": "t", "kv_transfer_params": {"kvreuse_recompute_blend": 0.4}}
    )
    scheduler.matched_tokens(other, 0)
    assert scheduler.matched_tokens(other, 4) == 0  # no choice recorded for this run and setting: computed


def test_a_chunked_prefill_loads_a_blended_run_plainly_and_keeps_its_blocks_out_of_the_prefix_cache(monkeypatch):
    """The pass runs over every spliced token with the prompt before it in the step that loads the run: where vLLM
    schedules less than the rest of the prompt there, the run's first tokens are loaded plainly (vLLM computes the
    rest at its own positions), and the request's blocks from its first candidate on leave vLLM's prefix cache as
    they fill, to the end of the request (their hashes name the blend's plan, which they do not hold); a request
    admitted in the same step whose hit holds one of its blocks waits a step."""
    from kvreuse.patches import vllm_0_32

    uncached, blocks = [], {"r": [5, 6, 7]}
    monkeypatch.setattr(vllm_0_32, "request_block_ids", lambda manager, rid: blocks[rid])
    monkeypatch.setattr(vllm_0_32, "uncache_blocks", lambda manager, ids: uncached.extend(ids))
    monkeypatch.setattr(vllm_0_32, "caches_prefixes", lambda manager: False)  # nothing folded (no hashes here)
    scheduler, request = _blend_request(0.3)  # run [0, 10): 3 chosen by the worker, vLLM counts 7 computed
    scheduler.kv_cache_manager = object()
    assert scheduler.matched_tokens(request, 0) == 7
    scheduler.allocated(request, blocks["r"], 7)
    _, second = _blend_request(0.3)
    second.request_id, second.block_hashes = "second", request.block_hashes
    assert scheduler.matched_tokens(second, 4) is None  # its hit holds the first's block 0: it waits a step
    # Step 1: 2 of the 5 tokens left: no pass; positions 0-6 loaded as stored, none recomputed or blended.
    (load,) = scheduler.build_metadata(_step("r", 2, 7)).loads
    assert [(p.prompt_start, p.length) for p in load.pieces] == [(0, 6), (6, 1)]
    assert load.recompute == () and load.start == 0 and load.blend is None
    assert uncached == [5, 6]  # blocks full after the step (positions 0-7) that hold the plainly loaded candidates
    # Steps 2 and 3: the rest of the prompt, then a decoded token; nothing is loaded, each block leaves as it fills.
    assert scheduler.build_metadata(_step("r", 3, 9, new=False)).loads == []
    assert uncached == [5, 6, 7]
    blocks["r"] = [5, 6, 7, 8]
    assert scheduler.build_metadata(_step("r", 1, 12, new=False)).loads == []
    assert uncached == [5, 6, 7]  # block 8 is not full yet
    assert scheduler.finished_params("r") is None  # no pass ran
    scheduler.finished("r")
    assert "r" not in scheduler._loading


def test_blend_layers_past_the_models_compute_every_inexact_token():
    scheduler, request = _blend_request(0.1, layers=4)  # the fake model has 4 layers
    assert scheduler.matched_tokens(request, 0) == 0


def test_the_setting_and_the_whole_run_name_the_blocks_with_inexact_tokens(monkeypatch):
    from kvreuse.patches import vllm_0_32

    folded: dict[int, tuple[str, ...]] = {}
    monkeypatch.setattr(vllm_0_32, "caches_prefixes", lambda manager: True)
    monkeypatch.setattr(vllm_0_32, "prefix_cache_hit", lambda manager, request: 0)
    monkeypatch.setattr(vllm_0_32, "fold_into_block_hashes", lambda c, m, r, first, keys: folded.update(keys) or True)

    def keys(share, layers=1, b_version=2):
        folded.clear()
        scheduler, request = _blend_request(share, layers)
        scheduler.kv_cache_manager = object()
        if b_version != 2:  # b encoded again: another entry of the same tokens
            scheduler.worker_reported(ModuleCacheWorkerMeta(dropped={ModuleKey("b", 2)}))
            register(scheduler, (ModuleKey("b", b_version), (7, 8, 9, 10), (99,), ""))
        _place(scheduler, a=())  # a exact: its block 0 is a plain splice's
        scheduler.matched_tokens(request, 0)
        return dict(folded)

    plain = keys(0.0)
    blended = keys(0.5)
    assert blended[0] == plain[0] == (ModuleKey("a", 1).identity,)  # only exact tokens: shared with plain splices
    assert all(blended[b] != plain[b] for b in (1, 2))  # b's tokens: named by the choice
    assert keys(0.5) == blended  # the same run and setting: the same names
    assert keys(0.25)[1] != blended[1] and keys(0.5, layers=2)[1] != blended[1]
    # another entry of b changes the names of every block holding a candidate, a's too (it is one run)
    other = keys(0.5, b_version=3)
    assert other[1] != blended[1] and other[2] != blended[2]


def test_an_engine_that_cannot_run_the_pass_refuses_the_setting_at_start_and_computes_such_requests():
    from kvreuse.vllm.modules.scheduler import ModuleScheduler

    base = module_scheduler().vllm_config
    parallel = SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1)
    config = SimpleNamespace(**{**vars(base), "parallel_config": parallel})
    scheduler = ModuleScheduler(config)
    assert "tensor parallel 2" in scheduler.blend_refusal
    _, request = _blend_request(0.2)
    register(scheduler, (ModuleKey("a", 1), (1, 2, 3, 4, 5, 6), (99,), ""))
    assert scheduler.matched_tokens(request, 0) == 0  # computed in full, never spliced without the asked recompute
    config.additional_config = {"kvreuse": {"modules": {"recompute_blend": 0.2}}}
    with pytest.raises(ConfigError, match=r"modules.recompute_blend \(0.2\) needs one worker"):
        ModuleScheduler(config)


# -- the request fields ------------------------------------------------------------------------------------------------


def test_a_request_sets_its_own_blend_and_bad_values_name_the_field():
    assert recompute_blend(None, 0.1) == 0.1 and recompute_blend({"kvreuse_recompute_blend": 1}, 0.0) == 1.0
    tiny = recompute_blend({"kvreuse_recompute_blend": 5e-324}, 0.0)  # a subnormal share: no token at all
    assert tiny == 5e-324 and blend_count(tiny, 10**6) == 0
    assert blend_layers({}, 3) == 3 and blend_layers({"kvreuse_blend_layers": 1024}, 1) == 1024
    for bad in (-0.1, 1.01, math.nan, math.inf, -math.inf, True, "0.2", 10**4000, None):
        with pytest.raises(RequestParameterError, match="kvreuse_recompute_blend must be a number from 0 to 1") as e:
            check_transfer_params({"kvreuse_recompute_blend": bad})
        assert e.value.field == "kv_transfer_params.kvreuse_recompute_blend"
    for bad in (0, -1, 1025, 2**63, 10**4000, 1.0, math.nan, math.inf, False, "2"):
        with pytest.raises(RequestParameterError, match="kvreuse_blend_layers must be an integer from 1 to 1024") as e:
            check_transfer_params({"kvreuse_blend_layers": bad})
        assert e.value.field == "kv_transfer_params.kvreuse_blend_layers"
