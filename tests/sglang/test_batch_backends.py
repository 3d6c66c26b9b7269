"""The batch front ends' backends for SGLang: a server URL (the OpenAI-compatible backend) and an in-process
``sglang.Engine`` (``kvreuse.sglang.backend``).

The server's answers are SGLang's own response models (``CompletionResponse``, ``UsageProcessor``, ``ModelList``)
serialised as its HTTP server does, served through ``httpx.MockTransport``. SGLang's engine cannot start without a
GPU: the ``Engine`` backend is tested on its translation, with outputs in the shape SGLang's tokenizer manager
returns them and a stand-in engine that records what it was asked.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest
from sglang.srt.entrypoints.openai.protocol import CompletionResponse, CompletionResponseChoice, ModelCard, ModelList
from sglang.srt.entrypoints.openai.usage_processor import UsageProcessor

from kvreuse.batch.backend import Completion
from kvreuse.batch.openai_server import OpenAIServerBackend
from kvreuse.errors import BackendError, ConfigError
from kvreuse.sglang.backend import SGLangBackend, completions, greedy_sampling_params


def sglang_server(cache_report: bool, cached: dict[str, int], seen: list[dict]) -> httpx.MockTransport:
    """Answers as SGLang's OpenAI-compatible server does, with or without ``--enable-cache-report``."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, text=ModelList(data=[ModelCard(id="served")]).model_dump_json())
        body = json.loads(request.content)
        seen.append(body)
        prompt = body["prompt"]
        meta = {"id": "x", "prompt_tokens": len(prompt), "completion_tokens": 2, "cached_tokens": cached[prompt]}
        usage = UsageProcessor.calculate_response_usage(
            [{"meta_info": meta}], n_choices=1, enable_cache_report=cache_report
        )
        response = CompletionResponse(
            id="x",
            model=body["model"],
            usage=usage,
            choices=[CompletionResponseChoice(index=0, text=f"<{prompt}>", finish_reason="length")],
        )
        return httpx.Response(200, text=response.model_dump_json())

    return httpx.MockTransport(handle)


def test_an_sglang_server_url_works_and_reports_cached_tokens_with_enable_cache_report():
    seen: list[dict] = []
    backend = OpenAIServerBackend(  # raw text (--raw): the completions endpoint, which reports cached tokens
        "http://127.0.0.1:30000", concurrency=1, chat=False, transport=sglang_server(True, {"ab": 0, "abc": 2}, seen)
    )
    got = backend.generate(["ab", "abc"], max_tokens=4)
    assert got == [Completion("<ab>", 2, 0), Completion("<abc>", 3, 2)]
    assert [b["prompt"] for b in seen] == ["ab", "abc"] and seen[0]["model"] == "served"
    assert seen[0]["temperature"] == 0.0 and seen[0]["max_tokens"] == 4


def test_without_enable_cache_report_cached_tokens_are_unknown():
    backend = OpenAIServerBackend("http://127.0.0.1:30000", chat=False, transport=sglang_server(False, {"ab": 2}, []))
    assert backend.generate(["ab"], max_tokens=4) == [Completion("<ab>", 2, None)]


def engine_output(text: str, prompt_tokens: int, cached_tokens: int) -> dict:
    """One element of ``Engine.generate``'s answer to a batch (keys as SGLang's tokenizer manager sets them)."""
    return {
        "text": text,
        "output_ids": [1, 2],
        "meta_info": {
            "id": "r",
            "finish_reason": {"type": "length", "length": 2},
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 2,
            "cached_tokens": cached_tokens,
            "reasoning_tokens": 0,
            "e2e_latency": 0.1,
        },
    }


class StandInEngine:
    """What ``SGLangBackend`` reads from an ``sglang.Engine``: ``generate``, the tokenizer, the page size."""

    def __init__(self, page_size: int):
        self.server_args = SimpleNamespace(page_size=page_size)
        self.tokenizer_manager = SimpleNamespace(
            tokenizer=lambda prompts: {"input_ids": [[ord(c) for c in p] for p in prompts]}
        )
        self.calls = []

    def generate(self, prompt, sampling_params):
        self.calls.append((prompt, sampling_params))
        return [engine_output(p.upper(), len(p), len(p) - 1) for p in prompt]


def test_the_engine_backend_sends_the_prompts_in_order_as_one_greedy_batch():
    engine = StandInEngine(page_size=16)
    backend = SGLangBackend(engine)
    got = backend.generate(["b", "ab", "abc"], max_tokens=3)
    assert got == [Completion("B", 1, 0), Completion("AB", 2, 1), Completion("ABC", 3, 2)]
    assert engine.calls == [(["b", "ab", "abc"], {"temperature": 0.0, "max_new_tokens": 3})]
    assert backend.generate([], max_tokens=3) == [] and len(engine.calls) == 1


def test_the_engine_backend_tells_the_front_ends_its_tokenizer_and_page_size():
    backend = SGLangBackend(StandInEngine(page_size=16))
    assert backend.cache_model.block_size == 16
    assert backend.cache_model.tokenize(["ab"]) == [[97, 98]]


def test_engine_outputs_are_checked():
    assert completions(engine_output("x", 5, 4), 1) == [Completion("x", 5, 4)]
    with pytest.raises(BackendError, match="2 outputs for 3 prompts"):
        completions([engine_output("x", 1, 0)] * 2, 3)
    assert greedy_sampling_params(7) == {"temperature": 0.0, "max_new_tokens": 7}


@pytest.fixture(scope="module")
def chat_model():
    """The local test model (``small`` preset: a real byte-level BPE tokenizer, a chat template that writes its
    BOS token), built if needed."""
    from pathlib import Path

    from kvreuse.localmodel import build_model

    return build_model("small", Path(__file__).resolve().parents[2] / "build" / "models" / "small")


class ChatEngine(StandInEngine):
    """A stand-in engine holding the tokenizer SGLang's tokenizer manager loads for a model with a chat template;
    it records text prompts and token-id prompts apart."""

    def __init__(self, model, page_size: int = 16):
        from sglang.srt.utils.hf_transformers.tokenizer import get_tokenizer

        super().__init__(page_size)
        self.tokenizer_manager = SimpleNamespace(tokenizer=get_tokenizer(str(model)))

    def generate(self, prompt=None, sampling_params=None, input_ids=None):
        self.calls.append((prompt, input_ids, sampling_params))
        return [engine_output("yes", len(p), 0) for p in (prompt or input_ids)]


def test_the_engine_backend_sends_each_row_as_a_chat_rendered_by_the_models_template(chat_model):
    engine = ChatEngine(chat_model)
    backend = SGLangBackend(engine)
    backend.generate(["Kids?\n\ntitle: Up\n", "Kids?\n\ntitle: Heat\n"], max_tokens=3)
    [(text, ids, params)] = engine.calls
    tokenizer = engine.tokenizer_manager.tokenizer
    # the ids SGLang's own chat endpoint sends for the same user turn: one BOS token, the template's
    chats = [[{"role": "user", "content": f"Kids?\n\ntitle: {t}\n"}] for t in ("Up", "Heat")]
    assert text is None and params == {"temperature": 0.0, "max_new_tokens": 3}
    assert ids == [
        list(tokenizer.apply_chat_template(c, tokenize=True, add_generation_prompt=True, return_dict=False))
        for c in chats
    ]
    assert [row.count(tokenizer.bos_token_id) for row in ids] == [1, 1]


def test_the_chat_preamble_is_the_prefix_planning_counts(chat_model):
    engine = ChatEngine(chat_model)
    backend = SGLangBackend(engine, system="Answer yes or no.")
    backend.generate(["Kids?\n\ntitle: Up\n"], max_tokens=3)
    [(_, [sent], _)] = engine.calls
    bos = engine.tokenizer_manager.tokenizer.bos_token
    assert backend.cache_model.prefix == f"{bos}<|system|>\nAnswer yes or no.\n<|user|>\n"
    assert backend.cache_model.suffix == "\n<|assistant|>\n"  # the turn's end and the assistant's header
    assert list(backend.cache_model.sent_tokens(["Kids?\n\ntitle: Up\n"])[0]) == list(sent)  # planned = sent
    planned = backend.cache_model.tokenize([backend.cache_model.prefix + "Kids?\n\ntitle: Up\n"])[0]
    assert sent[: len(planned)] == list(planned)  # planning tokenizes what the engine is sent, up to the turn's end


def test_raw_text_is_sent_with_chat_false(chat_model):
    engine = ChatEngine(chat_model)
    SGLangBackend(engine, chat=False).generate(["Kids?\n\ntitle: Up\n"], max_tokens=3)
    assert engine.calls == [(["Kids?\n\ntitle: Up\n"], None, {"temperature": 0.0, "max_new_tokens": 3})]


def test_chats_without_a_template_and_a_system_prompt_without_chats_are_refused(chat_model):
    with pytest.raises(ConfigError, match="the model has no chat template"):
        SGLangBackend(StandInEngine(page_size=16), chat=True)
    with pytest.raises(ConfigError, match="a system prompt needs chat prompts"):
        SGLangBackend(ChatEngine(chat_model), chat=False, system="Answer yes or no.")
