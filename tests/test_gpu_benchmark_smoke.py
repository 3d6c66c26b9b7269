"""The GPU benchmark's script stays runnable between the sessions that are lent a GPU: ``--smoke`` runs it on tiny
sizes in Triton's interpreter (``benchmarks/sparse_decode_gpu.py``; its times mean nothing, its counts do)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from harness import SCRATCH  # noqa: E402


def test_the_gpu_benchmark_runs_every_arm_and_counts_what_dipr_reads():
    written = SCRATCH / "sparse_decode_smoke.json"  # a run writes under build/ (the harness's scratch folder)
    written.unlink(missing_ok=True)  # so the figures read below are this run's
    # A script's own folder (benchmarks/) goes on sys.path, not the working directory: triton_kernels/ stays hidden.
    done = subprocess.run(
        [sys.executable, "benchmarks/sparse_decode_gpu.py", "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads(written.read_text())
    arms: dict[tuple, dict[str, dict]] = {}
    for row in results["decode"]:
        arms.setdefault((row["keys"], row["context"], row["batch"]), {})[row["arm"]] = row
    assert {key[0] for key in arms} == {"real L4 x1", "real L20 x1", "synthetic"}
    for key, by_arm in arms.items():
        # no FlashAttention on the CPU: its arms are left out, the filter's own cost is timed
        assert set(by_arm) == {"dense", "dense paged", "dipr beta=inf", "dipr beta=4", "filter only beta=4"}, key
        assert by_arm["dipr beta=inf"]["blocks_read"] == 1.0, key  # dense: every block, no sketch
        # the filter reads the blocks the DIPR kernels read: one sketch scan decides both
        assert by_arm["filter only beta=4"]["blocks_read"] == by_arm["dipr beta=4"]["blocks_read"], key
        assert all(row["seconds"] > 0 and row["graph_seconds"] > 0 for row in by_arm.values()), key
    # On the real keys of layer 20 the sketch prunes (17% of the blocks of the 1K-token prompt at beta = 4).
    assert arms[("real L20 x1", 1027, 1)]["dipr beta=4"]["blocks_read"] < 0.5
    paged = [row for row in results["prefill"] if row["arm"] == "dense paged (kvreuse)"]
    assert paged and all(row["max_abs_diff_vs_flash"] < 1e-4 for row in paged)  # fp32 on the CPU: the same outputs
    # without FlashAttention the goals are judged from the filter's own cost against SDPA, and said to be bounds
    assert results["flash"] == "no GPU" and results["goals"]
    assert all("filter only" in line and "a bound" in line for line in results["goals"])
