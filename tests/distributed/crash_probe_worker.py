"""Launched by test_launch.py under torchrun: rank 1 dies in native code (abort) on the first run, i.e. while
the marker file argv[1] does not exist yet; argv[2] == "python" makes that death a Python error instead."""

import os
import sys
from pathlib import Path

import torch.distributed as dist

from megadlms.distributed.init import destroy_parallel

dist.init_process_group("gloo")
marker = Path(sys.argv[1])
if dist.get_rank() == 1 and not marker.exists():
    marker.write_text("first run")
    if sys.argv[2] == "python":
        raise RuntimeError("a Python error")
    os.abort()
destroy_parallel()
