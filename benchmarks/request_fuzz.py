"""A fuzz campaign through a real ``vllm serve`` with the module cache (issue 26): hypothesis-generated
``kv_transfer_params`` from a client with an API key but no module-write key, while victim clients check their
answers.

The server (``serve_arguments``): SmolLM2-135M-Instruct on vLLM's CPU engine with every kvreuse plugin: the
prefix-affinity scheduler, the module-cache connector, kvreuse's attention backend in CPU_ATTN's place (so APE
applies); ``--api-key`` and the module-write guard. The operator
registers one global module (with the write key) before the campaign. Each fuzz request splices that module after
32 tokens of the attacker's own text under the attacker's own ``cache_salt`` (the position APE and recompute act
on), with ``kv_transfer_params`` drawn by :func:`transfer_params`: every key kvreuse reads, and made-up
``kvreuse_*`` ones; numbers at and beyond the representable edges (NaN, inf, subnormals, the bounds of APE's
factors and a step past them, 2**31, 10**300), wrong types, huge strings and lists, nested objects.

Victims (other salts, no modules, no kvreuse parameters) ask greedy questions the whole time from another
thread; a victim answer that differs from the same question's answer before the campaign is a changed answer.
Before the campaign each victim question is also asked of the stock engine (another server with no kvreuse
plugin switched on), and the baseline's agreement with it is reported.

Before the drawn requests, the structural cases (:data:`STRUCTURAL`): ``kv_transfer_params`` and ``vllm_xargs`` at
and past each shape bound of :mod:`kvreuse.shape` (depth: 32 levels, 33, the 600 that ended the engine, 5,000 past
Python's recursion limit; width: 2^20 values and one more; size: strings of a megabyte and more; many keys:
100,000 and 600,000), each sent once and expected answered (200) within the bounds and refused with 400 past them.

Figures: requests sent, status counts, 5xx (goal 0), server deaths (health checked after every request; goal 0),
victim answers checked and changed (goal 0), and each structural case's status.
``python benchmarks/request_fuzz.py [--requests N] [--seconds S]`` prints a table, writes ``request_fuzz.json`` and
``.png`` (the harness's output folder); the integration test
``integration_tests/test_module_security_serve.py`` runs a short campaign with the same functions.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from harness import bench_parser, new_figure, output_dir, write_results
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration_tests"))
from served import healthy, vllm_serve  # noqa: E402  (a server for tests and benchmarks alike)

SERVED = "smollm2"
API_KEY = "client-api-key-0123"
WRITE_KEY = "operator-module-key-0123456789"
CONNECTOR = {"kv_connector": "KVReuseModuleCache", "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
ADDITIONAL = {
    "kvreuse": {
        "sparse": {"beta": "inf"},
        "modules": {
            **{"gpu_bytes": 0, "cpu_bytes": 32 << 20, "disk_bytes": 0, "recompute_first": 0},
            "namespace_bytes": 12 << 20,
        },
    }
}
KEYS = (
    "kvreuse_module",
    "kvreuse_context",
    "kvreuse_replace",
    "kvreuse_probe",
    "kvreuse_recompute_first",
    "kvreuse_recompute_share",
    "kvreuse_ape",
    "kvreuse_write_proof",
)
EDGE_FLOATS = (
    0.0,
    -0.0,
    5e-324,  # issue 26: the smallest subnormal, T that left NaN KV behind
    1.7e-308,
    2.2250738585072014e-308,
    2.9e-39,
    1e-38,
    1e-300,  # issue 26: T that ended the engine
    2.0**-8,
    2.0**-8 * (1 - 2**-20),
    2.0**8,
    2.0**8 * (1 + 2**-20),
    2.0**-126,
    2.0**126,
    2.0**127,
    1e308,
    1.7976931348623157e308,
    0.5,
    0.8,
    1.0,
    math.nan,
    math.inf,
    -math.inf,
)
EDGE_INTS = (0, 1, 16, -1, 2**31 - 1, 2**31, 2**63, -(2**63), 10**300)
VICTIMS = (
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nName a large animal that lives in the sea.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhat colour is the sky on a clear day?<|im_end|>\n<|im_start|>assistant\n",
)
MODULE = (
    "<|im_start|>system\nYou are a helpful assistant for travellers. Answer questions about countries, capitals and "
    "cities in a few words, with well-known facts only.<|im_end|>\n"
)
ATTACKER_PREFIX = "The attacker writes thirty-two tokens of its own text here, and caches them first under its salt:"
QUESTION = "<|im_start|>user\nWhat is the capital of Italy?<|im_end|>\n<|im_start|>assistant\n"


def serve_arguments(model: Path | str) -> list[str]:
    """``vllm serve`` arguments of the attacked server (the environment: :func:`serve_environment`)."""
    return [
        *("--model", str(model), "--served-model-name", SERVED),
        *("--block-size", "32", "--enforce-eager", "--kv-cache-memory-bytes", str(256 << 20), "--dtype", "float32"),
        *("--max-model-len", "1024", "--seed", "0", "--disable-uvicorn-access-log", "--api-key", API_KEY),
        *("--middleware", "kvreuse.vllm.modules.guard.ModuleWriteGuard", "--enable-prompt-tokens-details"),
        *("--kv-transfer-config", json.dumps(CONNECTOR), "--additional-config", json.dumps(ADDITIONAL)),
        *("--scheduler-cls", "kvreuse.vllm.PrefixAffinityScheduler"),
    ]


def serve_environment() -> dict[str, str]:
    return {**os.environ, "KVREUSE_SPARSE_CPU_BACKEND": "1", "KVREUSE_MODULES_WRITE_KEY": WRITE_KEY}


# -- what a fuzz request carries ----------------------------------------------------------------------------------

_scalars = st.one_of(
    st.sampled_from(EDGE_FLOATS),
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True),
    st.sampled_from(EDGE_INTS),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.booleans(),
    st.none(),
    st.text(max_size=40),
    st.sampled_from(("x" * 100_000, "system", "0.8", "NaN", "1e-300")),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.sampled_from(("temperature", "scale", "kvreuse_ape", "x")) | st.text(max_size=8), inner),
        st.just([0] * 20_000),
    ),
    max_leaves=8,
)
_ape = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.sampled_from(EDGE_FLOATS) | _scalars,
        "scale": st.sampled_from(EDGE_FLOATS) | _scalars,
    },
)


def transfer_params() -> st.SearchStrategy[dict[str, Any]]:
    """``kv_transfer_params`` of a fuzz request: some of the keys kvreuse reads (APE mostly as an object of edge
    numbers), made-up ``kvreuse_*`` keys, and values of any JSON shape."""
    key = st.sampled_from(KEYS) | st.text(max_size=12).map(lambda text: "kvreuse_" + text)
    return st.one_of(
        st.fixed_dictionaries({"kvreuse_ape": _ape}),
        st.fixed_dictionaries({"kvreuse_ape": _ape}, optional={"kvreuse_recompute_first": _scalars}),
        st.dictionaries(key, st.one_of(_ape, _values), max_size=4),
    )


# -- the structural cases: shapes at and past kvreuse.shape's bounds ---------------------------------------------


def _nested_json(depth: int) -> str:
    """An object ``depth`` levels deep, as JSON text (``json.dumps`` stops at Python's recursion limit)."""
    return '{"foo":' * (depth - 1) + "{}" + "}" * (depth - 1)


def _keys_json(count: int) -> str:
    return "{" + ",".join(f'"k{k}":0' for k in range(count)) + "}"


# name -> (the request's field, its value as JSON text, the status expected: 200 within the bounds, 400 past them)
STRUCTURAL: dict[str, tuple[str, str, int]] = {
    "depth 32 (the bound)": ("kv_transfer_params", _nested_json(32), 200),
    "depth 33": ("kv_transfer_params", _nested_json(33), 400),
    "depth 600 (ended the engine)": ("kv_transfer_params", '{"foo":' + _nested_json(600) + "}", 400),
    "depth 5,000": ("kv_transfer_params", _nested_json(5000), 400),
    "xargs depth 600": ("vllm_xargs", '{"x":' + _nested_json(600) + "}", 400),
    # the object, its key and its list count too: 2^20 - 3 numbers make 2^20 values, the bound
    "width 2^20 values (the bound)": ("kv_transfer_params", '{"ids":[' + ",".join(["0"] * ((1 << 20) - 3)) + "]}", 200),
    "width 2^20 + 1 values": ("kv_transfer_params", '{"ids":[' + ",".join(["0"] * ((1 << 20) - 2)) + "]}", 400),
    "size 1 MiB - 8 characters": ("kv_transfer_params", '{"s":"' + "x" * ((1 << 20) - 8) + '"}', 200),
    "size 2 MiB": ("kv_transfer_params", '{"s":"' + "x" * (2 << 20) + '"}', 400),
    "100,000 keys": ("kv_transfer_params", _keys_json(100_000), 200),
    "600,000 keys": ("kv_transfer_params", _keys_json(600_000), 400),
    "xargs 600,000 keys": ("vllm_xargs", _keys_json(600_000), 400),
}


def structural_cases(url: str, figures: CampaignFigures, alive: Callable[[], bool]) -> None:
    """Send each of :data:`STRUCTURAL` once (the attacker's prompt, one answer token) and record its status."""
    attacker = ATTACKER_PREFIX + MODULE + QUESTION
    for name, (field_name, value, expected) in STRUCTURAL.items():
        head = json.dumps({"model": SERVED, "prompt": attacker, "max_tokens": 1, "temperature": 0.0})
        content = (head[:-1] + f', "{field_name}": {value}}}').encode()
        headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
        try:
            status = httpx.post(f"{url}/v1/completions", content=content, headers=headers, timeout=300).status_code
        except httpx.HTTPError:
            status = 0
        _count(figures, status, alive, url, {"structural": name})
        figures.structural[name] = status
        figures.structural_unexpected += status != expected


def _count(
    figures: CampaignFigures, status: int, alive: Callable[[], bool], url: str, example: Mapping[str, Any]
) -> None:
    """Count one request's answer, and whether the server still lives after it."""
    figures.requests += 1
    figures.statuses[str(status) if status else "no answer"] += 1
    failed = status >= 500 or status == 0
    figures.server_errors += status >= 500
    figures.transport_errors += status == 0
    if not (alive() and healthy(url, timeout_s=10)):
        figures.server_deaths += 1
        failed = True
    if failed and len(figures.examples) < 5:
        figures.examples.append({"status": status, **example})


# -- the campaign -------------------------------------------------------------------------------------------------


@dataclass
class CampaignFigures:
    """What a campaign saw."""

    requests: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    server_errors: int = 0  # 5xx
    transport_errors: int = 0  # no answer at all
    server_deaths: int = 0  # /health failing after a request
    victim_checks: int = 0
    victim_changed: int = 0
    victim_agree_with_stock: int | None = None  # of len(VICTIMS), before the campaign (None: not asked)
    seconds: float = 0.0
    examples: list[dict[str, Any]] = field(default_factory=list)  # the first request of each 5xx / death
    structural: dict[str, int] = field(default_factory=dict)  # STRUCTURAL case -> status
    structural_unexpected: int = 0  # structural cases answered otherwise than expected

    def table(self) -> str:
        rows = [
            ("requests sent", self.requests),
            ("status counts", dict(sorted(self.statuses.items()))),
            ("5xx (goal 0)", self.server_errors),
            ("no answer (goal 0)", self.transport_errors),
            ("server deaths (goal 0)", self.server_deaths),
            ("victim answers checked", self.victim_checks),
            ("victim answers changed (goal 0)", self.victim_changed),
            (
                "victim baseline = stock engine",
                "not asked"
                if self.victim_agree_with_stock is None
                else f"{self.victim_agree_with_stock}/{len(VICTIMS)}",
            ),  # fmt: skip
            (
                "structural cases answered as expected",
                f"{len(self.structural) - self.structural_unexpected}/{len(self.structural)}",
            ),
            *((f"structural: {name}", status) for name, status in self.structural.items()),
            ("seconds", round(self.seconds, 1)),
        ]
        return "\n".join(f"| {name} | {value} |" for name, value in rows)


def completion(url: str, body: Mapping[str, Any], *, headers: Mapping[str, str] | None = None) -> httpx.Response:
    """POST ``body`` (with NaN and inf written as Python's json writes them, as a client may) to completions."""
    content = json.dumps({"model": SERVED, "temperature": 0.0, **body}).encode()
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json", **(headers or {})}
    return httpx.post(f"{url}/v1/completions", content=content, headers=headers, timeout=300)


def greedy_text(url: str, prompt: str, salt: str, max_tokens: int = 8) -> str:
    response = completion(url, {"prompt": prompt, "max_tokens": max_tokens, "cache_salt": salt})
    response.raise_for_status()
    return str(response.json()["choices"][0]["text"])


def register_module(url: str) -> None:
    """The operator's global module, written with the module-write key (after no context): a write's prompt is
    token ids (its proof names them), from the server's own tokenizer."""
    tokenized = httpx.post(
        f"{url}/tokenize",
        json={"model": SERVED, "prompt": MODULE, "add_special_tokens": False},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    tokenized.raise_for_status()
    params = {"kvreuse_module": "travel", "kvreuse_context": 0}
    body = {"prompt": tokenized.json()["tokens"], "max_tokens": 1, "kv_transfer_params": params}
    response = completion(url, body, headers={"X-KVReuse-Module-Key": WRITE_KEY})
    response.raise_for_status()
    deadline = time.monotonic() + 60  # the store reports the module at the next step
    attacker = ATTACKER_PREFIX + MODULE + QUESTION
    while time.monotonic() < deadline:
        out = completion(url, {"prompt": attacker, "max_tokens": 1, "cache_salt": "mallory-probe"}).json()
        if out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0:
            return
        time.sleep(0.5)
    raise RuntimeError("the operator's module was not spliced into the attacker's prompt within 60 s")


def victim_baseline(url: str) -> list[str]:
    return [greedy_text(url, prompt, f"victim-{i}") for i, prompt in enumerate(VICTIMS)]


def run_campaign(
    url: str,
    baseline: Sequence[str],
    *,
    requests: int,
    seconds: float,
    alive: Callable[[], bool] = lambda: True,
    stock: Sequence[str] | None = None,
    structural: bool = True,
) -> CampaignFigures:
    """Send the structural cases (unless ``structural`` is false), then up to ``requests`` fuzz requests (for at
    most ``seconds``) while a victim thread asks ``VICTIMS``
    again and again under its own salts and compares each answer with ``baseline``. ``alive``: whether the server
    process still runs (a death is also a failed ``/health``)."""
    figures = CampaignFigures()
    if stock is not None:
        figures.victim_agree_with_stock = sum(a == b for a, b in zip(baseline, stock))
    done = threading.Event()

    def victims() -> None:
        turn = 0
        while not done.is_set():
            i = turn % len(VICTIMS)
            try:
                text = greedy_text(url, VICTIMS[i], f"victim-{i}")
            except httpx.HTTPError:
                text = None
            figures.victim_checks += 1
            figures.victim_changed += text != baseline[i]
            turn += 1

    thread = threading.Thread(target=victims, daemon=True)
    start = time.monotonic()
    thread.start()
    attacker = ATTACKER_PREFIX + MODULE + QUESTION
    if structural:
        structural_cases(url, figures, alive)

    @settings(
        max_examples=requests,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(params=transfer_params(), tokens=st.integers(min_value=1, max_value=3))
    def one(params: dict[str, Any], tokens: int) -> None:
        if time.monotonic() - start > seconds:
            return
        body = {"prompt": attacker, "max_tokens": tokens, "cache_salt": "mallory", "kv_transfer_params": params}
        try:
            status = completion(url, body).status_code
        except httpx.HTTPError:
            status = 0
        _count(figures, status, alive, url, {"kv_transfer_params": _shown(params)})

    try:
        one()
    finally:
        done.set()
        thread.join(timeout=600)
        figures.seconds = time.monotonic() - start
    return figures


def _shown(params: Any) -> Any:
    """``params`` cut to a loggable size (strings and lists of thousands of items)."""
    if isinstance(params, dict):
        return {str(k)[:40]: _shown(v) for k, v in list(params.items())[:8]}
    if isinstance(params, list):
        return [_shown(v) for v in params[:4]] + (["..."] if len(params) > 4 else [])
    if isinstance(params, str):
        return params[:40]
    if isinstance(params, float) and not math.isfinite(params):
        return repr(params)
    if isinstance(params, int) and abs(params) > 2**64:
        return f"int of {len(str(abs(params)))} digits"
    return params


# -- the benchmark ------------------------------------------------------------------------------------------------


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--requests", type=int, default=1000, help="fuzz requests at most (default 1000)")
    parser.add_argument("--seconds", type=float, default=900, help="campaign time at most (default 900)")
    parser.add_argument("--model", default=None, help="model folder (default: build/models/smollm2, built if needed)")
    args = parser.parse_args()
    from kvreuse.localmodel import build_model

    model = Path(args.model or build_model("smollm2", Path(__file__).resolve().parents[1] / "build/models/smollm2"))
    with tempfile.TemporaryDirectory() as scratch:
        stock_arguments = [
            *("--model", str(model), "--served-model-name", SERVED, "--block-size", "32", "--enforce-eager"),
            *("--kv-cache-memory-bytes", str(256 << 20), "--dtype", "float32", "--max-model-len", "1024"),
            *("--seed", "0", "--api-key", API_KEY),
        ]
        with vllm_serve(stock_arguments, Path(scratch)) as (url, _):
            stock = victim_baseline(url)
        with vllm_serve(serve_arguments(model), Path(scratch), serve_environment()) as (url, process):
            register_module(url)
            baseline = victim_baseline(url)
            figures = run_campaign(
                url,
                baseline,
                requests=args.requests,
                seconds=args.seconds,
                alive=lambda: process.poll() is None,
                stock=stock,
            )
    print("| figure | value |\n| --- | --- |")
    print(figures.table())
    record = {**asdict(figures), "statuses": dict(figures.statuses), "requests_asked": args.requests}
    write_results("request_fuzz", record, output_dir(args), plot(figures))


def plot(figures: CampaignFigures) -> Any:
    """The fuzz requests by the server's answer, and the victim checks (changed ones in red)."""
    fig, (left, right) = new_figure(1, 2, figsize=(9, 3.2))
    statuses = sorted(figures.statuses.items())
    left.bar([s for s, _ in statuses], [n for _, n in statuses], color="#7570b3")
    left.set_title(f"{figures.requests} fuzz requests by status")
    right.bar(["unchanged", "changed"], [figures.victim_checks - figures.victim_changed, figures.victim_changed],
              color=["#1b9e77", "#d95f02"])  # fmt: skip
    right.set_title("victim answers")
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
