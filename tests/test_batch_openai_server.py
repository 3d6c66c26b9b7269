"""The OpenAI-compatible server backend, against an in-process fake of ``/v1/chat/completions`` (the default:
each prompt the user turn of a chat) and ``/v1/completions`` (``chat=False``)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvreuse.batch import BackendError, Completion, OpenAIServerBackend
from kvreuse.errors import ConfigError


class FakeServer:
    """Echoes each prompt upper-cased after a delay that makes later prompts finish first; records traffic."""

    def __init__(self, failures: list[int | str] | None = None, details: bool = True) -> None:
        self.bodies: list[dict] = []
        self.paths: list[str] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.failures = list(failures or [])  # answered, in turn, before any success: a status or "drop"
        self.details = details
        self.authorization: str | None = None

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        self.authorization = request.headers.get("authorization")
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "served-small"}]})
        if self.failures:
            failure = self.failures.pop(0)
            if failure == "drop":
                raise httpx.ConnectError("connection refused", request=request)
            return httpx.Response(failure, text=f"fake failure {failure}")
        body = json.loads(request.content)
        self.bodies.append(body)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0.02 / (1 + len(self.bodies)))
        self.in_flight -= 1
        prompt = prompt_of(body)
        usage = {"prompt_tokens": len(prompt)}
        if self.details:
            usage["prompt_tokens_details"] = {"cached_tokens": len(prompt) // 2}
        if request.url.path == "/v1/chat/completions":
            choice = {"index": 0, "message": {"role": "assistant", "content": prompt.upper()}}
        else:
            choice = {"index": 0, "text": prompt.upper()}
        return httpx.Response(200, json={"choices": [choice], "usage": usage})


def prompt_of(body: dict) -> str:
    """A request's prompt: the raw prompt, or a chat's user turn."""
    if "messages" in body:
        return next(m["content"] for m in body["messages"] if m["role"] == "user")
    return body["prompt"]


def backend(server: FakeServer, **kwargs) -> OpenAIServerBackend:
    return OpenAIServerBackend("http://fake:8000/v1/", transport=httpx.MockTransport(server), backoff_s=0.0, **kwargs)


PROMPTS = [f"prompt {i}" for i in range(20)]


def test_completions_come_back_in_prompt_order_although_the_server_finishes_out_of_order():
    completions = backend(FakeServer(), concurrency=8).generate(PROMPTS, max_tokens=4)
    assert [c.text for c in completions] == [p.upper() for p in PROMPTS]


def test_requests_start_in_prompt_order_and_at_most_concurrency_are_in_flight():
    server = FakeServer()
    backend(server, concurrency=3).generate(PROMPTS, max_tokens=4)
    assert [prompt_of(body) for body in server.bodies] == PROMPTS
    assert server.most_in_flight == 3


def test_requests_are_greedy_with_the_given_length_for_the_listed_model():
    server = FakeServer()
    backend(server).generate(["a"], max_tokens=7)
    assert server.paths == ["/v1/models", "/v1/chat/completions"]
    assert server.bodies[0] == {
        "model": "served-small",
        "messages": [{"role": "user", "content": "a"}],
        "max_tokens": 7,
        "temperature": 0.0,
        "n": 1,
        "stream": False,
    }


def test_a_named_model_is_used_without_asking_the_server():
    server = FakeServer()
    backend(server, model="mine").generate(["a"], max_tokens=1)
    assert (server.paths, server.bodies[0]["model"]) == (["/v1/chat/completions"], "mine")


def test_an_api_key_is_sent_as_a_bearer_token():
    server = FakeServer()
    backend(server, model="m", api_key="secret").generate(["a"], max_tokens=1)
    assert server.authorization == "Bearer secret"


def test_usage_gives_prompt_and_cached_tokens_and_cached_is_unknown_without_details():
    (completion,) = backend(FakeServer()).generate(["abcdef"], max_tokens=1)
    assert (completion.prompt_tokens, completion.cached_tokens) == (6, 3)
    (completion,) = backend(FakeServer(details=False)).generate(["abcdef"], max_tokens=1)
    assert (completion.prompt_tokens, completion.cached_tokens) == (6, None)


def test_connection_errors_408_429_and_5xx_are_retried():
    server = FakeServer(failures=["drop", 408, 429, 503, 500])
    completions = backend(server, model="m", retries=5).generate(["a", "b"], max_tokens=1)
    assert [c.text for c in completions] == ["A", "B"]


def test_it_gives_up_after_the_retries_naming_the_url_and_the_last_failure():
    server = FakeServer(failures=[503] * 3)
    with pytest.raises(
        BackendError, match=r"http://fake:8000/v1/chat/completions failed 3 time\(s\), last with HTTP 503"
    ):
        backend(server, model="m", retries=2).generate(["a"], max_tokens=1)


def test_a_refused_prompt_is_that_rows_error_and_the_others_are_answered():
    server = FakeServer(failures=[400])
    completions = backend(server, model="m", retries=5, concurrency=1).generate(["a", "b"], max_tokens=1)
    assert completions[0] == Completion.failed("HTTP 400: fake failure 400")
    assert completions[1].text == "B" and completions[1].error is None
    assert server.failures == []  # not retried


def test_the_servers_json_error_message_is_kept():
    class TooLong(FakeServer):
        async def __call__(self, request):
            return httpx.Response(400, json={"error": {"message": "maximum context length is 4096", "code": 400}})

    (completion,) = backend(TooLong(), model="m").generate(["a"], max_tokens=1)
    assert completion.error == "HTTP 400: maximum context length is 4096"


def test_a_refusal_of_every_prompt_stops_the_job_at_once():
    server = FakeServer(failures=[404, 404])
    with pytest.raises(BackendError, match="refused the request with HTTP 404: fake failure 404"):
        backend(server, model="m", retries=5).generate(["a"], max_tokens=1)
    assert server.failures == [404]


def test_answers_are_handed_over_as_they_finish_and_a_dead_server_stops_the_stream_after_them():
    class DiesAfterTwo(FakeServer):
        async def __call__(self, request):
            if len(self.bodies) >= 2:
                raise httpx.ConnectError("connection refused", request=request)
            return await super().__call__(request)

    got = []
    with pytest.raises(BackendError, match=r"failed 2 time\(s\), last with ConnectError"):
        for item in backend(DiesAfterTwo(), model="m", retries=1, concurrency=1).stream(PROMPTS, max_tokens=1):
            got.append(item)
    assert [(position, c.text) for position, c in got] == [(0, "PROMPT 0"), (1, "PROMPT 1")]


def test_no_prompts_make_no_requests():
    server = FakeServer()
    assert backend(server).generate([], max_tokens=1) == []
    assert server.paths == []


def test_it_works_when_called_from_inside_an_event_loop():
    async def notebook_cell():
        return backend(FakeServer()).generate(["a"], max_tokens=1)

    assert [c.text for c in asyncio.run(notebook_cell())] == ["A"]


@pytest.mark.parametrize(
    ("url", "kwargs", "message"),
    [
        ("localhost:8000", {}, "must start with http"),
        ("http://h:1", {"concurrency": 0}, "concurrency >= 1"),
    ],
)
def test_bad_settings_are_config_errors(url, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        OpenAIServerBackend(url, **kwargs)


def test_a_system_prompt_is_the_chats_first_turn():
    server = FakeServer()
    backend(server, model="m", system="Answer in one word.").generate(["a"], max_tokens=1)
    assert server.bodies[0]["messages"] == [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "a"},
    ]


def test_chat_false_sends_the_raw_prompt_to_the_completions_endpoint():
    server = FakeServer()
    completions = backend(server, model="m", chat=False).generate(["a"], max_tokens=1)
    assert server.paths == ["/v1/completions"] and server.bodies[0]["prompt"] == "a"
    assert completions[0].text == "A"


def test_a_server_without_a_chat_template_stops_the_job_saying_to_send_raw_prompts():
    async def no_template(request: httpx.Request) -> httpx.Response:
        message = "As of transformers v4.44, default chat template is no longer allowed"
        return httpx.Response(400, json={"error": {"message": message}})

    server = OpenAIServerBackend("http://fake:8000", "m", transport=httpx.MockTransport(no_template))
    with pytest.raises(ConfigError, match=r"cannot render chats .*send the prompts raw \(--raw, chat=False\)"):
        server.generate(["a"], max_tokens=1)


def test_a_system_prompt_with_raw_prompts_is_a_config_error():
    with pytest.raises(ConfigError, match="a system prompt needs chat prompts"):
        OpenAIServerBackend("http://fake:8000", "m", chat=False, system="Be brief.")
