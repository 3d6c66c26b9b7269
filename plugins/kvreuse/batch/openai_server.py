"""A backend on any OpenAI-compatible server (``vllm serve``, SGLang) through ``POST /v1/chat/completions``.

Each prompt goes as the user turn of a chat (after an optional system turn), which the server renders with its
model's chat template, so an instruct model answers instead of continuing the record; ``chat=False`` (``--raw``)
sends the raw text to ``POST /v1/completions`` instead. One request per prompt, so each answer keeps its own
token accounting. Requests start in the order given and at most ``concurrency`` are in flight: the server then
sees the reordered stream nearly in order, which is what lets a prompt find its predecessor's prefix in the
cache. Answers are handed over as they arrive (:meth:`stream`).

What the server says decides what happens, so that a job loses nothing and stops only when it must:

* connection errors, 408, 429 and 5xx are retried with exponential backoff (``tenacity``); if they persist, the
  server is gone and the job stops (:class:`~kvreuse.errors.BackendError`) with the rows answered so far;
* 400, 413 and 422 refuse this prompt (vLLM answers 400 to a prompt longer than the context): the row gets the
  server's status and message as its error, and the job goes on;
* any other refusal (401, 403, 404 for an unknown model, ...) would refuse every prompt: the job stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import tenacity

from kvreuse.batch.backend import Completion, PrefixCacheModel
from kvreuse.batch.chat import chat_messages, check_system
from kvreuse.errors import BackendError, ConfigError

RETRIED_STATUS = frozenset({408, 429, 500, 502, 503, 504})
ROW_STATUS = frozenset({400, 413, 422})
CHAT_PATH, RAW_PATH = "/v1/chat/completions", "/v1/completions"


class _Retry(Exception):
    """A failure worth retrying; ``problem`` says what it was."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem


class RowRefused(Exception):
    """The server refused one prompt (``status``, ``message``): that row's error, not the job's."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")


class OpenAIServerBackend:
    """Greedy completions from the server at ``url`` (``http://host:port``, with or without ``/v1``).

    ``model`` is the served model name; ``None`` takes the first one the server lists at ``/v1/models``.
    ``cached_tokens`` is read from ``usage.prompt_tokens_details.cached_tokens``, which vLLM reports when started
    with ``--enable-prompt-tokens-details`` and SGLang with ``--enable-cache-report``; otherwise it is ``None``.
    ``retries`` retries after the first attempt, waiting ``backoff_s``, then twice as long each time.
    ``transport`` replaces httpx's network transport (an ``httpx.MockTransport`` in tests, a proxy, ...).
    ``chat`` (the default) sends chats, ``system`` being their system turn; ``chat=False`` sends raw text.
    """

    # A server does not tell its tokenizer or block size, so orders are planned by GGR alone.
    cache_model: PrefixCacheModel | None = None

    def __init__(
        self,
        url: str,
        model: str | None = None,
        *,
        concurrency: int = 16,
        retries: int = 5,
        backoff_s: float = 0.5,
        timeout_s: float = 600.0,
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        chat: bool = True,
        system: str | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"server URL {url!r} must start with http:// or https://")
        if concurrency < 1 or retries < 0 or backoff_s < 0 or timeout_s <= 0:
            raise ConfigError(
                f"need concurrency >= 1, retries >= 0, backoff_s >= 0 and timeout_s > 0; got "
                f"{concurrency}, {retries}, {backoff_s}, {timeout_s}"
            )
        base = url.rstrip("/")
        self.base_url = base[: -len("/v1")] if base.endswith("/v1") else base
        self.model = model
        self.concurrency = concurrency
        self.retries = retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._transport = transport
        self.chat = chat
        self.system = check_system(system)
        if system is not None and not chat:
            raise ConfigError("a system prompt needs chat prompts; leave out --system (system=) with --raw")

    def generate(self, prompts: Sequence[str], *, max_tokens: int, progress: bool = False) -> list[Completion]:
        """Completions of ``prompts`` in their order (see :class:`kvreuse.batch.Backend`)."""
        out: list[Completion] = [None] * len(prompts)  # type: ignore[list-item]
        for position, completion in self.stream(prompts, max_tokens=max_tokens):
            out[position] = completion
        return out

    def stream(self, prompts: Sequence[str], *, max_tokens: int) -> Iterator[tuple[int, Completion]]:
        """``(position, completion)`` as answers arrive (see :class:`kvreuse.batch.backend.StreamingBackend`).

        The requests run on an event loop in a thread of their own (so this works inside a notebook's loop too);
        stopping the iteration early (an error, Ctrl-C) cancels the requests still in flight.
        """
        if not prompts:
            return
        results: queue.Queue[tuple[int, Completion] | BaseException | None] = queue.Queue()
        loop = asyncio.new_event_loop()
        thread = threading.Thread(
            target=self._loop_main, args=(loop, list(prompts), max_tokens, results), daemon=True, name="kvreuse-http"
        )
        thread.start()
        try:
            for _ in range(len(prompts)):
                item = results.get()
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            # The loop may close between the check and the call (its thread is finishing): nothing is left to cancel.
            with contextlib.suppress(RuntimeError):
                if thread.is_alive():
                    loop.call_soon_threadsafe(_cancel_all, loop)
            thread.join()

    def _loop_main(self, loop: asyncio.AbstractEventLoop, prompts: list[str], max_tokens: int, results: Any) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._run(prompts, max_tokens, results.put))
        except asyncio.CancelledError:
            pass
        except BaseException as error:  # noqa: BLE001 (handed to the caller's thread)
            results.put(error)
        finally:
            loop.close()
            results.put(None)

    async def _run(self, prompts: list[str], max_tokens: int, put: Any) -> None:
        limits = httpx.Limits(max_connections=self.concurrency)
        async with httpx.AsyncClient(
            base_url=self.base_url,
            headers=self._headers,
            limits=limits,
            timeout=self.timeout_s,
            transport=self._transport,
        ) as client:
            model = self.model or await self._first_model(client)
            gate = asyncio.Semaphore(self.concurrency)

            async def one(position: int, prompt: str) -> None:
                async with gate:
                    asked = {"messages": chat_messages(prompt, self.system)} if self.chat else {"prompt": prompt}
                    try:
                        body = await self._request(
                            client,
                            "POST",
                            CHAT_PATH if self.chat else RAW_PATH,
                            json={
                                "model": model,
                                **asked,
                                "max_tokens": max_tokens,
                                "temperature": 0.0,
                                "n": 1,
                                "stream": False,
                            },
                        )
                    except RowRefused as refused:
                        put((position, Completion.failed(str(refused))))
                        return
                put((position, _completion(body)))

            # Tasks are created in send order and the semaphore wakes waiters first come, first served; the first
            # error that stops the job cancels the others (TaskGroup), and is what the caller sees.
            try:
                async with asyncio.TaskGroup() as group:
                    for position, prompt in enumerate(prompts):
                        group.create_task(one(position, prompt))
            except BaseExceptionGroup as failed:
                first: BaseException = failed
                while isinstance(first, BaseExceptionGroup):
                    first = first.exceptions[0]
                raise first from None

    async def _first_model(self, client: httpx.AsyncClient) -> str:
        listed = (await self._request(client, "GET", "/v1/models")).get("data") or []
        if not listed:
            raise BackendError(f"{self.base_url}/v1/models lists no model; pass the served model name")
        return listed[0]["id"]

    async def _request(self, client: httpx.AsyncClient, method: str, path: str, **kwargs: Any) -> dict:
        """One HTTP call, retried on connection errors, 408, 429 and 5xx; the decoded JSON body of a 2xx answer."""
        url = f"{self.base_url}{path}"

        async def attempt() -> dict:
            try:
                response = await client.request(method, path, **kwargs)
            except httpx.TransportError as error:
                raise _Retry(repr(error)) from None
            if response.is_success:
                return response.json()
            message = _error_message(response)
            if response.status_code in RETRIED_STATUS:
                raise _Retry(f"HTTP {response.status_code}: {message}")
            if path == CHAT_PATH and response.status_code == 400 and "chat template" in message.lower():
                raise ConfigError(
                    f"{url} cannot render chats ({message}); send the prompts raw (--raw, chat=False), or start "
                    "the server with a chat template (vllm serve --chat-template FILE)"
                )
            if response.status_code in ROW_STATUS and path in (CHAT_PATH, RAW_PATH):
                raise RowRefused(response.status_code, message)
            raise BackendError(f"{url} refused the request with HTTP {response.status_code}: {message}")

        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception_type(_Retry),
            stop=tenacity.stop_after_attempt(self.retries + 1),
            wait=tenacity.wait_exponential(multiplier=self.backoff_s, min=self.backoff_s),
            reraise=True,
        )
        try:
            return await retrying(attempt)
        except _Retry as last:
            raise BackendError(f"{url} failed {self.retries + 1} time(s), last with {last.problem}") from None


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    for task in asyncio.all_tasks(loop):
        task.cancel()


def _error_message(response: httpx.Response) -> str:
    """The message of an error answer: vLLM's and OpenAI's JSON ``{"error": {"message": ...}}`` or
    ``{"message": ...}``, else the start of the body."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"]
        if isinstance(error, str):
            return error
        if isinstance(body.get("message"), str):
            return body["message"]
    return response.text[:500]


def _completion(body: dict) -> Completion:
    """The first choice's text (a chat answer's message content) and the usage counts of one answer."""
    usage = body.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    choice = body["choices"][0]
    text = (choice["message"].get("content") or "") if "message" in choice else choice["text"]
    return Completion(text, usage.get("prompt_tokens"), details.get("cached_tokens"))
