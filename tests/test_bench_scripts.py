"""Every benchmark on the harness starts and offers the harness's options: ``--help`` of each script, run as a user
runs it, in one child process (the scripts set engine variables at import)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The scripts whose output goes through benchmarks/harness.py (write_results under build/ or --update-results).
ON_THE_HARNESS = [
    "all_plugins",
    "demo",
    "module_cache",
    "module_calibration_goal",
    "module_encodings_vllm",
    "module_index",
    "module_quality",
    "module_quality_vllm",
    "ray_replicas",
    "reorder_answers",
    "reorder_chat_orders",
    "reorder_engine",
    "reorder_orders",
    "reorder_plan_accuracy",
    "reorder_plan_time",
    "reorder_scheduler",
    "reorder_serve",
    "request_fuzz",
    "router_simulation",
    "sparse_bytes",
    "sparse_cpu_step",
    "sparse_decisions",
    "sparse_decode_gpu",
    "sparse_long",
    "sparse_qa",
    "sparse_real_keys",
]

# The modules in benchmarks/ that run nothing themselves: workloads and references benchmarks and tests share.
SHARED = ["harness", "module_quality_data", "reference_ggr", "reorder_tables", "retrieval_cases", "splice_reference"]

HELP_EACH = """
import contextlib, io, json, runpy, sys
out = {}
for name in sys.argv[1:]:
    sys.argv = [f"benchmarks/{name}.py", "--help"]
    text = io.StringIO()
    try:
        with contextlib.redirect_stdout(text):
            runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as done:
        out[name] = (done.code, text.getvalue())
print(json.dumps(out))
"""


def test_every_benchmark_on_the_harness_starts_and_can_update_the_docs_results():
    done = subprocess.run(
        [sys.executable, "-c", HELP_EACH, *ON_THE_HARNESS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT / "benchmarks")},  # as `python benchmarks/X.py` puts it first
    )
    assert done.returncode == 0, done.stderr[-3000:]
    helps = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(helps) == sorted(ON_THE_HARNESS)
    for name, (code, text) in helps.items():
        assert code in (0, None) and "--update-results" in text, (name, text[-500:])


def test_every_script_in_benchmarks_is_on_the_harness_or_a_shared_module():
    scripts = sorted(path.stem for path in (ROOT / "benchmarks").glob("*.py"))
    assert scripts == sorted(ON_THE_HARNESS + SHARED)
