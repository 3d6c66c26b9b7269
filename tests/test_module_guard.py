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
    NONCE_CAPACITY,
    PROOF_LIFETIME_S,
    REDACTED,
    ProofVerdict,
    SeenNonces,
    WriteClaim,
    check_module_name,
    check_proof,
    content_digest,
    key_matches,
    load_write_key,
    redacted,
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


def claim(name="system", context=0, namespace="", prompt=(1, 2, 3), replace=False, probe=False) -> WriteClaim:
    return WriteClaim(name, context, namespace, replace, probe, content_digest(prompt))


def verdict(proof: object, of: WriteClaim) -> ProofVerdict:
    """What a fresh engine (one that has seen no proof) makes of ``proof`` for the write ``of``."""
    return check_proof([KEY], proof, of, SeenNonces())


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
    body = write("tables.singer", 2, cache_salt="tenant-a")
    response = call("POST", "/v1/completions", body=body, headers=WITH_KEY)
    assert response.status_code == 200
    reached = response.json()
    proof = reached["body"]["kv_transfer_params"]["kvreuse_write_proof"]
    assert verdict(proof, claim("tables.singer", 2, "tenant-a")) is ProofVerdict.VALID
    assert verdict(proof, claim("tables.singer", 2, "")) is ProofVerdict.UNPROVEN  # bound to the salt
    assert "x-kvreuse-module-key" not in reached["headers"]
    assert int(reached["headers"]["content-length"]) == len(json.dumps(reached["body"]).encode())


def test_a_proof_names_the_prompts_token_ids_and_every_flag_of_the_write():
    body = write("doc", 1, kv_transfer_params={"kvreuse_module": "doc", "kvreuse_context": 1, "kvreuse_probe": True})
    proof = call("POST", "/v1/completions", body=body, headers=WITH_KEY).json()["body"]["kv_transfer_params"][
        "kvreuse_write_proof"
    ]
    assert verdict(proof, claim("doc", 1, probe=True)) is ProofVerdict.VALID
    for other in (
        claim("doc", 1, probe=True, prompt=(1, 2, 4)),  # the same write of other content: a content swap
        claim("doc", 1, probe=True, prompt=(1, 2)),
        claim("doc", 1, probe=False),
        claim("doc", 1, probe=True, replace=True),
        claim("doc", 2, probe=True),
        claim("doc2", 1, probe=True),
    ):
        assert verdict(proof, other) is ProofVerdict.UNPROVEN, other


def test_a_proof_writes_once_and_only_before_it_expires():
    seen = SeenNonces()
    proof = write_proof(KEY, claim(), now=1_000_000)
    assert check_proof([KEY], proof, claim(), seen, now=1_000_001) is ProofVerdict.VALID
    assert check_proof([KEY], proof, claim(), seen, now=1_000_002) is ProofVerdict.REPLAYED
    late = write_proof(KEY, claim(), now=1_000_000)
    expiry = 1_000_000 + PROOF_LIFETIME_S
    assert check_proof([KEY], late, claim(), seen, now=expiry) is ProofVerdict.EXPIRED
    # The same write sent again through the guard gets a new proof (a new nonce): written again.
    assert write_proof(KEY, claim()) != write_proof(KEY, claim())
    # A proof dated further ahead than a proof lives (a key holder's, or a front end with a clock far ahead).
    ahead = write_proof(KEY, claim(), now=1_000_000 + 3600)
    assert check_proof([KEY], ahead, claim(), seen, now=1_000_000) is ProofVerdict.EXPIRED


def test_the_engine_remembers_a_bounded_number_of_proofs_and_forgets_them_when_they_expire():
    seen = SeenNonces(capacity=2)
    proofs = [write_proof(KEY, claim(), now=1000 + i) for i in range(3)]
    assert [check_proof([KEY], p, claim(), seen, now=1001) for p in proofs] == [
        ProofVerdict.VALID,
        ProofVerdict.VALID,
        ProofVerdict.NONCES_FULL,  # refused, never let through unremembered
    ]
    assert len(seen) == 2
    later = 1000 + PROOF_LIFETIME_S + 0.5  # the first proof has expired, the others not
    assert check_proof([KEY], proofs[2], claim(), seen, now=later) is ProofVerdict.VALID and len(seen) == 2
    assert check_proof([KEY], proofs[0], claim(), seen, now=later) is ProofVerdict.EXPIRED  # forgotten, not replayable
    # A proof that is not a key holder's leaves nothing to remember.
    assert check_proof([KEY], write_proof("another-key-0123456789", claim()), claim(), seen) is ProofVerdict.UNPROVEN
    assert NONCE_CAPACITY >= 1 << 16


@pytest.mark.parametrize("proof", [None, "", "0" * 64, "1.2.3", f"9999999999.{'a' * 32}.{'b' * 64}", 12, ["x"]])
def test_anything_but_a_key_holders_proof_of_this_write_is_unproven(proof):
    assert verdict(proof, claim()) is ProofVerdict.UNPROVEN


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "prompt is token ids"),
        ({"prompt": "the module's text"}, "prompt is token ids"),
        ({"prompt": [[1, 2, 3]]}, "prompt is token ids"),
        ({"prompt": [1, True, 3]}, "prompt is token ids"),
        ({"prompt": [1, -2, 3]}, "prompt is token ids"),
        ({"prompt": []}, "prompt is token ids"),
    ],
)
def test_a_write_whose_prompt_is_not_token_ids_is_a_400(body, says):
    sent = {"model": "m", **body, "kv_transfer_params": {"kvreuse_module": "doc"}}
    response = call("POST", "/v1/chat/completions", body=sent, headers=WITH_KEY)
    assert response.status_code == 400 and says in response.json()["error"]["message"]


def test_a_write_away_from_the_top_level_kv_transfer_params_is_a_400_with_the_key():
    nested = {"prompt": [1, 2], "vllm_xargs": {"kv_transfer_params": {"kvreuse_module": "x"}}}
    response = call("POST", "/v1/completions", body=nested, headers=WITH_KEY)
    assert response.status_code == 400 and "top-level kv_transfer_params" in response.json()["error"]["message"]


def test_vllms_request_log_shows_proofs_redacted(caplog):
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.serve.utils.request_logger import RequestLogger
    from vllm.sampling_params import SamplingParams

    ModuleWriteGuard(APP, write_key=KEY)  # installs the redaction in this process (as in vLLM's API server)
    proof = write_proof(KEY, claim())
    params = {"kvreuse_module": "system", "kvreuse_context": 0, "kvreuse_write_proof": proof}
    sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
    request = CompletionRequest(model="m", prompt=[1, 2, 3], kv_transfer_params=params)
    with caplog.at_level("DEBUG"):
        logger = RequestLogger(max_log_len=None)
        logger.log_inputs("r1", None, [1, 2, 3], None, params=sampling, lora_request=None)
        logger.log_request_body(request)
    logged = caplog.text
    assert "Received request r1" in logged and "JSON body" in logged  # both lines were written
    assert proof not in logged and proof.split(".")[2] not in logged
    assert logged.count(REDACTED) == 2 and "'kvreuse_module': 'system'" in logged
    # What the engine receives is unchanged.
    assert sampling.extra_args["kv_transfer_params"]["kvreuse_write_proof"] == proof
    assert request.kv_transfer_params["kvreuse_write_proof"] == proof
    assert redacted({"other": 1}) == {"other": 1} and redacted(None) is None


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
        ({"kvreuse_recompute_budget": -0.1}, "kvreuse_recompute_budget"),
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
    body["kv_transfer_params"]["kvreuse_write_proof"] = write_proof(KEY, claim())
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
