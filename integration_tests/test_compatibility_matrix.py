"""The compatibility matrix (issue 29): vLLM features users turn on, with each kvreuse plugin alone and all three
together, on the real model (SmolLM2-135M-Instruct) in vLLM's CPU engine.

One engine per column, shared by that column's tests, in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the case
that failed at start with ``KVReuseSparseFigures``): the stock engine (the reference), ``reorder`` (the prefix-
affinity scheduler), ``modules`` (the module-cache connector, kvreuse's attention backend at beta = inf), ``sparse``
(the backend at beta = inf with the figures' connector) and ``all`` (scheduler + module cache + backend; the module
cache's connector carries the sparse figures too: one connector slot, see ``KVReuseSparseFigures``). Every
column's engine has a small KV cache (preemption) and a small step budget (chunked prefill of the long prompt).

Where the math says the answer is the stock engine's (beta = inf, no module in the prompt, a plain prefix hit),
greedy tokens are compared with the stock engine's (``greedy.py``: the same tokens at every decided step); elsewhere
the output is checked for validity (``n`` outputs, a choice among the allowed ones, the finish reason, an aborted
request's blocks back). ``MATRIX`` is the docs' compatibility table (docs/reference/compatibility.md), generated
from it by ``matrix_table`` when the site is built; ``test_the_docs_show_this_matrix`` checks the page asks for it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from greedy import LOGPROBS, assert_same_greedy_path
from real_engine import MODULE_CONNECTOR, start_llm, stop_llm

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[1]
PLUGINS = ("reorder", "modules", "sparse", "all")
TESTED, UNTESTED, NOT_APPLICABLE = "tested", "not tested", "n/a"
# Feature -> (how it is turned on, its cell per column, the test that checks it or why it is not tested).
MATRIX: dict[str, tuple[str, dict[str, str], str]] = {
    "greedy answers = stock": ("default", dict.fromkeys(PLUGINS, TESTED), "test_greedy_answers_are_the_stock_engines"),
    "prefix caching on (a hit)": (
        "`enable_prefix_caching=True` (default)",
        dict.fromkeys(PLUGINS, TESTED),
        "test_a_prefix_cache_hit_gives_the_stock_answer",
    ),
    "prefix caching off": (
        "`enable_prefix_caching=False`",
        {"reorder": UNTESTED, "modules": UNTESTED, "sparse": UNTESTED, "all": TESTED},
        "test_all_plugins_without_prefix_caching_give_the_stock_answer",
    ),
    "chunked prefill": (
        "`max_num_batched_tokens` below the prompt",
        dict.fromkeys(PLUGINS, TESTED),
        "test_greedy_answers_are_the_stock_engines (the long prompt is prefilled in chunks)",
    ),
    "preemption (small KV cache)": (
        "`kv_cache_memory_bytes` small",
        dict.fromkeys(PLUGINS, TESTED),
        "test_requests_preempted_for_room_give_the_stock_answers",
    ),
    "n > 1": ("`SamplingParams(n=2)`", dict.fromkeys(PLUGINS, TESTED), "test_n_samples_come_back"),
    "max_tokens hit vs EOS": (
        "`max_tokens`, `ignore_eos`",
        dict.fromkeys(PLUGINS, TESTED),
        "test_finish_reasons_are_length_and_stop",
    ),
    "structured outputs": (
        "`StructuredOutputsParams(choice=...)`",
        dict.fromkeys(PLUGINS, TESTED),
        "test_a_structured_output_is_one_of_the_choices",
    ),
    "abort": ("`LLMEngine.abort_request`", dict.fromkeys(PLUGINS, TESTED), "test_an_aborted_request_frees_its_blocks"),
    "in-process engine": (
        "`VLLM_ENABLE_V1_MULTIPROCESSING=0`",
        dict.fromkeys(PLUGINS, TESTED),
        "every test here (the engines run in-process)",
    ),
    "streaming, client disconnects": (
        "`vllm serve`",
        dict.fromkeys(PLUGINS, NOT_APPLICABLE),
        "engine-side they are aborts (row above); the HTTP layer is vLLM's own",
    ),
    "LoRA adapters": (
        "`enable_lora=True`, `LoRARequest`",
        dict.fromkeys(PLUGINS, TESTED),
        "test_lora_requests_give_the_stock_lora_engines_answers (a random r = 8 adapter on q, k, v, o; modules "
        "encoded with and without it)",
    ),
    "speculative decoding, n-gram": (
        '`speculative_config={"method": "ngram"}`',
        dict.fromkeys(PLUGINS, TESTED),
        "test_ngram_speculation_gives_the_stock_answers, test_a_prompt_gets_the_same_tokens_alone_and_in_a_busy_batch",
    ),
    "speculative decoding, draft model or EAGLE": (
        "`speculative_config` with a draft model",
        dict.fromkeys(PLUGINS, UNTESTED),
        "no draft model of SmolLM2 here",
    ),
}

LONG = " ".join(f"Item {i}: the crate holds {i % 7} red and {i % 5} blue marbles." for i in range(60))
PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nName three colours of the rainbow.<|im_end|>\n<|im_start|>assistant\n",
    f"<|im_start|>user\n{LONG}\nHow many red marbles does item 3 hold?<|im_end|>\n<|im_start|>assistant\n",
]
MAX_TOKENS = 12
# SmolLM2's float32 KV is 46 KB a token (30 layers x K, V x 3 heads x 64): 80 MiB hold 56 blocks of 32 tokens (49
# with the sparse backend's sketch rows), at least max_model_len. 256 tokens a step: the long prompt is prefilled in
# chunks.
SMALL_KV = 80 << 20
ENGINE = dict(kv_cache_memory_bytes=SMALL_KV, max_num_batched_tokens=256, max_model_len=1280, max_num_seqs=8)
SCHEDULER = {"scheduler_cls": "kvreuse.vllm.PrefixAffinityScheduler"}
# The scheduler admits by default only what the cache can hold to completion, which avoids preemption; off here,
# so that preemption is exercised with it too.
DENSE = {"sparse": {"beta": float("inf")}, "reorder": {"admit_to_completion": False}}
FIGURES_CONNECTOR = {"kv_connector": "KVReuseSparseFigures", "kv_role": "kv_both"}
COLUMNS = {
    "stock": ({}, {}),
    "reorder": (dict(**SCHEDULER, additional_config={"kvreuse": DENSE}), {}),
    "modules": (
        dict(kv_transfer_config=MODULE_CONNECTOR, additional_config={"kvreuse": DENSE}),
        {"KVREUSE_SPARSE_CPU_BACKEND": "1"},
    ),
    "sparse": (
        dict(kv_transfer_config=FIGURES_CONNECTOR, additional_config={"kvreuse": DENSE}),
        {"KVREUSE_SPARSE_CPU_BACKEND": "1"},
    ),
    "all": (
        dict(**SCHEDULER, kv_transfer_config=MODULE_CONNECTOR, additional_config={"kvreuse": DENSE}),
        {"KVREUSE_SPARSE_CPU_BACKEND": "1"},
    ),
}


def engine(model: Path, column: str, **overrides):
    """An in-process engine of ``column`` (stopped by the caller with ``release``). vLLM runs its plugins once per
    process, when the first engine starts, so the switch to kvreuse's backend that the plugin makes there for
    ``KVREUSE_SPARSE_CPU_BACKEND=1`` is made here for each column that sets it (a user sets the variable before the
    first engine)."""
    from kvreuse.patches import vllm_0_32
    from kvreuse.vllm.names import SPARSE_BACKEND, SPARSE_CPU_SWITCH

    args, env = COLUMNS[column]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        for name, value in env.items():
            mp.setenv(name, value)
        if SPARSE_CPU_SWITCH in env:
            vllm_0_32.replace_cpu_attention(SPARSE_BACKEND)
        return start_llm(model, **{**ENGINE, **args, **overrides})


def release(llm) -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    stop_llm(llm)
    if AttentionBackendEnum.CPU_ATTN.is_overridden():
        AttentionBackendEnum.CPU_ATTN.clear_override()


def greedy(llm, prompts, max_tokens: int = MAX_TOKENS, lora_request=None):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=LOGPROBS)
    return [out.outputs[0] for out in llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)]


@pytest.fixture(scope="module")
def stock(smollm2_model):
    llm = engine(smollm2_model, "stock")
    try:
        yield {"greedy": greedy(llm, PROMPTS), "crowd": greedy(llm, crowd(), CROWD_TOKENS)}
    finally:
        release(llm)


@pytest.fixture(scope="module", params=PLUGINS)
def column(request, smollm2_model, stock):
    llm = engine(smollm2_model, request.param)
    try:
        yield request.param, llm
    finally:
        release(llm)


def crowd() -> list[str]:
    """Six ~300-token prompts decoding 112 tokens each: five fit ``SMALL_KV`` at admission (four with the sketch
    rows), and their decodes outgrow it, so the scheduler preempts."""

    def items(case: int) -> str:  # each prompt its own from the first block on: no shared prefix blocks
        return " ".join(f"Crate {case}-{i} holds {(i + case) % 7} red and {i % 5} blue marbles." for i in range(18))

    return [f"<|im_start|>user\n{items(i)}\nWhich crate holds the most marbles?" for i in range(6)]


CROWD_TOKENS = 112


def test_greedy_answers_are_the_stock_engines(column, stock):
    name, llm = column
    for i, (reference, ours) in enumerate(zip(stock["greedy"], greedy(llm, PROMPTS))):
        assert_same_greedy_path(reference, ours, f"{name}, prompt {i}")


def test_a_prefix_cache_hit_gives_the_stock_answer(column, stock):
    from vllm import SamplingParams

    name, llm = column
    llm.reset_prefix_cache()
    greedy(llm, [PROMPTS[2]])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=LOGPROBS)
    again = llm.generate([PROMPTS[2]], params, use_tqdm=False)[0]
    assert again.num_cached_tokens and again.num_cached_tokens >= 32
    assert_same_greedy_path(stock["greedy"][2], again.outputs[0], f"{name}, prefix hit")


def test_requests_preempted_for_room_give_the_stock_answers(column, stock):
    name, llm = column
    before = _counter(llm, "vllm:num_preemptions")
    outputs = greedy(llm, crowd(), CROWD_TOKENS)
    assert _counter(llm, "vllm:num_preemptions") > before  # the cache is small enough: the test can fail
    for i, (reference, ours) in enumerate(zip(stock["crowd"], outputs)):
        assert_same_greedy_path(reference, ours, f"{name}, crowded prompt {i}")


def test_n_samples_come_back(column):
    from vllm import SamplingParams

    _, llm = column
    out = llm.generate(PROMPTS[:1], SamplingParams(n=2, max_tokens=6, temperature=0.8, seed=1), use_tqdm=False)[0]
    assert len(out.outputs) == 2 and all(len(o.token_ids) == 6 for o in out.outputs)


def test_finish_reasons_are_length_and_stop(column):
    from vllm import SamplingParams

    _, llm = column
    length = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)[0].outputs[0]
    stop = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=64, temperature=0.0), use_tqdm=False)[0].outputs[0]
    assert length.finish_reason == "length" and len(length.token_ids) == 3
    assert stop.finish_reason == "stop" and len(stop.token_ids) < 64


def test_a_structured_output_is_one_of_the_choices(column):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    _, llm = column
    choices = ["Paris", "London", "Berlin"]
    params = SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=StructuredOutputsParams(choice=choices))
    assert llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].text in choices


def test_an_aborted_request_frees_its_blocks(column, stock):
    """A request aborted after its prefill gives its blocks back (the free-block count is what it was), leaves no
    unfinished request, and the next answer is still the stock engine's."""
    from vllm import SamplingParams

    name, llm = column
    llm.reset_prefix_cache()
    core = llm.llm_engine
    free = _free_blocks(llm)
    core.add_request("abort-me", PROMPTS[2], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        core.step()
    assert _free_blocks(llm) < free
    core.abort_request(["abort-me"])
    while core.has_unfinished_requests():
        core.step()
    llm.reset_prefix_cache()
    assert _free_blocks(llm) == free
    assert_same_greedy_path(stock["greedy"][0], greedy(llm, PROMPTS[:1])[0], f"{name}, after an abort")


def test_all_plugins_without_prefix_caching_give_the_stock_answer(smollm2_model, stock):
    """Without vLLM's prefix cache nothing is folded into block hashes (the module cache has no cached block to tell
    apart) and the scheduler admits by arrival; the answers are the stock engine's."""
    llm = engine(smollm2_model, "all", enable_prefix_caching=False)
    try:
        for i, (reference, ours) in enumerate(zip(stock["greedy"], greedy(llm, PROMPTS))):
            assert_same_greedy_path(reference, ours, f"all, no prefix caching, prompt {i}")
    finally:
        release(llm)


def test_the_docs_show_this_matrix():
    """The compatibility page is generated from ``MATRIX`` (docs/docs_reference.py runs ``matrix_table``)."""
    sys.path.insert(0, str(REPO / "docs"))
    import docs_reference

    page = (REPO / "docs" / "reference" / "compatibility.md").read_text()
    assert ("compatibility", None) in docs_reference.markers(page)
    assert docs_reference.compatibility_table() == matrix_table()
    for feature in MATRIX:
        assert f"| {feature} |" in docs_reference.render(page), feature


def matrix_table() -> str:
    """``MATRIX`` as the docs' Markdown table (vLLM columns; SGLang's column is prose below it)."""
    lines = [
        "| vLLM feature | turned on with | reorder | modules | sparse | all three | checked by |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for feature, (how, cells, test) in MATRIX.items():
        shown = test if not test.startswith("test_") else f"`{test.split(' ')[0]}`{test[len(test.split(' ')[0]) :]}"
        lines.append(f"| {feature} | {how} | {' | '.join(cells[p] for p in PLUGINS)} | {shown} |")
    return "\n".join(lines)


def _counter(llm, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == name and hasattr(m, "value"))


def _free_blocks(llm) -> int:
    """The free KV blocks of the in-process engine's scheduler."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    return int(scheduler.kv_cache_manager.block_pool.get_num_free_blocks())


if __name__ == "__main__":  # print the docs' table
    print(matrix_table())
