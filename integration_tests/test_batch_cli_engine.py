"""``kvreuse run --model`` and a script as a user runs them, on a real engine started the way kvreuse starts it (in
the calling process): Ctrl-C from a terminal, a script without a main guard, and standard error with one line per
fact.

Ctrl-C is what a terminal sends: SIGINT to the whole foreground process group, here a session of the job's own.
The engine is the small local model (random weights: what is checked is the job's behaviour, not its answers).
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest

pytestmark = pytest.mark.engine

ROWS = 400
CLI_ENGINE_ARGS = '{"block_size": 32, "enforce_eager": true, "kv_cache_memory_bytes": 268435456, "max_model_len": 512}'


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli_engine") / "movies.csv"
    titles = [f"Film number {k}, a title long enough to take a while" for k in range(ROWS)]
    pd.DataFrame({"title": titles, "genre": [("drama", "comedy", "horror")[k % 3] for k in range(ROWS)]}).to_csv(
        path, index=False
    )
    return path


def kvreuse_run(table: Path, model: Path, out: Path, *extra: str) -> subprocess.Popen:
    command = [
        str(Path(sys.executable).parent / "kvreuse"),
        *("run", "--table", str(table), "--prompt", "Describe this movie.", "--model", str(model)),
        *("--out", str(out), "--max-tokens", "24", "--engine-args", CLI_ENGINE_ARGS, *extra),
    ]
    # a session of its own: its process group is the terminal's foreground job
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def written_rows(out: Path) -> int:
    """Rows in the output so far (an answer of random weights may hold line breaks: records, not lines)."""
    if not out.exists():
        return 0
    with out.open(encoding="utf-8", newline="") as handle:
        return max(sum(1 for _ in csv.reader(handle)) - 1, 0)


def test_ctrl_c_from_a_terminal_ends_the_job_with_130_one_line_and_resume_finishes_it(table, small_model, tmp_path):
    out = tmp_path / "answers.csv"
    job = kvreuse_run(table, small_model, out)
    deadline = time.monotonic() + 300
    while written_rows(out) < 5 and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert job.poll() is None, job.communicate()[1][-3000:]
    os.killpg(job.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    _, err = job.communicate(timeout=120)
    done = written_rows(out)
    assert job.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "EngineDeadError" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last == (
        f"kvreuse run: interrupted; {done} of {ROWS} rows were answered and are in {out}; run the same command "
        "with --resume to ask the others"
    )
    assert 5 <= done < ROWS
    resumed = kvreuse_run(table, small_model, out, "--resume")
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    rows = pd.read_csv(out, dtype=str, keep_default_na=False)["row"].astype(int).tolist()
    assert rows == list(range(ROWS))  # every row exactly once, in the table's order


SCRIPT = """\
from pathlib import Path
from kvreuse.batch import llm_map
from kvreuse.batch.table_io import read_table
from kvreuse.vllm.backend import started_vllm

movies = read_table(Path({table!r}))  # strict CSV: every cell as its text, nothing guessed
with started_vllm({model!r}, block_size=32, enforce_eager=True, max_model_len=512) as backend:
    answers = llm_map(
        movies.head(8), "Is this movie suitable for kids?", ["title", "genre"], backend=backend, out={out!r}
    )  # each row written as it is answered
print(len(answers))
"""


def test_the_readmes_llm_map_example_runs_as_a_script_without_a_main_guard(table, small_model, tmp_path):
    """The README's example saved as a file and run as written, with no ``if __name__ == "__main__":`` (a spawned
    engine process would re-run the script and fail with "An attempt has been made to start a new process")."""
    out = tmp_path / "answers.jsonl"
    script = tmp_path / "kids.py"
    script.write_text(textwrap.dedent(SCRIPT.format(table=str(table), model=str(small_model), out=str(out))))
    done = subprocess.run([sys.executable, "-P", str(script)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "8" and len(out.read_text().splitlines()) == 8
    assert "start a new process" not in done.stderr
    # one line per fact: vLLM's start-up is logged by one process, and no warning twice
    warnings = [line.split("]", 1)[-1] for line in done.stderr.splitlines() if " WARNING " in line]
    assert len(warnings) == len(set(warnings)), warnings
    assert "leaked shared_memory" not in done.stderr
