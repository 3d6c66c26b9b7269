"""``vllm serve`` for a test or a benchmark: start it on a free port, wait until it answers, stop it and its
children after.

Kept out of ``conftest.py`` so tests can import it by a name that no other test folder's module shadows; benchmarks
import it too (``benchmarks/request_fuzz.py``), so it does not depend on pytest.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

# Only bounds a failure: the real model on a loaded 2-core machine can take minutes to start.
START_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def healthy(url: str, timeout_s: float = 2) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=timeout_s).status_code == 200
    except httpx.TransportError:
        return False


def wait_until_healthy(url: str, process: subprocess.Popen, log: Path) -> None:
    """Return once ``url`` answers; raise ``RuntimeError`` with the end of ``log`` if the process exits or time runs
    out."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not healthy(url):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start:\n{log.read_text()[-3000:]}")
        time.sleep(1)


@contextmanager
def vllm_serve(
    arguments: Sequence[str], workdir: Path, env: Mapping[str, str] | None = None
) -> Iterator[tuple[str, subprocess.Popen]]:
    """``(url, process)`` of vLLM's OpenAI server started with ``arguments`` (model, engine flags) in ``workdir``.

    ``workdir`` must not be the repository root, where ``triton_kernels/`` would shadow the package vLLM probes for.
    The server runs in a session of its own, so that stopping it stops its engine processes too.
    """
    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port)]
    with _serving(command + list(arguments), port, workdir, env) as (url, process, _):
        yield url, process


@contextmanager
def serve_command(
    command: str, workdir: Path, env: Mapping[str, str] | None = None
) -> Iterator[tuple[str, subprocess.Popen, Path]]:
    """``(url, process, log)`` of a server started by ``command`` as a user types it (a shell line, such as a
    documented ``vllm serve ...``), in ``workdir``, with ``--port`` and a free port added; stopped after, with its
    children."""
    port = free_port()
    with _serving(["bash", "-c", f"{command} --port {port}"], port, workdir, env) as served:
        yield served


@contextmanager
def _serving(
    argv: Sequence[str], port: int, workdir: Path, env: Mapping[str, str] | None
) -> Iterator[tuple[str, subprocess.Popen, Path]]:
    log = workdir / f"server-{port}.log"
    with log.open("w") as sink:
        process = subprocess.Popen(
            list(argv),
            stdout=sink,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            env=dict(os.environ if env is None else env),
            start_new_session=True,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until_healthy(url, process, log)
            yield url, process, log
        finally:
            stop_group(process)


def stop_group(process: subprocess.Popen, *, crash: bool = False, timeout_s: float = 30) -> None:
    """SIGTERM to the server's session (SIGKILL if it is still there after ``timeout_s``), then reap it; with
    ``crash``, SIGKILL at once (a server that dies mid-job)."""
    for sig in (signal.SIGKILL,) if crash else (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=timeout_s)
            break
        except subprocess.TimeoutExpired:
            continue
    process.wait()
