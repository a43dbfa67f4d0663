"""`python -m megadlms ARGS` with a failure injected into the training loop: `Trainer.train_step` raises once
`FAIL_AT` (default 2) iterations are done, on rank `FAIL_RANK` (default 0); `FAIL=bug` raises a TypeError, `FAIL=oom`
a torch.OutOfMemoryError as the CUDA allocator words it. Used by test_failure_exit.py."""

import os
import runpy

import torch

from megadlms.training.trainer import Trainer

step = Trainer.train_step


def failing_step(self):
    if (self.state.iteration == int(os.environ.get("FAIL_AT", "2"))
            and int(os.environ.get("RANK", "0")) == int(os.environ.get("FAIL_RANK", "0"))):
        if os.environ["FAIL"] == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity "
                                         "of 79.19 GiB of which 1.06 GiB is free.")
        raise TypeError(f"injected failure at iteration {self.state.iteration}")
    return step(self)


Trainer.train_step = failing_step
runpy.run_module("megadlms", run_name="__main__", alter_sys=True)
