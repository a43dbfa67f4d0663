"""A run that fails inside the training loop exits at once, non-zero, on every rank: its data-loading workers end and
its process group is released (before, an exception left the process waiting for the workers forever, and a peer
rank waiting in its next collective); out of memory is one line naming the flags that lower it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from .conftest import TINY

ROOT = Path(__file__).resolve().parents[2]
RUNNER = str(Path(__file__).with_name("failing_run.py"))


def _flags(workers: int) -> list[str]:
    return [str(workers) if TINY[i - 1] == "--num-workers" else a for i, a in enumerate(TINY)]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def _train(fail: str) -> tuple[subprocess.Popen, float]:
    """`python -m megadlms train` (2 loader workers) failing in iteration 3; returns it and when iteration 2 ended."""
    proc = subprocess.Popen([sys.executable, RUNNER, "train", *_flags(2), "--train-iters", "1000"], cwd=ROOT,
                            env=_env(FAIL=fail), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("iter ") and " 2/1000 " in line:
            return proc, time.monotonic()
    raise AssertionError(f"no second iteration: {proc.communicate(timeout=60)}")


def _finish(proc: subprocess.Popen, failed_at: float) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the process and its workers
        raise AssertionError(f"still running 30 s after the failure: {proc.communicate()}") from None
    assert time.monotonic() - failed_at < 15, err
    return proc.returncode, err


def test_a_failure_in_the_loop_ends_the_process_and_its_workers():
    proc, failed_at = _train("bug")
    rc, err = _finish(proc, failed_at)
    # a bug keeps its traceback (errors.report_errors): the last line names it
    assert rc == 1 and err.strip().splitlines()[-1] == "TypeError: injected failure at iteration 2", err
    leftover = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert leftover == [], leftover  # no data-loading worker outlives the run


def test_out_of_memory_is_one_line_naming_the_flags_that_lower_memory():
    rc, err = _finish(*_train("oom"))
    assert rc == 2 and "Traceback" not in err, err
    lines = [x for x in err.splitlines() if "error:" in x]
    assert len(lines) == 1, err
    assert lines[0].startswith("megadlms train: error: out of memory on cpu after iteration 2: 2.50 GiB more"), err
    for knob in ("--micro-batch-size (now 2;", "--recompute-granularity full", "--seq-length (now 16)",
                 "--fp8-format hybrid"):
        assert knob in lines[0], lines[0]


def test_a_stalled_shutdown_after_a_failure_still_ends_the_process():
    code = ("import threading, time\n"
            "from megadlms.training.failure import exit_if_shutdown_stalls\n"
            "threading.Thread(target=time.sleep, args=(600,)).start()  # a thread that never ends\n"
            "exit_if_shutdown_stalls(3, grace_s=0.5)\n")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3 and "had not exited 0.5 s after its failure; ending it (status 3)" in proc.stderr, \
        proc.stderr
    assert time.monotonic() - started < 30


def test_a_failing_rank_makes_its_peer_exit():
    """Two gloo ranks launched without torchrun (which would stop the peer itself): rank 0 fails in iteration 3
    while rank 1 goes on into that step's gradient all-reduce; both exit non-zero within seconds, rank 1 with one
    line pointing at the first failure. Each rank has a loader worker."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [subprocess.Popen([sys.executable, RUNNER, "train", *_flags(1), "--global-batch-size", "4",
                               "--train-iters", "1000"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True,
                              env=_env(FAIL="bug", RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for r in (0, 1)]
    deadline = time.monotonic() + 120  # start-up of two processes on a busy machine, then seconds
    results = []
    for p in procs:
        try:
            results.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                os.killpg(q.pid, 9)
            raise AssertionError(f"rank {procs.index(p)} did not exit: {[q.communicate() for q in procs]}") from None
    (out0, err0), (out1, err1) = results
    assert "iter      2/1000" in out0 and procs[0].returncode == 1, err0
    # (torch.distributed prefixes each rank's stderr lines with "[rankN]:")
    assert err0.strip().splitlines()[-1].endswith("TypeError: injected failure at iteration 2"), err0
    assert procs[1].returncode == 2 and "Traceback" not in err1, err1
    lines = [x for x in err1.splitlines() if "error:" in x]
    assert len(lines) == 1, err1
    assert "megadlms train: error: rank 1: a collective failed after iteration 2 (" in lines[0] and \
        lines[0].endswith("another rank has probably failed first; its error, earlier in the log, is the cause"), err1
