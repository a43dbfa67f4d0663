"""benchmarks/host_gaps.py: the GPU's busy time as the union of kernel intervals, and the CPU smoke run."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from host_gaps import gpu_busy_ms  # noqa: E402


def test_gpu_busy_time_counts_overlapping_and_nested_kernels_once(tmp_path):
    events = [{"ph": "X", "cat": "kernel", "name": "a", "ts": 0, "dur": 2000},
              {"ph": "X", "cat": "kernel", "name": "b", "ts": 1000, "dur": 2000},  # overlaps a: [0, 3000]
              {"ph": "X", "cat": "gpu_memset", "name": "c", "ts": 1500, "dur": 500},  # inside
              {"ph": "X", "cat": "gpu_memcpy", "name": "d", "ts": 5000, "dur": 1000},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 3000, "dur": 2000}]  # host: not counted
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    assert gpu_busy_ms(trace) == 4.0


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
