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
import time
from pathlib import Path

import httpx
import pandas as pd
import psutil
import pytest
from served import free_port, serve_command, wait_until_healthy

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


def user_environment() -> dict[str, str]:
    """The environment a user's shell has: this environment's scripts (kvreuse, python, vllm) first on PATH."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


def shell(command: str, cwd: Path, **kwargs) -> subprocess.Popen:
    """``command`` as a user types it, in ``cwd``."""
    return subprocess.Popen(["bash", "-c", command], cwd=cwd, env=user_environment(), text=True, **kwargs)


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
    command = the_command(page, "vllm.entrypoints.openai.api_server", which).replace("MODEL", str(small_model))
    with serve_command(command, workdir, env=user_environment()) as (url, _, _):
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200


# -- the quickstart (and the README's tour, which shows the same commands) -------------------------------------------

QUICKSTART = "getting-started/quickstart.md"


@pytest.fixture
def checkout(tmp_path: Path, smollm2_model: Path) -> Path:
    """A folder laid out as the quickstart's reader has it: ``.venv`` (this environment), ``build/models`` (the
    built models) and, beside it, ``../shared/datasets/movies_small.csv`` (its first ROWS rows)."""
    repo = tmp_path / "kvreuse"
    (repo / "build").mkdir(parents=True)
    (repo / ".venv").symlink_to(Path(sys.executable).parent.parent)
    (repo / "build" / "models").symlink_to(smollm2_model.parent)
    source = DATASETS / "movies_small.csv"
    if not source.exists():
        pytest.fail(f"{source} is missing: this test reads the shared datasets (set KVREUSE_DATASETS)", pytrace=False)
    datasets = tmp_path / "shared" / "datasets"
    datasets.mkdir(parents=True)
    pd.read_csv(source, dtype=str, keep_default_na=False).head(ROWS).to_csv(datasets / "movies_small.csv", index=False)
    return repo


def test_the_readmes_tour_and_the_first_server_are_the_quickstarts_commands():
    for part in ("pd.read_csv", "--model build/models/smollm2", "vllm serve"):
        assert the_command("README.md", part) == the_command(QUICKSTART, part)
    assert the_command("guides/serving-vllm.md", "vllm serve") == the_command(QUICKSTART, "vllm serve")


def metric(url: str, name: str) -> float:
    """The sum of ``name``'s samples on the server's ``/metrics``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith((name + " ", name + "{")))


def test_the_quickstart_runs_as_written_and_its_server_shares_prefixes_and_logs_the_schedulers_summary(checkout):
    for part in ("pd.read_csv", "--model build/models/smollm2"):
        done = shell(the_command(QUICKSTART, part), checkout, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        _, err = done.communicate(timeout=600)
        assert done.returncode == 0, err[-3000:]
    answers = pd.read_csv(checkout / "build" / "answers.csv", dtype=str, keep_default_na=False)
    assert len(answers) == ROWS and (answers["error"] == "").all()

    with serve_command(the_command(QUICKSTART, "vllm serve"), checkout, env=user_environment()) as (url, server, log):
        port = url.rsplit(":", 1)[1]
        ask = shell(
            the_command(QUICKSTART, "--url http://127.0.0.1:8000").replace(":8000", f":{port}"),
            checkout,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        _, err = ask.communicate(timeout=600)
        assert ask.returncode == 0, err[-3000:]
        assert len(pd.read_csv(checkout / "build" / "served.csv", dtype=str, keep_default_na=False)) == ROWS
        # 32-token blocks: the rows share the chat preamble, the instruction and each movie's description.
        assert metric(url, "vllm:prefix_cache_hits_total") > 0
        assert metric(url, "kvreuse:reorder_admissions_total") == ROWS
        summary = f"kvreuse reorder: {ROWS} admissions"
        deadline = time.monotonic() + 30  # vLLM logs its figures every VLLM_LOG_STATS_INTERVAL (10) s
        while summary not in log.read_text() and time.monotonic() < deadline:
            time.sleep(1)
        assert summary in log.read_text(), log.read_text()[-3000:]
        assert "kvreuse: KV blocks of" not in log.read_text()  # the block size the docs set draws no warning
        os.killpg(server.pid, signal.SIGINT)  # Ctrl-C
        assert server.wait(timeout=120) is not None


# -- every command the docs show is run by a test here, or where it runs is named --------------------------------------

# Commands this module's tests run (page, parts that single the command out).
RUN_HERE = [
    ("guides/table-jobs.md", ("kvreuse run", "--model MODEL")),
    ("guides/table-jobs.md", ("kvreuse run", "--url http://127.0.0.1:8000")),
    ("plugins/modules.md", ("vllm.entrypoints.openai.api_server", "KVReuseModuleCache")),
    ("plugins/sparse.md", ("vllm.entrypoints.openai.api_server", '"beta": 4.0')),
    *[
        (page, (part,))
        for page in (QUICKSTART, "README.md")
        for part in ("pd.read_csv", "--model build/models/smollm2")
    ],
    *[(page, ("vllm serve",)) for page in (QUICKSTART, "README.md", "guides/serving-vllm.md")],
    (QUICKSTART, ("--url http://127.0.0.1:8000",)),
]
# Commands run elsewhere, and where: (a part that singles them out, why not here).
RUN_ELSEWHERE = [
    ("make ", "a Makefile target: CI (.ci/run) runs setup, lint, typecheck, docs, test and test-sglang"),
    ("pip install -e", "what make setup runs"),
    (
        "sglang.launch_server",
        "an SGLang engine needs a GPU; the plugins are tested on SGLang's classes (make test-sglang)",
    ),
    ("--url http://127.0.0.1:30000", "an SGLang server's URL; the same command against vLLM's server runs here"),
    ("--attention-backend CUSTOM", "GPU only: vLLM's CPU platform has no attention-backend choice"),
    ("OPENBLAS_CORETYPE", "a maintenance loop over CPU core types, run by hand (tests never set OPENBLAS_*)"),
    ("for core in", "the same loop"),
    ("done; done", "the same loop"),
]


def test_every_command_the_docs_show_is_run_here_or_named_where_it_runs():
    run_here = {the_command(page, *parts) for page, parts in RUN_HERE}
    for page, text in PAGES.items():
        for command in docs_reference.commands(text):
            if command in run_here or any(part in command for part, _ in RUN_ELSEWHERE):
                continue
            pytest.fail(f"{page}: `{command}` is neither run by a test here nor in RUN_ELSEWHERE")


# Python blocks: the one run here, and where the others' calls run (page, a line that singles the block out, where).
PYTHON_RUN_HERE = [("guides/table-jobs.md", "started_vllm")]
PYTHON_RUN_ELSEWHERE = [
    (
        "guides/serving-vllm.md",
        "scheduler_cls=",
        "integration_tests/test_prefix_affinity_scheduler.py (the same flags)",
    ),
    (
        "plugins/modules.md",
        "encode_database",
        "integration_tests/test_module_cache.py (encode_modules, _database, _schema)",
    ),
    ("guides/serving-sglang.md", "started_sglang", "an SGLang engine needs a GPU; tests/sglang/test_batch_backends.py"),
    ("guides/serving-sglang.md", "json.dump(", "writes a modules file with the model's tokenizer; no engine"),
    (
        "plugins/sparse.md",
        "extended_context(",
        "benchmarks/sparse_long.py starts this 32K engine; tests/test_localmodel_rope.py checks the arguments",
    ),
]


def test_every_python_block_of_the_docs_is_run_here_or_named_where_it_runs():
    known = PYTHON_RUN_HERE + [(page, line) for page, line, _ in PYTHON_RUN_ELSEWHERE]
    for page, text in PAGES.items():
        for block in docs_reference.code_blocks("python", text):
            assert any(page == p and line in block for p, line in known), f"{page}: a python block run nowhere"
    for page, line in known:
        assert any(line in block for block in docs_reference.code_blocks("python", PAGES[page])), (page, line)
