"""Engine-side pieces of the module cache that need no running engine: encode parameters, what workers report,
the CPU path of the key rotation, and the tokenizer's special prefix (its metrics: ``test_connector_metrics.py``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from numerics import assert_within, rotation_bound

from kvreuse.errors import ModuleRegistrationError
from kvreuse.kernels.rerotate import RopeSpec, move_keys, rerotate_keys_reference
from kvreuse.modules.store import ModuleKey
from kvreuse.vllm.modules import encode_params, special_prefix
from kvreuse.vllm.modules.common import ModuleCacheWorkerMeta, ModuleWrite, encode_request


def test_encode_parameters_round_trip_and_bad_ones_name_the_problem():
    assert encode_request(encode_params("doc", 3), 10) == ModuleWrite("doc", 3, "", False)
    assert encode_request({"kvreuse_module": "doc"}, 10, "tenant") == ModuleWrite("doc", 0, "tenant", False)
    assert encode_request(encode_params("doc", replace=True), 10) == ModuleWrite("doc", 0, "", True)
    assert encode_request(None, 10) is None and encode_request({"other": 1}, 10) is None
    assert encode_request("kvreuse_module", 10) is None  # not a mapping: asks nothing
    with pytest.raises(ModuleRegistrationError, match="1-128 characters"):
        encode_request({"kvreuse_module": ""}, 10)
    with pytest.raises(ModuleRegistrationError, match="1-128 characters"):
        encode_request({"kvreuse_module": "x" * 1_000_000}, 10)
    with pytest.raises(ModuleRegistrationError, match="true or false"):
        encode_request({"kvreuse_module": "doc", "kvreuse_replace": "yes"}, 10)
    with pytest.raises(ModuleRegistrationError, match=r"0\.\.9 \(the prompt has 10 tokens\), got 10"):
        encode_request(encode_params("doc", 10), 10)
    with pytest.raises(ModuleRegistrationError, match="got True"):
        encode_request({"kvreuse_module": "doc", "kvreuse_context": True}, 10)


def test_worker_reports_aggregate_to_modules_every_worker_stored_and_any_worker_lost():
    a, b, c = (ModuleKey(n, n * 4) for n in "abc")
    one = ModuleCacheWorkerMeta(stored={a: (1,), b: (2,)}, dropped={c}, failed={"x": "too large"})
    two = ModuleCacheWorkerMeta(stored={a: (1,)}, dropped=set(), failed={"y": "bad tokens"})
    both = one.aggregate(two)
    assert both.stored == {a: (1,)} and both.dropped == {c} and both.failed == {"x": "too large", "y": "bad tokens"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keys_move_on_cpu_by_the_reference_rounded_once(dtype):
    spec = RopeSpec(head_dim=64, rotary_dim=64)
    keys = torch.randn(9, 2, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    deltas = torch.full((9,), 1234, dtype=torch.int64)
    moved = move_keys(keys, deltas, spec)
    # Bitwise: on CPU move_keys is this very computation, the same operations in the same order.
    assert moved.dtype == dtype and torch.equal(moved, rerotate_keys_reference(keys, deltas, spec).to(dtype))
    back = move_keys(moved, -deltas, spec)
    assert_within(back, keys, rotation_bound(keys, moves=2), f"{dtype} moved and back")  # two roundings


def test_the_special_prefix_is_what_the_tokenizer_puts_before_every_text(local_tokenizer):
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    plain = PreTrainedTokenizerFast(tokenizer_object=local_tokenizer)
    assert special_prefix(plain) == []
    bos = local_tokenizer.token_to_id("<|begin_of_text|>")
    with_bos = local_tokenizer.__class__.from_str(local_tokenizer.to_str())
    with_bos.post_processor = TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
    )
    assert special_prefix(PreTrainedTokenizerFast(tokenizer_object=with_bos)) == [bos]


def module_scheduler(**modules):
    """A scheduler side (block size 4) with the ``modules`` settings given (the rest at their defaults)."""
    from types import SimpleNamespace

    from kvreuse.vllm.modules.scheduler import ModuleScheduler

    hf = {"model_type": "llama", "rope_theta": 10000.0, "hidden_size": 256, "num_attention_heads": 4, "head_dim": 64}
    config = SimpleNamespace(
        additional_config={"kvreuse": {"modules": modules}},
        kv_transfer_config=SimpleNamespace(kv_load_failure_policy="recompute"),
        cache_config=SimpleNamespace(block_size=4),
        model_config=SimpleNamespace(hf_config=SimpleNamespace(to_dict=lambda: hf, num_hidden_layers=4)),
        device_config=SimpleNamespace(device_type="cpu"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
    )
    return ModuleScheduler(config)


def register(scheduler, *modules):
    """The workers report these modules stored, each ``(key, token_ids)`` or ``(key, token_ids, context, adapter)``
    (default: encoded alone at position 0 with the base model), every one its name's first encoding."""
    from kvreuse.modules.encodings import Encoding
    from kvreuse.vllm.modules.common import ModuleCacheWorkerMeta

    stored, placed = {}, {}
    for key, ids, *how in modules:
        context, adapter = how if how else ((), "")
        stored[key] = tuple(ids)
        placed[key] = Encoding(key, adapter, tuple(context), len(context), True, key.version)
    scheduler.worker_reported(ModuleCacheWorkerMeta(stored=stored, placed=placed))


def test_modules_found_but_not_spliced_are_counted_by_reason_once_per_request(caplog):
    from types import SimpleNamespace

    from kvreuse.vllm.metrics import KVReuseStats

    scheduler = module_scheduler(recompute_first=0)  # the plain splice: the counts below are of loaded tokens
    a, b, gone = ModuleKey("a", 1), ModuleKey("b", 2), ModuleKey("gone", 3)
    register(scheduler, (a, (1, 2, 3, 4)), (b, (5, 6, 7, 8)), (gone, (9, 9, 9, 9)))
    scheduler.worker_reported(ModuleCacheWorkerMeta(dropped={gone}))  # the index keeps it: lost since
    scheduler.trie.add(("", "gone"), (9, 9, 9, 9))
    # a, free text, b, the module the store lost, then "a" again with its last token merged into 99.
    prompt = [1, 2, 3, 4, 0, 5, 6, 7, 8, 9, 9, 9, 9, 1, 2, 3, 99, 0]
    request = SimpleNamespace(
        request_id="r1", prompt_token_ids=prompt, num_tokens=len(prompt), kv_transfer_params={}, cache_salt=None
    )
    with caplog.at_level("DEBUG", logger="vllm.plugins.kvreuse"):
        assert scheduler.matched_tokens(request, 0) == 4
        assert scheduler.matched_tokens(request, 0) == 4  # asked again while waiting: not counted again
    stats = scheduler.take_stats()
    assert stats == {
        "splice_skipped:after_free_text": 1,
        "splice_skipped:not_stored": 1,
        "splice_skipped:token_boundary": 1,
    }
    assert "kvreuse module 'b' at token 5 of request r1 not spliced: after_free_text" in caplog.text
    assert scheduler.take_stats() == {}
    # What the scheduler-side connector hands vLLM, and how it reaches Prometheus.
    assert KVReuseStats(data=stats).reduce()["splice_skipped:not_stored"] == 1


def encode_request_of(params, salt=None, prompt=(1, 2, 3, 4, 5, 6, 7, 8), rid="enc"):
    from types import SimpleNamespace

    return SimpleNamespace(
        request_id=rid,
        prompt_token_ids=list(prompt),
        num_tokens=len(prompt),
        kv_transfer_params=params,
        cache_salt=salt,
        skip_reading_prefix_cache=False,
    )


def proven_params(key, name, context=0, namespace="", prompt=(1, 2, 3, 4, 5, 6, 7, 8), now=None):
    """``encode_params(name, context)`` with the proof the HTTP guard adds under ``key`` for ``prompt``."""
    from kvreuse.modules.writes import WRITE_PROOF, WriteClaim, content_digest, write_proof

    made = WriteClaim(name, context, namespace, False, False, content_digest(prompt))
    return {**encode_params(name, context), WRITE_PROOF: write_proof(key, made, now=now)}


def test_a_write_without_a_proof_under_the_engines_keys_is_refused_and_counted():
    scheduler = module_scheduler()
    scheduler.write_keys = ("k" * 32,)
    forged = encode_request_of(proven_params("x" * 32, "doc"))
    scheduler.arrived(forged)
    assert scheduler.matched_tokens(forged, 0) == 0 and not forged.skip_reading_prefix_cache
    scheduler.allocated(forged, [0, 1], 0)
    assert scheduler._encodes == {}  # nothing will be stored
    assert scheduler.take_stats() == {"writes_refused:unproven": 1}
    # The same write proven under the key (what the HTTP guard adds), but for another namespace: refused too.
    elsewhere = encode_request_of(proven_params("k" * 32, "doc"), salt="tenant-a")
    scheduler.arrived(elsewhere)
    assert not elsewhere.skip_reading_prefix_cache
    assert scheduler.take_stats() == {"writes_refused:unproven": 1}


def test_a_proven_write_is_computed_without_reading_the_prefix_cache():
    scheduler = module_scheduler()
    scheduler.write_keys = ("k" * 32,)
    proven = encode_request_of(proven_params("k" * 32, "doc", 2, "t"), salt="t")
    scheduler.arrived(proven)
    assert proven.skip_reading_prefix_cache  # set before vLLM's first look-up reads it
    assert scheduler.matched_tokens(proven, 0) == 0
    scheduler.allocated(proven, [0, 1], 0)
    assert scheduler._encodes["enc"][0] == ModuleWrite("doc", 2, "t", False)
    assert scheduler.take_stats() == {}


def test_a_seen_proof_replayed_or_put_on_other_content_writes_nothing(caplog):
    """The issue's "one seen proof writes any content under that name forever": a proof the guard made for one
    write, taken (e.g. from a log) and sent again, as it is or with other tokens, is refused and says why."""
    scheduler = module_scheduler()
    scheduler.write_keys = ("k" * 32,)
    params = proven_params("k" * 32, "system")
    first = encode_request_of(params, rid="first")
    scheduler.arrived(first)
    assert scheduler._writes["first"] is not None
    replayed = encode_request_of(dict(params), rid="again")
    swapped = encode_request_of(dict(params), prompt=(1, 2, 3, 4, 5, 6, 7, 666), rid="swapped")
    with caplog.at_level("WARNING", logger="vllm.plugins.kvreuse"):
        scheduler.arrived(replayed)
        scheduler.arrived(swapped)
    assert scheduler._writes["again"] is None and scheduler._writes["swapped"] is None
    assert not replayed.skip_reading_prefix_cache and not swapped.skip_reading_prefix_cache
    assert scheduler.take_stats() == {"writes_refused:replayed": 1, "writes_refused:unproven": 1}
    assert "request again asked to write module 'system'" in caplog.text and "used before" in caplog.text
    assert "made for other content" in caplog.text


def test_an_expired_proof_writes_nothing():
    scheduler = module_scheduler()
    scheduler.write_keys = ("k" * 32,)
    stale = encode_request_of(proven_params("k" * 32, "doc", now=1_000_000))
    scheduler.arrived(stale)
    assert scheduler._writes["enc"] is None and scheduler.take_stats() == {"writes_refused:expired": 1}


def test_a_request_splices_global_modules_and_its_own_salts_never_another_tenants():
    from types import SimpleNamespace

    scheduler = module_scheduler(recompute_first=0)  # the plain splice: the counts below are of loaded tokens
    shared, mine = ModuleKey("shared", 1), ModuleKey("mine", 2, namespace="tenant-a")
    register(scheduler, (shared, (1, 2, 3, 4)), (mine, (5, 6, 7, 8)))
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 0]

    def matched(salt, rid):
        request = SimpleNamespace(
            request_id=rid, prompt_token_ids=prompt, num_tokens=9, kv_transfer_params=None, cache_salt=salt
        )
        return scheduler.matched_tokens(request, 0)

    assert matched("tenant-a", "a") == 8
    assert matched("tenant-b", "b") == 4  # the global module only
    assert matched(None, "none") == 4


def _lora(name, path):
    from types import SimpleNamespace

    return SimpleNamespace(lora_name=name, lora_path=path, lora_int_id=1)


def test_a_request_splices_only_the_encodings_computed_with_its_own_adapter():
    from types import SimpleNamespace

    from kvreuse.vllm.modules.common import kv_adapter

    scheduler = module_scheduler(recompute_first=0)
    adapter = kv_adapter(SimpleNamespace(lora_request=_lora("x", "/adapters/x")))
    assert adapter.startswith("lora:") and len(adapter) <= 64 and kv_adapter(SimpleNamespace(lora_request=None)) == ""
    assert adapter != kv_adapter(SimpleNamespace(lora_request=_lora("x", "/adapters/other")))  # vLLM's name + path
    base, tuned = ModuleKey("doc", "base-kv", version=1), ModuleKey("doc", "lora-kv", version=2)
    register(scheduler, (base, (1, 2, 3, 4)))
    prompt = [1, 2, 3, 4, 0]

    def spliced(rid, lora):
        request = SimpleNamespace(
            request_id=rid,
            prompt_token_ids=prompt,
            num_tokens=len(prompt),
            kv_transfer_params=None,
            cache_salt=None,
            lora_request=lora,
        )
        matched = scheduler.matched_tokens(request, 0)
        return matched, [piece.name for piece in scheduler._plans[rid].pieces]

    # Only the base model's KV is stored: a LoRA request computes the module (the wrong answers came from
    # splicing it), and says why.
    assert spliced("lora-1", _lora("x", "/adapters/x")) == (0, [])
    assert scheduler.take_stats() == {"splice_skipped:other_adapter": 1}
    register(scheduler, (tuned, (1, 2, 3, 4), (), adapter))
    assert spliced("lora-2", _lora("x", "/adapters/x")) == (4, [tuned])
    assert spliced("base", None) == (4, [base])
    assert spliced("other", _lora("x", "/adapters/other")) == (0, [])  # same name, another adapter's weights


def test_an_adapters_entry_names_its_blocks_in_vllms_prefix_cache_apart_from_the_base_models(monkeypatch):
    from types import SimpleNamespace

    from kvreuse.patches import vllm_0_32
    from kvreuse.vllm.modules.common import kv_adapter

    folded = {}
    monkeypatch.setattr(vllm_0_32, "caches_prefixes", lambda manager: True)
    monkeypatch.setattr(vllm_0_32, "prefix_cache_hit", lambda manager, request: 0)
    monkeypatch.setattr(
        vllm_0_32, "fold_into_block_hashes", lambda c, m, r, first, keys: folded.setdefault(r.request_id, keys) or True
    )
    scheduler = module_scheduler(recompute_first=0)
    scheduler.kv_cache_manager = object()
    lora = _lora("x", "/adapters/x")
    adapter = kv_adapter(SimpleNamespace(lora_request=lora))
    base, tuned = ModuleKey("doc", "base-kv", version=1), ModuleKey("doc", "lora-kv", version=2)
    register(scheduler, (base, (1, 2, 3, 4)), (tuned, (1, 2, 3, 4), (), adapter))
    for rid, lora_request in (("base", None), ("lora", lora)):
        prompt = [1, 2, 3, 4, 0]
        request = SimpleNamespace(
            request_id=rid,
            prompt_token_ids=prompt,
            num_tokens=5,
            kv_transfer_params=None,
            cache_salt=None,
            lora_request=lora_request,
        )
        scheduler.matched_tokens(request, 0)
    assert folded == {"base": {0: (base.identity,)}, "lora": {0: (tuned.identity,)}}


def test_a_request_with_inputs_besides_its_token_ids_neither_splices_nor_writes():
    from types import SimpleNamespace

    scheduler = module_scheduler(recompute_first=0)
    register(scheduler, (ModuleKey("doc", 1), (1, 2, 3, 4)))
    for rid, extra in (("image", {"mm_features": [object()]}), ("embeds", {"prompt_embeds": object()})):
        request = SimpleNamespace(
            request_id=rid, prompt_token_ids=[1, 2, 3, 4, 0], num_tokens=5, kv_transfer_params=None, cache_salt=None
        )
        request.__dict__.update(extra)
        assert scheduler.matched_tokens(request, 0) == 0
    assert scheduler.take_stats() == {"splice_skipped:non_token_input": 2}
    scheduler.config = replace(scheduler.config, open_writes=True)
    write = encode_request_of(encode_params("doc2"))
    write.mm_features = [object()]
    scheduler.arrived(write)
    assert scheduler._writes["enc"] is None and not write.skip_reading_prefix_cache
    assert scheduler.take_stats() == {"writes_refused:non_token_input": 1}


def _planned(scheduler, rid, prompt, hit):
    from types import SimpleNamespace

    request = SimpleNamespace(
        request_id=rid, prompt_token_ids=prompt, num_tokens=len(prompt), kv_transfer_params=None, cache_salt=None
    )
    matched = scheduler.matched_tokens(request, hit)
    plan = scheduler._plans.get(rid)
    return matched, None if plan is None else [(p.name.name, p.prompt_start, p.length) for p in plan.pieces]


def test_the_same_prompt_gets_the_same_plan_wherever_vllms_prefix_hit_ends():
    """A module after free text is computed, always: the plan is the run from the prompt's first token, never a
    run from wherever another request's blocks ended vLLM's prefix hit (issue: the same prompt took a module's
    tokens from the cache in one run and computed them in another)."""
    scheduler = module_scheduler(recompute_first=0)  # block size 4
    register(scheduler, (ModuleKey("h", 1), (1, 2, 3, 4, 5)), (ModuleKey("m", 2), (7, 8, 9, 10, 11, 12, 13, 14)))
    prompt = [1, 2, 3, 4, 5, 0, 7, 8, 9, 10, 11, 12, 13, 14, 0, 0]  # h [0, 5), free text, m [6, 14), question
    assert _planned(scheduler, "cold", prompt, 0) == (5, [("h", 0, 5)])
    assert _planned(scheduler, "in-h", prompt, 4) == (1, [("h", 4, 1)])
    for hit in (8, 12):  # a hit inside m (its blocks computed by an earlier request): m is not loaded from there
        assert _planned(scheduler, f"in-m-{hit}", prompt, hit) == (0, [])
    assert scheduler.take_stats() == {"splice_skipped:after_free_text": 4}  # counted alike for each request


def test_the_blocks_a_plan_folds_do_not_depend_on_vllms_prefix_hit(monkeypatch):
    from kvreuse.patches import vllm_0_32

    folded = {}
    monkeypatch.setattr(vllm_0_32, "caches_prefixes", lambda manager: True)
    monkeypatch.setattr(vllm_0_32, "prefix_cache_hit", lambda manager, request: 0)
    monkeypatch.setattr(
        vllm_0_32,
        "fold_into_block_hashes",
        lambda c, m, request, first, keys: folded.setdefault(request.request_id, (first, keys)) or True,
    )
    scheduler = module_scheduler(recompute_first=2)
    scheduler.kv_cache_manager = object()
    h, m = ModuleKey("h", 1), ModuleKey("m", 2)
    register(scheduler, (h, (1, 2, 3, 4, 5)), (m, (7, 8, 9, 10, 11, 12, 13, 14)))
    prompt = [1, 2, 3, 4, 5, 0, 7, 8, 9, 10, 11, 12, 13, 14, 0, 0]
    assert _planned(scheduler, "cold", prompt, 0) == (5, [("h", 0, 5)])  # h is exact at 0: none recomputed
    # vLLM's first look-up used the hashes before the fold: a hit past block 0 must be looked up again.
    assert _planned(scheduler, "warm", prompt, 8) == (None, None)
    assert folded["cold"] == folded["warm"] == (0, {0: (h.identity,), 1: (h.identity,)})  # m's blocks: computed
    assert _planned(scheduler, "warm", prompt, 4) == (1, [("h", 4, 1)])  # asked again with the folded hit
