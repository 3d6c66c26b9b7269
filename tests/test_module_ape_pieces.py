"""APE over spliced modules (``modules.ape_temperature`` / ``ape_scale``, ``kvreuse_ape``) without an engine: the
settings and the request parameter, the attention math against a small reference of this file's own, the sparse
backend's routing of a batch that mixes requests with and without APE, what the scheduler side sends the worker
and the worker the backend. The real engine: ``integration_tests/test_module_splice_quality.py``."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from numerics import gamma
from test_module_connector_pieces import module_scheduler, register

from kvreuse.errors import ConfigError, RequestParameterError
from kvreuse.modules.config import ModulesConfig
from kvreuse.modules.store import ModuleKey
from kvreuse.sparse import cpu_attention
from kvreuse.sparse.ape import OFF, ApeSpans, ape_attend
from kvreuse.sparse.config import SparseConfig
from kvreuse.sparse.paged import PagedBatch, SparseAttention
from kvreuse.vllm.modules.common import ModuleCacheMetadata, ape_setting


# -- settings -----------------------------------------------------------------------------------------------------
def test_ape_settings_default_to_off_and_bad_values_name_the_setting():
    assert ModulesConfig.load({}, environ={}).ape == (1.0, 1.0)
    assert ModulesConfig.load({"ape_temperature": 0.8, "ape_scale": 2}, environ={}).ape == (0.8, 2.0)
    assert ModulesConfig.load({}, environ={"KVREUSE_MODULES_APE_TEMPERATURE": "0.5"}).ape == (0.5, 1.0)
    for bad in ({"ape_temperature": 0}, {"ape_scale": -1.0}, {"ape_temperature": float("inf")}, {"ape_scale": 1e300}):
        with pytest.raises(ConfigError, match="ape_"):
            ModulesConfig.load(bad, environ={})


def test_a_request_sets_its_own_ape_and_bad_values_name_the_parameter():
    assert ape_setting(None, (0.8, 1.0)) == (0.8, 1.0) and ape_setting({"other": 1}, (1.0, 1.0)) == (1.0, 1.0)
    assert ape_setting({"kvreuse_ape": {"temperature": 0.8, "scale": 2}}, (1.0, 1.0)) == (0.8, 2.0)
    assert ape_setting({"kvreuse_ape": {"scale": 0.5}}, (0.8, 1.0)) == (1.0, 0.5)  # a key left out is 1
    assert ape_setting({"kvreuse_ape": {}}, (0.8, 1.0)) == (1.0, 1.0)  # a request turns the engine's APE off
    for bad in (0.8, {"temp": 0.8}, {"temperature": 0}, {"scale": "2"}, {"temperature": True}):
        with pytest.raises(RequestParameterError, match="kvreuse_ape"):
            ape_setting({"kvreuse_ape": bad}, (1.0, 1.0))


@pytest.mark.parametrize(
    "ape, field",
    [
        ({"temperature": 1e-300}, "temperature"),  # issue 26: 1 / T overflowed a float and ended the engine
        ({"temperature": 5e-324}, "temperature"),  # issue 26: finite as a setting, NaN KV as arithmetic
        ({"temperature": 1e-38, "scale": 1e308}, "temperature"),
        ({"scale": 1e308}, "scale"),
        ({"scale": 5e-324}, "scale"),
        ({"temperature": 2.0**-8 * 0.99}, "temperature"),
        ({"temperature": 2.0**8 * 1.01}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"scale": float("inf")}, "scale"),
    ],
)
def test_ape_factors_past_what_fp32_attention_holds_are_refused_naming_the_field(ape, field):
    with pytest.raises(RequestParameterError, match=f"kvreuse_ape: {field} must be a number from") as refused:
        ape_setting({"kvreuse_ape": ape}, (1.0, 1.0))
    assert refused.value.field == f"kv_transfer_params.kvreuse_ape.{field}"


def test_ape_factors_at_their_bounds_keep_attention_finite_in_every_dtype():
    """At the bounds (T = 2**-8 and 2**8, S = 2**-126 and 2**126) APE's late queries attend in fp32 and give a
    finite output for bf16 and fp16 caches, with keys as large as fp16 holds."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for temperature, scale in ((2.0**-8, 2.0**126), (2.0**8, 2.0**-126)):
            spans = ApeSpans(
                ((2, 10),), *ape_setting({"kvreuse_ape": {"temperature": temperature, "scale": scale}}, OFF)
            )
            g = torch.Generator().manual_seed(0)
            keys = (torch.randn(12, 1, 8, generator=g) * 60000).clamp(-65504, 65504).to(dtype)
            values = torch.randn(12, 1, 8, generator=g).to(dtype)
            query = (torch.randn(2, 2, 8, generator=g) * 100).to(dtype)
            out = ape_attend(query, keys, values, torch.tensor([10, 11]), spans, 8**-0.5)
            assert out.dtype == dtype and bool(torch.isfinite(out).all())


# -- the attention ------------------------------------------------------------------------------------------------
def reference_ape(query, keys, values, positions, spans, scale):
    """APE written out in float64, one query and one head at a time: logits ``q.k * scale`` (divided by T and plus
    log S on module keys for a query at or after the modules), masked to the keys at or before the query."""
    q_len, q_heads, _ = query.shape
    group = q_heads // keys.shape[1]
    out = torch.empty(query.shape, dtype=torch.float64)
    module = torch.zeros(keys.shape[0], dtype=torch.bool)
    for start, end in spans.ranges:
        module[start:end] = True
    for i in range(q_len):
        pos = int(positions[i])
        for h in range(q_heads):
            k, v = keys[: pos + 1, h // group].double(), values[: pos + 1, h // group].double()
            logits = (k @ query[i, h].double()) * scale
            if pos >= spans.after:
                logits = torch.where(module[: pos + 1], logits / spans.temperature + math.log(spans.scale), logits)
            out[i, h] = torch.softmax(logits, 0) @ v
    return out


def bound(query, keys, values, scale, spans):
    """What float32 rounding may move an output by (tests/numerics.py): each logit's dot product (``d`` terms,
    at most ``|q| |k| scale / T``) moves the softmax weights by that relatively, and the weighted sum over the keys
    (``len(keys)`` terms) adds its own; outputs are at most ``max |v|``. Twice over, for two implementations."""
    logit = float(query.norm(dim=-1).max() * keys.norm(dim=-1).max()) * scale / min(spans.temperature, 1.0)
    dim = query.shape[-1]
    return 2 * (2 * gamma(dim) * logit + gamma(len(keys))) * float(values.abs().max())


@pytest.mark.parametrize("temperature, scale", [(0.8, 1.0), (0.5, 3.0), (1.0, 0.25)])
def test_ape_attend_is_the_reference_on_module_keys_and_plain_attention_before_them(temperature, scale):
    torch.manual_seed(0)
    seq, heads, kv_heads, dim, sm = 40, 6, 2, 16, 0.25
    query = torch.randn(seq, heads, dim)
    keys, values = torch.randn(seq, kv_heads, dim), torch.randn(seq, kv_heads, dim)
    spans = ApeSpans(((5, 14), (14, 30)), temperature, scale)
    positions = torch.tensor([3, 8, 29, 30, 31, 39])  # two recomputed tokens inside the run, then the question
    got = ape_attend(query[positions], keys, values, positions, spans, sm)
    want = reference_ape(query[positions], keys, values, positions, spans, sm)
    assert (got.double() - want).abs().max() <= bound(query, keys, values, sm, spans)
    # Queries inside the run attend plainly: what attention masked by position gives them.
    plain = cpu_attention.dense_at(query[positions[:3]], keys, values, positions[:3], sm)
    assert (got[:3] - plain).abs().max() <= bound(query, keys, values, sm, spans)
    # The control: APE moves the question's outputs by far more than rounding.
    far = cpu_attention.dense_at(query[positions[3:]], keys, values, positions[3:], sm)
    assert (got[3:] - far).abs().max() > 100 * bound(query, keys, values, sm, spans)


def test_ape_with_temperature_1_and_scale_1_is_plain_attention():
    torch.manual_seed(1)
    query, keys, values = torch.randn(12, 4, 8), torch.randn(12, 2, 8), torch.randn(12, 2, 8)
    spans = ApeSpans(((2, 9),), 1.0, 1.0)
    positions = torch.arange(12)
    got = ape_attend(query, keys, values, positions, spans, 0.3)
    plain = cpu_attention.dense_causal(query, keys, values, 0.3)
    assert (got - plain).abs().max() <= bound(query, keys, values, 0.3, spans)


# -- the backend: a batch that mixes requests with and without APE ------------------------------------------------
BLOCK = 4


def paged(keys, values, tables):
    """A paged cache holding each sequence's ``keys``/``values[n, kv, d]`` in the blocks of its table row."""
    num_blocks = 1 + max(max(row) for row in tables)
    key_cache = torch.zeros(num_blocks, BLOCK, *keys[0].shape[1:])
    value_cache = torch.zeros_like(key_cache)
    for k, v, row in zip(keys, values, tables):
        for t in range(len(k)):
            key_cache[row[t // BLOCK], t % BLOCK], value_cache[row[t // BLOCK], t % BLOCK] = k[t], v[t]
    return key_cache, value_cache


def batch_of(q_lens, seq_lens, tables, ape=None):
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    width = max(len(r) for r in tables)
    table = torch.tensor([r + [0] * (width - len(r)) for r in tables], dtype=torch.int32)
    return PagedBatch(
        query_start_loc=starts,
        query_start_loc_cpu=starts,
        seq_lens=torch.tensor(seq_lens),
        seq_lens_cpu=torch.tensor(seq_lens),
        block_table=table,
        slot_mapping=torch.zeros(int(starts[-1]), dtype=torch.int64),
        num_actual_tokens=int(starts[-1]),
        max_seq_len=max(seq_lens),
        ape=ape,
    )


def test_the_backend_applies_ape_to_its_requests_only_and_never_decodes_them_with_dipr():
    """Request 0 prefills its question (6 tokens) after a spliced run, request 1 is a plain prefill, requests 2
    and 3 decode after 40 tokens in a sparse layer (beta 0: DIPR prunes), 3 with APE. Rows without APE are what
    the same batch gives without any APE, bit for bit (same code path); rows with APE are ``ape_attend``'s over the
    request's tokens, DIPR's pruning left out."""
    torch.manual_seed(2)
    heads, kv_heads, dim = 4, 2, 8
    lens = [26, 9, 40, 40]
    keys = [torch.randn(n, kv_heads, dim) for n in lens]
    values = [torch.randn(n, kv_heads, dim) for n in lens]
    tables = [list(range(0, 7)), list(range(7, 10)), list(range(10, 20)), list(range(20, 30))]
    key_cache, value_cache = paged(keys, values, tables)
    q_lens = [6, 9, 1, 1]
    query = torch.randn(sum(q_lens), heads, dim)
    spans = ApeSpans(((4, 20),), 0.8, 1.5)
    config = SparseConfig(beta=0.0, dense_layers=0, sink=1, local=1, min_context=8)
    attention = SparseAttention(heads, kv_heads, dim, BLOCK, 0.35, config)
    sketch = attention.allocate_sketch(key_cache.shape[0], "cpu")
    from kvreuse.kernels.key_sketch import sketch_written_reference

    sketch_written_reference(key_cache, sketch, torch.arange(key_cache.shape[0] * BLOCK))
    plain, mixed = torch.zeros_like(query), torch.zeros_like(query)
    attention.attend(3, query, key_cache, value_cache, sketch, batch_of(q_lens, lens, tables), plain)
    with_ape = batch_of(q_lens, lens, tables, ape=(spans, None, None, spans))
    attention.attend(3, query, key_cache, value_cache, sketch, with_ape, mixed)
    assert torch.equal(mixed[6:16], plain[6:16])  # requests 1 and 2: same operations, same order
    tolerance = bound(query, keys[0], values[0], 0.35, spans)
    first = ape_attend(query[:6], keys[0], values[0], torch.arange(20, 26), spans, 0.35)
    assert (mixed[:6] - first).abs().max() <= tolerance
    last = ape_attend(query[16:], keys[3], values[3], torch.tensor([39]), spans, 0.35)
    assert (mixed[16:] - last).abs().max() <= tolerance
    dense = cpu_attention.dense_decode(query[16], key_cache, value_cache, torch.tensor(tables[3]), 40, 0.35)
    assert (plain[16] - dense).abs().max() > 100 * tolerance  # the control: DIPR pruned request 3 without APE


# -- the scheduler side and the worker side -----------------------------------------------------------------------
@pytest.fixture(autouse=True)
def kvreuse_backend_on_cpu(monkeypatch):
    """The engines these tests stand for run kvreuse's backend over vLLM's CPU build (which applies APE)."""
    monkeypatch.setenv("KVREUSE_SPARSE_CPU_BACKEND", "1")


def _request(params, rid="r"):
    # block size 4, no prefix cache; recompute_first 0 (its default, 16, would recompute these short modules whole)
    scheduler = module_scheduler(recompute_first=0)
    header, a, b = ModuleKey("header", 0), ModuleKey("a", 1), ModuleKey("b", 2)
    register(scheduler, (header, (1, 2, 3)), (a, (4, 5, 6, 7, 8, 9)), (b, (10, 11, 12, 13)))
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 0, 0]  # header [0, 3), a [3, 9), b [9, 13), question
    request = SimpleNamespace(
        request_id=rid, prompt_token_ids=prompt, num_tokens=len(prompt), kv_transfer_params=params, cache_salt=None
    )
    return scheduler, request


def _step(scheduled):
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens=scheduled,
    )


def test_the_scheduler_sends_the_spliced_modules_less_the_shared_prefix_every_step_until_the_request_ends():
    scheduler, request = _request({"kvreuse_ape": {"temperature": 0.8}})
    assert scheduler.matched_tokens(request, 0) == 13  # the splice itself is unchanged
    scheduler.allocated(request, [5, 6, 7, 8], 13)
    meta = scheduler.build_metadata(_step({"r": 2}))
    assert meta.ape == {"r": ApeSpans(((3, 9), (9, 13)), 0.8, 1.0)}  # the header at position 0 is the prefix
    assert scheduler.build_metadata(_step({"r": 1})).ape == {"r": meta.ape["r"]}  # decode steps too
    assert scheduler.build_metadata(_step({"other": 1})).ape == {}  # not scheduled this step
    scheduler.finished("r")
    assert scheduler.build_metadata(_step({"r": 1})).ape == {}


def test_the_modules_are_the_whole_run_wherever_the_engines_prefix_hit_ended_in_it():
    from kvreuse.modules.splice import Piece, plan_splice, run_from
    from kvreuse.modules.trie import ModuleMatch

    matches = [ModuleMatch("h", 0, 3), ModuleMatch("a", 3, 9), ModuleMatch("b", 9, 13), ModuleMatch("c", 15, 20)]
    run = plan_splice(matches, 0, 19, lambda name: True)
    assert [p.name for p in run] == ["h", "a", "b"]  # free text at 13 ends the run: c is computed
    assert run_from(run, 4) == [Piece("a", 1, 4, 5), Piece("b", 0, 9, 4)]  # vLLM's hit ended inside a
    assert run_from(run, 13) == run_from(run, 16) == []  # a hit past the run: nothing of c is loaded
    assert run_from(run, 0) == run
    scheduler, request = _request({"kvreuse_ape": {"temperature": 0.8}})
    assert scheduler.matched_tokens(request, 4) == 9  # vLLM's hit ended inside a
    scheduler.allocated(request, [5, 6, 7, 8], 9)
    assert scheduler.build_metadata(_step({"r": 2})).ape["r"].ranges == ((3, 9), (9, 13))


def test_without_ape_the_scheduler_sends_nothing_and_the_engines_setting_is_the_default():
    scheduler, request = _request(None)
    scheduler.matched_tokens(request, 0)
    scheduler.allocated(request, [5, 6, 7, 8], 13)
    assert scheduler.build_metadata(_step({"r": 2})).ape == {}
    scheduler, request = _request({"kvreuse_ape": {"temperature": 1, "scale": 1}})
    scheduler.matched_tokens(request, 0)
    assert scheduler.build_metadata(_step({"r": 2})).ape == {}
    scheduler, request = _request(None)
    scheduler.config = ModulesConfig(ape_temperature=0.5)
    scheduler.matched_tokens(request, 0)
    assert scheduler.build_metadata(_step({"r": 2})).ape["r"].temperature == 0.5


def test_an_engine_that_cannot_apply_ape_refuses_its_setting_and_computes_such_requests_in_full(caplog, monkeypatch):
    from kvreuse.vllm.modules import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "applies_ape", lambda config: False)
    scheduler, request = _request({"kvreuse_ape": {"temperature": 0.8}})
    with caplog.at_level("ERROR", logger="vllm.plugins.kvreuse"):
        assert scheduler.matched_tokens(request, 0) == 0
    assert "asks for APE (kvreuse_ape (0.8, 1.0)) but this engine runs another attention" in caplog.text
    plain = _request(None)
    assert plain[0].matched_tokens(plain[1], 0) == 13  # a request without APE splices as before
    monkeypatch.setenv("KVREUSE_MODULES_APE_TEMPERATURE", "0.8")
    with pytest.raises(ConfigError, match="modules.ape_temperature / modules.ape_scale .* need kvreuse's attention"):
        module_scheduler()


def test_the_worker_hands_the_backend_each_steps_ape_in_batch_order():
    from kvreuse.vllm.modules.worker import ModuleWorker
    from kvreuse.vllm.runtime import runtime
    from kvreuse.vllm.sparse.backend import step_ape

    worker = SimpleNamespace(masks_by_position=True)
    spans = ApeSpans(((3, 9),), 0.8, 1.0)
    assert ModuleWorker.plan_step(worker, ModuleCacheMetadata(ape={"b": spans}), ["a", "b", "c"], None) == {}
    assert runtime().step_ape == (None, spans, None) and step_ape(3) == (None, spans, None)
    assert step_ape(2) is None  # a step of another size (a dummy run) never gets them
    ModuleWorker.plan_step(worker, ModuleCacheMetadata(), ["a", "b"], None)
    assert runtime().step_ape is None
