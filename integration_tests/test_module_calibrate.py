"""Calibrating the module cache's recompute on the real model in the engine (``calibrate_modules``): the setting
chosen on a sample of the QA set's prompts keeps its agreement floor on held-back prompts of the same kind.

One engine (the module connector over kvreuse's attention backend on vLLM's CPU build, SmolLM2, float32), the
header and the modules of the first ``2 * SAMPLE`` cases of the QA set ``mixed`` encoded alone; agreement is the
first ``MAX_TOKENS`` greedy tokens equal to full prefill's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from real_engine import module_cache_llm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from module_quality_data import QA_SETS, make_cases, tokenize_case  # noqa: E402

pytestmark = pytest.mark.engine

SAMPLE = 8  # prompts calibrated on, and as many held back
# SmolLM2's first 4 tokens agree with full prefill's on these 8 prompts for 1, 3, 4 and 4 of 8 with recompute_first
# 0, 16, 32 and 64 (README): no candidate keeps 75%; a floor of 25% rules the plain splice out and keeps 16.
FLOOR = 0.25
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def prompts(smollm2_model):
    from kvreuse.vllm.modules import encode_modules

    with module_cache_llm(smollm2_model, cpu_bytes=512 << 20) as llm:
        tokenizer = llm.get_tokenizer()

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

        cases = [tokenize_case(c, encode) for c in make_cases(QA_SETS["mixed"], encode)[: 2 * SAMPLE]]
        unique = dict.fromkeys(ids for tc in cases for ids in tc.modules)
        encode_modules(llm, {"header": list(cases[0].header)})
        encode_modules(llm, {f"module-{i}": list(ids) for i, ids in enumerate(unique)})
        yield llm, [tc.prompt for tc in cases[:SAMPLE]], [tc.prompt for tc in cases[SAMPLE:]]


def test_the_chosen_setting_keeps_its_floor_on_held_back_prompts_and_computes_less_than_full(prompts):
    from kvreuse.modules.calibrate import ALL_TOKENS
    from kvreuse.vllm.modules.calibrate import calibrate_modules

    llm, sample, held_back = prompts
    found = calibrate_modules(llm, sample, FLOOR, max_tokens=MAX_TOKENS)
    print(found.report())
    assert found.kept and found.chosen.recompute_first != ALL_TOKENS
    assert [m.computed for m in found.curve] == sorted(m.computed for m in found.curve)
    chosen = next(m for m in found.curve if m.setting == found.chosen)
    assert chosen.agreement >= FLOOR and chosen.computed < 0.5
    assert any(m.agreement < FLOOR for m in found.curve)  # the floor rules some candidate out: the choice matters
    check = calibrate_modules(
        llm, held_back, FLOOR, firsts=(found.chosen.recompute_first,), max_tokens=MAX_TOKENS
    )  # the chosen setting alone, on prompts calibration never saw
    assert check.curve[0].agreement >= FLOOR
    assert f'"recompute_first": {found.chosen.recompute_first}' in found.report()


def _counter(name: str) -> float | None:
    """A ``kvreuse:`` counter of the offline front end, summed over its labels; ``None`` where it does not show."""
    from prometheus_client import REGISTRY

    values = [s.value for family in REGISTRY.collect() for s in family.samples if s.name == name]
    return sum(values) if values else None


def test_shadow_checks_count_every_nth_request_and_its_agreement_with_full_prefill(prompts):
    """The counters show from start-up (at 0 before any check here, whatever ran before); every second request's
    full-prefill copy is compared in the engine, and the user gets the outputs of their own requests only."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvreuse.vllm.modules.shadow import ShadowChecker

    llm, sample, _ = prompts
    checks, agreed = _counter("kvreuse:module_shadow_checks_total"), _counter("kvreuse:module_shadow_agreed_total")
    assert checks is not None and agreed is not None  # shown from start-up
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, extra_args={"kv_transfer_params": {}})
    chosen = [TokensPrompt(prompt_token_ids=p) for p in sample[:4]]
    llm.reset_prefix_cache()
    outputs = ShadowChecker(llm, every=2, compare_tokens=MAX_TOKENS).generate(chosen, params)
    assert [out.prompt_token_ids for out in outputs] == [p["prompt_token_ids"] for p in chosen]
    full = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, skip_reading_prefix_cache=True)
    expected = sum(
        list(llm.generate([chosen[i]], full, use_tqdm=False)[0].outputs[0].token_ids)
        == list(outputs[i].outputs[0].token_ids)
        for i in (0, 2)
    )
    assert _counter("kvreuse:module_shadow_checks_total") - checks == 2  # requests 0 and 2 of 4
    assert _counter("kvreuse:module_shadow_agreed_total") - agreed == expected
