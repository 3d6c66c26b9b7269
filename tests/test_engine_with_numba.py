"""An engine starts in a process that has imported numba (kvreuse's module index does).

vLLM 0.32's CPU kernel overrides scan every module's attributes and trip over llvmlite's ``ffi.lib``; the plugin's
entry point shields it (``kvreuse.patches.vllm_0_32.shield_llvmlite_from_kernel_scan``). Each case runs in a fresh
interpreter because the overrides rebind kernels in every loaded module, as a worker does, and that cannot be undone
in the test process.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

# What a vLLM worker does first (worker_base.WorkerWrapperBase.init_worker): run the general plugins, then let the
# platform replace Triton kernels it cannot run.
WORKER_START = """
{before}
from vllm.platforms import current_platform
from vllm.triton_utils import HAS_TRITON
if HAS_TRITON:
    raise SystemExit(3)  # Triton runs on this CPU; vLLM registers no overrides and never scans
{plugins}
{after}
current_platform.register_triton_kernel_overrides()
"""


def _start(plugins: str, *, before: str = "import numba", after: str = "") -> subprocess.CompletedProcess[str]:
    code = WORKER_START.format(plugins=plugins, before=before, after=after)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_a_worker_starts_after_numba_was_imported_once_the_plugin_has_run():
    started = _start("from kvreuse.vllm.registration import register\nregister()")
    if started.returncode == 3:
        pytest.skip("this vLLM build runs Triton on CPU, so it never scans for kernel overrides")
    assert started.returncode == 0, started.stderr[-2000:]


def test_without_the_shield_the_scan_fails_so_the_test_above_can_fail():
    started = _start("")
    if started.returncode == 3:
        pytest.skip("this vLLM build runs Triton on CPU, so it never scans for kernel overrides")
    assert started.returncode != 0
    assert "_lib_fn_wrapper" in started.stderr


def test_a_worker_starts_when_numba_is_imported_after_the_plugin_ran():
    """Issue 29: an in-process engine with ``KVReuseSparseFigures`` died at start, because importing the connector
    (its metrics import the module store, whose package imports the numba index) loaded llvmlite after the plugin
    had run and before vLLM's scan."""
    started = _start(
        "from kvreuse.vllm.registration import register\nregister()",
        before="",
        after="import kvreuse.vllm.sparse.connector",
    )
    if started.returncode == 3:
        pytest.skip("this vLLM build runs Triton on CPU, so it never scans for kernel overrides")
    assert started.returncode == 0, started.stderr[-2000:]
