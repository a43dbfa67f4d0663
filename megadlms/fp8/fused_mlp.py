"""The FP8 MLP as one autograd function: gate/up GEMM -> SwiGLU -> down GEMM, with the SwiGLU fused into the
FP8 casts on both sides of it (`triton_swiglu`).

    forward:  x -> one cast (q, x^T) -> y = x @ [W_gate; W_up]^T (BF16) -> h = silu(gate) * up written straight
              to FP8 (q, h^T) with the down projection's input scale -> out = h @ W_down^T
    backward: d_out -> one cast (q, d_out^T) -> dh = d_out @ W_down (BF16) -> [d_gate, d_up] written straight to
              FP8 (q, ^T) with the gate/up gradient scale -> dx, and the three weight gradients

Against the unfused FP8 layers (`FusedFloat8Projection` for gate/up, the compiled SwiGLU, the down
`Float8Linear`), neither h nor [d_gate, d_up] is written in BF16 and read back by a cast kernel: per layer
12 * tokens * ffn bytes less memory traffic, and no BF16 rounding before the FP8 one. Everything else is the
same code: the concatenated gate/up weight and its scales come from the group's `FusedFloat8Projection`, the
down weight from its `Float8Linear`; amax histories, scales and state_dict keys stay on the member modules.

Current (tensorwise) scaling needs the scale of h and of [d_gate, d_up] before their casts: a pass of its own
first (`triton_swiglu.swiglu_amax` / `swiglu_bwd_amax`) reads the fused kernel's inputs and computes the amax of
the same fp32 values the cast then scales, writing nothing. Against the unfused layers that is one read of h
(and of [d_gate, d_up]) in place of its BF16 write, its read by an amax pass and its read by the cast.

`FusedFloat8MLP` is the module in `MLP.fusion` (which `MLP.forward` calls) after `convert_to_fp8(fuse_mlp=True)`
(the default) for delayed and current scaling. It takes the fused path where the fused kernels run (CUDA with Triton, or
Triton's interpreter), with delayed scaling once scales exist (from the first `fp8_step` on: the casts need
their scales before the pass); otherwise (delayed scaling's first step, FP8 telemetry on, hooks on a member,
outside fp8_autocast) it runs the MLP's layers one by one, as without it. Rowwise scaling does not install it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..model import SwiGLU, compute_dtype
from . import triton_swiglu
from .fused_linear import FusedFloat8Projection, cast_grad_parts, cast_group_operand
from .gemm import Operand, fp8_gemm
from .kernels import current_scale
from .linear import GRAD, INPUT, Float8Linear, take_fp8_weights
from .quantize import pad_2d, round_up16
from .state import FP8GlobalStateManager
from .swiglu import SwiGLUFP8InputStore, quantize_rows


class FusedFloat8MLP(nn.Module):
    """x [..., H] -> MLP output [..., H] for one `MLP` whose three projections are Float8Linears (see the module
    docstring): the module `convert_to_fp8` puts in `MLP.fusion` (`fusions.FUSIONS`). Holds no parameters or
    buffers; `gate_up` is the gate/up group whose concatenated FP8 weight it uses (the MLP's `gate_up_fusion`
    when that is set)."""

    def __init__(self, mlp: nn.Module, gate_up: FusedFloat8Projection):
        super().__init__()
        self._mlp = (mlp,)  # the MLP it runs, in a tuple: its parent, not a child
        self.gate_up = gate_up
        self.num_fused_calls = 0  # forwards that took the fused path (tests, debugging)

    @classmethod
    def of(cls, mlp: nn.Module) -> FusedFloat8MLP | None:
        """The fusion of `mlp`, or None unless its three projections are Float8Linears of a per-tensor recipe."""
        if not all(type(getattr(mlp, n)) is Float8Linear for n in ("gate_proj", "up_proj", "down_proj")):
            return None
        if not mlp.down_proj.quantizers[GRAD].per_tensor:
            return None
        gate_up = mlp.gate_up_fusion
        if not isinstance(gate_up, FusedFloat8Projection):
            gate_up = FusedFloat8Projection((mlp.gate_proj, mlp.up_proj), ("gate_proj", "up_proj"))
        return cls(mlp, gate_up)

    @property
    def mlp(self) -> nn.Module:
        return self._mlp[0]

    def extra_repr(self) -> str:
        return "gate_proj, up_proj, act_fn, down_proj"

    def _unfused(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp.layers_forward(x)

    def _fusable(self, x: torch.Tensor) -> bool:
        mlp = self.mlp
        down = mlp.down_proj
        gu = self.gate_up.members()
        if type(down) is not Float8Linear or type(mlp.act_fn) not in (SwiGLU, SwiGLUFP8InputStore):
            return False
        if not self.gate_up.fusable(gu, x) or not down.quantizers[GRAD].per_tensor:
            return False
        if down._forward_hooks or down._forward_pre_hooks or mlp.act_fn._forward_hooks:
            return False
        if down.bias is not None or any(m.bias is not None for m in gu) or not down.fp8_wgrad:
            return False
        if down.weight.shape[1] != gu[0].weight.shape[0] or down.weight.shape[0] % 16:
            return False
        if any(m.collect_fp8_stats for m in (*gu, down)) or down.recipe != gu[0].recipe:
            return False
        delayed = down.quantizers[INPUT].keeps_history
        if delayed and not all(m.scales_ready() for m in (*gu, down)):  # scales exist from the first fp8_step on
            return False
        return triton_swiglu.available(x.reshape(-1, x.shape[-1]))

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not FP8GlobalStateManager.is_fp8_enabled() or x.numel() == 0 or not self._fusable(x):
            return self._unfused(x)
        mlp = self.mlp
        gu = tuple(self.gate_up.members())
        down = mlp.down_proj
        ws = (gu[0].weight, gu[1].weight, down.weight)
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        grad_follows = torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in ws))
        self.num_fused_calls += 1
        out = _FusedFloat8MLPFn.apply(x2, self, gu, down, compute_dtype(x), grad_follows,
                                      isinstance(mlp.act_fn, SwiGLUFP8InputStore), *ws)
        return out.view(*x.shape[:-1], out.shape[-1])


class _FusedFloat8MLPFn(torch.autograd.Function):
    """x [M, H], W_gate, W_up [F, H], W_down [H, F] -> down(silu(x W_gate^T) * (x W_up^T)) [M, H]."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fused: FusedFloat8MLP, gu: tuple[Float8Linear, Float8Linear],
                down: Float8Linear, out_dtype: torch.dtype, grad_follows: bool, store_fp8: bool,
                w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        recipe = down.recipe
        fwd = recipe.fp8_format.fwd_dtype
        delayed = down.quantizers[INPUT].keeps_history
        record = delayed and down.training  # amax histories: delayed scaling only
        m, k = x.shape
        mp = round_up16(m)
        xp = pad_2d(x, mp, k)
        need_wgu = any(ctx.needs_input_grad[7:9])
        need_wdown = ctx.needs_input_grad[9]
        # the gate/up projection: one cast of x (and x^T for its weight gradient), one GEMM
        # uncached weights: W^T for the input gradient is made in the backward (as in the layers' own paths)
        wgu = fused.gate_up.group_weight(list(gu), grad_follows and (w_gate.requires_grad or w_up.requires_grad)
                                          and down.cache_weight)
        xq, x_si, xt = cast_group_operand(gu, xp, INPUT, fwd, wgu, record, True, need_wgu)
        y = fp8_gemm(Operand(xq, x_si), wgu.rows, out_dtype, gu[0].fprop_fast_accum)  # [mp, 2F]
        # the SwiGLU straight into the down projection's FP8 input (h and h^T for its weight gradient)
        wd = down.fp8_weight(grad_follows)
        f = y.shape[1] // 2
        out, h_si = None, None
        if delayed:
            h_slot = down.fp8_amax_history[0, INPUT] if record else None
            h_si = wd.scale_inv_of(INPUT)
            out = triton_swiglu.checked_swiglu_cast(y, down.fp8_scale[INPUT], fwd, need_wdown, h_slot)
        else:  # current scaling: the amax of h first, from y (h is never written in BF16)
            h_amax = triton_swiglu.checked_swiglu_amax(y)
            if h_amax is not None:
                h_scale, h_si = current_scale([h_amax], fwd, recipe.margin)
                out = triton_swiglu.checked_swiglu_cast(y, h_scale, fwd, need_wdown)
        if out is not None:
            hq, ht = out
        else:  # the kernel is off: BF16 SwiGLU, then the down projection's own cast
            h = triton_swiglu.swiglu_ref(y[:, :f], y[:, f:]).to(out_dtype)
            h8 = down.quantize(h, INPUT, m * f, cols=need_wdown, record=record, scale_inv=h_si)
            (hq, h_si), ht = h8.rows, h8.cols.data if h8.cols is not None else None
        result = fp8_gemm(Operand(hq, h_si), wd.rows, out_dtype, down.fprop_fast_accum)[:m]
        # what the backward needs: x^T and h^T (weight gradients), gate/up (the SwiGLU's derivative)
        saved_y: tuple[torch.Tensor, ...] = ()
        if grad_follows:
            if store_fp8:  # activation_func_fp8_input_store: E4M3 with one scale per row, as SwiGLUFP8InputStore
                gq, g_si = quantize_rows(y[:, :f])
                uq, u_si = quantize_rows(y[:, f:])
                saved_y = (gq, uq, g_si.reshape(-1), u_si.reshape(-1))
            else:
                saved_y = (y,)
        ctx.save_for_backward(xt, x_si, ht, h_si, *saved_y)  # x^T [H, mp], h^T [F, mp]: the wgrad operands
        ctx.fused, ctx.gu, ctx.down, ctx.wgu, ctx.wd = fused, gu, down, wgu, wd
        ctx.keep_weights = down.cache_weight
        ctx.dims = (m, k, f)
        ctx.x_dtype, ctx.out_dtype = x.dtype, out_dtype
        ctx.w_dtypes = (w_gate.dtype, w_up.dtype, w_down.dtype)
        ctx.store_fp8 = store_fp8
        ctx.delayed = delayed
        return result

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gu, down = ctx.gu, ctx.down
        wgu, wd = take_fp8_weights(ctx, "wgu", "wd")
        bwd = down.recipe.fp8_format.bwd_dtype
        x_saved, x_si, h_saved, h_si, *saved_y = ctx.saved_tensors
        m, k, f = ctx.dims
        mp = round_up16(m)
        need_dx = ctx.needs_input_grad[0]
        need_wg, need_wu, need_wd = ctx.needs_input_grad[7:10]
        need_wgu = need_wg or need_wu
        bwd_fast = down.backward_fast_accum
        # the down projection: one cast of d_out (q and d_out^T), dgrad -> dh, wgrad
        g = pad_2d(d_out.contiguous(), mp, d_out.shape[1])
        g8 = down.quantize(g, GRAD, m * d_out.shape[1], cols=need_wd, scale_inv=wd.scale_inv_of(GRAD))
        dh = fp8_gemm(g8.rows, down.fp8_weight_dgrad(wd), ctx.out_dtype, bwd_fast)  # [mp, F]
        d_wdown = fp8_gemm(g8.cols, Operand(h_saved, h_si), ctx.w_dtypes[2], bwd_fast) if need_wd else None
        # the SwiGLU's derivative straight into the gate/up gradient's FP8 operands
        if ctx.store_fp8:
            gate, up, g_rs, u_rs = saved_y
            row_scales = (g_rs, u_rs)
        else:
            (y,) = saved_y
            gate, up, row_scales = y[:, :f], y[:, f:], None
        out = None
        if ctx.delayed:
            slots = [mod.fp8_amax_history[0, GRAD] for mod in gu]
            out = triton_swiglu.checked_swiglu_bwd_cast(dh, gate, up, wgu.scales[GRAD], bwd, need_dx, need_wgu,
                                                        row_scales, slots)
            d_si = wgu.scale_invs[GRAD]
        else:  # current scaling: the derivatives' amax first, from the same inputs
            d_amax = triton_swiglu.checked_swiglu_bwd_amax(dh, gate, up, row_scales)
            if d_amax is not None:
                d_scale, d_si = current_scale([d_amax], bwd, down.recipe.margin)
                out = triton_swiglu.checked_swiglu_bwd_cast(dh, gate, up, d_scale, bwd, need_dx, need_wgu,
                                                            row_scales)
        if out is not None:
            dq, dt = out
        else:  # the kernel is off: BF16 derivatives, then the group's own gradient cast
            if row_scales is not None:
                gate, up = gate.float() * row_scales[0][:, None], up.float() * row_scales[1][:, None]
            d_gate, d_up = (d.to(ctx.out_dtype) for d in triton_swiglu.swiglu_bwd_ref(dh, gate, up))
            dq, d_si, dt = cast_grad_parts(gu, (d_gate, d_up), bwd, wgu, ctx.delayed, need_dx, need_wgu, mp)
        dx = None
        if need_dx:
            dx = fp8_gemm(Operand(dq, d_si), wgu.cols(), ctx.x_dtype, bwd_fast)[:m]
        d_wg = d_wu = None
        if need_wgu:
            dw = fp8_gemm(Operand(dt, d_si), Operand(x_saved, x_si), ctx.w_dtypes[0], bwd_fast)  # [2F, H]
            d_wg = dw[:f].to(ctx.w_dtypes[0]) if need_wg else None
            d_wu = dw[f:].to(ctx.w_dtypes[1]) if need_wu else None
        return dx, None, None, None, None, None, None, d_wg, d_wu, d_wdown


def fused_projections(module: nn.Module) -> list[FusedFloat8Projection]:
    """The fused projection groups inside `module` (q/k/v, gate/up; a fused MLP's own gate/up group included),
    each once."""
    return [m for m in module.modules() if isinstance(m, FusedFloat8Projection)]
