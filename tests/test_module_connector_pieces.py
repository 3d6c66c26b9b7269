"""Engine-side pieces of the module cache that need no running engine: encode parameters, what workers report,
the CPU path of the key rotation, and the tokenizer's special prefix (its metrics: ``test_connector_metrics.py``)."""

from __future__ import annotations

import pytest
import torch
from numerics import assert_within, rotation_bound

from kvreuse.errors import ModuleRegistrationError
from kvreuse.kernels.rerotate import RopeSpec, move_keys, rerotate_keys_reference
from kvreuse.modules.store import ModuleKey
from kvreuse.vllm.modules import encode_params, special_prefix
from kvreuse.vllm.modules.common import ModuleCacheWorkerMeta, encode_request


def test_encode_parameters_round_trip_and_bad_ones_name_the_problem():
    assert encode_request(encode_params("doc", 3), 10) == ("doc", 3)
    assert encode_request({"kvreuse_module": "doc"}, 10) == ("doc", 0)
    assert encode_request(None, 10) is None and encode_request({"other": 1}, 10) is None
    with pytest.raises(ModuleRegistrationError, match="non-empty string"):
        encode_request({"kvreuse_module": ""}, 10)
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


def module_scheduler():
    from types import SimpleNamespace

    from kvreuse.vllm.modules.scheduler import ModuleScheduler

    hf = {"model_type": "llama", "rope_theta": 10000.0, "hidden_size": 256, "num_attention_heads": 4, "head_dim": 64}
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_load_failure_policy="recompute"),
        cache_config=SimpleNamespace(block_size=4),
        model_config=SimpleNamespace(hf_config=SimpleNamespace(to_dict=lambda: hf)),
    )
    return ModuleScheduler(config)


def test_modules_found_but_not_spliced_are_counted_by_reason_once_per_request(caplog):
    from types import SimpleNamespace

    from kvreuse.vllm.metrics import KVReuseStats

    scheduler = module_scheduler()
    a, b, gone = ModuleKey("a", 1), ModuleKey("b", 2), ModuleKey("gone", 3)
    for key, ids in ((a, (1, 2, 3, 4)), (b, (5, 6, 7, 8)), (gone, (9, 9, 9, 9))):
        scheduler.trie.add(key, ids)
    scheduler.available = {a, b}
    # a, free text, b, the module the store lost, then "a" again with its last token merged into 99.
    prompt = [1, 2, 3, 4, 0, 5, 6, 7, 8, 9, 9, 9, 9, 1, 2, 3, 99, 0]
    request = SimpleNamespace(request_id="r1", prompt_token_ids=prompt, num_tokens=len(prompt), kv_transfer_params={})
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
