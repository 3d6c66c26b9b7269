"""vLLM loads kvreuse's entry point in each of its processes, and honours ``VLLM_PLUGINS``."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from real_engine import start_llm, stop_llm

pytestmark = pytest.mark.engine


def test_entry_point_runs_in_engine_core_and_worker_processes(small_model, capfd):
    """vLLM tags each log line with its process: the plugin's line must come from the engine core and a worker."""
    stop_llm(start_llm(small_model))
    captured = capfd.readouterr()
    out = captured.out + captured.err  # vLLM logs to stderr once a kvreuse front end ran in this process
    registered = dict(re.findall(r"\((\w+)(?:-\d+)? pid=(\d+)\).*kvreuse plugin registered in pid", out))
    assert set(registered) >= {"EngineCore", "VllmWorker"}, out[-3000:]
    assert registered["EngineCore"] != registered["VllmWorker"] != str(os.getpid())


@pytest.mark.parametrize(("allowed", "loaded"), [("kvreuse", True), ("some_other_plugin", False)])
def test_vllm_plugins_allow_list_is_honoured(allowed, loaded, tmp_path):
    code = (
        "from vllm.plugins import load_general_plugins; load_general_plugins(); "
        "import kvreuse.vllm as k; print(bool(k.registered_pids()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "VLLM_PLUGINS": allowed},
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
        cwd=tmp_path,
    ).stdout
    assert out.strip().splitlines()[-1] == str(loaded)
