"""The compatibility matrix's LoRA and speculation rows (``MATRIX`` in ``test_compatibility_matrix.py``): each
column's engine with LoRA and n-gram speculation on, on the real model (SmolLM2-135M-Instruct), in-process.

A module of its own: vLLM keeps one KV connector per process (its worker's transfer group), so two in-process
engines alive at once would share the last one's; here the columns' engines of the matrix are gone (pytest ends a
module's fixtures with the module), and one featured engine lives at a time. The references come from one stock
engine with LoRA on: its adapter's answers, and the base model's (the same greedy path as the stock engine's,
checked at every decided step by ``greedy.py``).
"""

from __future__ import annotations

import pytest
from greedy import assert_same_greedy_path
from test_compatibility_matrix import LONG, PLUGINS, PROMPTS, REPO, _counter, crowd, engine, greedy, release

pytestmark = pytest.mark.engine


# SmolLM2's chat prompts with a module: SYSTEM starts each prompt (encoded alone, its spliced KV is a full
# prefill's there), NOTES follows it (encoded alone, so moved: recomputed by the default recompute_first), and FREE
# is text no module holds, before NOTES in the prompts that test a module after free text.
SYSTEM = "<|im_start|>system\nYou are a careful assistant. Answer every question in one short sentence.<|im_end|>"
NOTES = (
    "<|im_start|>user\nNotes: the ferry to Tallinn leaves at nine, the museum opens at ten and closes at six, "
    "and the old town market sells amber, wool and rye bread every morning except Monday."
)
FREE = "<|im_start|>user\nRead the notes below before you answer, and keep the answer short and plain, please."
QUESTIONS = ("When does the museum close?", "What does the market sell?", "When does the ferry leave?")
SPECULATION = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
FEATURES = dict(enable_lora=True, max_lora_rank=8, max_loras=1, speculative_config=SPECULATION)


def asked(*parts: str, question: str) -> str:
    return "\n".join(parts) + f"\nQuestion: {question}<|im_end|>\n<|im_start|>assistant\n"


SYSTEM_PROMPTS = [asked(SYSTEM, f"<|im_start|>user\n{q}", question="Answer it.") for q in QUESTIONS[:2]]
LORA_PROMPTS = [PROMPTS[0], *SYSTEM_PROMPTS]


@pytest.fixture(scope="module")
def adapter(smollm2_model):
    from vllm.lora.request import LoRARequest

    from kvreuse.localmodel import build_lora_adapter

    return LoRARequest(
        "random-r8", 1, str(build_lora_adapter(smollm2_model, REPO / "build" / "models" / "smollm2-lora"))
    )


@pytest.fixture(scope="module")
def stock_lora(smollm2_model, adapter):
    """The stock engine with LoRA on, no speculation: its answers with the adapter, and without it (the stock
    engine's)."""
    llm = engine(smollm2_model, "stock", enable_lora=True, max_lora_rank=8, max_loras=1)
    try:
        yield {
            "lora": greedy(llm, LORA_PROMPTS, lora_request=adapter),
            "base": greedy(llm, SYSTEM_PROMPTS),
            "greedy": greedy(llm, PROMPTS),
        }
    finally:
        release(llm)


@pytest.fixture(scope="module", params=PLUGINS)
def featured(request, smollm2_model, stock_lora):
    """Each column's engine with LoRA and n-gram speculation on; the module cache's columns hold SYSTEM and NOTES
    encoded by the base model (no adapter). Started after the reference engines: each engine's Prometheus logger
    replaces vLLM's collectors, so the speculation counters read are the engine started last's."""
    from kvreuse.vllm.modules import encode_modules

    llm = engine(smollm2_model, request.param, **FEATURES)
    try:
        if request.param in ("modules", "all"):
            encode_modules(llm, {"system": SYSTEM, "notes": NOTES})
        yield request.param, llm
    finally:
        release(llm)


def test_lora_requests_give_the_stock_lora_engines_answers(featured, stock_lora, adapter):
    """The issue's wrong answers: a module encoded without an adapter was spliced into requests that use one, and
    its blocks then entered vLLM's prefix cache under the adapter's hashes. Now a LoRA request splices only an
    encoding computed with its adapter: none at first (it computes the module), then the adapter's own."""
    from kvreuse.vllm.modules import encode_modules, module_token_ids

    name, llm = featured
    llm.reset_prefix_cache()
    outputs = greedy(llm, LORA_PROMPTS, lora_request=adapter)
    for i, (reference, ours) in enumerate(zip(stock_lora["lora"], outputs)):
        assert_same_greedy_path(reference, ours, f"{name} + LoRA, prompt {i}")
    if name not in ("modules", "all"):
        return
    llm.reset_prefix_cache()
    assert _cached_tokens(llm, SYSTEM_PROMPTS[0], adapter) == 0  # the base model's SYSTEM is not the adapter's
    encode_modules(llm, {"system": SYSTEM}, lora_request=adapter)
    for rerun in ("spliced", "from vLLM's prefix cache"):
        if rerun == "spliced":
            llm.reset_prefix_cache()
        outputs = greedy(llm, SYSTEM_PROMPTS, lora_request=adapter)
        for i, (reference, ours) in enumerate(zip(stock_lora["lora"][1:], outputs)):
            assert_same_greedy_path(reference, ours, f"{name} + LoRA, SYSTEM prompt {i} ({rerun})")
        base = greedy(llm, SYSTEM_PROMPTS)  # requests without the adapter still take the base model's encoding
        for i, (reference, ours) in enumerate(zip(stock_lora["base"], base)):
            assert_same_greedy_path(reference, ours, f"{name}, SYSTEM prompt {i} without LoRA ({rerun})")
    llm.reset_prefix_cache()
    system = len(module_token_ids(llm.get_tokenizer(), SYSTEM))
    assert _cached_tokens(llm, SYSTEM_PROMPTS[0], adapter) == system  # now the adapter's encoding is spliced


def test_ngram_speculation_gives_the_stock_answers(featured, stock_lora):
    name, llm = featured
    drafted = _counter(llm, "vllm:spec_decode_num_draft_tokens")
    for i, (reference, ours) in enumerate(zip(stock_lora["greedy"], greedy(llm, PROMPTS))):
        assert_same_greedy_path(reference, ours, f"{name} + n-gram speculation, prompt {i}")
    assert _counter(llm, "vllm:spec_decode_num_draft_tokens") > drafted  # speculation ran


def test_a_prompt_gets_the_same_tokens_alone_and_in_a_busy_batch(featured, monkeypatch):
    """The issue's timing: the same prompt took a module after free text from the cache in one run and computed it
    in another, depending on where vLLM's prefix hit (another request's blocks) ended. Now the plan is the prompt's
    own: ``after_free`` (FREE, then NOTES) is the same alone and after a request that shares its first blocks, and
    ``recomputed`` (SYSTEM, then NOTES with its first tokens recomputed, then a long question) the same alone, in
    one step, and in a batch whose step budget vLLM spends on a long prompt first, prefilling it in chunks (the
    prefix-affinity scheduler may admit it first: the chunks are checked on the stock scheduler's column).
    Speculation is on. On the columns without the module cache nothing is spliced: not run (their answers alone
    are checked above)."""
    from kvreuse.vllm.modules.scheduler import ModuleScheduler

    name, llm = featured
    if name not in ("modules", "all"):
        pytest.skip("no module cache in this column")
    after_free = asked(FREE, NOTES, question=QUESTIONS[0])
    sharing = asked(FREE, NOTES, question=QUESTIONS[1])  # the same first blocks
    recomputed = asked(SYSTEM, NOTES, question=f"{LONG[:600]} {QUESTIONS[2]}")
    length = len(llm.get_tokenizer().encode(recomputed))
    loads: list[tuple[int, int]] = []  # (vLLM's computed count after the load, tokens scheduled) of each recompute
    original = ModuleScheduler._loads

    def watched(self, scheduler_output):
        specs = original(self, scheduler_output)
        loads.extend((s.start, scheduler_output.num_scheduled_tokens[s.req_id]) for s in specs if s.recompute)
        return specs

    monkeypatch.setattr(ModuleScheduler, "_loads", watched)
    alone = []
    for prompt in (after_free, recomputed):
        llm.reset_prefix_cache()
        alone += greedy(llm, [prompt])
    assert loads and all(start + scheduled == length for start, scheduled in loads)  # in one step
    llm.reset_prefix_cache()
    loads.clear()
    busy = greedy(llm, [crowd()[0] * 2, sharing, after_free, recomputed])[2:]  # the first fills a step's budget
    for what, reference, ours in zip(("after free text", "recomputed"), alone, busy):
        assert_same_greedy_path(reference, ours, f"{name}: {what}, alone and in a busy batch")
    if name == "modules":
        assert any(start + scheduled < length for start, scheduled in loads)  # its prefill was chunked


def _cached_tokens(llm, prompt: str, lora_request=None) -> int:
    from vllm import SamplingParams

    out = llm.generate(
        [prompt], SamplingParams(max_tokens=1, temperature=0.0), lora_request=lora_request, use_tqdm=False
    )
    return int(out[0].num_cached_tokens or 0)
