"""Selective recompute of spliced module tokens (LegoLink, ``modules.recompute_first``) in the real CPU engine, on the
real trained model (smollm2): the tokens recomputed inside a spliced run get their own positions, slots and causal
mask, so recomputing every token whose spliced KV is not what a full prefill computes gives the full prefill's
answer.

One engine for the module: the module connector, kvreuse's attention backend in place of CPU_ATTN (dense, ``beta =
inf``), float32, ``modules.recompute_first`` at its default; each request picks its own with
``kv_transfer_params``. The full prefill is the same engine with vLLM's ``skip_reading_prefix_cache`` (the connector
is not asked). The prefix cache is reset before every spliced request, so that its modules come from the connector.
"""

from __future__ import annotations

import pytest
from greedy import LOGPROB_TOLERANCE, LOGPROBS, assert_same_greedy_path
from real_engine import module_cache_llm

pytestmark = pytest.mark.engine

# A is longer than B: recomputing the first len(B) tokens of each module recomputes all of B and A's head.
TEXTS = {
    "A": (
        "Profile of Marta Ilves. Marta Ilves was born in 1961 in the harbour town of Pärnu. She trained as a marine "
        "engineer, designed ferry hulls for twenty years and now keeps bees on an island farm with her two dogs."
    ),
    "B": "Profile of Oskar Brandt. Oskar Brandt is a baker from Kiel whose rye bread won a national prize in 2004.",
}
QUESTION = "\nQuestion: In which town was Marta Ilves born?\nAnswer:"
MAX_TOKENS = 12


def _figures(worker):
    from kvreuse.vllm.runtime import module_figures

    return module_figures()


def loaded(llm) -> int:
    return llm.collective_rpc(_figures)[0]["tokens_loaded"]


@pytest.fixture(scope="module")
def llm(smollm2_model):
    with module_cache_llm(smollm2_model, cpu_bytes=256 << 20) as engine:
        yield engine


@pytest.fixture(scope="module")
def prompt(llm):
    """Special prefix (if any) + A + B + question; A is encoded after the special prefix, so its spliced KV is
    exactly what a full prefill computes (same tokens, same positions, same context); B is encoded alone, so its KV
    differs from a full prefill's (it never attended to A)."""
    from kvreuse.vllm.modules import encode_modules
    from kvreuse.vllm.modules.encode import special_prefix

    tokenizer = llm.get_tokenizer()
    prefix = special_prefix(tokenizer)
    ids = encode_modules(llm, TEXTS, contexts={"A": prefix})
    assert len(ids["A"]) > len(ids["B"]) + 8
    return prefix, ids, prefix + ids["A"] + ids["B"] + tokenizer.encode(QUESTION, add_special_tokens=False)


def generate(llm, prompt, *, recompute_first=None, full=False):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = None if recompute_first is None else {"kv_transfer_params": {"kvreuse_recompute_first": recompute_first}}
    params = SamplingParams(
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        ignore_eos=True,
        logprobs=LOGPROBS,
        skip_reading_prefix_cache=full,
        extra_args=extra,
    )
    llm.reset_prefix_cache()
    return llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]


def first_token_gap(a, b) -> float:
    """Largest gap between two generations' first-token log-probabilities over their common candidates."""
    ours, theirs = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
    return max(abs(ours[t].logprob - theirs[t].logprob) for t in set(ours) & set(theirs))


@pytest.fixture(scope="module")
def full(llm, prompt):
    return generate(llm, prompt[2], full=True)


def test_recomputing_every_inexact_spliced_token_gives_the_full_prefill(llm, prompt, full):
    """k = len(B): all of B and A's first len(B) tokens are computed inside the run (at positions before and after
    loaded ones), A's tail keeps its loaded KV, which is a full prefill's. The result must be the full prefill's: a
    wrong position, slot, token or mask for any recomputed token would move it by far more than rounding."""
    prefix, ids, tokens = prompt
    run = len(prefix) + len(ids["A"]) + len(ids["B"])
    before = loaded(llm)
    out = generate(llm, tokens, recompute_first=len(ids["B"]))
    assert loaded(llm) - before == run  # the whole run is loaded; the forward overwrote the recomputed tokens
    recomputed = 2 * len(ids["B"]) + min(len(prefix), len(ids["B"]))
    assert out.num_cached_tokens == run - recomputed  # vLLM counted only the tokens kept from the splice
    assert_same_greedy_path(full.outputs[0], out.outputs[0], "recompute of every inexact spliced token")
    assert first_token_gap(full, out) <= LOGPROB_TOLERANCE


def test_a_plain_splice_of_b_is_not_the_full_prefill(llm, prompt, full):
    """The control: without recompute, B's spliced KV moves the first token's log-probabilities by more than
    rounding, so the test above could fail."""
    out = generate(llm, prompt[2], recompute_first=0)
    assert first_token_gap(full, out) > 10 * LOGPROB_TOLERANCE


def test_a_requests_own_recompute_first_0_is_the_plain_splice_under_the_engines_default(llm, prompt):
    """The engine runs the setting's default (LegoLink's first 16 tokens of each module): a request without
    kv_transfer_params recomputes them, as one that asks for the default itself does; a request's own 0 loads the
    whole run and recomputes nothing (today's plain splice)."""
    from kvreuse.modules.config import ModulesConfig

    default = ModulesConfig.load({}, {}).recompute_first
    assert default > 0  # else the default and the plain splice below would be the same request
    prefix, ids, tokens = prompt
    run = len(prefix) + len(ids["A"]) + len(ids["B"])
    before = loaded(llm)
    zero = generate(llm, tokens, recompute_first=0)
    assert loaded(llm) - before == zero.num_cached_tokens == run
    by_default = generate(llm, tokens)
    asked = generate(llm, tokens, recompute_first=default)
    recomputed = sum(min(len(part), default) for part in (prefix, ids["A"], ids["B"]))
    assert by_default.num_cached_tokens == asked.num_cached_tokens == run - recomputed
    assert by_default.outputs[0].token_ids == asked.outputs[0].token_ids
    assert first_token_gap(by_default, asked) == 0.0
    assert first_token_gap(zero, by_default) > 0.0  # the default's recompute changed what the question saw


def test_recomputing_every_module_token_loads_nothing_and_is_the_full_prefill(llm, prompt, full):
    """k at least a module's length: the whole run is computed, so nothing is loaded (100% recompute)."""
    before = loaded(llm)
    out = generate(llm, prompt[2], recompute_first=10_000)
    assert loaded(llm) == before and out.num_cached_tokens == 0
    assert_same_greedy_path(full.outputs[0], out.outputs[0], "100% recompute")
