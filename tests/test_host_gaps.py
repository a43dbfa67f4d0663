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
    """Every workload but the compiled eager LoRA (compiling on the CPU is slow), the CUDA graphs emulated."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MEGADLMS_EMULATE_CUDA_GRAPHS="1")
    workloads = ("recompute", "recompute-graphs", "lora", "lora-graphs")
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_gaps.py"), "--smoke", "--workloads",
                          ",".join(workloads)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = {line.split()[0]: line.split()[1:] for line in res.stdout.splitlines() if line.startswith(workloads)}
    assert set(rows) == {f"{w}/{p}" for w in workloads for p in ("bf16", "fp8")}, res.stdout
    assert all(float(r[0]) > 0 for r in rows.values())  # ms per step
    assert all((int(r[-1]) > 0) == ("-graphs/" in name) for name, r in rows.items())  # graph replays
