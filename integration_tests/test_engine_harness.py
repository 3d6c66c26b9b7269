"""The harness itself: the stock engine runs on the local model and its prefix-cache accounting is consistent."""

from __future__ import annotations

import pytest

from kvreuse.vllm.prefix_cache import prefix_cache_counters, sum_request_cached_tokens

pytestmark = pytest.mark.engine

BLOCK = 32


def test_stock_engine_generates_greedy_tokens_deterministically(llm):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.0)
    first = llm.generate(["name: Mighty Joe Young"], params, use_tqdm=False)[0]
    again = llm.generate(["name: Mighty Joe Young"], params, use_tqdm=False)[0]
    assert len(first.outputs[0].token_ids) == 6
    # Bitwise: the prompt is shorter than one KV block, so nothing comes from the prefix cache and the second request
    # runs the same operations, in the same order, on the same numbers as the first.
    assert len(first.prompt_token_ids) < BLOCK
    assert first.outputs[0].token_ids == again.outputs[0].token_ids


def test_prefix_cache_hits_agree_between_requests_and_engine_metrics(llm):
    """On prompts that share a long prefix, the per-request cached tokens add up to vLLM's hit counter."""
    from vllm import SamplingParams

    shared = "Instruction: is this movie suitable for children? Answer yes or no. " * 12
    prompts = [shared + f"\nmovie_title: film number {i}" for i in range(6)]
    shared_ids = llm.get_tokenizer()(shared, add_special_tokens=True)["input_ids"]

    before = prefix_cache_counters(llm)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    delta = prefix_cache_counters(llm) - before

    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    cached = sum_request_cached_tokens(outputs)
    assert delta.queries == prompt_tokens
    assert delta.hits == cached
    # Every prompt but the first reuses at least the shared prefix's full blocks.
    full_shared = (len(shared_ids) - 1) // BLOCK * BLOCK
    assert all(o.num_cached_tokens >= full_shared for o in outputs[1:]), [o.num_cached_tokens for o in outputs]
    assert cached >= 5 * full_shared > 0
