"""A job survives its engine: ``kvreuse run --url`` against a real ``vllm serve`` that is killed mid-job keeps every
row answered before, and ``--resume`` against a fresh server completes the job with every input row exactly once.

The server is vLLM's OpenAI entry point on the small model (as in ``test_vllm_serve_backend.py``), started in a
session of its own so that killing its process group kills its engine process with it, as a crash would.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pandas as pd
import pytest
from served import stop_group, vllm_serve

from kvreuse.batch import plan_table

pytestmark = pytest.mark.engine

ROWS = 160
INSTRUCTION = "Describe this movie in a few words."


@contextmanager
def vllm_server(model: Path, workdir: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    arguments = [
        *("--model", str(model), "--block-size", "32", "--enforce-eager", "--kv-cache-memory-bytes", str(256 << 20)),
        *("--dtype", "float32", "--max-model-len", "512", "--seed", "0", "--disable-uvicorn-access-log"),
    ]
    with vllm_serve(arguments, workdir) as served:
        yield served


def kvreuse_run(table: Path, url: str, out: Path, *extra: str) -> subprocess.Popen:
    command = [
        str(Path(sys.executable).parent / "kvreuse"),
        "run",
        "--table",
        str(table),
        "--prompt",
        INSTRUCTION,
        "--url",
        url,
        "--out",
        str(out),
        "--max-tokens",
        "12",
        "--concurrency",
        "2",
        "--retries",
        "1",
        *extra,
    ]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=table.parent)


def written_rows(out: Path) -> int:
    if not out.exists():
        return 0
    return max(0, out.read_bytes().count(b"\r\n") - 1)  # records end with CRLF; embedded breaks are rarely CRLF


def test_killing_the_engine_mid_job_keeps_the_rows_done_and_resume_answers_every_row_exactly_once(
    small_model, tmp_path
):
    table = tmp_path / "movies.csv"
    pd.DataFrame(
        {
            "title": [f"Film {i % 40}" for i in range(ROWS)],
            "review": [f'review number {i}, with a comma and a "quote"' for i in range(ROWS)],
        }
    ).to_csv(table, index=False)
    out = tmp_path / "answers.csv"

    with vllm_server(small_model, tmp_path) as (url, server):
        job = kvreuse_run(table, url, out)
        deadline = time.monotonic() + 300
        while written_rows(out) < 20:
            assert job.poll() is None, job.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the job wrote too few rows"
            time.sleep(0.2)
        stop_group(server, crash=True)  # the server and its engine die mid-job
        _, err = job.communicate(timeout=120)
    assert job.returncode == 1, err[-3000:]
    assert "Traceback" not in err and "--resume" in err
    kept = pd.read_csv(out, dtype=str, keep_default_na=False)
    assert 20 <= len(kept) < ROWS, len(kept)
    assert kept["row"].is_unique and (kept["error"] == "").all()
    assert f"{len(kept)} of {ROWS} rows were answered and are in {out}" in err

    with vllm_server(small_model, tmp_path) as (url, _):
        done = kvreuse_run(table, url, out, "--resume")
        _, err = done.communicate(timeout=600)
        assert done.returncode == 0, err[-3000:]
        # A row the first server answered has the answer the second gives its prompt: the same greedy model.
        check = kept.iloc[0]
        plan = plan_table(pd.read_csv(table, dtype=str, keep_default_na=False), INSTRUCTION)
        prompt = dict(zip(plan.rows.tolist(), plan.prompts))[int(check["row"])]
        chat = [{"role": "user", "content": prompt}]  # kvreuse run sends chats by default
        alone = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": str(small_model), "messages": chat, "max_tokens": 12, "temperature": 0.0},
            timeout=60,
        ).json()["choices"][0]["message"]["content"]
    final = pd.read_csv(out, dtype=str, keep_default_na=False)
    assert final["row"].astype(int).tolist() == list(range(ROWS))  # every row exactly once, in the table's order
    assert (final["error"] == "").all()
    assert f"{len(kept)} answered by an earlier run" in err
    assert final.set_index("row").loc[check["row"], "answer"] == check["answer"] == alone
