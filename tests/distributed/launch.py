"""Launching training runs on CPU processes (gloo) from the tests, and reading their metrics back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# a tiny model, fp32, no randomness in sequence lengths: runs split differently must agree to rounding
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
        "--ffn-hidden-size", "128", "--seq-length", "32", "--log-interval", "1", "--fp32", "--device", "cpu",
        "--eval-iters", "0", "--no-compile", "--num-workers", "0", "--difflm-varilen-prob", "0", "--no-progress",
        "--no-generate-sample", "--lr", "3e-3", "--global-batch-size", "4"]


def launch(nproc: int, argv: list[str], script: str = "pretrain_difflm.py", timeout: float = 600,
           env: dict[str, str] | None = None) -> str:
    """Run `script argv` on `nproc` processes: torchrun for nproc > 1, plain python for 1 (with `env` added to
    the environment). Returns the output."""
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script]
    else:
        cmd = [sys.executable, script]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.run(cmd + argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    if proc.returncode:
        raise AssertionError(f"{' '.join(cmd[-2:] + argv)} exited with {proc.returncode}:\n{out[-6000:]}")
    return out


def train_losses(save_dir: str | Path) -> list[float]:
    """The training loss of every logged iteration, from the run's metrics.jsonl."""
    lines = (Path(save_dir) / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["split"] == "train"]


def train_iterations(save_dir: str | Path) -> list[int]:
    lines = (Path(save_dir) / "metrics.jsonl").read_text().splitlines()
    return [r["iteration"] for r in map(json.loads, lines) if r["split"] == "train"]
