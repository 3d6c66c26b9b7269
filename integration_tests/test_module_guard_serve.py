"""Module writes over HTTP against a real ``vllm serve`` with the module cache, ``--api-key`` and the write guard.

The server runs the module-cache connector on the small model (kvreuse's attention backend at beta = inf, dense),
vLLM's own ``--api-key`` and ``--middleware kvreuse.vllm.modules.guard.ModuleWriteGuard`` with a module-write key
in ``KVREUSE_MODULES_WRITE_KEY``, and ``--enable-log-requests``. An API key alone reads (completes) but cannot
write; the module-write key writes, and the module is encoded (``kvreuse:module_encoded_total`` on ``/metrics``);
the write proof the guard adds is not in the server's log. The same server runs ``modules.shadow_every`` 2: its
API server sends every second greedy request's full-prefill copy, and the engine counts the pairs whose request
spliced a module.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from served import vllm_serve
from test_vllm_serve_backend import SERVED

pytestmark = pytest.mark.engine

API_KEY = "client-api-key-0123"
WRITE_KEY = "operator-module-key-0123456789"
CONNECTOR = {"kv_connector": "KVReuseModuleCache", "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
ADDITIONAL = {"kvreuse": {"sparse": {"beta": "inf"}, "modules": {"cpu_bytes": 64 << 20, "shadow_every": 2}}}
SHADOWED = tuple(range(100, 140))  # a module of 40 token ids


@pytest.fixture(scope="module")
def served(small_model, tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """The server's URL and its log file."""
    arguments = [
        *("--model", str(small_model), "--served-model-name", SERVED),
        *("--block-size", "32", "--enforce-eager", "--kv-cache-memory-bytes", str(256 << 20), "--dtype", "float32"),
        *("--max-model-len", "2048", "--seed", "0", "--disable-uvicorn-access-log", "--api-key", API_KEY),
        *("--middleware", "kvreuse.vllm.modules.guard.ModuleWriteGuard", "--enable-log-requests"),
        *("--kv-transfer-config", json.dumps(CONNECTOR), "--additional-config", json.dumps(ADDITIONAL)),
    ]
    env = {**os.environ, "KVREUSE_SPARSE_CPU_BACKEND": "1", "KVREUSE_MODULES_WRITE_KEY": WRITE_KEY}
    workdir = tmp_path_factory.mktemp("vllm_serve_guard")
    with vllm_serve(arguments, workdir, env) as (url, _):
        yield url, next(workdir.glob("server-*.log"))


@pytest.fixture(scope="module")
def server(served) -> str:
    return served[0]


def complete(
    url: str, *, module: str | None = None, write_key: str | None = None, prompt: object = (5, 6, 7, 8, 9, 10, 11, 12)
) -> httpx.Response:
    body = {"model": SERVED, "prompt": list(prompt) if isinstance(prompt, tuple) else prompt, "max_tokens": 1}
    body["temperature"] = 0.0
    if module is not None:
        body["kv_transfer_params"] = {"kvreuse_module": module, "kvreuse_context": 0}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    if write_key is not None:
        headers["X-KVReuse-Module-Key"] = write_key
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)


def counter(url: str, name: str) -> float:
    found = re.findall(rf"^kvreuse:{name}_total(?:\{{[^}}]*\}})? ([0-9.e+]+)$", httpx.get(f"{url}/metrics").text, re.M)
    return sum(float(value) for value in found)


def encoded(url: str) -> float:
    return counter(url, "module_encoded")


def test_the_api_key_reads_but_does_not_write_and_the_module_key_writes(server):
    assert complete(server).status_code == 200  # reading (a plain completion) needs only vLLM's API key
    refused = complete(server, module="system")
    assert refused.status_code == 403 and refused.json()["error"]["type"] == "PermissionDeniedError"
    assert complete(server, module="system", write_key=API_KEY).status_code == 403
    assert complete(server, module="bad name!", write_key=WRITE_KEY).status_code == 400
    before = encoded(server)
    assert complete(server, module="system", write_key=WRITE_KEY).status_code == 200
    deadline = time.monotonic() + 30  # vLLM publishes connector stats with its periodic metrics
    while encoded(server) <= before and time.monotonic() < deadline:
        complete(server)
        time.sleep(1)
    assert encoded(server) == before + 1


def test_the_write_proof_is_kept_out_of_the_request_log_and_a_text_prompt_cannot_be_proven(served):
    """vLLM logs each request's parameters (``kv_transfer_params`` among them) with ``--enable-log-requests``: the
    proof the guard added to an allowed write shows as ``[redacted]``. A write whose prompt is text is a 400: the
    proof names token ids, and the guard does not tokenize."""
    url, log = served
    assert complete(url, module="logged", write_key=WRITE_KEY, prompt=(21, 22, 23, 24)).status_code == 200
    text = complete(url, module="texted", write_key=WRITE_KEY, prompt="a module as text")
    assert text.status_code == 400 and "prompt is token ids" in text.json()["error"]["message"]
    deadline = time.monotonic() + 10  # the log line is written as the request is received; the file is buffered
    while "'kvreuse_module': 'logged'" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.5)
    lines = [line for line in log.read_text().splitlines() if "'kvreuse_module': 'logged'" in line]
    assert lines and all("'kvreuse_write_proof': '[redacted]'" in line for line in lines), lines
    assert not re.search(r"[0-9]{10}\.[0-9a-f]{32}\.[0-9a-f]{64}", log.read_text())  # no proof anywhere


def test_every_second_request_that_splices_is_checked_against_its_full_prefill_copy(server):
    """With ``modules.shadow_every`` 2, four greedy requests whose prompt starts with a stored module give two shadow
    checks (the counters move on ``/metrics``); requests without a module give none (both halves computed in full)."""
    before = encoded(server)
    assert complete(server, module="shadowed", write_key=WRITE_KEY, prompt=SHADOWED).status_code == 200
    deadline = time.monotonic() + 30
    while encoded(server) <= before and time.monotonic() < deadline:
        time.sleep(1)
    assert encoded(server) == before + 1
    checks, agreed = counter(server, "module_shadow_checks"), counter(server, "module_shadow_agreed")
    for question in range(4):
        assert complete(server, prompt=(*SHADOWED, 7, 8, 9, 10 + question)).status_code == 200
    deadline = time.monotonic() + 30  # the copies finish in the background; stats are published periodically
    while counter(server, "module_shadow_checks") < checks + 2 and time.monotonic() < deadline:
        time.sleep(1)
    assert counter(server, "module_shadow_checks") == checks + 2
    assert agreed <= counter(server, "module_shadow_agreed") <= agreed + 2
    for _ in range(4):  # no module in this prompt: two copies are sent, and no check is counted
        assert complete(server, prompt=tuple(range(70, 78))).status_code == 200
    time.sleep(12)  # longer than vLLM's stats interval (10 s)
    assert counter(server, "module_shadow_checks") == checks + 2
