"""AdamW whose update of each large fp32 parameter is one Triton pass at the memory's speed.

torch's fused AdamW updates all parameters through `multi_tensor_apply` in chunks of 64K elements, slower than a
device copy of the same bytes (benchmarks/adamw_speed.py measures both; docs/performance.md). The update reads p, g,
m, v and writes p, m, v (28 bytes per parameter), so its time is its traffic: `StreamingAdamW` runs one kernel per
large parameter tensor with wide loads, near the copy's time. It is torch's AdamW in everything else: options,
parameter groups, state (`step`, `exp_avg`, `exp_avg_sq`), checkpoints, the fused kernel's `grad_scale` divisor (the
clipping factor of `optim.clip_grad_norm`) and its `found_inf` flag (a device scalar; nonzero: the step leaves
parameters, moments and step counts as they were, decided on the device). Parameters the kernel does not take (small
ones, DTensor shards, non-fp32 or non-contiguous ones, a group with a tensor learning rate) go through torch's fused
kernel in the same step. The arithmetic is torch's, so the two agree to fp32 rounding; unlike torch's kernel this
one leaves the gradients as they are (torch writes the unscaled gradient back)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

try:
    import triton
    import triton.language as tl
except Exception:  # no Triton: StreamingAdamW is not used (optim.build_optimizer)
    triton = None


def available(device: torch.device) -> bool:
    """Whether the kernel can run for tensors on `device` (a GPU, or the CPU under Triton's interpreter);
    MEGADLMS_TRITON_ADAMW=0 turns it off (torch's fused AdamW everywhere)."""
    return (triton is not None and os.environ.get("MEGADLMS_TRITON_ADAMW", "1") != "0"
            and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"))


if triton is not None:
    @triton.jit
    def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, step_ptr, scale_ptr, amax_ptr, found_ptr, n, lr, beta1, beta2,
                      log2_beta1, log2_beta2, eps, weight_decay, HAS_SCALE: tl.constexpr, HAS_AMAX: tl.constexpr,
                      HAS_FOUND_INF: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        step = tl.load(step_ptr)  # the fp32 device step count, advanced for this update
        bias_correction1 = 1.0 - tl.exp2(step * log2_beta1)
        bias_correction2_sqrt = tl.sqrt_rn(1.0 - tl.exp2(step * log2_beta2))
        p = tl.load(p_ptr + offs, mask=mask)
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
        if HAS_SCALE:
            g = g / tl.load(scale_ptr)
        m0 = tl.load(m_ptr + offs, mask=mask)
        v0 = tl.load(v_ptr + offs, mask=mask)
        p0 = p
        p = p * (1.0 - lr * weight_decay)
        m = beta1 * m0 + (1.0 - beta1) * g
        v = beta2 * v0 + (1.0 - beta2) * g * g
        denom = tl.sqrt_rn(v) / bias_correction2_sqrt + eps
        p = p - (lr / bias_correction1) * (m / denom)
        if HAS_FOUND_INF:  # a skipped step (non-finite loss or gradients) keeps every value as it was
            skip = tl.load(found_ptr) != 0
            p = tl.where(skip, p0, p)
            m = tl.where(skip, m0, m)
            v = tl.where(skip, v0, v)
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        if HAS_AMAX:  # max |p| of the updated parameter, for its FP8 cast (fp8 weight_amax); amax_ptr starts at 0
            tl.atomic_max(amax_ptr, tl.max(tl.where(mask, tl.abs(p), 0.0), axis=0))


def adamw_update_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  step: torch.Tensor, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                  grad_scale: torch.Tensor | None = None, amax_out: torch.Tensor | None = None,
                  found_inf: torch.Tensor | None = None, block: int = 1024, num_warps: int = 4) -> None:
    """One AdamW update of a contiguous fp32 `param` and its moments, in place. `step`: the fp32 device step count
    including this update; `grad_scale`: an fp32 scalar tensor the gradient is divided by; `amax_out`: an fp32
    scalar tensor, zero before the call, raised to max |param| of the updated values (for finite values the same as
    an amax pass after the update); `found_inf`: an fp32 scalar tensor, nonzero to keep param and moments as they
    are (the caller keeps `step` too). The default tile is the fastest that benchmarks/adamw_speed.py
    measured."""
    n = param.numel()
    _adamw_kernel[(triton.cdiv(n, block),)](
        param, grad, exp_avg, exp_avg_sq, step, grad_scale if grad_scale is not None else step,
        amax_out if amax_out is not None else step, found_inf if found_inf is not None else step, n, lr, beta1,
        beta2, math.log2(beta1), math.log2(beta2), eps, weight_decay, HAS_SCALE=grad_scale is not None,
        HAS_AMAX=amax_out is not None, HAS_FOUND_INF=found_inf is not None, BLOCK=block, num_warps=num_warps)


class StreamingAdamW(torch.optim.AdamW):
    """torch.optim.AdamW (fused) whose large plain fp32 parameters are updated by `adamw_update_`.

    `publish_amaxes` asks it to keep max |p| of some parameters after every step (the weight amaxes of FP8 current
    scaling: megadlms.fp8.integrations.weight_amax.KeptAmax), out of the update's own pass where the kernel updates the
    parameter, by an amax pass where torch's kernel did.
    """

    min_numel = 1 << 16  # smaller tensors share torch's multi-tensor launches instead of one launch each

    def __init__(self, params: Iterable[Any], **kwargs: Any):
        for option in ("amsgrad", "maximize", "foreach", "capturable", "differentiable"):
            if kwargs.get(option):
                raise ValueError(f"StreamingAdamW does not take {option}=True; use torch.optim.AdamW for it")
        if kwargs.get("fused") is False:
            raise ValueError("StreamingAdamW is a fused optimizer; fused=False asks for torch.optim.AdamW")
        super().__init__(params, **{**kwargs, "fused": True})
        self._amax_of: dict[torch.Tensor, Any] = {}  # parameter -> its KeptAmax

    def publish_amaxes(self, pairs: Iterable[tuple[torch.Tensor, Any]]) -> None:
        """From now on keep each `kept` (a `megadlms.fp8.integrations.weight_amax.KeptAmax`: `value`, an fp32 scalar
        tensor on the parameter's device, and `version`) equal to max |p| after every step, for the (p, kept) pairs
        whose p this optimizer updates (others are ignored)."""
        mine = {p for g in self.param_groups for p in g["params"]}
        for p, kept in pairs:
            if p in mine:
                v = kept.value
                if v.dtype != torch.float32 or v.numel() != 1 or v.device != p.device:
                    raise ValueError(f"publish_amaxes: the amax of a parameter {tuple(p.shape)} must be an fp32 "
                                     f"scalar on {p.device}, got {v.dtype} {tuple(v.shape)} on {v.device}")
                self._amax_of[p] = kept

    def _refresh_amaxes(self, params: Iterable[torch.Tensor]) -> None:
        """max |p| by an amax pass, for the published parameters among `params` (updated by torch's kernel)."""
        for p in [p for p in params if p in self._amax_of]:
            self._amax_of[p].refresh(p)

    def _streamed(self, p: torch.Tensor, lr: Any, kernel_on: dict[torch.device, bool]) -> bool:
        g = p.grad
        if (g is None or isinstance(p, DTensor) or isinstance(g, DTensor) or g.is_sparse or p.dtype != torch.float32
                or p.numel() < self.min_numel or not p.is_contiguous() or not g.is_contiguous() or g.shape != p.shape
                or g.device != p.device or isinstance(lr, torch.Tensor)):
            return False
        if p.device not in kernel_on:
            kernel_on[p.device] = available(p.device)
        return kernel_on[p.device]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if closure is not None:
            out = _torch_adamw_step(self, closure)
            self._refresh_amaxes(self._amax_of)
            return out
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)  # torch's kernel below reads it too
        work = []
        kernel_on: dict[torch.device, bool] = {}  # available(), asked once per device and step
        for group in self.param_groups:
            for p in group["params"]:
                if not self._streamed(p, group["lr"], kernel_on):
                    continue
                state = self.state[p]
                if not state:  # what torch's fused AdamW makes: an fp32 step count on the parameter's device
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if not all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device == p.device
                           and t.is_contiguous() for t in (state["step"], state["exp_avg"], state["exp_avg_sq"])):
                    continue  # state in another form (e.g. set by hand): torch's kernel takes it as it is
                work.append((p, p.grad, state, group))
        # the rest through torch's fused kernel: it skips parameters without a gradient
        for p, _, _, _ in work:
            p.grad = None
        try:
            _torch_adamw_step(self)
        finally:
            for p, g, _, _ in work:
                p.grad = g
        if self._amax_of:  # published parameters torch's kernel updated
            streamed = {p for p, _, _, _ in work}
            self._refresh_amaxes(p for p in self._amax_of if p.grad is not None and p not in streamed)
        if not work:
            return None
        steps = [s["step"] for _, _, s, _ in work]
        torch._foreach_add_(steps, 1.0)
        founds: dict[torch.device, torch.Tensor] = {}
        if found_inf is not None:  # a skipped step does not count (as in torch's fused kernel)
            for st in steps:
                founds.setdefault(st.device, found_inf.to(st.device, torch.float32))
            torch._foreach_sub_(steps, [founds[st.device] for st in steps])
        kept = [self._amax_of.get(p) for p, _, _, _ in work]
        amaxes = [k.value if k is not None else None for k in kept]
        if live := [a for a in amaxes if a is not None]:
            torch._foreach_zero_(live)
        scales: dict[torch.device, torch.Tensor] = {}
        for (p, g, state, group), amax in zip(work, amaxes):
            beta1, beta2 = group["betas"]
            scale = None if grad_scale is None else scales.setdefault(p.device, grad_scale.to(p.device, torch.float32))
            adamw_update_(p, g, state["exp_avg"], state["exp_avg_sq"], state["step"], lr=float(group["lr"]),
                          beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                          weight_decay=float(group["weight_decay"]), grad_scale=scale, amax_out=amax,
                          found_inf=founds.get(p.device))
        for (p, _, _, _), k in zip(work, kept):
            if k is not None:  # the kernel's writes leave the version counter as it was
                k.version = p._version
        return None


def _torch_adamw_step(optimizer: torch.optim.AdamW, closure: Any = None) -> Any:
    """torch's AdamW step without the step hooks around it (the hooks run once, around StreamingAdamW.step)."""
    step: Any = torch.optim.AdamW.step
    while getattr(step, "hooked", False):  # Optimizer._patch_step_function's wrapper
        step = step.__wrapped__
    return step(optimizer, closure)
