"""The reference of splicing and recovery methods (benchmarks/splice_reference.py) on a tiny random Llama.

Random weights are enough here: these are exactness properties (what must equal what), not answer quality.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from splice_reference import (  # noqa: E402
    ApeBias,
    FixedTokens,
    KVDeviation,
    ReferenceLlama,
    ResumedTokens,
    as_module,
    kv_only_share,
    splice,
)

# float32 sums: the longest reduction in a layer is the MLP's (intermediate) or attention's (sequence length);
# through every layer, a relative difference of a few units of eps per term bounds what reordering can change.
EPS = torch.finfo(torch.float32).eps


def tolerance(model, length: int) -> float:
    return model.num_layers * max(model.intermediate, length) * EPS


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_theta=100000.0,
        initializer_range=0.1,
        tie_word_embeddings=True,
    )
    hf = LlamaForCausalLM(config).eval()
    ref = ReferenceLlama(hf)
    ref.hf = hf
    ref.intermediate = config.intermediate_size
    return ref


@pytest.fixture(scope="module")
def prompt():
    g = torch.Generator().manual_seed(1)
    header = torch.randint(3, 300, (7,), generator=g).tolist()
    modules = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (19, 11, 23)]
    question = torch.randint(3, 300, (6,), generator=g).tolist()
    return header, modules, question


def spliced(model, header, modules, anchored=False):
    head = model.encode(header)
    stored = [as_module(f"m{i}", model.encode(ids, head if anchored else None)) for i, ids in enumerate(modules)]
    return splice(head, stored, model.spec)


def test_a_full_prefill_gives_hugging_faces_logits(model, prompt):
    header, modules, question = prompt
    ids = header + [t for m in modules for t in m] + question
    ours = model.prefill(model.empty_cache(), ids).logits
    with torch.inference_mode():
        theirs = model.hf(torch.tensor([ids])).logits[0, -1]
    assert (ours - theirs).abs().max() <= tolerance(model, len(ids)) * theirs.abs().max()


def test_recomputing_every_cached_token_is_a_full_prefill(model, prompt):
    header, modules, question = prompt
    ids = header + [t for m in modules for t in m] + question
    full = model.generate(model.empty_cache(), ids, max_new_tokens=8)
    cache = spliced(model, header, modules)
    everything = FixedTokens(torch.arange(len(cache)))
    recomputed = model.generate(cache, question, max_new_tokens=8, recompute=everything)
    assert recomputed.tokens == full.tokens
    scale = full.first_logits.abs().max()
    assert (recomputed.first_logits - full.first_logits).abs().max() <= tolerance(model, len(ids)) * scale
    assert recomputed.compute.full == full.compute.full == len(ids) * model.num_layers


def test_cacheblend_keeping_every_token_is_a_full_prefill(model, prompt):
    header, modules, question = prompt
    ids = header + [t for m in modules for t in m] + question
    full = model.prefill(model.empty_cache(), ids)
    cache = spliced(model, header, modules)
    blend = KVDeviation(torch.arange(len(cache)), {1: 1.0})
    out = model.prefill(cache, question, recompute=blend)
    assert (out.logits - full.logits).abs().max() <= tolerance(model, len(ids)) * full.logits.abs().max()


def test_the_splice_has_a_full_prefills_layer0_keys_and_values(model, prompt):
    """Layer 0's KV depends only on each token and its position: re-rotation moves it exactly."""
    header, modules, question = prompt
    ids = header + [t for m in modules for t in m]
    full = model.prefill(model.empty_cache(), ids).cache
    cache = spliced(model, header, modules)
    assert cache.positions.tolist() == list(range(len(ids))) and cache.token_ids.tolist() == ids
    assert (cache.keys[0] - full.keys[0]).abs().max() <= 1e-5 * full.keys[0].abs().max()
    # values carry no position; a matrix product over another number of rows may round differently
    assert (cache.values[0] - full.values[0]).abs().max() <= 1e-6 * full.values[0].abs().max()
    assert (cache.keys[1] - full.keys[1]).abs().max() > 1e-3 * full.keys[1].abs().max()  # later layers differ


def test_ape_with_temperature_1_and_scale_1_is_plain_splicing(model, prompt):
    header, modules, question = prompt
    cache = spliced(model, header, modules)
    columns = torch.arange(len(header), len(cache))
    plain = model.generate(cache, question, max_new_tokens=8)
    ape = model.generate(cache, question, max_new_tokens=8, ape=ApeBias(columns, 1.0, 1.0))
    assert ape.tokens == plain.tokens and torch.equal(ape.first_logits, plain.first_logits)


def test_ape_temperature_and_scale_change_the_attention_over_module_keys_only(model, prompt):
    header, modules, question = prompt
    cache = spliced(model, header, modules)
    columns = torch.arange(len(header), len(cache))
    plain = model.prefill(cache, question).logits
    sharper = model.prefill(cache, question, ape=ApeBias(columns, 0.5, 1.0)).logits
    heavier = model.prefill(cache, question, ape=ApeBias(columns, 1.0, 3.0)).logits
    assert not torch.allclose(plain, sharper) and not torch.allclose(plain, heavier)
    nothing = torch.empty(0, dtype=torch.int64)
    assert torch.equal(model.prefill(cache, question, ape=ApeBias(nothing, 0.5, 3.0)).logits, plain)


def test_hiding_keys_from_new_tokens_equals_a_cache_without_them(model, prompt):
    header, modules, question = prompt
    cache = spliced(model, header, [modules[0]])
    hidden = torch.arange(len(header), len(header) + 3)
    masked = model.prefill(cache, question, ape=ApeBias(torch.empty(0, dtype=torch.int64), hidden=hidden))
    kept = torch.cat([torch.arange(len(header)), torch.arange(len(header) + 3, len(cache))])
    shorter = type(cache)(cache.keys[:, kept], cache.values[:, kept], cache.positions[kept], cache.token_ids[kept])
    direct = model.prefill(shorter, question)
    assert (masked.logits - direct.logits).abs().max() <= 1e-5 * direct.logits.abs().max()


def test_decoding_several_sequences_together_gives_each_ones_tokens(model, prompt):
    header, modules, question = prompt
    cache = spliced(model, header, modules)
    anchored = spliced(model, header, modules, anchored=True)
    columns = torch.arange(len(header), len(cache))
    jobs = [(cache, None), (anchored, None), (cache, ApeBias(columns, 0.7, 0.5))]
    alone = [model.generate(c, question, max_new_tokens=10, ape=a).tokens for c, a in jobs]
    together = model.decode([(model.prefill(c, question, ape=a), a) for c, a in jobs], max_new_tokens=10)
    assert together == alone


def test_fixed_tokens_recompute_counts_their_token_layers(model, prompt):
    header, modules, question = prompt
    cache = spliced(model, header, modules)
    chosen = torch.tensor([7, 8, 30])
    out = model.prefill(cache, question, recompute=FixedTokens(chosen))
    assert out.compute.full == (len(chosen) + len(question)) * model.num_layers and out.compute.kv_only == 0
    # the recomputed tokens' KV replaced the spliced KV; the others' stayed
    assert not torch.equal(out.cache.keys[2, 30], cache.keys[2, 30])
    assert torch.equal(out.cache.keys[2, 29], cache.keys[2, 29])


def test_cacheblend_picks_on_its_layers_and_counts_the_key_value_only_tokens(model, prompt):
    header, modules, question = prompt
    cache = spliced(model, header, modules)
    candidates = torch.arange(len(header), len(cache))
    out = model.prefill(cache, question, recompute=KVDeviation(candidates, {1: 0.25}))
    kept = round(0.25 * len(candidates))
    n, q = len(candidates), len(question)
    assert out.compute.full == (n + q) + (kept + q) * (model.num_layers - 1)
    assert out.compute.kv_only == n - kept


def test_the_key_value_share_of_a_layer_is_its_projections_share_of_the_weights():
    assert kv_only_share(576, 192, 576, 1536) == pytest.approx(2 * 576 * 192 / 3538944)


def test_tokens_resumed_at_layer_0_from_their_embeddings_are_tokens_recomputed(model, prompt):
    header, modules, question = prompt
    cache = spliced(model, header, modules)
    index = torch.arange(len(header), len(cache))
    fixed = model.prefill(cache, question, recompute=FixedTokens(index))
    resumed = model.prefill(cache, question, recompute=ResumedTokens(index, 0, model.embed[cache.token_ids[index]]))
    assert (resumed.logits - fixed.logits).abs().max() <= 1e-5 * fixed.logits.abs().max()
    assert resumed.compute.full == fixed.compute.full


def test_tokens_resumed_late_are_computed_in_the_late_layers_only(model, prompt):
    header, modules, question = prompt
    head = model.encode(header)
    kv, hidden = model.encode_with_hidden(modules[0], capture=(2,))
    cache = splice(head, [as_module("m", kv)], model.spec)
    index = torch.arange(len(header), len(cache))
    out = model.prefill(cache, question, recompute=ResumedTokens(index, 2, hidden[2]))
    assert out.compute.full == len(question) * model.num_layers + len(index) * (model.num_layers - 2)
    assert torch.equal(out.cache.keys[1, index], cache.keys[1, index])  # layers before 2 keep the spliced KV
    assert not torch.equal(out.cache.keys[2, index], cache.keys[2, index])
