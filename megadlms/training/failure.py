"""How a training run fails: every exception out of `train()` (a bug, CUDA out of memory, a data error, a failed
collective) ends the data loader's worker processes and releases the process group before it propagates, so the
process exits at once, on every rank, instead of holding its devices until the job's wall-time limit.

Both are needed: the exception's traceback keeps the loader's iterator alive, its workers ignore SIGTERM
(`data.loader`), and multiprocessing's exit handler would wait for them forever; a rank that hangs keeps its peers
waiting in their next collective until the process group's timeout (30 minutes).

Ranks: the failing rank tears down its process group and exits. With gloo its connections close, so a peer waiting
on it in a collective fails at once, and stops the same way with a line that points to the first failure. With NCCL
this rank's communicators are aborted, but a peer blocked inside an NCCL collective need not notice a departed rank
before the collective timeout: torchrun stops the remaining ranks once one has exited non-zero (SIGTERM, then
SIGKILL after its grace period), as does `srun --kill-on-bad-exit`.

Messages: an out-of-memory error becomes one line naming the memory in use and the flags that lower it
(`OutOfDeviceMemoryError`), and a collective that failed because a peer is gone one line saying so
(`PeerFailureError`); both are `MegaDLMsError`s, which the command line prints as `megadlms train: error: ...` with
exit status 2. Other exceptions (a bug) propagate unchanged, with their traceback (exit status 1). Should the
interpreter's shutdown still stall after a failure of `megadlms train` (a stuck thread or child process), the
process ends `EXIT_GRACE_S` after its main thread has finished, with the failure's exit status.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..distributed.init import abort_parallel
from ..errors import USER_ERRNOS, MegaDLMsError

EXIT_GRACE_S = 10.0  # after a failure, the longest the interpreter's shutdown may take before the process ends anyway

# gloo's (and the TCP store's) words for a peer that is gone; NCCL's errors are DistBackendErrors
_PEER_GONE = re.compile(r"Connection (closed|reset) by peer|Broken pipe|remote process exited|"
                        r"NCCL communicator was aborted", re.IGNORECASE)


class OutOfDeviceMemoryError(MegaDLMsError, torch.OutOfMemoryError):
    """The device ran out of memory; the message names the memory in use and the flags that lower it."""


class PeerFailureError(MegaDLMsError, RuntimeError):
    """A collective failed because another rank is gone (it failed first, or the network between them did)."""


class RunFailure:
    """What `handled_failures` knows of the run: its configuration and, once `setup` has built it, the trainer."""

    def __init__(self, config: Any):
        self.config = config
        self.trainer: Any = None

    def watch(self, trainer: Any) -> Any:
        """Remember the run's trainer (its loaders, device and iteration); returns it."""
        self.trainer = trainer
        return trainer

    def close_loaders(self) -> None:
        loaders = getattr(self.trainer, "loaders", None)
        close = getattr(loaders, "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------ messages
    def _where(self) -> str:
        """'rank R: ' in a run of several processes, else ''."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return f"rank {dist.get_rank()}: "
        return ""

    def _when(self) -> str:
        if self.trainer is None:
            return " while setting up the run"
        done = int(self.trainer.state.iteration)
        return f" after iteration {done}" if done else " before the first iteration ended"

    def describe(self, e: BaseException) -> MegaDLMsError | None:
        """The one-line error that replaces `e`, or None where `e` keeps its own message (and traceback)."""
        if isinstance(e, MegaDLMsError) or not isinstance(e, Exception):
            return None
        if isinstance(e, torch.OutOfMemoryError):
            return OutOfDeviceMemoryError(self._out_of_memory(e))
        if self._where() and (isinstance(e, dist.DistError) or
                              (isinstance(e, RuntimeError) and _PEER_GONE.search(str(e)))):
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            first = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", first)  # the C++ source position
            first = first.split(". ")[0]  # gloo adds advice on how to read the logs
            first = first if len(first) <= 160 else first[:157] + "..."
            return PeerFailureError(f"{self._where()}a collective failed{self._when()} ({first}): another rank has "
                                    "probably failed first; its error, earlier in the log, is the cause")
        return None

    def _out_of_memory(self, e: BaseException) -> str:
        t = self.config.train
        device = getattr(self.trainer, "device", None) or torch.device(t.device or "cpu")
        memory = ""
        if device.type == "cuda" and torch.cuda.is_available():
            try:
                free, total = torch.cuda.mem_get_info(device)
                memory = (f": {(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB in use, "
                          f"{torch.cuda.memory_allocated(device) / 2**30:.1f} GiB of it allocated by PyTorch")
            except Exception:  # the figures are a help, not the point
                pass
        asked = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", str(e))
        if asked:
            memory += f"{';' if memory else ':'} {asked.group(1)} more was asked for"
        cfg = getattr(self.trainer, "cfg", None)
        seq = getattr(cfg, "seq_length", None) or getattr(self.config.model, "seq_length", None)
        keep = (f"gradient accumulation keeps --global-batch-size {t.global_batch_size}" if t.global_batch_size
                else "--global-batch-size keeps the batch by gradient accumulation")
        hints = [f"lower --micro-batch-size (now {t.micro_batch_size}; {keep})"]
        if t.recompute_granularity != "full":
            hints.append("add --recompute-granularity full")
        hints.append(f"shorten --seq-length{f' (now {seq})' if seq else ''}")
        if not self.config.fp8.enabled:
            hints.append("train the linear layers in FP8 (--fp8-format hybrid)")
        return (f"{self._where()}out of memory on {device}{self._when()}{memory}; to fit, "
                f"{', '.join(hints[:-1])} or {hints[-1]}")


def exit_status(e: BaseException) -> int:
    """The status the command line exits with after `e` (`errors.report_errors`' 2 for a user's error)."""
    if isinstance(e, SystemExit):
        return 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    if isinstance(e, KeyboardInterrupt):
        return 130
    if isinstance(e, MegaDLMsError) or (isinstance(e, OSError) and e.errno in USER_ERRNOS and e.filename):
        return 2
    return 1


_exit_watch: threading.Thread | None = None


def exit_if_shutdown_stalls(status: int, grace_s: float = EXIT_GRACE_S) -> None:
    """Once the main thread has finished (the interpreter is shutting down), give the shutdown `grace_s` seconds,
    then end the process with `status`: a failed run must not be held by a thread or child process that never
    ends. Nothing happens while the main thread runs; one call per process counts."""
    global _exit_watch
    if _exit_watch is not None:
        return

    def watch() -> None:
        threading.main_thread().join()
        time.sleep(grace_s)
        print(f"megadlms: the process had not exited {grace_s:g} s after its failure; ending it "
              f"(status {status})", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os._exit(status)

    _exit_watch = threading.Thread(target=watch, name="megadlms-exit-watch", daemon=True)
    _exit_watch.start()


@contextlib.contextmanager
def handled_failures(config: Any) -> Iterator[RunFailure]:
    """Wrap a run (`trainer.train`): its loaders' workers always end with it; on an exception the process group is
    released too (no barrier) and a known failure becomes a one-line `MegaDLMsError`. `watch(trainer)` on the
    yielded object once setup has built it."""
    run = RunFailure(config)
    try:
        yield run
    except BaseException as e:
        replacement = run.describe(e)  # before the teardown: it reads the rank and the device's memory
        with contextlib.suppress(Exception):  # the run's own error is the one to report
            run.close_loaders()
        abort_parallel()
        if replacement is None:
            raise
        raise replacement from e
    else:
        run.close_loaders()


@contextlib.contextmanager
def exit_promptly_on_failure() -> Iterator[None]:
    """For a process that ends with its run (`megadlms train`): after an exception, `exit_if_shutdown_stalls`."""
    try:
        yield
    except BaseException as e:
        exit_if_shutdown_stalls(exit_status(e))
        raise
