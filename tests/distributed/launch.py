"""Launching training runs on CPU processes (gloo) from the tests, and reading their metrics back."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# a tiny model, fp32, no randomness in sequence lengths: runs split differently must agree to rounding
TINY = ["--model-path", "tiny",  # flags of its own run, not over the demo configuration
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
        "--ffn-hidden-size", "128", "--seq-length", "32", "--log-interval", "1", "--fp32", "--device", "cpu",
        "--eval-iters", "0", "--no-compile", "--num-workers", "0", "--difflm-varilen-prob", "0", "--no-progress",
        "--no-generate-sample", "--lr", "3e-3", "--global-batch-size", "4"]


# how torchrun reports a rank killed inside native code (a gloo thread calling std::terminate, a segfault)
NATIVE_CRASHES = ("Signal 6 (SIGABRT)", "Signal 11 (SIGSEGV)")


def launch(nproc: int, argv: list[str], script: str = "pretrain_difflm.py", timeout: float = 600,
           env: dict[str, str] | None = None, rerun_after_native_crash: bool = False,
           clean_before_rerun: Sequence[Path] = ()) -> str:
    """Run `script argv` on `nproc` processes: torchrun for nproc > 1, plain python for 1 (with `env` added to
    the environment). Returns the output.

    rerun_after_native_crash: run once more, with a warning, when torchrun reports a rank killed in native code
    (gloo's threads can abort a process at teardown) rather than a Python error; a second failure fails. The
    folders in `clean_before_rerun` are removed first, so that a rerun starts from what the first attempt
    started from (a training run would otherwise find its own checkpoints and metrics).
    """
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script]
    else:
        cmd = [sys.executable, script]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}

    def run() -> tuple[int, str]:
        proc = subprocess.run(cmd + argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        return proc.returncode, proc.stdout + proc.stderr

    code, out = run()
    if code and rerun_after_native_crash and any(s in out for s in NATIVE_CRASHES):
        warnings.warn(f"{script}: a rank died in native code; running it once more. Its output:\n{out[-3000:]}")
        for path in clean_before_rerun:
            shutil.rmtree(path, ignore_errors=True)
        code, out = run()
    if code:
        raise AssertionError(f"{' '.join(cmd[-2:] + argv)} exited with {code}:\n{out[-6000:]}")
    return out


def train_losses(save_dir: str | Path) -> list[float]:
    """The training loss of every logged iteration, from the run's metrics.jsonl."""
    lines = (Path(save_dir) / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["split"] == "train"]


def train_iterations(save_dir: str | Path) -> list[int]:
    lines = (Path(save_dir) / "metrics.jsonl").read_text().splitlines()
    return [r["iteration"] for r in map(json.loads, lines) if r["split"] == "train"]
