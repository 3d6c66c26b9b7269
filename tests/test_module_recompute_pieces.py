"""Selective recompute of spliced module tokens (``modules.recompute_first``) without an engine: which tokens, what the
scheduler side offers vLLM and plans to load, how the worker's input wrapper moves a step's scheduled tokens
(``vllm_0_32.remap_scheduled_tokens``, on a fake model runner and block table), and attention masked by position.
The real engine: ``integration_tests/test_module_splice_quality.py``."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_module_connector_pieces import module_scheduler, register

from kvreuse.errors import RequestParameterError
from kvreuse.modules.encodings import Encoding, choose_encoding
from kvreuse.modules.splice import Piece, allot_first_tokens, first_tokens, true_positions
from kvreuse.modules.store import ModuleKey
from kvreuse.sparse import cpu_attention
from kvreuse.vllm.modules.common import ModuleCacheMetadata, recompute_first


def test_first_tokens_are_each_modules_first_k_of_the_run():
    pieces = [Piece("a", 0, 2, 5), Piece("b", 0, 7, 3), Piece("c", 2, 10, 4)]  # c: the engine's hit ended inside
    assert first_tokens(pieces, 0) == ()
    assert first_tokens(pieces, 2) == (2, 3, 7, 8)  # c's first two tokens are in the engine's hit already
    assert first_tokens(pieces, 3) == (2, 3, 4, 7, 8, 9, 10)
    assert first_tokens(pieces, 100) == tuple(range(2, 14))


def test_first_tokens_take_each_modules_own_count_where_allotted():
    pieces = [Piece("a", 0, 2, 5), Piece("b", 0, 7, 3), Piece("c", 2, 10, 4)]  # c's module starts at 8
    assert first_tokens(pieces, {2: 0, 7: 3, 8: 4}) == (7, 8, 9, 10, 11)  # c: its tokens 2, 3 of the first 4
    assert first_tokens(pieces, {7: 1}) == (7,)  # a module missing from the allotment recomputes none


def _exact(context, start, prompt, at):
    """Whether a module encoded at ``start`` after ``context`` is exact at position ``at`` of ``prompt``."""
    return choose_encoding([Encoding("m", "", tuple(context), start, True)], prompt, at, "").exact


def test_a_module_encoded_alone_is_exact_only_at_the_prompts_start():
    prompt = [5, 6, 7, 1, 2, 3]
    assert _exact((), 0, prompt, 0)
    assert not _exact((), 0, prompt, 3)  # moved: its tokens never saw 5, 6, 7


def test_a_module_encoded_after_the_prompts_own_tokens_before_it_is_exact():
    prompt = [5, 6, 7, 1, 2, 3]
    assert _exact((5, 6, 7), 3, prompt, 3)
    assert not _exact((5, 6, 8), 3, prompt, 3)  # another context of the same length
    assert not _exact((6, 7), 2, prompt, 3)  # a context that is only the prompt's tail


def test_recompute_first_gives_an_exact_modules_budget_to_the_other_modules():
    # header h (5 tokens, exact), documents a (6) and b (4): 2 per module is 6 tokens, all for a and b.
    run = [Piece("h", 0, 0, 5), Piece("a", 0, 5, 6), Piece("b", 0, 11, 4)]
    exact = {0}.__contains__

    def allot(k):
        return allot_first_tokens(run, k, lambda piece: exact(piece.module_start))

    assert allot(2) == {0: 0, 5: 3, 11: 3}
    assert allot(3) == {0: 0, 5: 5, 11: 4}  # 9 tokens: b is full at 4, a takes the other 5
    assert allot(4) == {0: 0, 5: 6, 11: 4}  # 12 tokens asked, a and b have 10: both recomputed whole
    assert allot(0) == {0: 0, 5: 0, 11: 0}


def test_recompute_first_spreads_a_remainder_one_token_each_in_prompt_order():
    run = [Piece("h", 0, 0, 4), Piece("a", 0, 4, 6), Piece("b", 0, 10, 6), Piece("c", 0, 16, 6)]
    counts = allot_first_tokens(run, 2, lambda piece: piece.name == "h")  # 8 tokens over three documents
    assert counts == {0: 0, 4: 3, 10: 3, 16: 2} and sum(counts.values()) == 8


def test_recompute_first_without_an_exact_module_is_k_per_module():
    run = [Piece("a", 0, 0, 6), Piece("b", 0, 6, 3), Piece("c", 0, 9, 20)]
    assert allot_first_tokens(run, 4, lambda piece: False) == {0: 4, 6: 3, 9: 4}  # b has only 3 tokens
    assert allot_first_tokens(run, 4, lambda piece: True) == {0: 0, 6: 0, 9: 0}  # all exact: nothing


def test_true_positions_move_the_first_scheduled_tokens_and_keep_the_rest():
    # Run [2, 14) with recompute (2, 3, 7, 8): vLLM counts start = 14 - 4 = 10 as computed, schedules 10 ...
    assert true_positions(10, 6, 10, (2, 3, 7, 8)) == [2, 3, 7, 8, 14, 15]
    assert true_positions(12, 4, 10, (2, 3, 7, 8)) == [7, 8, 14, 15]  # a later chunk: same map
    assert true_positions(20, 1, 10, (2, 3, 7, 8)) == [20]  # a decode
    assert true_positions(10, 3, 10, ()) == [10, 11, 12]


def test_a_request_sets_its_own_recompute_first_and_bad_values_name_the_problem():
    assert recompute_first(None, 4) == 4 and recompute_first({"other": 1}, 4) == 4
    assert recompute_first({"kvreuse_recompute_first": 0}, 4) == 0
    assert recompute_first({"kvreuse_recompute_first": 32}, 0) == 32
    assert recompute_first({"kvreuse_recompute_first": 2**31 - 1}, 0) == 2**31 - 1
    for bad in (-1, True, "8", 1.5, 2**31, 10**4000):  # past int32: vLLM's position tensors
        with pytest.raises(RequestParameterError, match="kvreuse_recompute_first must be a non-negative integer"):
            recompute_first({"kvreuse_recompute_first": bad}, 0)


def _splice_request(k, rid="r", **engine):
    """Modules a (6 tokens) and b (4) then a 2-token question; ``k``: the request's own recompute_first (``None``:
    none); ``engine``: the engine's modules settings."""
    scheduler = module_scheduler(**engine)  # block size 4
    a, b = ModuleKey("a", 1), ModuleKey("b", 2)
    # encoded after a context no prompt here holds: neither is exact anywhere (_place encodes them otherwise)
    register(scheduler, (a, (1, 2, 3, 4, 5, 6), (99,), ""), (b, (7, 8, 9, 10), (99,), ""))
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 0]  # run [0, 10), question [10, 12)
    params = None if k is None else {"kvreuse_recompute_first": k}
    request = SimpleNamespace(
        request_id=rid,
        prompt_token_ids=prompt,
        num_tokens=len(prompt),
        kv_transfer_params=params,
        cache_salt=None,
        block_hashes=[f"{rid}-block-{b}" for b in range(len(prompt) // 4)],
    )
    return scheduler, request


def _step(rid, scheduled, computed, *, new=True):
    """A step that schedules ``scheduled`` tokens of request ``rid``, vLLM having counted ``computed`` (the first
    step of a request: a new one; later chunks: a cached one)."""
    mine = SimpleNamespace(req_id=rid, num_computed_tokens=computed)
    return SimpleNamespace(
        scheduled_new_reqs=[mine] if new else [],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[] if new else [rid], num_computed_tokens=[] if new else [computed]
        ),
        num_scheduled_tokens={rid: scheduled},
    )


def test_the_scheduler_offers_the_run_less_the_recomputed_tokens_and_loads_all_of_it():
    scheduler, request = _splice_request(2)
    assert scheduler.matched_tokens(request, 0) == 10 - 4  # recompute 0, 1 (a) and 6, 7 (b)
    scheduler.allocated(request, [5, 6, 7], 6)
    (load,) = scheduler.build_metadata(_step("r", 6, 6)).loads  # 4 recomputed + the 2 question tokens
    assert [(p.name.name, p.prompt_start, p.length) for p in load.pieces] == [("a", 0, 6), ("b", 6, 4)]
    assert load.recompute == (0, 1, 6, 7) and load.start == 6
    assert load.slots == ((20, 21, 22, 23, 24, 25), (26, 27, 28, 29))


def test_recompute_0_plans_exactly_todays_splice():
    # A request's own 0 under the engine's default, and a request without its own under an engine set to 0.
    for k, engine in ((0, {}), (None, {"recompute_first": 0})):
        scheduler, request = _splice_request(k, **engine)
        assert scheduler.matched_tokens(request, 0) == 10
        scheduler.allocated(request, [5, 6, 7], 10)
        (load,) = scheduler.build_metadata(_step("r", 2, 10)).loads
        assert load.recompute == () and load.start == 0 and sum(p.length for p in load.pieces) == 10


def test_a_request_without_its_own_recompute_first_takes_the_engines():
    from kvreuse.modules.config import ModulesConfig

    default = ModulesConfig.load({}, {}).recompute_first
    assert default == 16  # LegoLink's first 16 tokens: the README's best measured point
    scheduler, request = _splice_request(None)
    assert scheduler.matched_tokens(request, 0) == 10 - min(6, default) - min(4, default)  # 0: all recomputed
    scheduler, request = _splice_request(None, recompute_first=2)
    assert scheduler.matched_tokens(request, 0) == 10 - 4
    assert scheduler._plans["r"].recompute == (0, 1, 6, 7)


def _place(scheduler, **contexts):
    """The workers report modules a and b of ``_splice_request`` stored, encoded after these context tokens."""
    keys = {"a": ModuleKey("a", 1), "b": ModuleKey("b", 2)}
    tokens = {"a": (1, 2, 3, 4, 5, 6), "b": (7, 8, 9, 10)}
    register(scheduler, *((keys[n], tokens[n], context, "") for n, context in contexts.items()))


def test_a_module_at_the_prompts_start_encoded_alone_is_not_recomputed_and_its_budget_goes_to_the_next():
    scheduler, request = _splice_request(2)
    _place(scheduler, a=(), b=())  # a is exact where it stands, b (at 6) is not
    assert scheduler.matched_tokens(request, 0) == 10 - 4
    assert scheduler._plans["r"].recompute == (6, 7, 8, 9)  # a's 2 tokens and b's 2: all of b


def test_a_module_encoded_after_the_prompts_own_tokens_before_it_is_not_recomputed():
    scheduler, request = _splice_request(1)
    _place(scheduler, a=(), b=(1, 2, 3, 4, 5, 6))  # both exact
    assert scheduler.matched_tokens(request, 0) == 10
    assert scheduler._plans["r"].recompute == ()


def test_a_module_encoded_elsewhere_is_recomputed_as_before():
    scheduler, request = _splice_request(2)
    _place(scheduler, a=(9, 9, 9), b=())  # neither where it stands
    assert scheduler.matched_tokens(request, 0) == 10 - 4
    assert scheduler._plans["r"].recompute == (0, 1, 6, 7)


def test_the_allotment_is_the_runs_wherever_vllms_prefix_hit_ended_in_it():
    scheduler, request = _splice_request(2)
    _place(scheduler, a=(), b=())
    assert scheduler.matched_tokens(request, 4) == 2 + 4 - 4  # a's last 2 tokens loaded, b's 4 recomputed
    assert scheduler._plans["r"].recompute == (6, 7, 8, 9)


def test_each_modules_allotted_count_names_its_blocks_in_vllms_prefix_cache(monkeypatch):
    from kvreuse.patches import vllm_0_32

    folded = {}
    monkeypatch.setattr(vllm_0_32, "caches_prefixes", lambda manager: True)
    monkeypatch.setattr(vllm_0_32, "prefix_cache_hit", lambda manager, request: 0)
    monkeypatch.setattr(vllm_0_32, "fold_into_block_hashes", lambda c, m, r, first, keys: folded.update(keys) or True)
    scheduler, request = _splice_request(2)
    scheduler.kv_cache_manager = object()
    _place(scheduler, a=(), b=())
    scheduler.matched_tokens(request, 0)
    a, b = ModuleKey("a", 1).identity, ModuleKey("b", 2).identity
    # Blocks of 4: a's block 0 holds KV exactly as a plain splice's (shared with one); b's count names its blocks.
    assert folded == {0: (a,), 1: (a, b, "recompute_first=4"), 2: (b, "recompute_first=4")}


def test_a_chunked_prefill_loads_the_run_as_vllm_allocates_it_and_recomputes_every_planned_token(monkeypatch):
    """vLLM may schedule fewer tokens than the rest of the prompt (other requests took the step's budget): the
    plan's KV must not depend on that (issue: a prompt's answer changed inside a busy batch). Each step loads what
    vLLM allocated and carries the recompute, so the worker moves whatever part of it vLLM scheduled; blocks vLLM
    cached whose recomputed tokens a later step computes leave vLLM's prefix cache."""
    from kvreuse.patches import vllm_0_32

    uncached, blocks = [], {"r": [5, 6]}
    monkeypatch.setattr(vllm_0_32, "request_block_ids", lambda manager, rid: blocks[rid])
    monkeypatch.setattr(vllm_0_32, "uncache_blocks", lambda manager, ids: uncached.extend(ids))
    monkeypatch.setattr(vllm_0_32, "caches_prefixes", lambda manager: False)  # nothing folded (no hashes here)
    scheduler, request = _splice_request(2)  # recompute 0, 1 (a) and 6, 7 (b): vLLM counts 6 computed
    scheduler.kv_cache_manager = object()
    assert scheduler.matched_tokens(request, 0) == 6
    scheduler.allocated(request, blocks["r"], 6)
    # Step 1: 1 token of 6 (blocks 5, 6 hold positions 0-7): positions 0-7 loaded, recompute position 0 computed.
    (load,) = scheduler.build_metadata(_step("r", 1, 6)).loads
    assert [(p.prompt_start, p.length) for p in load.pieces] == [(0, 6), (6, 2)]
    assert load.recompute == (0, 1, 6, 7) and load.start == 6
    assert uncached == [5]  # positions 1 (block 5) is recomputed later; block 6 is not full in vLLM's count yet
    # Step 2: 3 more; vLLM allocated block 7 (positions 8-11): the run's last 2 tokens load now.
    blocks["r"] = [5, 6, 7]
    (load,) = scheduler.build_metadata(_step("r", 3, 7, new=False)).loads
    assert [(p.prompt_start, p.length) for p in load.pieces] == [(8, 2)] and load.slots == ((28, 29),)
    assert load.recompute == (0, 1, 6, 7) and load.start == 6  # positions 1, 6, 7 are computed this step
    assert uncached == [5]
    # Step 3: the question; nothing is loaded or moved any more.
    assert scheduler.build_metadata(_step("r", 2, 10, new=False)).loads == []


def test_a_request_whose_hit_holds_blocks_recomputed_by_a_request_admitted_in_the_same_step_waits_a_step():
    scheduler, first = _splice_request(2, rid="first")
    assert scheduler.matched_tokens(first, 0) == 6
    scheduler.allocated(first, [5, 6, 7], 6)
    _, second = _splice_request(2, rid="second")
    second.block_hashes = first.block_hashes  # the same prompt and plan: the same folded hashes
    assert scheduler.matched_tokens(second, 8) is None  # vLLM's hit took first's blocks 0 and 1
    scheduler.build_metadata(_step("first", 6, 6))  # first computed its recomputed tokens: its blocks are final
    assert scheduler.matched_tokens(second, 8) == 2  # the run's last 2 tokens, after the hit


class FakeBlockTable:
    """vLLM's slot mapping, computed the simple way from a block table, 4 tokens per block."""

    def __init__(self, rows):
        self.rows = rows
        self.slot_mapping = None

    def compute_slot_mapping(self, num_reqs, query_start_loc, positions):
        starts = query_start_loc.tolist()
        slots = []
        for req in range(num_reqs):
            for pos in positions[starts[req] : starts[req + 1]].tolist():
                slots.append(self.rows[req][pos // 4] * 4 + pos % 4)
        self.slot_mapping = slots


def test_the_input_wrapper_moves_a_requests_scheduled_tokens_to_their_positions_ids_and_slots(monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from kvreuse.patches import vllm_0_32

    # Two requests: "d" decodes at position 20 (untouched); "r" has prompt [0, 12): run [0, 10) with (0, 1, 6, 7)
    # recomputed, so vLLM counted 6 tokens as computed and scheduled 6 from position 6.
    prompt = torch.arange(100, 112)
    token_ids = torch.zeros(2, 32, dtype=torch.int64)
    token_ids[1, :12] = prompt
    token_ids[0, 20] = 7
    table = FakeBlockTable([[9, 9, 9, 9, 9, 3], [5, 6, 7]])

    def original(self, scheduler_output, num_scheduled_tokens):  # what vLLM computes: positions in order
        starts = np.concatenate([[0], np.cumsum(num_scheduled_tokens)])
        self.query_start_loc = SimpleNamespace(np=starts, gpu=torch.tensor(starts))
        pos = np.concatenate(
            [np.arange(c, c + n) for c, n in zip(self.input_batch.num_computed_tokens_cpu, num_scheduled_tokens)]
        )
        self.positions[: len(pos)] = torch.tensor(pos)
        ids = token_ids[np.repeat([0, 1], num_scheduled_tokens), pos]
        self.input_ids.cpu[: len(pos)] = ids
        self.input_ids.gpu[: len(pos)] = ids
        self.input_batch.block_table.compute_slot_mapping(2, self.query_start_loc.gpu, self.positions[: len(pos)])
        return "logits indices"

    monkeypatch.setattr(GPUModelRunner, "_prepare_inputs", original)
    published = []
    worker = SimpleNamespace(masks_by_position=True)
    from kvreuse.vllm.modules.worker import ModuleWorker

    moves = lambda meta, req_ids, model: ModuleWorker.plan_step(worker, meta, req_ids, model)  # noqa: E731
    vllm_0_32.remap_scheduled_tokens(moves, published.append, true_positions)
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(
            req_id_to_index={"d": 0, "r": 1},
            req_ids=["d", "r"],
            num_computed_tokens_cpu=np.array([20, 6]),
            token_ids_cpu_tensor=token_ids,
            block_table=table,
            num_reqs=2,
        ),
        positions=torch.zeros(16, dtype=torch.int64),
        input_ids=SimpleNamespace(cpu=torch.zeros(16, dtype=torch.int64), gpu=torch.zeros(16, dtype=torch.int64)),
        get_model=lambda: None,
    )
    from kvreuse.vllm.modules.common import LoadSpec

    load = LoadSpec("r", (Piece("a", 0, 0, 10),), ((),), ((),), recompute=(0, 1, 6, 7), start=6)
    output = SimpleNamespace(kv_connector_metadata=ModuleCacheMetadata(loads=[load]), total_num_scheduled_tokens=7)
    assert GPUModelRunner._prepare_inputs(runner, output, np.array([1, 6])) == "logits indices"
    want = [20, 0, 1, 6, 7, 10, 11]
    assert runner.positions[:7].tolist() == want and published[-1].tolist() == want
    assert runner.input_ids.cpu[:7].tolist() == [7, 100, 101, 106, 107, 110, 111] == runner.input_ids.gpu[:7].tolist()
    assert table.slot_mapping == [3 * 4 + 0, 20, 21, 26, 27, 30, 31]
    # A step without recompute loads is vLLM's, untouched, and publishes no positions.
    output = SimpleNamespace(kv_connector_metadata=ModuleCacheMetadata(), total_num_scheduled_tokens=7)
    GPUModelRunner._prepare_inputs(runner, output, np.array([1, 6]))
    assert runner.positions[:7].tolist() == [20, 6, 7, 8, 9, 10, 11] and published[-1] is None
    # A worker whose attention cannot mask by position moves nothing (its loads fail over to vLLM's recompute).
    worker.masks_by_position = False
    output = SimpleNamespace(kv_connector_metadata=ModuleCacheMetadata(loads=[load]), total_num_scheduled_tokens=7)
    GPUModelRunner._prepare_inputs(runner, output, np.array([1, 6]))
    assert runner.positions[:7].tolist() == [20, 6, 7, 8, 9, 10, 11]


def test_attention_masked_by_position_is_causal_attention_in_the_tokens_order():
    torch.manual_seed(0)
    seq, heads, kv_heads, dim = 10, 4, 2, 8
    query = torch.randn(seq, heads, dim)
    keys, values = torch.randn(seq, kv_heads, dim), torch.randn(seq, kv_heads, dim)
    causal = cpu_attention.dense_causal(query, keys, values, 0.3)
    order = torch.tensor([3, 0, 9, 4, 1])  # a step's tokens out of order, with gaps
    got = cpu_attention.dense_at(query[order], keys, values, order, 0.3)
    assert torch.allclose(got, causal[order], atol=1e-6)


@pytest.mark.parametrize(
    ("backend", "modules", "warned"),
    [("FLASH_ATTN", {}, True), ("CUSTOM", {}, False), ("FLASH_ATTN", {"recompute_first": 0}, False)],
)
def test_the_worker_warns_at_start_when_the_default_recompute_cannot_run_on_its_backend(
    monkeypatch, caplog, backend, modules, warned
):
    """``modules.recompute_first`` is on by default; under a backend that does not mask by position every splice
    would fall back to computing its run, so the worker says so once, at start, naming the fix."""
    from kvreuse.vllm.modules.worker import ModuleWorker

    hf = {"model_type": "llama", "rope_theta": 10000.0, "hidden_size": 256, "num_attention_heads": 4, "head_dim": 64}
    model = SimpleNamespace(
        model="m", revision=None, tokenizer="m", tokenizer_revision=None, hf_config=SimpleNamespace(to_dict=lambda: hf)
    )
    worker = ModuleWorker(SimpleNamespace(additional_config={"kvreuse": {"modules": modules}}, model_config=model))
    monkeypatch.setattr(
        "kvreuse.patches.vllm_0_32.attention_backend_names", lambda config, layers: dict.fromkeys(layers, backend)
    )
    monkeypatch.setattr("kvreuse.patches.vllm_0_32.remap_scheduled_tokens", lambda *args: None)
    with caplog.at_level("WARNING", logger="vllm.plugins.kvreuse"):
        worker.register({"model.layers.0.self_attn.attn": torch.zeros(2, 4, 4, 128)})
    assert worker.masks_by_position == (backend == "CUSTOM")
    said = [r.getMessage() for r in caplog.records if "--attention-backend CUSTOM" in r.getMessage()]
    assert len(said) == warned
    if warned:
        assert "recompute_first=16" in said[0] and "FLASH_ATTN" in said[0] and "recompute_first 0" in said[0]
