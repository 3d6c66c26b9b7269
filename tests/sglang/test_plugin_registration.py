"""The ``sglang.srt.plugins`` entry point, loaded by SGLang's own ``load_plugins()`` in a fresh process.

As in SGLang's scheduler process, the scheduler module (which binds ``SchedulePolicy`` by ``from ... import``) is
imported before the plugins load; SGLang's ``HookRegistry`` must then replace that binding too. The server
arguments are parsed by SGLang's own ``prepare_server_args``, as ``sglang serve`` / ``launch_server`` do after
``load_plugins()``. Needs kvreuse installed in the environment (``pip install -e .``, as ``make test-sglang`` does).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

SCRIPT = f"""
import json, os, sys
sys.path.insert(0, {str(HERE)!r})
import sglang_stubs
sglang_stubs.install()
import sglang.srt.managers.scheduler as scheduler
from sglang.srt.plugins import load_plugins
load_plugins()
import sglang.srt.managers.schedule_policy as schedule_policy
from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.mem_cache.registry import registered_radix_cache_backends
import kvreuse.sglang
out = {{"policy": schedule_policy.SchedulePolicy.__module__ + "." + schedule_policy.SchedulePolicy.__name__,
       "scheduler_binding": scheduler.SchedulePolicy.__name__,
       "attention": "kvreuse_sparse" in ATTENTION_BACKENDS, "choice": "kvreuse_sparse" in ATTENTION_BACKEND_CHOICES,
       "radix": "kvreuse_modules" in registered_radix_cache_backends(),
       "registered_here": os.getpid() in kvreuse.sglang.registered_pids()}}
if out["choice"]:
    from sglang.srt.server_args import prepare_server_args
    args = prepare_server_args(["--model-path", "m", "--page-size", "16", "--attention-backend", "kvreuse_sparse",
                                "--radix-cache-backend", "kvreuse_modules"])
    out["args"] = [args.attention_backend, args.radix_cache_backend, args.page_size]
print("RESULT" + json.dumps(out))
"""


def load(allowed: str) -> dict:
    env = {**os.environ, "SGLANG_PLUGINS": allowed}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, cwd=HERE, capture_output=True, text=True, timeout=300
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT") :])


def test_sglang_loads_the_plugin_and_it_registers_every_name():
    got = load("kvreuse")
    assert got == {
        "policy": "kvreuse.sglang.scheduler.KVReuseSchedulePolicy",
        "scheduler_binding": "KVReuseSchedulePolicy",
        "attention": True,
        "choice": True,
        "radix": True,
        "registered_here": True,
        "args": ["kvreuse_sparse", "kvreuse_modules", 16],
    }


def test_sglang_plugins_without_kvreuse_leaves_sglang_stock():
    got = load("some-other-plugin")
    assert got == {
        "policy": "sglang.srt.managers.schedule_policy.SchedulePolicy",
        "scheduler_binding": "SchedulePolicy",
        "attention": False,
        "choice": False,
        "radix": False,
        "registered_here": False,
    }
