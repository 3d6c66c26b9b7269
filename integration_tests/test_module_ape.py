"""APE over spliced modules (``modules.ape_temperature`` / ``ape_scale``; per request ``kv_transfer_params
{"kvreuse_ape": {"temperature": T, "scale": S}}``) in the real CPU engine, on the real trained model (smollm2),
against the offline reference (``benchmarks/splice_reference.py``, ``ApeBias``) on cases of the QA set ``mixed``.

One engine for the module: the module connector, kvreuse's attention backend in place of CPU_ATTN (dense, ``beta =
inf``), float32; the header and each module encoded through encode requests, the modules after the header
(``anchored``, as the offline arm ``ape-anchored-T0.8``). The prefix cache is reset before a request unless the
test is about it, so that its modules come from the connector.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from greedy import LOGPROB_TOLERANCE, LOGPROBS
from real_engine import module_cache_llm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from module_quality_data import HEADER, QA_SETS, make_cases, tokenize_case  # noqa: E402

pytestmark = pytest.mark.engine

CASES = 3  # the first cases of the set (3 to 6 modules each)
MAX_TOKENS = 16
TEMPERATURE = 0.8
EOS_TEXT = "<|im_end|>"


@pytest.fixture(scope="module")
def llm(smollm2_model):
    # recompute_first 0 (the setting's default is 16): the offline reference's APE arms recompute nothing
    with module_cache_llm(smollm2_model, cpu_bytes=512 << 20, recompute_first=0) as engine:
        yield engine


@pytest.fixture(scope="module")
def cases(llm):
    """The cases' token ids, with the header and every module encoded in the engine (modules after the header)."""
    from kvreuse.vllm.modules import encode_modules

    tokenizer = llm.get_tokenizer()

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    tokenized = [tokenize_case(case, encode) for case in make_cases(QA_SETS["mixed"], encode)[:CASES]]
    header = encode(HEADER)
    unique = list(dict.fromkeys(ids for tc in tokenized for ids in tc.modules))
    modules = {f"module-{i}": list(ids) for i, ids in enumerate(unique)}
    encode_modules(llm, {"header": header, **modules}, contexts={name: header for name in modules})
    return tokenized


@pytest.fixture(scope="module")
def reference(smollm2_model, cases):
    """Per case, the offline reference's first-token log-probabilities and 16 greedy tokens, with APE (T = 0.8)
    and without, over the same anchored splice."""
    from splice_reference import ApeBias, ReferenceLlama, as_module, splice
    from transformers import AutoTokenizer, LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(smollm2_model, torch_dtype=torch.float32).eval()
    model = ReferenceLlama(hf)
    eos = AutoTokenizer.from_pretrained(smollm2_model).convert_tokens_to_ids(EOS_TEXT)
    results = []
    for tc in cases:
        head = model.encode(tc.header)
        stored = [as_module(f"m{i}", model.encode(ids, head)) for i, ids in enumerate(tc.modules)]
        cache = splice(head, stored, model.spec)
        bias = ApeBias(torch.arange(len(tc.header), len(cache)), TEMPERATURE, 1.0)
        results.append(
            {
                name: model.generate(cache, list(tc.question), max_new_tokens=MAX_TOKENS, eos=eos, ape=ape)
                for name, ape in (("ape", bias), ("plain", None))
            }
        )
    return results


def generate(llm, prompt, ape=None, *, reset=True):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    eos = llm.get_tokenizer().convert_tokens_to_ids(EOS_TEXT)
    extra = None if ape is None else {"kv_transfer_params": {"kvreuse_ape": ape}}
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=[eos], logprobs=LOGPROBS, extra_args=extra
    )
    if reset:
        llm.reset_prefix_cache()
    return llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]


def first_token_gap(out, logits) -> float:
    """Largest gap between the engine's first-token log-probabilities and the reference's (over the engine's
    candidates)."""
    theirs = torch.log_softmax(logits.double(), -1)
    return max(abs(entry.logprob - float(theirs[token])) for token, entry in out.outputs[0].logprobs[0].items())


def _figures(worker):
    from kvreuse.vllm.runtime import module_figures

    return module_figures()


def loaded(llm) -> int:
    return llm.collective_rpc(_figures)[0]["tokens_loaded"]


def test_the_engines_ape_gives_the_references_tokens(llm, cases, reference):
    for tc, ref in zip(cases, reference):
        out = generate(llm, tc.prompt, {"temperature": TEMPERATURE})
        assert out.num_cached_tokens == len(tc.prompt) - len(tc.question)  # the whole run was spliced
        assert list(out.outputs[0].token_ids) == ref["ape"].tokens, tc.case.key
        assert first_token_gap(out, ref["ape"].first_logits) <= LOGPROB_TOLERANCE, tc.case.key


def test_the_control_an_engine_without_ape_is_not_the_references_ape(llm, cases, reference):
    """Without APE the engine gives the reference's plain splice, and that is far from APE's first token: so the
    test above fails where the engine does not apply APE."""
    for tc, ref in zip(cases, reference):
        out = generate(llm, tc.prompt)
        assert first_token_gap(out, ref["plain"].first_logits) <= LOGPROB_TOLERANCE, tc.case.key
        assert first_token_gap(out, ref["ape"].first_logits) > 10 * LOGPROB_TOLERANCE, tc.case.key


def test_temperature_1_and_scale_1_is_todays_splice(llm, cases):
    tc = cases[0]
    plain = generate(llm, tc.prompt)
    off = generate(llm, tc.prompt, {"temperature": 1.0, "scale": 1.0})
    assert off.num_cached_tokens == plain.num_cached_tokens
    assert off.outputs[0].token_ids == plain.outputs[0].token_ids
    ours, theirs = off.outputs[0].logprobs[0], plain.outputs[0].logprobs[0]
    assert all(ours[t].logprob == theirs[t].logprob for t in theirs)  # the same computation, bit for bit


def test_the_prefix_cache_shares_module_blocks_with_plain_splices_but_not_the_blocks_after_them(llm, cases):
    """APE changes no module KV, only that of the tokens after the modules: an APE request finds a plain splice's
    blocks of module tokens alone in vLLM's prefix cache and loads only the tokens of the block where the modules
    end; a plain request never gets an APE request's later blocks, nor one APE setting another's."""
    block = 32  # kvreuse.localmodel.local_engine_args
    tc = next(tc for tc in cases if (len(tc.prompt) - 1) // block > (len(tc.prompt) - len(tc.question)) // block)
    run = len(tc.prompt) - len(tc.question)
    shared = run // block * block  # the blocks holding module tokens only
    fresh_ape = generate(llm, tc.prompt, {"temperature": TEMPERATURE})
    fresh_plain = generate(llm, tc.prompt)  # the prefix cache now holds the plain splice's blocks
    before = loaded(llm)
    ape = generate(llm, tc.prompt, {"temperature": TEMPERATURE}, reset=False)
    assert loaded(llm) - before == run - shared  # the module-only blocks came from the prefix cache
    assert ape.outputs[0].token_ids == fresh_ape.outputs[0].token_ids
    assert ape.num_cached_tokens == run
    before = loaded(llm)
    again = generate(llm, tc.prompt, {"temperature": TEMPERATURE}, reset=False)
    assert loaded(llm) == before and again.num_cached_tokens > run  # its own blocks after the modules are shared
    assert again.outputs[0].token_ids == fresh_ape.outputs[0].token_ids
    before = loaded(llm)
    other = generate(llm, tc.prompt, {"temperature": 0.5}, reset=False)
    assert loaded(llm) - before == run - shared and other.num_cached_tokens == run  # another setting: not shared
    before = loaded(llm)
    plain = generate(llm, tc.prompt, reset=False)
    assert plain.num_cached_tokens > run and loaded(llm) == before  # the plain request's own blocks, not APE's
    assert plain.outputs[0].token_ids == fresh_plain.outputs[0].token_ids
