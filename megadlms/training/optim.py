"""AdamW with Megatron's parameter groups, and Megatron's learning-rate schedules."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..config import ConfigError
from . import triton_adamw

LR_DECAY_STYLES = ("constant", "linear", "cosine", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


def build_optimizer(model: nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float],
                    eps: float = 1e-8, fused: bool | None = None) -> torch.optim.AdamW:
    """AdamW; no weight decay on biases, norm weights and other 1-D parameters (Megatron's rule).

    fused=None picks the fused update when the parameters live on a GPU: `StreamingAdamW` (torch's AdamW with
    its large fp32 parameters updated by one Triton pass each) where Triton is installed, else torch's fused
    AdamW. fused=True on other devices is torch's fused AdamW.
    """
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 else decay).append(p)
    if fused is None:
        fused = all(p.is_cuda for p in decay + no_decay)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    params = decay + no_decay
    if fused and params and all(triton_adamw.available(p.device) for p in params):
        return triton_adamw.StreamingAdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps)
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps, fused=fused)


def allocate_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state now (AdamW: exp_avg, exp_avg_sq, step), as its first step would.

    Made lazily, the state (two fp32 copies of the model) is allocated after the first forward and backward, into
    the holes their freed activations leave; made before them it lies in segments of its own, and the caching
    allocator keeps less memory that no request fits. The state is created by a step with zero gradients and a
    zero learning rate (parameters unchanged, moments zero), then the step counter is put back to zero: training
    computes exactly what it computes without this call. A no-op when the state exists or gradients are present.
    """
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if optimizer.state or not params or any(p.grad is not None for p in params):
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for g in optimizer.param_groups:
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
    for state in optimizer.state.values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"].zero_()
        elif "step" in state:
            state["step"] = 0


def clip_grad_norm(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """The gradients' total L2 norm (a device tensor), with the gradients clipped to `max_norm` for the next step.

    With a fused Adam/AdamW the clipping factor is handed to the optimizer kernel as its gradient divisor (the
    `grad_scale` that AMP's GradScaler uses), so the gradients are not rewritten by a separate pass over all of
    them (one read and one write of every gradient per step). Otherwise, and for DTensor gradients (FSDP2,
    tensor parallelism), `torch.nn.utils.clip_grad_norm_`. The same rule either way: factor
    min(1, max_norm / (norm + 1e-6)); max_norm = inf only measures.
    """
    grads = [p.grad for p in params if p.grad is not None]
    fused = bool(optimizer.defaults.get("fused")) and isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
    if len({g.device_mesh for g in grads if isinstance(g, DTensor)}) > 1:
        optimizer.grad_scale = None  # type: ignore[attr-defined]
        return _clip_across_meshes(params, max_norm)
    if not fused or not grads or any(isinstance(g, DTensor) for g in grads):
        optimizer.grad_scale = None  # type: ignore[attr-defined]  # read by torch's fused Adam kernels
        return nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    norm = nn.utils.get_total_norm(grads, foreach=True)
    if math.isinf(max_norm):
        optimizer.grad_scale = None  # type: ignore[attr-defined]
    else:  # the kernel divides each gradient by this: 1 / min(1, max_norm / (norm + 1e-6))
        optimizer.grad_scale = ((norm + 1e-6) / max_norm).clamp(min=1.0).to(torch.float32)  # type: ignore[attr-defined]
    return norm


def _clip_across_meshes(params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """`clip_grad_norm` for DTensor gradients of several meshes (expert parallelism: the experts' mesh beside the
    dense one), which one DTensor norm cannot mix. Every mesh spans all ranks: the total is the sum over all ranks of
    each local shard's squares divided by its copies (the sizes of its mesh's replicated dimensions); then each
    mesh's gradients are clipped with it."""
    import torch.distributed as dist

    with_grad = [p for p in params if p.grad is not None]
    locals_: list[torch.Tensor] = []
    copies: list[int] = []
    for p in with_grad:
        g = p.grad
        assert g is not None  # filtered above
        if isinstance(g, DTensor):
            locals_.append(g.to_local())
            copies.append(math.prod(g.device_mesh.size(i) for i, pl in enumerate(g.placements) if pl.is_replicate()))
        else:  # a plain gradient is the same on every rank
            locals_.append(g)
            copies.append(dist.get_world_size())
    norms = torch._foreach_norm(locals_)
    total_sq = sum(n.float().square() / c for n, c in zip(norms, copies))
    assert isinstance(total_sq, torch.Tensor)  # a gradient exists: several meshes were seen
    dist.all_reduce(total_sq)
    total = total_sq.sqrt()
    if not math.isinf(max_norm):
        by_mesh: dict[object, list[torch.Tensor]] = {}
        for p in with_grad:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
        for group in by_mesh.values():
            nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total


@dataclass
class LRSchedule:
    """lr(iteration): linear warmup, then constant | linear | cosine | WSD decay to min_lr.

    WSD (warmup-stable-decay) holds lr until the last `wsd_decay_iters` of `decay_iters`, then
    decays with `wsd_decay_style`.
    """

    lr: float
    min_lr: float = 0.0
    warmup_iters: int = 0
    decay_iters: int = 1
    decay_style: str = "cosine"
    wsd_decay_iters: int = 0
    wsd_decay_style: str = "linear"

    def __post_init__(self) -> None:
        if self.decay_style not in LR_DECAY_STYLES:
            raise ConfigError(f"--lr-decay-style {self.decay_style!r} is not one of {list(LR_DECAY_STYLES)}")
        if self.wsd_decay_style not in WSD_DECAY_STYLES:
            raise ConfigError(f"--lr-wsd-decay-style {self.wsd_decay_style!r} is not one of {list(WSD_DECAY_STYLES)}")
        if self.min_lr > self.lr:
            raise ConfigError(f"--min-lr {self.min_lr} is larger than --lr {self.lr}")
        if self.warmup_iters > self.decay_iters:
            raise ConfigError(f"--lr-warmup-iters {self.warmup_iters} exceeds --lr-decay-iters {self.decay_iters} "
                              f"(default: --train-iters); pass --lr-warmup-iters {self.decay_iters} or less")

    def __call__(self, iteration: int) -> float:
        if self.warmup_iters > 0 and iteration < self.warmup_iters:
            return self.lr * (iteration + 1) / self.warmup_iters
        if self.decay_style == "constant":
            return self.lr
        if iteration >= self.decay_iters:
            return self.min_lr
        delta = self.lr - self.min_lr
        if self.decay_style == "WSD":
            start = self.decay_iters - self.wsd_decay_iters
            if iteration < start:
                return self.lr
            r = (iteration - start) / max(1, self.wsd_decay_iters)
            coeff = {"linear": 1.0 - r, "cosine": 0.5 * (math.cos(math.pi * r) + 1.0),
                     "exponential": (2.0 * (0.5 ** r)) - 1.0, "minus_sqrt": 1.0 - math.sqrt(r)}[self.wsd_decay_style]
            return self.min_lr + coeff * delta
        r = (iteration - self.warmup_iters) / max(1, self.decay_iters - self.warmup_iters)
        coeff = 1.0 - r if self.decay_style == "linear" else 0.5 * (math.cos(math.pi * r) + 1.0)
        return self.min_lr + coeff * delta


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
