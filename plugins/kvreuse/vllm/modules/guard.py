"""ASGI middleware for vLLM's OpenAI server: module writes need the module-write key; reading stays open.

Switched on with vLLM's own flag and an operator secret (see :mod:`kvreuse.modules.writes`)::

    KVREUSE_MODULES_WRITE_KEY=$(cat /run/secrets/kvreuse-modules) \\
        vllm serve MODEL --middleware kvreuse.vllm.modules.guard.ModuleWriteGuard ...

A module write is a request whose JSON body has ``kv_transfer_params`` (at any depth, so every endpoint that
forwards them is covered: completions, chat completions, responses, ...) holding ``kvreuse_module``, or any
non-``GET`` request to a kvreuse module endpoint (:data:`MODULE_ENDPOINTS`). It is refused with 403 unless it
carries the header ``X-KVReuse-Module-Key`` equal to the key (compared in constant time); with no key configured,
every write is refused. Every ``kv_transfer_params`` must pass ``check_transfer_params`` (a module name, context,
flags and per-request settings within their bounds), else 400 naming the field. The guard then removes the header
and adds ``kvreuse_write_proof`` to the write's ``kv_transfer_params``, so that the engine can tell the writes the
guard allowed (a client-sent proof, or ``kv_transfer_params`` that are not an object, are refused with 400). The
proof (``kvreuse.modules.writes.write_proof``) names the content: a digest of the token ids the engine will compute,
so a write must be a request whose top-level ``prompt`` is those token ids (a completion: context, then module) and
whose top-level ``kv_transfer_params`` name the module, else 400 (the guard does not tokenize text, and a prompt
the server would template or tokenize could not be named). It expires after
``kvreuse.modules.writes.PROOF_LIFETIME_S`` and carries a nonce the engine accepts once; vLLM's request log shows
it redacted. Errors are JSON in vLLM's shape: ``{"error": {"message", "type", "param", "code"}}``.

Everything else passes through untouched: requests without module writes (splicing reads modules by their
tokens, no parameter needed), other methods, non-JSON bodies, and bodies that are not valid JSON (the server
answers those itself). The offline Python API (``kvreuse.vllm.modules``) does not go through HTTP and is unchanged.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvreuse.errors import RequestParameterError
from kvreuse.modules.namespace import GLOBAL
from kvreuse.modules.writes import (
    WRITE_KEY_HEADER,
    WRITE_PROOF,
    WriteClaim,
    content_digest,
    key_matches,
    load_write_key,
    redacted,
    write_proof,
)
from kvreuse.patches import vllm_0_32
from kvreuse.vllm.modules.common import ENCODE_MODULE, check_transfer_params, write_fields

logger = logging.getLogger("vllm.plugins.kvreuse")

TRANSFER_PARAMS = "kv_transfer_params"
MODULE_ENDPOINTS = ("/kvreuse/", "/v1/kvreuse/")  # future module endpoints: every non-GET is a write
READ_METHODS = ("GET", "HEAD", "OPTIONS")
_FROM_ENVIRONMENT = object()


class GuardRefusal(Exception):
    def __init__(self, status: int, kind: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.message, self.param = status, kind, message, param

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}
        return JSONResponse(body, status_code=self.status)


class ModuleWriteGuard:
    """Pure ASGI middleware (vLLM adds it with ``app.add_middleware``); ``write_key`` defaults to the environment's."""

    def __init__(self, app: ASGIApp, write_key: Any = _FROM_ENVIRONMENT) -> None:
        self.app = app
        self.key: str | None = load_write_key() if write_key is _FROM_ENVIRONMENT else write_key
        if self.key is None:
            logger.info("kvreuse: module writes over HTTP are off (no KVREUSE_MODULES_WRITE_KEY)")
        # The proofs this guard adds are credentials (each good for one write until it expires): never logged.
        vllm_0_32.redact_in_request_log(redacted)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in READ_METHODS:
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        headers = Headers(scope=scope)
        given = headers.get(WRITE_KEY_HEADER)
        inner = dict(scope, headers=[(k, v) for k, v in scope["headers"] if k.lower() != WRITE_KEY_HEADER.encode()])
        try:
            if path.startswith(MODULE_ENDPOINTS):
                self._authorise(given, f"{scope['method']} {path}")
                await self.app(inner, receive, send)
                return
            body, rest = await _read_body(receive)
            rewritten = self._check(body, headers, given)
        except GuardRefusal as refusal:
            await refusal.response()(scope, receive, send)
            return
        if rewritten is not None:
            body = rewritten
            inner["headers"] = [(k, v) for k, v in inner["headers"] if k.lower() != b"content-length"]
            inner["headers"].append((b"content-length", str(len(body)).encode()))
        await self.app(inner, _replay(body, rest, receive), send)

    def _authorise(self, given: str | None, what: str) -> None:
        if self.key is None:
            raise GuardRefusal(
                403,
                "PermissionDeniedError",
                f"module writes are off on this server ({what}): the operator has not set KVREUSE_MODULES_WRITE_KEY",
            )
        if not key_matches(given, self.key):
            raise GuardRefusal(
                403,
                "PermissionDeniedError",
                f"a module write ({what}) needs the module-write key in the X-KVReuse-Module-Key header "
                f"(missing or wrong); reading modules needs none",
            )

    def _check(self, body: bytes, headers: Headers, given: str | None) -> bytes | None:
        """The body with proofs added if it holds allowed module writes, ``None`` if it holds none."""
        if not body or headers.get("content-type", "").startswith("multipart/"):
            return None
        try:  # whatever the content type says: a server that parses JSON anyway must not be a way around
            document = json.loads(body)
        except (ValueError, RecursionError):
            return None  # not JSON: the server answers it
        writes = []
        for params in _transfer_params(document):
            if not isinstance(params, dict):
                raise GuardRefusal(400, "BadRequestError", f"{TRANSFER_PARAMS} must be a JSON object")
            if WRITE_PROOF in params:
                raise GuardRefusal(400, "BadRequestError", f"{WRITE_PROOF} is set by the server, never by a client")
            try:  # every kvreuse parameter, not only a write's: vLLM's front end checks them again
                check_transfer_params(params)
            except RequestParameterError as why:
                raise GuardRefusal(400, "BadRequestError", str(why), why.field) from None
            if ENCODE_MODULE in params:
                writes.append(params)
        if not writes:
            return None
        self._authorise(given, "kv_transfer_params with kvreuse_module")
        salt = document.get("cache_salt") if isinstance(document, dict) else None
        namespace = salt if isinstance(salt, str) and salt else GLOBAL
        for params in writes:
            name, context, replace, probe = write_fields(params)  # passed check_transfer_params above
            params[WRITE_PROOF] = self._prove(document, params, name, context, namespace, replace, probe)
        return json.dumps(document).encode()

    def _prove(
        self,
        document: Any,
        params: dict[str, Any],
        name: str,
        context: int,
        namespace: str,
        replace: bool,
        probe: bool,
    ) -> str:
        """The write's proof, naming the token ids the engine will compute: the body's top-level ``prompt``, which
        must be a list of token ids for the body's own (top-level) ``kv_transfer_params``; 400 otherwise."""
        assert self.key is not None  # _authorise passed
        if not isinstance(document, dict) or document.get(TRANSFER_PARAMS) is not params:
            raise GuardRefusal(
                400,
                "BadRequestError",
                f"a module write goes in the request's top-level {TRANSFER_PARAMS}, next to its prompt",
            )
        prompt = document.get("prompt")
        if (
            not isinstance(prompt, list)
            or not prompt
            or not all(isinstance(token, int) and not isinstance(token, bool) and token >= 0 for token in prompt)
        ):
            raise GuardRefusal(
                400,
                "BadRequestError",
                "a module write is a completion whose prompt is token ids (the context's, then the module's): its "
                "proof names the token ids the engine computes, and text would be tokenized after the proof is made",
            )
        return write_proof(self.key, WriteClaim(name, context, namespace, replace, probe, content_digest(prompt)))


def _transfer_params(document: Any) -> Iterator[Any]:
    """Every value of a ``kv_transfer_params`` key, at any depth (iteratively: no recursion limit to hit)."""
    stack = [document]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key == TRANSFER_PARAMS and value is not None:
                    yield value
                if isinstance(value, (dict, list)):
                    stack.append(value)
        elif isinstance(node, list):
            stack.extend(item for item in node if isinstance(item, (dict, list)))


async def _read_body(receive: Receive) -> tuple[bytes, list[Message]]:
    """The whole request body, and any message that came with it that is not body (a disconnect)."""
    chunks, rest = [], []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            rest.append(message)
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks), rest


def _replay(body: bytes, rest: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that gives the (checked) body once, then what the client sends next."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}, *rest]

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
