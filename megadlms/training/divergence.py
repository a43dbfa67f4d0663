"""Steps with a non-finite loss or gradient norm are skipped, counted, and stop the run when they repeat.

The test runs on the device every step: `found_inf` (1.0 for a bad step) is computed from the loss and the
gradients' norm without a host sync and handed to a fused optimizer, whose kernel then leaves parameters, moments
and step counts as they were (AMP's `found_inf` of torch's fused Adam/AdamW; `StreamingAdamW` takes the same
attribute). Other optimizers (the CPU's foreach AdamW) read the flag on the host instead, where nothing runs ahead
to wait for. Counters stay on the device; the host reads them where it syncs anyway (log lines, saves) or one
step late (`preemption.RunControl`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..errors import MegaDLMsError


class DivergenceError(MegaDLMsError, FloatingPointError):
    """Too many consecutive steps had a non-finite loss or gradient norm."""


class NonFiniteStateError(MegaDLMsError, FloatingPointError):
    """The weights or optimizer state hold NaN or inf: such a checkpoint is not written."""


def _takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's kernel skips its update on a device `found_inf`: torch's fused Adam/AdamW (on plain
    and DTensor parameters alike) and StreamingAdamW, built on it."""
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and bool(optimizer.defaults.get("fused"))


class DivergenceGuard:
    """Per-step non-finite detection and optimizer-step skipping for one run.

    max_consecutive: that many skipped steps in a row stop the run (`DivergenceError`); 0 never stops.
    group: the process group over which ranks agree on a skip (every rank skips the same steps).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device, max_consecutive: int,
                 group: dist.ProcessGroup | None = None):
        self.optimizer, self.max_consecutive, self.group = optimizer, max_consecutive, group
        self.on_device = _takes_found_inf(optimizer)
        z = torch.zeros((), dtype=torch.float32, device=device)
        self.found_inf = z.clone()  # 1.0 when this step is skipped
        self.consecutive = z.clone()  # skipped steps in a row, up to this one
        self.window_skipped = z.clone()  # skipped steps since the last log line
        self.total_skipped = 0  # host count, as of the last log line

    def step(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """The optimizer step, skipped when `loss` or `grad_norm` is not finite (decided on the device)."""
        bad = torch.logical_not(torch.isfinite(loss.detach().float()) & torch.isfinite(grad_norm.detach().float()))
        self.found_inf.copy_(bad)
        if self.group is not None:
            dist.all_reduce(self.found_inf, op=dist.ReduceOp.MAX, group=self.group)
        self.consecutive.add_(1.0).mul_(self.found_inf)
        self.window_skipped.add_(self.found_inf)
        if self.on_device:
            self.optimizer.found_inf = self.found_inf  # type: ignore[attr-defined]  # read by torch's fused kernels
            try:
                self.optimizer.step()
            finally:
                self.optimizer.found_inf = None  # type: ignore[attr-defined]
        elif not bool(self.found_inf):  # the host decides: on the CPU nothing runs ahead to wait for
            self.optimizer.step()

    def finite_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The step's loss for the logged average: 0 for a skipped step (the average leaves it out)."""
        return torch.where(self.found_inf > 0, torch.zeros_like(loss), loss)

    def end_window(self, iteration: int) -> int:
        """At a log line (the host syncs there anyway): the steps skipped since the last one; raises
        `DivergenceError` when the run of consecutive skips reached the limit."""
        skipped, consecutive = (int(v) for v in torch.stack([self.window_skipped, self.consecutive]).tolist())
        self.window_skipped.zero_()
        self.total_skipped += skipped
        self.check_consecutive(consecutive, iteration)
        return skipped

    def check_consecutive(self, consecutive: int, iteration: int) -> None:
        if self.max_consecutive and consecutive >= self.max_consecutive:
            raise DivergenceError(
                f"training diverged: the last {consecutive} steps (to iteration {iteration}) had a non-finite loss "
                f"or gradient norm and were skipped ({self.total_skipped} skipped in all); resume from the last "
                "checkpoint with a lower --lr or more --lr-warmup-iters, check the data, or raise "
                "--max-skipped-steps")


def check_finite_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, iteration: int,
                       group: dist.ProcessGroup | None = None) -> None:
    """Raise `NonFiniteStateError` when a parameter or an optimizer state tensor holds NaN or inf (one host sync;
    collective over `group`: shards differ between ranks)."""
    tensors = [p.detach() for p in model.parameters()]
    tensors += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    tensors = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    tensors = [t for t in tensors if t.is_floating_point() and t.numel()]
    if not tensors:
        return
    # max |x| per tensor: a reduction without a temporary of the tensor's size; NaN and inf carry through it
    peaks = torch.stack([torch.linalg.vector_norm(t, float("inf")).float() for t in tensors])
    bad = torch.logical_not(torch.isfinite(peaks).all()).float()
    if group is not None:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    if bool(bad):
        raise NonFiniteStateError(f"not saving iteration {iteration}: the weights or optimizer state hold NaN or inf, "
                                  "and such a checkpoint cannot be trained from; the previous checkpoint stays "
                                  "`latest`: resume from it with a lower --lr or more --lr-warmup-iters")
