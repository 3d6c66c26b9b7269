"""Module writes over HTTP need the module-write key (``kvreuse.vllm.modules.guard``, ``kvreuse.modules.writes``).

The guard wraps a tiny Starlette app that echoes what reached it (the body and the headers), as vLLM's server would
receive them, through ``httpx.ASGITransport``: no engine, no network.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from kvreuse.errors import ConfigError, ModuleRegistrationError
from kvreuse.modules.writes import (
    MAX_NAME_LENGTH,
    check_module_name,
    key_matches,
    load_write_key,
    proof_matches,
    write_proof,
)
from kvreuse.vllm.modules.guard import ModuleWriteGuard

KEY = "operator-secret-0123456789"
API = {"Authorization": "Bearer client-api-key"}  # vLLM's --api-key is another credential: it never allows writes


async def echo(request: Request) -> JSONResponse:
    body = await request.body()
    try:
        seen = json.loads(body) if body else None
    except ValueError:
        seen = body.decode()
    return JSONResponse({"body": seen, "headers": dict(request.headers)})


APP = Starlette(
    routes=[
        Route(path, echo, methods=["GET", "POST", "DELETE"])
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/kvreuse/modules", "/health")
    ]
)


def call(method: str, path: str, *, key: str | None = KEY, body=None, headers=None, raw: bytes | None = None):
    async def go():
        transport = httpx.ASGITransport(app=ModuleWriteGuard(APP, write_key=key))
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
            content = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
            sent = {"content-type": "application/json", **API, **(headers or {})}
            return await client.request(method, path, content=content, headers=sent)

    return asyncio.run(go())


def write(name="system", context=0, **extra) -> dict:
    return {
        "model": "m",
        "prompt": [1, 2, 3],
        "kv_transfer_params": {"kvreuse_module": name, "kvreuse_context": context},
        **extra,
    }


WITH_KEY = {"X-KVReuse-Module-Key": KEY}


def test_a_plain_completion_passes_untouched_without_any_key():
    body = {"model": "m", "prompt": "What is the capital of France?", "max_tokens": 4}
    response = call("POST", "/v1/completions", body=body, key=None)
    assert response.status_code == 200 and response.json()["body"] == body


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_a_module_write_without_the_key_is_refused_with_a_json_error(path):
    response = call("POST", path, body=write())
    assert response.status_code == 403
    error = response.json()["error"]
    assert error["type"] == "PermissionDeniedError" and error["code"] == 403
    assert "X-KVReuse-Module-Key" in error["message"] and "reading modules needs none" in error["message"]


def test_a_wrong_key_and_the_api_key_are_refused_alike():
    for headers in ({"X-KVReuse-Module-Key": KEY + "x"}, {"X-KVReuse-Module-Key": "client-api-key"}, {}):
        assert call("POST", "/v1/completions", body=write(), headers=headers).status_code == 403


def test_with_no_key_configured_every_write_is_refused_even_with_a_header():
    response = call("POST", "/v1/completions", body=write(), key=None, headers=WITH_KEY)
    assert response.status_code == 403 and "KVREUSE_MODULES_WRITE_KEY" in response.json()["error"]["message"]


def test_an_allowed_write_reaches_the_server_with_a_proof_and_without_the_key_header():
    response = call(
        "POST", "/v1/chat/completions", body=write("tables.singer", 7, cache_salt="tenant-a"), headers=WITH_KEY
    )
    assert response.status_code == 200
    reached = response.json()
    params = reached["body"]["kv_transfer_params"]
    assert proof_matches(KEY, params["kvreuse_write_proof"], "tables.singer", 7, "tenant-a", False)
    assert not proof_matches(KEY, params["kvreuse_write_proof"], "tables.singer", 7, "", False)  # bound to the salt
    assert "x-kvreuse-module-key" not in reached["headers"]
    assert int(reached["headers"]["content-length"]) == len(json.dumps(reached["body"]).encode())


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({"kvreuse_module": "x" * (MAX_NAME_LENGTH + 1)}, "1-128 characters"),
        ({"kvreuse_module": "a\nb"}, "letters, digits"),
        ({"kvreuse_module": ""}, "1-128 characters"),
        ({"kvreuse_module": ["a"]}, "must be a string"),
        ({"kvreuse_module": "a", "kvreuse_context": -1}, "integer from 0 to 2147483647"),
        ({"kvreuse_module": "a", "kvreuse_context": True}, "integer from 0 to 2147483647"),
        ({"kvreuse_module": "a", "kvreuse_context": 2**31}, "integer from 0 to 2147483647"),
        ({"kvreuse_module": "a", "kvreuse_replace": "yes"}, "true or false"),
    ],
)
def test_a_write_with_the_key_but_a_bad_name_or_context_is_a_400_naming_the_problem(params, says):
    response = call("POST", "/v1/completions", body={"prompt": [1], "kv_transfer_params": params}, headers=WITH_KEY)
    assert response.status_code == 400 and says in response.json()["error"]["message"]
    assert response.json()["error"]["type"] == "BadRequestError"


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"kvreuse_ape": {"temperature": 1e-300}}, "kvreuse_ape.temperature"),  # issue 26: ended the engine
        ({"kvreuse_ape": {"temperature": 1e-38, "scale": 1e308}}, "kvreuse_ape.temperature"),
        ({"kvreuse_ape": {"scale": 1e308}}, "kvreuse_ape.scale"),
        ({"kvreuse_recompute_first": 10**30}, "kvreuse_recompute_first"),
        ({"kvreuse_recompute_share": 2}, "kvreuse_recompute_share"),
        ({"kvreuse_recompute_frist": 8}, "kvreuse_recompute_frist"),  # misspelt: never silently ignored
    ],
)
def test_a_per_request_setting_out_of_its_range_is_a_400_naming_the_field_without_any_key(params, field):
    """Not a write, so no key is needed to send it, and none makes it pass: the guard answers 400 and the request
    never reaches the server behind it."""
    for headers in ({}, WITH_KEY):
        response = call("POST", "/v1/completions", body={"prompt": [1], "kv_transfer_params": params}, headers=headers)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == f"kv_transfer_params.{field}"


def test_a_megabyte_name_is_refused_before_it_reaches_the_engine_or_a_log():
    response = call("POST", "/v1/completions", body=write("n" * (1 << 20)), headers=WITH_KEY)
    assert response.status_code == 400 and len(response.content) < 1000


def test_writes_hidden_elsewhere_in_the_body_are_found():
    # vllm_xargs become the engine's extra_args: a string there would reach the connector as kv_transfer_params
    hidden = {"prompt": [1], "vllm_xargs": {"kv_transfer_params": "kvreuse_module"}}
    assert call("POST", "/v1/completions", body=hidden).status_code == 400
    nested = {"input": [{"kv_transfer_params": {"kvreuse_module": "x"}}]}
    assert call("POST", "/v1/responses", body=nested).status_code == 403
    as_text = call("POST", "/v1/completions", raw=json.dumps(write()).encode(), headers={"content-type": "text/plain"})
    assert as_text.status_code == 403


def test_a_client_cannot_send_its_own_proof():
    body = write()
    body["kv_transfer_params"]["kvreuse_write_proof"] = write_proof(KEY, "system", 0, "", False)
    assert call("POST", "/v1/completions", body=body, headers=WITH_KEY).status_code == 400


def test_other_connectors_params_and_bodies_that_are_not_json_pass_through():
    other = {"prompt": [1], "kv_transfer_params": {"do_remote_prefill": True}}
    assert call("POST", "/v1/completions", body=other, key=None).json()["body"] == other
    assert call("POST", "/v1/completions", raw=b"{not json", key=None).json()["body"] == "{not json"


def test_module_endpoints_need_the_key_for_anything_but_reading():
    assert call("GET", "/v1/kvreuse/modules").status_code == 200
    assert call("DELETE", "/v1/kvreuse/modules").status_code == 403
    assert call("DELETE", "/v1/kvreuse/modules", headers=WITH_KEY).status_code == 200


def test_the_key_comes_from_the_variable_or_its_file_and_must_not_be_guessable(tmp_path):
    assert load_write_key({}) is None
    assert load_write_key({"KVREUSE_MODULES_WRITE_KEY": KEY}) == KEY
    secret = tmp_path / "key"
    secret.write_text(KEY + "\n")
    assert load_write_key({"KVREUSE_MODULES_WRITE_KEY_FILE": str(secret)}) == KEY
    with pytest.raises(ConfigError, match="at least 16"):
        load_write_key({"KVREUSE_MODULES_WRITE_KEY": "short"})
    with pytest.raises(ConfigError, match="cannot read"):
        load_write_key({"KVREUSE_MODULES_WRITE_KEY_FILE": str(tmp_path / "missing")})
    assert key_matches(KEY, KEY) and not key_matches(None, KEY) and not key_matches(KEY[:-1], KEY)


def test_module_names_are_bounded_in_length_and_charset():
    assert check_module_name("db/concert_singer:singer@v2") == "db/concert_singer:singer@v2"
    for bad in ("-x", "a b", "é", "x" * 129, 7):
        with pytest.raises(ModuleRegistrationError):
            check_module_name(bad)
