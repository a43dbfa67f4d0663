"""The FP8 MLP as one autograd function: gate/up GEMM -> SwiGLU -> down GEMM, with the SwiGLU fused into the
FP8 casts on both sides of it (`triton_swiglu`).

    forward:  x -> one cast (q, x^T) -> y = x @ [W_gate; W_up]^T (BF16) -> h = silu(gate) * up written straight
              to FP8 (q, h^T) with the down projection's input scale -> out = h @ W_down^T
    backward: d_out -> one cast (q, d_out^T) -> dh = d_out @ W_down (BF16) -> [d_gate, d_up] written straight to
              FP8 (q, ^T) with the gate/up gradient scale -> dx, and the three weight gradients

Against the unfused FP8 layers (`FusedFloat8Projection` for gate/up, the compiled SwiGLU, the down
`Float8Linear`), neither h nor [d_gate, d_up] is written in BF16 and read back by a cast kernel: per layer
12 * tokens * ffn bytes less memory traffic, and no BF16 rounding before the FP8 one. Everything else is the
same code: the gate/up group and the down `Float8Linear` make their FP8 weights and cast their own operands
(`linear.fprop` / `bprop`, the GEMMs of every FP8 linear); the fused casts take their scales from the quantizers
of the operands they write (`Quantizer.fused_scale`: the down projection's input, the gate/up group's gradient).
Amax histories, scales and state_dict keys stay on the member modules.

Current (tensorwise) scaling needs the scale of h and of [d_gate, d_up] before their casts: a pass of its own
first (`triton_swiglu.swiglu_amax` / `swiglu_bwd_amax`) reads the fused kernel's inputs and computes the amax of
the same fp32 values the cast then scales, writing nothing. Against the unfused layers that is one read of h
(and of [d_gate, d_up]) in place of its BF16 write, its read by an amax pass and its read by the cast.

`FusedFloat8MLP` is the module in `MLP.fusion` (which `MLP.forward` calls) after `convert_to_fp8(fuse_mlp=True)`
(the default) for delayed and current scaling; whether an MLP can be fused is decided there, once (`mlp_problem`:
three Float8Linears of a per-tensor recipe, a SwiGLU, no biases, FP8 weight gradients, fusable gate/up, equal
settings, no hooks), and logged; a forward raises `FusionError` where that decision no longer holds, but runs the
layers one by one while any of them (or the SwiGLU) has hooks, so that they fire (logged once). At run time it
takes the fused path where the fused kernels run (CUDA with Triton, or Triton's interpreter), with delayed scaling
once scales exist (from the first `fp8_step` on: the casts need their scales before the pass); otherwise (no
Triton, delayed scaling's first step, FP8 telemetry on, outside fp8_autocast) it runs the MLP's layers one by one,
as without it. Rowwise, blockwise and MXFP8 scaling do not install it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...model import MLP, SwiGLU, compute_dtype
from ..gemm import fp8_gemm
from ..kernels import triton_swiglu
from ..kernels.primitives import E4M3, pad_2d, quantize_rowwise, round_up16
from ..linear import GRAD, INPUT, Float8Linear, FP8WeightCache, bprop, fprop, take_fp8_weights
from ..quantizer import FP8Copies, Quantizer
from ..state import FP8GlobalStateManager
from ..tensor import FP8Tensor, Scaling
from .fused_linear import (
    SHARED_SETTINGS,
    FusedFloat8Projection,
    FusionError,
    group_problem,
    has_hooks,
    has_own_hooks,
    log_hooked_once,
)
from .swiglu import SwiGLUFP8InputStore


class FusedFloat8MLP(nn.Module):
    """x [..., H] -> MLP output [..., H] for one `MLP` whose three projections are Float8Linears (see the module
    docstring): the module `convert_to_fp8` puts in `MLP.fusion` (`fusions.FUSIONS`). Holds no parameters or
    buffers; `gate_up` is the gate/up group whose concatenated FP8 weight it uses (the MLP's `gate_up_fusion`
    when that is set)."""

    def __init__(self, mlp: MLP, gate_up: FusedFloat8Projection):
        super().__init__()
        self._mlp = (mlp,)  # the MLP it runs, in a tuple: its parent, not a child
        self.gate_up = gate_up
        self.num_fused_calls = 0  # forwards that took the fused path (tests, debugging)

    @classmethod
    def of(cls, mlp: nn.Module) -> FusedFloat8MLP | str:
        """The fusion of `mlp`, or why it cannot be (`mlp_problem`): decided here, once."""
        if not isinstance(mlp, MLP):
            return "not an MLP"
        problem = mlp_problem(mlp)
        if problem is not None:
            return problem
        gate_up = mlp.gate_up_fusion
        if not isinstance(gate_up, FusedFloat8Projection):
            gate_up = FusedFloat8Projection(
                (_float8_linear(mlp.gate_proj), _float8_linear(mlp.up_proj)), ("gate_proj", "up_proj"))
        return cls(mlp, gate_up)

    @property
    def mlp(self) -> MLP:
        return self._mlp[0]

    @property
    def down(self) -> Float8Linear:
        return _float8_linear(self.mlp.down_proj)

    def extra_repr(self) -> str:
        return "gate_proj, up_proj, act_fn, down_proj"

    def _unfused(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp.layers_forward(x)

    def _fusable(self, x: torch.Tensor) -> bool:
        """Whether this call runs fused (inside fp8_autocast: where the fused kernels run, without telemetry, with
        delayed scaling once scales exist, no layer hooked). Raises FusionError where the decision made at conversion
        no longer holds."""
        gu = self.gate_up.members()
        if not self.gate_up.fusable(gu, x):  # outside the members' recipe or hooked: they run one by one
            return False
        problem = mlp_problem(self.mlp, hooks=False)
        if problem is not None:
            raise FusionError(f"FusedFloat8MLP: the fusion decided at conversion no longer holds: {problem}; convert "
                              "without fuse_mlp, or remove the fusions (megadlms.fp8.fusions.registry.remove_fusions) "
                              "before "
                              "changing the MLP")
        down = self.down
        if has_hooks(down) or has_hooks(self.mlp.act_fn):
            log_hooked_once("fused MLPs")
            return False
        if any(m.collect_fp8_stats for m in (*gu, down)):
            return False
        delayed = down.quantizers[INPUT].keeps_history
        if delayed and not all(m.scales_ready() for m in (*gu, down)):  # scales exist from the first fp8_step on
            return False
        return triton_swiglu.available(x.reshape(-1, x.shape[-1]))

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not FP8GlobalStateManager.is_fp8_enabled() or x.numel() == 0 or not self._fusable(x):
            return self._unfused(x)
        gate, up = self.gate_up.members()
        ws = (gate.weight, up.weight, self.down.weight)
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        grad_follows = torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in ws))
        self.num_fused_calls += 1
        out = _FusedFloat8MLPFn.apply(x2, self.gate_up, self.down, compute_dtype(x), grad_follows,
                                      isinstance(self.mlp.act_fn, SwiGLUFP8InputStore), *ws)
        return out.view(*x.shape[:-1], out.shape[-1])


def mlp_problem(mlp: MLP, *, hooks: bool = True) -> str | None:
    """Why `mlp` cannot run as one fused FP8 function, or None: gate/up/down are Float8Linears of a per-tensor
    recipe (gate/up fusable as a group: `group_problem`), the activation a SwiGLU, no biases, FP8 weight gradients,
    matching widths (down's a multiple of 16), one set of settings for the three, no hooks on its layers (unless
    `hooks` is False: a forward's check, where hooks mean running unfused)."""
    gate, up, down, act = mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn
    if type(down) is not Float8Linear or type(act) not in (SwiGLU, SwiGLUFP8InputStore):
        return "its down projection is not a Float8Linear or its activation not a SwiGLU"
    problem = group_problem((gate, up), hooks=hooks)
    if problem is not None:
        return f"gate/up: {problem}"
    gu = (_float8_linear(gate), _float8_linear(up))
    if not down.quantizers[GRAD].per_tensor:
        return f"--fp8-recipe {down.recipe.name}: the fused GEMMs take per-tensor scales"
    if hooks and (has_own_hooks(down) or has_own_hooks(act)):
        return "its down projection or SwiGLU has hooks"
    if down.bias is not None or any(m.bias is not None for m in gu):
        return "a projection has a bias"
    if not down.fp8_wgrad:
        return "its weight gradients run in high precision (fp8_wgrad=False)"
    if down.weight.shape[1] != gu[0].weight.shape[0] or down.weight.shape[0] % 16:
        return f"down weight {tuple(down.weight.shape)} does not follow gate/up {tuple(gu[0].weight.shape)}"
    for s in SHARED_SETTINGS:  # one set for the three layers
        if getattr(down, s) != getattr(gu[0], s):
            return f"its projections' {s} differ"
    return None


def _float8_linear(m: nn.Module | torch.Tensor) -> Float8Linear:
    """An MLP projection that conversion made a Float8Linear (checked by the fusion before it is built)."""
    assert isinstance(m, Float8Linear)
    return m


def swiglu_to_fp8(y: torch.Tensor, quantizer: Quantizer, w: FP8WeightCache, cols: bool, record: bool
                ) -> FP8Copies | None:
    """h = silu(gate) * up of y = [gate, up] [Mp, 2F] written straight to FP8 (and h^T when `cols`) with the scale
    of `quantizer` (the down projection's input); None where the fused kernel is off."""
    scaling = quantizer.fused_scale(w.step, lambda: triton_swiglu.checked_swiglu_amax(y))
    if scaling is None:
        return None
    scale, scale_inv = scaling
    slots = quantizer.amax_slots() if record else []
    out = triton_swiglu.checked_swiglu_cast(y, scale, quantizer.fp8_dtype, cols, slots[0] if slots else None)
    if out is None:
        return None
    return FP8Copies.per_tensor(*out, scale_inv)


def swiglu_grads_to_fp8(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                    row_scales: tuple[torch.Tensor, torch.Tensor] | None, quantizer: Quantizer, w: FP8WeightCache,
                    rows: bool, cols: bool) -> FP8Copies | None:
    """The SwiGLU's derivatives [d_gate, d_up] [Mp, 2F] from dh [Mp, F] written straight to FP8 (`rows` and/or
    `cols`) with the scale of `quantizer` (the gate/up group's gradient), its amax recorded; None where the fused
    kernel is off. gate, up: the forward's, in FP8 with `row_scales` where kept so."""
    scaling = quantizer.fused_scale(w.step, lambda: triton_swiglu.checked_swiglu_bwd_amax(dh, gate, up, row_scales))
    if scaling is None:
        return None
    scale, scale_inv = scaling
    out = triton_swiglu.checked_swiglu_bwd_cast(dh, gate, up, scale, quantizer.fp8_dtype, rows, cols, row_scales,
                                                quantizer.amax_slots())
    if out is None:
        return None
    return FP8Copies.per_tensor(*out, scale_inv)


def _tensors(t: FP8Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(data, scale_inv) of t, to save for backward; (None, None) without t."""
    return (t.data, t.scale_inv) if t is not None else (None, None)


class _FusedFloat8MLPFn(torch.autograd.Function):
    """x [M, H], W_gate, W_up [F, H], W_down [H, F] -> down(silu(x W_gate^T) * (x W_up^T)) [M, H]: the gate/up
    group's and the down layer's FP8 GEMMs (`linear.fprop` / `bprop`) with the SwiGLU between them fused into the
    casts on both sides (`swiglu_to_fp8` / `swiglu_grads_to_fp8`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, gate_up: FusedFloat8Projection, down: Float8Linear,
                out_dtype: torch.dtype, grad_follows: bool, store_fp8: bool,
                w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        need_wgu = any(ctx.needs_input_grad[6:8])
        need_wdown = ctx.needs_input_grad[8]
        # the gate/up projection: one cast of x (and x^T for its weight gradient), one GEMM
        xp = pad_2d(x, round_up16(m), k)
        wgu = gate_up.fp8_weight(grad_follows)
        y, xq = fprop(gate_up, xp, m * k, wgu, need_wgu, out_dtype)  # [mp, 2F]
        # the SwiGLU straight into the down projection's FP8 input (h and h^T for its weight gradient)
        wd = down.fp8_weight(grad_follows)
        f = y.shape[1] // 2
        hq = swiglu_to_fp8(y, down.quantizers[INPUT], wd, need_wdown, down.training)
        if hq is None:  # the kernel is off: BF16 SwiGLU, then the down projection's own cast
            h = triton_swiglu.swiglu_ref(y[:, :f], y[:, f:]).to(out_dtype)
            hq = down.quantize_input(h, m * f, need_wdown, wd)
        result = fp8_gemm(hq.row_copy(), wd.rows, out_dtype, down.fprop_fast_accum)[:m]
        # what the backward needs: x^T and h^T (weight gradients), gate/up (the SwiGLU's derivative)
        saved_y: tuple[torch.Tensor, ...] = ()
        if grad_follows:
            if store_fp8:  # activation_func_fp8_input_store: E4M3 with one scale per row, as SwiGLUFP8InputStore
                gq, g_si = quantize_rowwise(y[:, :f], E4M3)
                uq, u_si = quantize_rowwise(y[:, f:], E4M3)
                saved_y = (gq, uq, g_si.reshape(-1), u_si.reshape(-1))
            else:
                saved_y = (y,)
        # x^T [H, mp], h^T [F, mp]: the wgrad operands (per tensor: the fused MLP's recipes are)
        ctx.save_for_backward(*_tensors(xq.cols), *_tensors(hq.cols), *saved_y)
        ctx.gate_up, ctx.down, ctx.wgu, ctx.wd = gate_up, down, wgu, wd
        ctx.keep_weights = down.cache_weight
        ctx.dims = (m, k, f)
        ctx.x_dtype, ctx.out_dtype = x.dtype, out_dtype
        ctx.w_dtypes = (w_gate.dtype, w_up.dtype, w_down.dtype)
        ctx.store_fp8 = store_fp8
        return result

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gate_up: FusedFloat8Projection = ctx.gate_up
        down: Float8Linear = ctx.down
        wgu, wd = take_fp8_weights(ctx, "wgu", "wd")
        x_saved, x_si, h_saved, h_si, *saved_y = ctx.saved_tensors
        m, k, f = ctx.dims
        need_dx = ctx.needs_input_grad[0]
        need_wg, need_wu, need_wd = ctx.needs_input_grad[6:9]
        need_wgu = need_wg or need_wu
        # the down projection: one cast of d_out (q and d_out^T), dgrad -> dh [mp, F] (unsliced), wgrad
        g8 = down.quantize_grad((d_out.contiguous(),), True, need_wd, wd)
        h_cols = FP8Tensor(h_saved, h_si, Scaling.TENSOR, transposed=True) if need_wd else None
        dh, (d_wdown,) = bprop(down, wd, g8, h_cols, (round_up16(m), f), (k,), ctx.out_dtype, ctx.w_dtypes[2:],
                               True, (need_wd,))
        assert dh is not None
        # the SwiGLU's derivative straight into the gate/up gradient's FP8 operands
        if ctx.store_fp8:
            gate, up, g_rs, u_rs = saved_y
            row_scales = (g_rs, u_rs)
        else:
            (y,) = saved_y
            gate, up, row_scales = y[:, :f], y[:, f:], None
        dq = swiglu_grads_to_fp8(dh, gate, up, row_scales, gate_up.quantizers[GRAD], wgu, need_dx, need_wgu)
        if dq is None:  # the kernel is off: BF16 derivatives, then the group's own gradient cast
            if row_scales is not None:
                gate, up = gate.float() * row_scales[0][:, None], up.float() * row_scales[1][:, None]
            d_gate, d_up = (d.to(ctx.out_dtype) for d in triton_swiglu.swiglu_bwd_ref(dh, gate, up))
            dq = gate_up.quantize_grad((d_gate, d_up), need_dx, need_wgu, wgu)
        x_cols = FP8Tensor(x_saved, x_si, Scaling.TENSOR, transposed=True) if need_wgu else None
        dx, (d_wg, d_wu) = bprop(gate_up, wgu, dq, x_cols, (m, k), (f, f), ctx.x_dtype, ctx.w_dtypes[:2], need_dx,
                                 (need_wg, need_wu))
        return dx, None, None, None, None, None, d_wg, d_wu, d_wdown


def fused_projections(module: nn.Module) -> list[FusedFloat8Projection]:
    """The fused projection groups inside `module` (q/k/v, gate/up; a fused MLP's own gate/up group included),
    each once."""
    return [m for m in module.modules() if isinstance(m, FusedFloat8Projection)]
