"""The commands of the README and the docs run as written on this CPU machine.

``MODEL`` is the small local model and ``movies_small.csv`` the first rows of the real table, in a folder of the
test's own; the only other change is the port a server listens on (a free one, not the docs' 8000, which another
process may hold). Each command starts a real engine. Commands are found by the page that shows them
(``docs_reference.pages``: the README and every page of docs/, as the site shows them).
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import psutil
import pytest
from served import free_port, wait_until_healthy

from kvreuse.localmodel import DATASETS

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "docs"))
import docs_reference  # noqa: E402 - docs/ holds the pages' reader the site's build uses

PAGES = docs_reference.pages()
ROWS = 30


def blocks(page: str, language: str) -> list[str]:
    return docs_reference.code_blocks(language, PAGES[page])


def the_command(page: str, *parts: str) -> str:
    """The one command of ``page`` that holds every one of ``parts``."""
    (found,) = [c for c in docs_reference.commands(PAGES[page]) if all(p in c for p in parts)]
    return found


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    source = DATASETS / "movies_small.csv"
    if not source.exists():
        pytest.fail(f"{source} is missing: this test reads the shared datasets (set KVREUSE_DATASETS)", pytrace=False)
    pd.read_csv(source, dtype=str, keep_default_na=False).head(ROWS).to_csv(tmp_path / "movies_small.csv", index=False)
    return tmp_path


def shell(command: str, cwd: Path, **kwargs) -> subprocess.Popen:
    """``command`` as a user types it, with this environment's scripts (kvreuse, python) first on PATH."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, text=True, **kwargs)


def test_the_readmes_kvreuse_run_starts_vllm_on_a_cpu_as_written(workdir, small_model):
    command = the_command("guides/table-jobs.md", "kvreuse run", "--model MODEL").replace("MODEL", str(small_model))
    done = shell(command, workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, err = done.communicate(timeout=600)
    assert done.returncode == 0, err[-3000:]
    answers = pd.read_csv(workdir / "answers.csv", dtype=str, keep_default_na=False)
    assert answers["row"].astype(int).tolist() == list(range(ROWS)) and (answers["error"] == "").all()


def test_the_readmes_python_example_runs_as_written(workdir, small_model):
    (code,) = [b for b in blocks("guides/table-jobs.md", "python") if "started_vllm" in b]
    done = subprocess.run(
        [sys.executable, "-c", code.replace('"MODEL"', repr(str(small_model)))],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert len((workdir / "answers.jsonl").read_text().splitlines()) == ROWS


def test_kvreuse_serve_with_the_readmes_file_answers_the_readmes_url_command_and_stops_on_sigterm(workdir):
    port = free_port()
    (toml,) = blocks("guides/serving-vllm.md", "toml")
    config = workdir / "serve.toml"
    config.write_text(toml.replace("port = 8000", f"port = {port}"))
    log = workdir / "serve.log"
    with log.open("w") as sink:
        serve = shell(f"exec kvreuse serve --config {config}", REPO, stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, serve, log)
        command = the_command("guides/table-jobs.md", "kvreuse run", "--url http://127.0.0.1:8000").replace(
            ":8000", f":{port}"
        )
        ask = shell(command, workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = ask.communicate(timeout=600)
        assert ask.returncode == 0, err[-3000:]
        assert len(pd.read_csv(io.StringIO(out), dtype=str, keep_default_na=False)) == ROWS
        tree = psutil.Process(serve.pid).children(recursive=True)  # vLLM's server and its engine processes
        assert any("vllm.entrypoints.openai.api_server" in " ".join(p.cmdline()) for p in tree)
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=120) == 128 + signal.SIGTERM
        _, alive = psutil.wait_procs(tree, timeout=5)
        assert not alive, [p.cmdline() for p in alive]  # no vLLM process left running
    finally:
        if serve.poll() is None:
            for process in psutil.Process(serve.pid).children(recursive=True):
                process.kill()
            serve.kill()


@pytest.mark.parametrize(
    ("page", "which"), [("plugins/modules.md", "KVReuseModuleCache"), ("plugins/sparse.md", '"beta": 4.0')]
)
def test_the_docs_cpu_server_commands_start_as_written(workdir, small_model, page, which):
    port = free_port()
    command = the_command(page, "vllm.entrypoints.openai.api_server", which).replace("MODEL", str(small_model))
    log = workdir / "server.log"
    with log.open("w") as sink:
        server = shell(
            f"{command} --port {port}", workdir, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", server, log)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
