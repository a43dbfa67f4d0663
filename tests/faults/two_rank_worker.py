"""Launched by test_two_ranks.py under torchrun (2 gloo ranks): an unbroken run; a run in which only rank 0 gets
SIGTERM after iteration 2 (both ranks must stop there and save together); its resume; a run whose rank 1 finds
its disk full at the first save; then a run whose rank 1 is killed with SIGKILL inside its second save (the launch
then fails, as a node failure does)."""

import os
import signal
import sys
from pathlib import Path

from megadlms.training import checkpoint as ckpt
from megadlms.training.args import parse_train_args
from megadlms.training.trainer import setup

out, flags = Path(sys.argv[1]), sys.argv[2:]
rank = int(os.environ["RANK"])


def trainer(*extra: str):
    return setup(parse_train_args(flags + list(extra)))


trainer("--save", str(out / "unbroken")).run()

t = trainer("--save", str(out / "preempted"))
if rank == 0:
    step = t.train_step

    def stepping():
        result = step()
        if t.state.iteration == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return result
    t.train_step = stepping
print(f"rank {rank} stopped at iteration {t.run().iteration}", flush=True)
t.control.uninstall()

trainer("--save", str(out / "preempted"), "--load", str(out / "preempted")).run()
print(f"rank {rank} resumed to the end", flush=True)

t = trainer("--save", str(out / "full"), "--save-interval", "1", "--ckpt-save-failures-ok", "1")
if rank == 1:  # rank 1's disk is full at its first save: both ranks drop that checkpoint and go on
    import errno

    import torch

    save = torch.save

    def full_once(obj, f, *a, **k):
        if hasattr(f, "write") and not getattr(full_once, "done", False):
            full_once.done = True
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(obj, f, *a, **k)
    torch.save = full_once
print(f"rank {rank} went on to iteration {t.run().iteration}", flush=True)

t = trainer("--save", str(out / "killed"), "--save-interval", "1")
if rank == 1:
    commit = ckpt._commit_save

    def dying(tmp, final, iteration, *a, **k):
        if iteration == 2:  # rank 1's shard is written, the checkpoint not yet committed
            os.kill(os.getpid(), signal.SIGKILL)
        return commit(tmp, final, iteration, *a, **k)
    ckpt._commit_save = dying
t.run()
