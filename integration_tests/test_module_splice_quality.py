"""What a splice recomputes or re-weighs to keep answers, in the real CPU engine, on the real trained model
(smollm2), each against what it must equal:

- **LegoLink recompute** (``modules.recompute_first``): the tokens recomputed inside a spliced run get their own
  positions, slots and causal mask, so recomputing every token whose spliced KV is not what a full prefill computes
  gives the full prefill's answer; the engine's default (16) applies to requests that do not ask for their own.
- **CacheBlend's token choice made at encode time** (``modules.recompute_share``): modules encoded with
  ``encode_modules(..., probe=header)`` are ranked in the engine, and a splice that recomputes each module's top
  share gives the 16 greedy tokens of the offline reference (``benchmarks/module_quality.py``'s ``blend-all-10%``
  arm: the same ranking by ``kvreuse.modules.blend``, the chosen tokens recomputed through every layer over the naive
  splice, in plain PyTorch); recomputing 100% is full prefill.
- **One budget per prompt** (``modules.recompute_budget``): over the same probed modules, the engine recomputes
  the budget's share of the spliced run's tokens, and all of them is the full prefill.
- **CacheBlend's choice from the request** (``modules.recompute_blend`` / ``blend_layers``): the engine's pass over
  the first layers and its choice give the 16 greedy tokens and first-token log-probabilities of the offline
  reference (``benchmarks/splice_reference.py``'s ``KVDeviation``: every module token computed through the first
  layers, the top share by deviation on the next recomputed in the rest); all of them is the full prefill; vLLM's
  prefix cache gives the blended blocks to the same request only.
- **APE** (``modules.ape_temperature`` / ``ape_scale``; per request ``kvreuse_ape``) over modules encoded after the
  header (``anchored``, as the offline arm ``ape-anchored-T0.8``), against the offline reference
  (``benchmarks/splice_reference.py``, ``ApeBias``).

One engine for the module (the module connector, kvreuse's attention backend in place of CPU_ATTN, dense, ``beta =
inf``, float32, ``modules.recompute_first`` at its default); each request sets its own recompute and APE settings with
``kv_transfer_params``, the CacheBlend and APE requests a recompute_first of 0, as their offline references recompute
nothing besides their own choice. The full prefill is the same engine with vLLM's ``skip_reading_prefix_cache`` (the
connector is not asked). The prefix cache is reset before a request unless the test is about it, so that its modules
come from the connector.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from greedy import LOGPROB_TOLERANCE, LOGPROBS, assert_same_greedy_path
from real_engine import module_cache_llm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from module_quality_data import QA_SETS, make_cases, tokenize_case  # noqa: E402

pytestmark = pytest.mark.engine

EOS_TEXT = "<|im_end|>"
MAX_TOKENS = 16
CASES = 3  # the first cases of the QA set `mixed` (3 to 6 modules each)
SHARE = 0.10  # the CacheBlend arm's recompute share
BLEND = 0.20  # the share of the choice from the request
TEMPERATURE = 0.8  # the APE arm's

# The LegoLink tests' two modules. A is longer than B: recomputing the first len(B) tokens of each module recomputes
# all of B and A's head.
TEXTS = {
    "A": (
        "Profile of Marta Ilves. Marta Ilves was born in 1961 in the harbour town of Pärnu. She trained as a marine "
        "engineer, designed ferry hulls for twenty years and now keeps bees on an island farm with her two dogs."
    ),
    "B": "Profile of Oskar Brandt. Oskar Brandt is a baker from Kiel whose rye bread won a national prize in 2004.",
}
QUESTION = "\nQuestion: In which town was Marta Ilves born?\nAnswer:"


@pytest.fixture(scope="module")
def llm(smollm2_model):
    with module_cache_llm(smollm2_model, cpu_bytes=512 << 20) as engine:
        yield engine


def generate(
    llm,
    prompt,
    *,
    recompute_first: int | None = None,
    share: float | None = None,
    budget: float | None = None,
    blend: float | None = None,
    blend_layers: int | None = None,
    ape: dict | None = None,
    full: bool = False,
    reset: bool = True,
    ignore_eos: bool = False,
):
    """One greedy generation of ``MAX_TOKENS`` tokens (stopping at the end of the turn unless ``ignore_eos``), with
    the request's own settings where given (else the engine's)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    own = {
        key: value
        for key, value in (
            ("kvreuse_recompute_first", recompute_first),
            ("kvreuse_recompute_share", share),
            ("kvreuse_recompute_budget", budget),
            ("kvreuse_recompute_blend", blend),
            ("kvreuse_blend_layers", blend_layers),
            ("kvreuse_ape", ape),
        )
        if value is not None
    }
    params = SamplingParams(
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        stop_token_ids=[llm.get_tokenizer().convert_tokens_to_ids(EOS_TEXT)],
        ignore_eos=ignore_eos,
        logprobs=LOGPROBS,
        skip_reading_prefix_cache=full,
        extra_args={"kv_transfer_params": own} if own else None,
    )
    if reset:
        llm.reset_prefix_cache()
    return llm.generate([TokensPrompt(prompt_token_ids=list(prompt))], params, use_tqdm=False)[0]


def gap(a, b) -> float:
    """Largest gap between two generations' first-token log-probabilities over their common candidates."""
    ours, theirs = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
    return max(abs(ours[t].logprob - theirs[t].logprob) for t in set(ours) & set(theirs))


def gap_to_logits(out, logits) -> float:
    """Largest gap between the engine's first-token log-probabilities and a reference's logits (over the engine's
    candidates)."""
    theirs = torch.log_softmax(logits.double(), -1)
    return max(abs(entry.logprob - float(theirs[token])) for token, entry in out.outputs[0].logprobs[0].items())


def _figures(worker):
    from kvreuse.vllm.runtime import module_figures

    return module_figures()


def loaded(llm) -> int:
    return llm.collective_rpc(_figures)[0]["tokens_loaded"]


# --- LegoLink: recompute the first k tokens of each spliced module ---


def legolink(llm, prompt, **settings):
    """The LegoLink tests' generations: all ``MAX_TOKENS`` tokens, so that more steps are compared."""
    return generate(llm, prompt, ignore_eos=True, **settings)


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


@pytest.fixture(scope="module")
def full(llm, prompt):
    return legolink(llm, prompt[2], full=True)


def test_recomputing_every_inexact_spliced_token_gives_the_full_prefill(llm, prompt, full):
    """k = len(B): all of B is computed inside the run, after A's loaded KV; A (and the special prefix) were encoded
    where they stand, so their KV is a full prefill's and none of it is recomputed (their budget finds no more
    tokens in B). The result must be the full prefill's: a wrong position, slot, token or mask for any recomputed
    token would move it by far more than rounding."""
    prefix, ids, tokens = prompt
    run = len(prefix) + len(ids["A"]) + len(ids["B"])
    before = loaded(llm)
    out = legolink(llm, tokens, recompute_first=len(ids["B"]))
    assert loaded(llm) - before == run  # the whole run is loaded; the forward overwrote the recomputed tokens
    assert out.num_cached_tokens == run - len(ids["B"])  # vLLM counted only the tokens kept from the splice
    assert_same_greedy_path(full.outputs[0], out.outputs[0], "recompute of every inexact spliced token")
    assert gap(full, out) <= LOGPROB_TOLERANCE


def test_a_plain_splice_of_b_is_not_the_full_prefill(llm, prompt, full):
    """The control: without recompute, B's spliced KV moves the first token's log-probabilities by more than
    rounding, so the test above could fail."""
    out = legolink(llm, prompt[2], recompute_first=0)
    assert gap(full, out) > 10 * LOGPROB_TOLERANCE


@pytest.mark.parametrize(
    ("own", "field"),
    [
        ({"ape": {"temperature": 1e-300}}, "kvreuse_ape.temperature"),  # issue 26: ended the engine
        ({"ape": {"scale": 1e308}}, "kvreuse_ape.scale"),
        ({"recompute_first": 2**31}, "kvreuse_recompute_first"),
        ({"share": float("nan")}, "kvreuse_recompute_share"),
        ({"blend": float("inf")}, "kvreuse_recompute_blend"),
        ({"blend": 0.2, "blend_layers": 2**40}, "kvreuse_blend_layers"),
    ],
)
def test_a_setting_past_its_bounds_is_refused_before_the_engine_naming_the_field(llm, prompt, full, own, field):
    """vLLM's own request check, which kvreuse extends (``patches.vllm_0_32.validate_extra_args``), refuses
    the request before it reaches the engine: in ``LLM.generate`` as vLLM's ``VLLMValidationError`` (over HTTP a
    400), naming the field; the engine then answers as before."""
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError) as refused:
        generate(llm, prompt[2], **own)
    assert refused.value.parameter == f"kv_transfer_params.{field}"
    assert generate(llm, prompt[2], full=True).outputs[0].token_ids == full.outputs[0].token_ids


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
    zero = legolink(llm, tokens, recompute_first=0)
    assert loaded(llm) - before == zero.num_cached_tokens == run
    by_default = legolink(llm, tokens)
    asked = legolink(llm, tokens, recompute_first=default)
    # the prefix's and A's budget goes to B (their KV is exact where they stand)
    recomputed = min(len(ids["B"]), sum(min(len(part), default) for part in (prefix, ids["A"], ids["B"])))
    assert by_default.num_cached_tokens == asked.num_cached_tokens == run - recomputed
    assert by_default.outputs[0].token_ids == asked.outputs[0].token_ids
    assert gap(by_default, asked) == 0.0
    assert gap(zero, by_default) > 0.0  # the default's recompute changed what the question saw


def test_recomputing_every_inexact_module_token_loads_only_the_exact_ones_and_is_the_full_prefill(llm, prompt, full):
    """k at least a module's length: every module whose KV is not exact (B) is computed, so only the modules encoded
    where they stand (the special prefix and A, whose KV is a full prefill's) are kept from the splice."""
    prefix, ids, tokens = prompt
    before = loaded(llm)
    out = legolink(llm, tokens, recompute_first=10_000)
    assert loaded(llm) - before == len(prefix) + len(ids["A"]) + len(ids["B"])  # B loaded, then overwritten
    assert out.num_cached_tokens == len(prefix) + len(ids["A"])
    assert_same_greedy_path(full.outputs[0], out.outputs[0], "100% recompute")


# --- The `mixed` cases: CacheBlend's encode-time choice and APE ---


class MixedModules:
    """The first ``CASES`` cases of the QA set ``mixed`` as token ids, their header encoded alone (at position 0
    its spliced KV is exact) and their modules encoded the way the running test needs: ``"probed"`` (each module
    alone, then ranked after the header: the CacheBlend arm) or ``"anchored"`` (each module after the header: the APE
    arm). Both use the same names, so a switch re-encodes them with ``replace`` (no block of vLLM's prefix cache
    computed from the old entries matches again); a test asks for its encoding, whatever ran before it."""

    def __init__(self, llm):
        from kvreuse.vllm.modules import encode_modules

        tokenizer = llm.get_tokenizer()

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

        self.llm = llm
        self.cases = [tokenize_case(case, encode) for case in make_cases(QA_SETS["mixed"], encode)[:CASES]]
        self.header = list(self.cases[0].header)
        assert all(list(tc.header) == self.header for tc in self.cases)
        unique = dict.fromkeys(ids for tc in self.cases for ids in tc.modules)
        self.modules = {f"module-{i}": list(ids) for i, ids in enumerate(unique)}
        encode_modules(llm, {"header": self.header})
        self.encoding: str | None = None

    def encoded(self, how: str) -> list:
        from kvreuse.vllm.modules import encode_modules

        if how != self.encoding:
            if how == "anchored":
                encode_modules(self.llm, self.modules, {name: self.header for name in self.modules}, replace=True)
            else:
                encode_modules(self.llm, self.modules, replace=True, probe=self.header)
            self.encoding = how
        return self.cases


@pytest.fixture(scope="module")
def mixed(llm) -> MixedModules:
    return MixedModules(llm)


@pytest.fixture
def probed(mixed):
    return mixed.encoded("probed")


@pytest.fixture
def anchored(mixed):
    return mixed.encoded("anchored")


@pytest.fixture(scope="module")
def reference_model(smollm2_model):
    from splice_reference import ReferenceLlama
    from transformers import AutoTokenizer, LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(smollm2_model, dtype=torch.float32).eval()
    return ReferenceLlama(hf), AutoTokenizer.from_pretrained(smollm2_model).convert_tokens_to_ids(EOS_TEXT)


@pytest.fixture(scope="module")
def prepared(reference_model, mixed):
    """The offline reference's preparation of each case (``module_quality.ModuleCache``: every module encoded alone,
    and after the header for the encode-time ranking)."""
    from module_quality import ModuleCache

    model, _ = reference_model
    store = ModuleCache(model, model.encode(mixed.header))
    return [store.prepare(tc) for tc in mixed.cases]


@pytest.fixture(scope="module")
def blend_reference(reference_model, mixed, prepared):
    """The offline reference's greedy tokens per case: ``blend-all-10%`` and, for the control, ``naive``."""
    from module_quality import encoded_choice

    model, eos = reference_model
    out = []
    for tc, prep in zip(mixed.cases, prepared):
        cache, question = prep.caches["alone"], list(tc.question)
        blend = model.generate(
            cache, question, max_new_tokens=MAX_TOKENS, eos=eos, recompute=encoded_choice(SHARE, "all")(prep)
        )
        naive = model.generate(cache, question, max_new_tokens=MAX_TOKENS, eos=eos)
        out.append({"blend": blend.tokens, "naive": naive.tokens})
    return out


@pytest.fixture(scope="module")
def ape_reference(reference_model, mixed):
    """Per case, the offline reference's first-token logits and 16 greedy tokens, with APE (T = 0.8) and without,
    over the same anchored splice."""
    from splice_reference import ApeBias, as_module, splice

    model, eos = reference_model
    results = []
    for tc in mixed.cases:
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


def test_the_engines_encode_time_choice_gives_the_offline_references_tokens(llm, probed, blend_reference):
    """Each case's 16 greedy tokens with 10% of each module's tokens recomputed equal the reference's with the same
    choice; the engine computed those tokens (fewer cached tokens than the plain splice)."""
    for tc, ref in zip(probed, blend_reference):
        plain = generate(llm, tc.prompt, recompute_first=0, share=0.0)
        out = generate(llm, tc.prompt, recompute_first=0, share=SHARE)
        chosen = sum(-(-len(m) * 10 // 100) for m in tc.modules)  # ceil(10% of each module)
        assert plain.num_cached_tokens - out.num_cached_tokens == chosen
        assert list(out.outputs[0].token_ids) == ref["blend"], tc.case.key
        assert list(plain.outputs[0].token_ids) == ref["naive"], tc.case.key


def test_the_choice_changes_answers(blend_reference):
    """The control: on these cases the recomputed tokens change the reference's output, so the test above tells
    a recompute of the chosen tokens from a plain splice."""
    assert any(ref["blend"] != ref["naive"] for ref in blend_reference)


@pytest.mark.parametrize("every", [{"share": 1.0}, {"blend": 1.0}], ids=["recompute_share 1", "recompute_blend 1"])
def test_recomputing_every_module_token_is_the_full_prefill(llm, probed, every):
    """Share 1, chosen at encode time or from the request: every module token is computed (the header, encoded
    alone at position 0, stays spliced: it is exact), so the output is the full prefill's within rounding."""
    tc = probed[0]
    full = generate(llm, tc.prompt, full=True)
    out = generate(llm, tc.prompt, recompute_first=0, **every)
    assert out.num_cached_tokens == len(tc.header)
    assert_same_greedy_path(full.outputs[0], out.outputs[0], f"{every}")
    assert gap(full, out) <= LOGPROB_TOLERANCE


def test_the_budget_recomputes_its_share_of_the_spliced_run(llm, probed):
    """Budget 10%: the engine computes 10% of the run's tokens (header and modules) more than the plain splice, all
    of them in the documents (the header is exact at the prompt's start), and the output moves off the plain
    splice's."""
    moved = 0
    for tc in probed:
        plain = generate(llm, tc.prompt, recompute_first=0)
        out = generate(llm, tc.prompt, recompute_first=0, budget=SHARE)
        run = len(tc.header) + sum(len(m) for m in tc.modules)
        assert plain.num_cached_tokens - out.num_cached_tokens == round(SHARE * run), tc.case.key
        moved += out.outputs[0].logprobs[0] != plain.outputs[0].logprobs[0]
    assert moved  # the recomputed tokens changed what the model read


def test_a_budget_of_every_token_is_the_full_prefill(llm, probed):
    """Budget 1: every document token is computed (the header stays spliced: it is exact), so the output is the
    full prefill's within rounding."""
    tc = probed[0]
    full = generate(llm, tc.prompt, full=True)
    out = generate(llm, tc.prompt, recompute_first=0, budget=1.0)
    assert out.num_cached_tokens == len(tc.header)
    assert_same_greedy_path(full.outputs[0], out.outputs[0], "budget 1")
    assert gap(full, out) <= LOGPROB_TOLERANCE


@pytest.fixture(scope="module")
def runtime_reference(reference_model, mixed, prepared):
    """Per case and number of exact layers (1: CacheBlend's layer 0, every case; 2, the first case), the offline
    reference's generation with the top ``BLEND`` of the module tokens by their deviation on the next layer
    recomputed in the rest."""
    from module_quality import deviation

    model, eos = reference_model
    return [
        {
            layers: model.generate(
                prep.caches["alone"],
                list(tc.question),
                max_new_tokens=MAX_TOKENS,
                eos=eos,
                recompute=deviation({layers: BLEND})(prep),
            )
            for layers in ((1, 2) if n == 0 else (1,))
        }
        for n, (tc, prep) in enumerate(zip(mixed.cases, prepared))
    ]


def test_the_engines_choice_from_the_request_gives_the_offline_references_tokens(llm, probed, runtime_reference):
    """Each case's 16 greedy tokens and first-token log-probabilities with the engine's pass over the first 1 (or 2)
    layers and its choice of 20% of the module tokens equal the reference's; the engine computed that many tokens
    more than the plain splice, and its pass ran over every module token."""
    for tc, ref in zip(probed, runtime_reference):
        plain = generate(llm, tc.prompt, recompute_first=0)
        for layers in ref:
            before = llm.collective_rpc(_figures)[0]
            out = generate(llm, tc.prompt, recompute_first=0, blend=BLEND, blend_layers=layers)
            after = llm.collective_rpc(_figures)[0]
            tokens = sum(len(m) for m in tc.modules)
            assert plain.num_cached_tokens - out.num_cached_tokens == round(BLEND * tokens), tc.case.key
            assert after["blend_tokens"] - before["blend_tokens"] == tokens  # the header is exact: no candidate
            assert list(out.outputs[0].token_ids) == ref[layers].tokens, (tc.case.key, layers)
            assert gap_to_logits(out, ref[layers].first_logits) <= LOGPROB_TOLERANCE, (tc.case.key, layers)


def test_the_choice_from_the_request_changes_answers(runtime_reference, blend_reference):
    """The control: the chosen tokens change the reference's output from the plain splice's, so the test above tells
    the engine's choice from none."""
    assert any(ref[1].tokens != plain["naive"] for ref, plain in zip(runtime_reference, blend_reference))


def test_the_prefix_cache_gives_blended_blocks_to_the_same_request_only(llm, probed):
    """The same prompt with the same setting finds its blended blocks in vLLM's prefix cache: it loads at most the
    run's tokens in the block where the run ends (recomputing there what the first request chose) and gives the same
    tokens; another share, or none, does not get them (only blocks of the exact header, a plain splice's)."""
    block = 32  # kvreuse.localmodel.local_engine_args
    tc = probed[0]
    run = len(tc.prompt) - len(tc.question)
    fresh = generate(llm, tc.prompt, recompute_first=0, blend=BLEND)
    before = loaded(llm)
    again = generate(llm, tc.prompt, recompute_first=0, blend=BLEND, reset=False)
    assert loaded(llm) - before < block and again.num_cached_tokens > run - block - round(BLEND * run)
    assert again.outputs[0].token_ids == fresh.outputs[0].token_ids
    for other in ({"blend": 0.1}, {}):
        before = loaded(llm)
        generate(llm, tc.prompt, recompute_first=0, reset=False, **other)
        assert loaded(llm) - before >= run - len(tc.header) // block * block, other


def ape(llm, prompt, setting: dict | None, *, reset: bool = True):
    """A plain (``setting`` None) or APE splice of the anchored modules, nothing recomputed."""
    return generate(llm, prompt, recompute_first=0, ape=setting, reset=reset)


def test_the_engines_ape_gives_the_references_tokens(llm, anchored, ape_reference):
    for tc, ref in zip(anchored, ape_reference):
        out = ape(llm, tc.prompt, {"temperature": TEMPERATURE})
        assert out.num_cached_tokens == len(tc.prompt) - len(tc.question)  # the whole run was spliced
        assert list(out.outputs[0].token_ids) == ref["ape"].tokens, tc.case.key
        assert gap_to_logits(out, ref["ape"].first_logits) <= LOGPROB_TOLERANCE, tc.case.key


def test_the_control_an_engine_without_ape_is_not_the_references_ape(llm, anchored, ape_reference):
    """Without APE the engine gives the reference's plain splice, and that is far from APE's first token: so the
    test above fails where the engine does not apply APE."""
    for tc, ref in zip(anchored, ape_reference):
        out = ape(llm, tc.prompt, None)
        assert gap_to_logits(out, ref["plain"].first_logits) <= LOGPROB_TOLERANCE, tc.case.key
        assert gap_to_logits(out, ref["ape"].first_logits) > 10 * LOGPROB_TOLERANCE, tc.case.key


def test_temperature_1_and_scale_1_is_todays_splice(llm, anchored):
    tc = anchored[0]
    plain = ape(llm, tc.prompt, None)
    off = ape(llm, tc.prompt, {"temperature": 1.0, "scale": 1.0})
    assert off.num_cached_tokens == plain.num_cached_tokens
    assert off.outputs[0].token_ids == plain.outputs[0].token_ids
    ours, theirs = off.outputs[0].logprobs[0], plain.outputs[0].logprobs[0]
    assert all(ours[t].logprob == theirs[t].logprob for t in theirs)  # the same computation, bit for bit


def test_the_prefix_cache_shares_module_blocks_with_plain_splices_but_not_the_blocks_after_them(llm, anchored):
    """APE changes no module KV, only that of the tokens after the modules: an APE request finds a plain splice's
    blocks of module tokens alone in vLLM's prefix cache and loads only the tokens of the block where the modules
    end; a plain request never gets an APE request's later blocks, nor one APE setting another's."""
    block = 32  # kvreuse.localmodel.local_engine_args
    tc = next(tc for tc in anchored if (len(tc.prompt) - 1) // block > (len(tc.prompt) - len(tc.question)) // block)
    run = len(tc.prompt) - len(tc.question)
    shared = run // block * block  # the blocks holding module tokens only
    setting = {"temperature": TEMPERATURE}
    fresh_ape = ape(llm, tc.prompt, setting)
    fresh_plain = ape(llm, tc.prompt, None)  # the prefix cache now holds the plain splice's blocks
    before = loaded(llm)
    again_ape = ape(llm, tc.prompt, setting, reset=False)
    assert loaded(llm) - before == run - shared  # the module-only blocks came from the prefix cache
    assert again_ape.outputs[0].token_ids == fresh_ape.outputs[0].token_ids
    assert again_ape.num_cached_tokens == run
    before = loaded(llm)
    again = ape(llm, tc.prompt, setting, reset=False)
    assert loaded(llm) == before and again.num_cached_tokens > run  # its own blocks after the modules are shared
    assert again.outputs[0].token_ids == fresh_ape.outputs[0].token_ids
    before = loaded(llm)
    other = ape(llm, tc.prompt, {"temperature": 0.5}, reset=False)
    assert loaded(llm) - before == run - shared and other.num_cached_tokens == run  # another setting: not shared
    before = loaded(llm)
    plain = ape(llm, tc.prompt, None, reset=False)
    assert plain.num_cached_tokens > run and loaded(llm) == before  # the plain request's own blocks, not APE's
    assert plain.outputs[0].token_ids == fresh_plain.outputs[0].token_ids
