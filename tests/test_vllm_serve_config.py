"""``kvreuse serve``: one config file becomes vLLM's own ``--config`` YAML, every kvreuse setting checked first,
and the server it starts is stopped with kvreuse (signals forwarded, nothing left running)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import yaml

from kvreuse.cli import main
from kvreuse.errors import ConfigError
from kvreuse.vllm.engine_args import CPU_KV_CACHE_BYTES, on_cpu_build
from kvreuse.vllm.serve import SERVER_MODULE, read_serve_config, serve_command, vllm_config

TOML = """
model = "build/models/small"
port = 8123
scheduler = "prefix-affinity"

[engine]
block_size = 32
enable_prompt_tokens_details = true
enable_prefix_caching = false
kv_cache_memory_bytes = 268435456

[kvreuse.reorder]
max_skips = 16

[kvreuse.modules]
cpu_bytes = 1048576
"""


def test_a_toml_config_becomes_vllms_own_yaml_config(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text(TOML)
    assert vllm_config(read_serve_config(path, environ={})) == {
        "model": "build/models/small",
        "port": 8123,
        "block-size": 32,
        "enable-prompt-tokens-details": True,
        "enable-prefix-caching": False,
        "kv-cache-memory-bytes": 268435456,
        "scheduler-cls": "kvreuse.vllm.PrefixAffinityScheduler",
        "additional-config": {"kvreuse": {"reorder": {"max_skips": 16}, "modules": {"cpu_bytes": 1048576}}},
    }
    assert serve_command("c.yaml", python="python") == ["python", "-P", "-m", SERVER_MODULE, "--config", "c.yaml"]


@pytest.mark.skipif(not on_cpu_build(), reason="the default is for vLLM's CPU build")
def test_on_the_cpu_build_an_unsized_kv_cache_gets_a_fixed_size(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text('model = "m"\n')
    assert vllm_config(read_serve_config(path, environ={}))["kv-cache-memory-bytes"] == CPU_KV_CACHE_BYTES
    path.write_text('model = "m"\n[engine]\ngpu-memory-utilization = 0.3\n')
    assert "kv-cache-memory-bytes" not in vllm_config(read_serve_config(path, environ={}))


def test_print_only_prints_the_yaml_and_the_command_that_reads_it(tmp_path, capsys):
    path = tmp_path / "serve.json"
    path.write_text(json.dumps({"model": "m", "engine": {"max_model_len": 1024}}))
    assert main(["serve", "--config", str(path), "--print-only"]) == 0
    out = capsys.readouterr().out
    assert f"-P -m {SERVER_MODULE} --config serve.vllm.yaml" in out
    assert yaml.safe_load(out)["max-model-len"] == 1024 and yaml.safe_load(out)["model"] == "m"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('model = "m"\n[kvreuse.reorder]\nmax_skips = -1\n', "reorder.max_skips"),
        ('model = "m"\n[kvreuse.reorder]\nmax_skips = 64.7\n', "64.7 is not a valid int"),
        ('model = "m"\n[kvreuse.reordr]\nmax_skips = 1\n', "[kvreuse] (did you mean 'reorder'?)"),
        ('model = "m"\n[kvreuse.modules]\ngpu_byte = 1\n', "gpu_byte (did you mean 'gpu_bytes'?)"),
        ('model = "m"\n[kvreuse]\nreorder = 5\n', "the reorder settings must be a table"),
        ('model = "m"\nkvreuse = 5\n', "must be a table/object of sections"),
        ('model = "m"\nscheduler = "fifo"\n', "scheduler 'fifo' is not one of prefix-affinity"),
        ('model = "m"\nscheduler = "prefix-afinity"\n', "(did you mean 'prefix-affinity'?)"),
        ("port = 1\n", "name the model"),
        ('model = "m"\nmodels = 2\n', "unknown key(s) models (did you mean 'model'?)"),
        ('model = "m"\nport = "80"\n', "port must be an integer"),
        ('model = "m"\nengine = 3\n', "engine must be a table"),
        ('model = "m"\n[engine]\nmodel = "x"\n', "give model at the top of the file"),
        ('model = "m"\n[engine]\nblock_sise = 32\n', "block_sise is not an argument of vLLM's server"),
        ('model = "m"\n[engine]\nblock_sise = 32\n', "(did you mean 'block_size'?)"),
        (
            'model = "m"\n[engine.kv_transfer_config]\nkv_connector = "KVReuseModuleCach"\nkv_role = "kv_both"\n',
            "kv_connector 'KVReuseModuleCach' is not a KV connector vLLM or kvreuse registers (did you mean",
        ),
    ],
)
def test_a_wrong_setting_is_named_before_anything_starts(tmp_path, text, message):
    path = tmp_path / "serve.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(message)):
        read_serve_config(path, environ={})


def test_vllms_server_arguments_and_connectors_are_read_from_its_source_without_importing_it():
    import subprocess

    program = (
        "import sys; from kvreuse.vllm.arg_names import connector_names, server_arg_names; "
        "names, connectors = server_arg_names(), connector_names(); "
        "assert {'block_size', 'enable_prompt_tokens_details', 'kv_transfer_config', 'scheduler_cls'} <= names; "
        "assert {'NixlConnector', 'KVReuseModuleCache'} <= connectors; "
        "assert 'vllm' not in sys.modules and 'torch' not in sys.modules"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_names_read_from_vllms_source_are_those_of_its_server_parser():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import FrontendArgs

    from kvreuse.vllm.arg_names import server_arg_names

    fields = [*dataclasses.fields(AsyncEngineArgs), *dataclasses.fields(FrontendArgs)]
    assert server_arg_names() == {f.name for f in fields if not f.name.startswith("_")}  # private: not flags


def test_the_variables_the_server_inherits_are_checked_too(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text('model = "m"\n')
    with pytest.raises(ConfigError, match="KVREUSE_SPARSE_BETTA .*did you mean 'KVREUSE_SPARSE_BETA'"):
        read_serve_config(path, environ={"KVREUSE_SPARSE_BETTA": "2"})


def test_a_model_folder_that_does_not_exist_is_refused_without_a_traceback(tmp_path, capsys):
    path = tmp_path / "serve.toml"
    path.write_text('model = "build/models/nope"\n')
    assert main(["serve", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert "model 'build/models/nope': no such folder" in err and "Traceback" not in err


# -- the server is stopped with kvreuse: signals forwarded, nothing left running --------------------------------------

# Stands in for vLLM's server: a process with a child of its own (vLLM's engine core), which on SIGTERM stops its
# child and exits (what vLLM does), unless told to ignore SIGTERM.
FAKE_SERVER = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    def stop(*_):
        child.terminate(); child.wait(); sys.exit(0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN if sys.argv[1] == "stubborn" else stop)
    signal.signal(signal.SIGINT, stop)
    print("ready", flush=True)
    time.sleep(120)
    """
)


def supervise(tmp_path: Path, mode: str, ready_url: str | None = None) -> tuple[subprocess.Popen, list[psutil.Process]]:
    """kvreuse's run_server (in a process of its own) running the fake server, taken as started unless
    ``ready_url`` is given (then as starting until it answers); the processes under it."""
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    runner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from kvreuse.vllm.serve import run_server; "
            f"sys.exit(run_server([sys.executable, {str(script)!r}, {mode!r}], {ready_url!r}))",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert runner.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 10
    while len(psutil.Process(runner.pid).children(recursive=True)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    tree = psutil.Process(runner.pid).children(recursive=True)
    assert len(tree) == 2
    return runner, tree


def gone(processes: list[psutil.Process], timeout: float = 10) -> bool:
    """Whether every process has exited within ``timeout``. A zombie has exited: a process whose parent was killed
    with it is reparented to the machine's init, which reaps it when it will (a container's may not at all)."""
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    return all(_exited(process) for process in alive)


def _exited(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_to_kvreuse_serve_stops_the_server_and_kvreuse_waits_for_it(tmp_path, signum, status):
    runner, tree = supervise(tmp_path, "polite")
    runner.send_signal(signum)
    assert runner.wait(timeout=20) == status
    assert gone(tree, timeout=1)  # the server and its child were gone before kvreuse exited


def test_a_second_signal_kills_a_server_that_does_not_stop(tmp_path):
    runner, tree = supervise(tmp_path, "stubborn")
    runner.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert all(p.is_running() for p in tree)  # forwarded, ignored
    runner.send_signal(signal.SIGTERM)
    runner.wait(timeout=20)
    assert gone(tree)


def test_one_ctrl_c_while_the_server_starts_stops_it_with_status_130_even_if_it_ignores_sigterm(tmp_path):
    # A server still starting (its /health never answers) that would finish starting before heeding a signal: it
    # gets SIGTERM and, after STARTUP_GRACE_S, its process group is killed; no second signal is needed.
    runner, tree = supervise(tmp_path, "stubborn", ready_url="http://127.0.0.1:9/health")
    runner.send_signal(signal.SIGINT)
    assert runner.wait(timeout=20) == 130
    assert gone(tree, timeout=1)


def test_the_server_stops_when_kvreuse_itself_is_killed(tmp_path):
    runner, tree = supervise(tmp_path, "polite")
    os.kill(runner.pid, signal.SIGKILL)
    runner.wait(timeout=20)
    assert gone(tree)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("kvreuse.vllm.PrefixAfinityScheduler", "kvreuse.vllm has no PrefixAfinityScheduler (did you mean"),
        ("kvreuse.vlm.PrefixAffinityScheduler", "cannot import kvreuse.vlm"),
        ("PrefixAffinityScheduler", "is not a class path (module.Class)"),
    ],
)
def test_a_class_path_that_does_not_import_is_refused_before_any_engine_starts(value, message):
    from kvreuse.vllm.engine_args import check_class_names

    with pytest.raises(ConfigError, match=re.escape(message)):
        check_class_names({"scheduler_cls": value})


def test_kvreuses_scheduler_class_path_resolves():
    from kvreuse.vllm.engine_args import check_class_names

    check_class_names({"scheduler_cls": "kvreuse.vllm.PrefixAffinityScheduler", "worker_cls": "auto"})
