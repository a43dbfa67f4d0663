"""benchmarks/host_gaps.py: the GPU's busy time as the union of kernel intervals, and the CPU smoke run."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from host_gaps import busy_ms  # noqa: E402


def test_busy_time_counts_overlapping_and_nested_kernels_once():
    assert busy_ms([]) == 0.0
    assert busy_ms([(0.0, 2.0), (1.0, 3.0), (1.5, 2.5), (5.0, 6.0)]) == 4.0  # [0, 3] and [5, 6]
    assert busy_ms([(4.0, 5.0), (0.0, 1.0), (0.5, 0.75)]) == 2.0


def test_host_gaps_smoke(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_gaps.py"), "--smoke", "--workloads",
                          "recompute,lora"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = {line.split()[0]: line.split()[1:] for line in res.stdout.splitlines()
            if line.startswith(("recompute/", "lora/"))}
    assert set(rows) == {"recompute/bf16", "recompute/fp8", "lora/bf16", "lora/fp8"}, res.stdout
    assert all(float(r[0]) > 0 for r in rows.values())  # ms per step
