"""Stopping a run cleanly: on SIGTERM / SIGINT / SIGUSR1 (a scheduler's preemption notice) or before a wall-time
limit (--exit-duration-in-mins), the trainer finishes its step, saves a checkpoint and exits with status 0.

A signal only sets a host flag; ranks must agree on the step at which they stop (the save is collective), so at
each step's end every rank MAX-reduces [stop requested, time is up, consecutive skipped steps] on the device. On a
GPU that result reaches the host through pinned memory and is read one step later, behind work already done: no
host sync is added. A second signal exits at once, by the signal's default action.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")


class _Lagged:
    """A device tensor on its way to the host: copied to pinned memory behind the queued work (CUDA), read later."""

    def __init__(self, t: torch.Tensor):
        self._event = None
        if not t.is_cuda:
            self._host = t
            return
        self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self._host.copy_(t, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def get(self) -> list[float]:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


class RunControl:
    """Signal handlers and the wall-time limit of one run; `after_step` says whether (and why) to stop.

    handle_signals: install the handlers (--exit-signal-handler); exit_duration_mins: stop after this many minutes
    from `start`; guard: a `divergence.DivergenceGuard` whose run of skipped steps is checked every step.
    """

    def __init__(self, device: torch.device, *, distributed: bool, handle_signals: bool = True,
                 exit_duration_mins: float | None = None, guard: Any = None, start: float | None = None):
        self.device, self.distributed, self.guard = device, distributed, guard
        self.handle_signals = handle_signals
        self.deadline = None if not exit_duration_mins else (start or time.time()) + 60.0 * exit_duration_mins
        self.received: str | None = None  # the name of the first stop signal
        self._previous: dict[int, Any] = {}
        self._pending: _Lagged | None = None
        self.reason: str | None = None

    # ------------------------------------------------------------------ signals
    def _on_signal(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:  # the second one: no more waiting for a save
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        self.received = name
        print(f"received {name}: finishing this step, then saving a checkpoint and exiting "
              f"(send it again to exit at once)", flush=True)

    def install(self) -> None:
        """Handle the stop signals from now on (main thread only: Python delivers signals there)."""
        if self.handle_signals and not self._previous and threading.current_thread() is threading.main_thread():
            for name in STOP_SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None:
                    self._previous[sig] = signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        """Put the previous handlers back (idempotent)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def report(self, iteration: int, save_dir: str | None, saved: bool, is_main: bool) -> None:
        """The line that says why the run stopped early and where it saved (nothing when it ran to its end)."""
        if self.reason is None or not is_main:
            return
        if saved and save_dir:
            from .checkpoint import iteration_dir

            what = f"saved checkpoint {iteration_dir(save_dir, iteration)}; resume with --load {save_dir}"
        else:
            what = "nothing saved (no --save)" if not save_dir else "the checkpoint could not be saved"
        print(f"stopped at iteration {iteration} on {self.reason}: {what}", flush=True)

    # ------------------------------------------------------------------ every step
    def after_step(self, iteration: int) -> str | None:
        """Called by every rank after each step: the reason to stop now ("SIGTERM", "the time limit ..."), agreed
        by all ranks, or None."""
        time_up = self.deadline is not None and time.time() >= self.deadline
        stop = self.received is not None
        skipped = self.guard.consecutive if self.guard is not None else torch.zeros((), device=self.device)
        consecutive = skipped.float()
        if self.distributed:  # every rank stops at the same step: agree on the flags
            flags = torch.stack([torch.full((), float(stop), device=self.device),
                                 torch.full((), float(time_up), device=self.device), consecutive])
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        else:  # the host flags are this process's own; only the skip count comes from the device
            flags = consecutive.reshape(1)
        previous, self._pending = self._pending, _Lagged(flags)
        if self.device.type != "cuda":  # nothing runs ahead on the CPU: this step's values are here
            previous = self._pending
        if previous is not None:
            values = previous.get()
            if self.guard is not None:
                self.guard.check_consecutive(int(values[-1]), iteration)
            if self.distributed:
                stop, time_up = values[0] > 0, values[1] > 0
        elif self.distributed:
            return None
        return self._reason(stop, time_up)

    def _reason(self, stop: bool, time_up: bool) -> str | None:
        if stop:
            self.reason = self.received or "a stop signal on another rank"
        elif time_up:
            self.reason = "the time limit of --exit-duration-in-mins"
        return self.reason
