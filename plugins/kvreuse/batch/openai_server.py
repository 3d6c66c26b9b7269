"""A backend on any OpenAI-compatible server (``vllm serve``, SGLang) through ``POST /v1/completions``.

One request per prompt, so each answer keeps its own token accounting. Requests start in the order given and at
most ``concurrency`` are in flight: the server then sees the reordered stream nearly in order, which is what lets
a prompt find its predecessor's prefix in the cache. Connection errors, 429 and 5xx are retried with
exponential backoff; any other refusal (a prompt too long, an unknown model) fails at once with the server's
message.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Sequence
from typing import Any

import httpx
from tqdm import tqdm

from kvreuse.batch.backend import Completion, PrefixCacheModel
from kvreuse.errors import BackendError, ConfigError

_RETRIED_STATUS = frozenset({429, 500, 502, 503, 504})


class OpenAIServerBackend:
    """Greedy completions from the server at ``url`` (``http://host:port``, with or without ``/v1``).

    ``model`` is the served model name; ``None`` takes the first one the server lists at ``/v1/models``.
    ``cached_tokens`` is read from ``usage.prompt_tokens_details.cached_tokens``, which vLLM reports when started
    with ``--enable-prompt-tokens-details`` and SGLang with ``--enable-cache-report``; otherwise it is ``None``.
    ``transport`` replaces httpx's network transport (an ``httpx.MockTransport`` in tests, a proxy, ...).
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

    def generate(self, prompts: Sequence[str], *, max_tokens: int, progress: bool = False) -> list[Completion]:
        """Completions of ``prompts`` in their order (see :class:`kvreuse.batch.Backend`)."""
        if not prompts:
            return []
        batch = self._generate(list(prompts), max_tokens, progress)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(batch)
        # Called from inside an event loop (a notebook): run ours on a thread of its own.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, batch).result()

    async def _generate(self, prompts: list[str], max_tokens: int, progress: bool) -> list[Completion]:
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
            with tqdm(total=len(prompts), disable=not progress, desc="prompts", unit="prompt") as bar:

                async def one(prompt: str) -> Completion:
                    async with gate:
                        body = await self._request(
                            client,
                            "POST",
                            "/v1/completions",
                            json={
                                "model": model,
                                "prompt": prompt,
                                "max_tokens": max_tokens,
                                "temperature": 0.0,
                                "n": 1,
                                "stream": False,
                            },
                        )
                    bar.update(1)
                    return _completion(body)

                # Tasks are created in send order and the semaphore wakes waiters first come, first served.
                return list(await asyncio.gather(*(one(prompt) for prompt in prompts)))

    async def _first_model(self, client: httpx.AsyncClient) -> str:
        listed = (await self._request(client, "GET", "/v1/models")).get("data") or []
        if not listed:
            raise BackendError(f"{self.base_url}/v1/models lists no model; pass the served model name")
        return listed[0]["id"]

    async def _request(self, client: httpx.AsyncClient, method: str, path: str, **kwargs: Any) -> dict:
        """One HTTP call, retried on connection errors, 429 and 5xx; the decoded JSON body of a 2xx answer."""
        url = f"{self.base_url}{path}"
        attempts = 0
        while True:
            attempts += 1
            try:
                response = await client.request(method, path, **kwargs)
            except httpx.TransportError as error:
                problem = repr(error)
            else:
                if response.is_success:
                    return response.json()
                problem = f"HTTP {response.status_code}: {response.text[:500]}"
                if response.status_code not in _RETRIED_STATUS:
                    raise BackendError(f"{url} refused the request with {problem}")
            if attempts > self.retries:
                raise BackendError(f"{url} failed {attempts} time(s), last with {problem}")
            await asyncio.sleep(self.backoff_s * 2 ** (attempts - 1))


def _completion(body: dict) -> Completion:
    """The first choice's text and the usage counts of one ``/v1/completions`` answer."""
    usage = body.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return Completion(body["choices"][0]["text"], usage.get("prompt_tokens"), details.get("cached_tokens"))
