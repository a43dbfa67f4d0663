"""Two gloo ranks: a SIGTERM that reaches one rank stops both at the same step with one collective save, and the
resumed run continues the unbroken run's losses bit for bit; a full disk on one rank fails that save on both, which
train on (--ckpt-save-failures-ok); a rank killed with SIGKILL mid-save leaves the previous checkpoint as `latest`,
whole, and it resumes (on one process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from megadlms.training import checkpoint as ckpt

from .conftest import TINY, logged_losses, tiny_trainer

ROOT = Path(__file__).resolve().parents[2]


def test_preemption_and_a_killed_rank_on_two_processes(tmp_path):
    flags = TINY + ["--global-batch-size", "4", "--train-iters", "4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(Path(__file__).with_name("two_rank_worker.py")), str(tmp_path), *flags],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out  # rank 1 was killed: the launch fails, as on a node failure
    for rank in (0, 1):
        assert f"rank {rank} stopped at iteration 2" in out and f"rank {rank} resumed to the end" in out, out
    # only rank 0 got the signal; rank 1 stopped by agreement. (Counted before the SIGKILL phase, where torchrun may
    # send SIGTERM to the surviving rank, depending on how fast that rank notices its peer is gone.)
    assert proc.stdout.split("went on to iteration 4")[0].count("received SIGTERM") == 1, out
    # one report, from rank 0 (the ranks share the pipe, so lines of the two may run together)
    report = (f"stopped at iteration 2 on SIGTERM: saved checkpoint {tmp_path / 'preempted' / 'iter_0000002'}"
              f"; resume with --load {tmp_path / 'preempted'}")
    assert out.count(report) == 1 and out.count("on SIGTERM: saved checkpoint") == 1, out
    unbroken = logged_losses(tmp_path / "unbroken")
    assert sorted(unbroken) == [1, 2, 3, 4] and logged_losses(tmp_path / "preempted") == unbroken  # bitwise

    for rank in (0, 1):  # a full disk on one rank: every rank drops that save, with one line, and trains on
        assert f"rank {rank} went on to iteration 4" in out, out
    assert out.count("training goes on (failed save 1 of the 1 --ckpt-save-failures-ok allows)") == 2, out
    assert "No space left on device [ENOSPC]" in out and "another rank failed to write its part" in out
    assert ckpt.complete_iterations(tmp_path / "full") == [2, 3, 4]

    killed = tmp_path / "killed"
    assert ckpt.find_checkpoint(killed) == ckpt.iteration_dir(killed, 1)
    assert ckpt.verify_checkpoint(ckpt.iteration_dir(killed, 1)) == []
    assert not ckpt.iteration_dir(killed, 2).exists()
    state = tiny_trainer("--global-batch-size", "4", "--train-iters", "2", "--load", str(killed)).run()
    assert state.iteration == 2
