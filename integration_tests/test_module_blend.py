"""CacheBlend's token choice made at encode time (``modules.recompute_share``) in the real CPU engine, on the real
trained model (smollm2): modules encoded with ``encode_modules(..., probe=header)`` are ranked in the engine, and a
splice that recomputes each module's top share gives the 16 greedy tokens of the offline reference
(``benchmarks/module_quality.py``'s ``blend-all-10%`` arm: the same ranking by ``kvreuse.modules.blend``, the chosen
tokens recomputed through every layer over the naive splice, in plain PyTorch); recomputing 100% is full prefill.

One engine for the module (the module connector, kvreuse's attention backend in place of CPU_ATTN, dense,
float32); each request sets its share with ``kv_transfer_params``; the prefix cache is reset before every spliced
request, so that its modules come from the connector.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from greedy import LOGPROB_TOLERANCE, LOGPROBS, assert_same_greedy_path
from real_engine import module_cache_llm

pytestmark = pytest.mark.engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

CASES = 3  # the first cases of the `mixed` set
SHARE = 0.10
MAX_NEW_TOKENS = 16


@pytest.fixture(scope="module")
def llm(smollm2_model):
    # recompute_first 0, not the default 16: the reference's blend arm recomputes the chosen tokens alone (with 16,
    # each module's first 16 would be recomputed too, the union).
    with module_cache_llm(smollm2_model, cpu_bytes=512 << 20, recompute_first=0) as engine:
        yield engine


@pytest.fixture(scope="module")
def cases(llm):
    """The cases' token ids, the header encoded alone (its spliced KV is exact), every module encoded alone and
    probed after the header."""
    from module_quality_data import QA_SETS, make_cases, tokenize_case

    from kvreuse.vllm.modules import encode_modules

    tokenizer = llm.get_tokenizer()

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    tokenized = [tokenize_case(c, encode) for c in make_cases(QA_SETS["mixed"], encode)[:CASES]]
    unique = dict.fromkeys(m for tc in tokenized for m in tc.modules)
    modules = {f"module-{i}": list(ids) for i, ids in enumerate(unique)}
    encode_modules(llm, {"header": list(tokenized[0].header)})
    encode_modules(llm, modules, probe=list(tokenized[0].header))
    return tokenized


@pytest.fixture(scope="module")
def reference(smollm2_model, cases, llm):
    """The offline reference's greedy tokens per case: ``blend-all-10%`` and, for the control, ``naive``."""
    import torch
    from module_quality import EOS_TEXT, ModuleCache, encoded_choice
    from splice_reference import ReferenceLlama
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(smollm2_model, dtype=torch.float32).eval()
    model = ReferenceLlama(hf)
    eos = llm.get_tokenizer().convert_tokens_to_ids(EOS_TEXT)
    store = ModuleCache(model, model.encode(cases[0].header))
    out = []
    for tc in cases:
        prep = store.prepare(tc)
        cache, question = prep.caches["alone"], list(tc.question)
        blend = model.generate(
            cache, question, max_new_tokens=MAX_NEW_TOKENS, eos=eos, recompute=encoded_choice(SHARE, "all")(prep)
        )
        naive = model.generate(cache, question, max_new_tokens=MAX_NEW_TOKENS, eos=eos)
        out.append({"blend": blend.tokens, "naive": naive.tokens})
    return out


def generate(llm, prompt, *, share=None, full=False, logprobs=None):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    eos = llm.get_tokenizer().convert_tokens_to_ids("<|im_end|>")
    extra = None if share is None else {"kv_transfer_params": {"kvreuse_recompute_share": share}}
    params = SamplingParams(
        max_tokens=MAX_NEW_TOKENS,
        temperature=0.0,
        stop_token_ids=[eos],
        logprobs=logprobs,
        skip_reading_prefix_cache=full,
        extra_args=extra,
    )
    llm.reset_prefix_cache()
    return llm.generate([TokensPrompt(prompt_token_ids=list(prompt))], params, use_tqdm=False)[0]


def test_the_engines_encode_time_choice_gives_the_offline_references_tokens(llm, cases, reference):
    """Each case's 16 greedy tokens with 10% of each module's tokens recomputed equal the reference's with the same
    choice; the engine computed those tokens (fewer cached tokens than the plain splice)."""
    for tc, ref in zip(cases, reference):
        plain = generate(llm, tc.prompt, share=0.0)
        out = generate(llm, tc.prompt, share=SHARE)
        chosen = sum(-(-len(m) * 10 // 100) for m in tc.modules)  # ceil(10% of each module)
        assert plain.num_cached_tokens - out.num_cached_tokens == chosen
        assert list(out.outputs[0].token_ids) == ref["blend"], tc.case.key
        assert list(plain.outputs[0].token_ids) == ref["naive"], tc.case.key


def test_the_choice_changes_answers(reference):
    """The control: on these cases the recomputed tokens change the reference's output, so the test above tells
    a recompute of the chosen tokens from a plain splice."""
    assert any(ref["blend"] != ref["naive"] for ref in reference)


def test_recomputing_every_module_token_is_the_full_prefill(llm, cases):
    """Share 1: every module token is computed (the header, encoded alone at position 0, stays spliced: it is
    exact), so the output is the full prefill's within rounding."""
    tc = cases[0]
    full = generate(llm, tc.prompt, full=True, logprobs=LOGPROBS)
    out = generate(llm, tc.prompt, share=1.0, logprobs=LOGPROBS)
    assert out.num_cached_tokens == len(tc.header)
    assert_same_greedy_path(full.outputs[0], out.outputs[0], "100% recompute share")
    ours, theirs = full.outputs[0].logprobs[0], out.outputs[0].logprobs[0]
    assert max(abs(ours[t].logprob - theirs[t].logprob) for t in set(ours) & set(theirs)) <= LOGPROB_TOLERANCE
