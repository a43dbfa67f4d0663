"""FP8 grouped GEMMs for the MoE experts: `Float8GroupedExperts`, the FP8 swap of `moe.GroupedExperts`.

The three products of each expert projection y = x @ W_e^T (x's rows grouped by expert, `offs`), in FP8:

    fprop:  y  = x @ W_e^T        x   [M, K] scaled per row      W_e [N, K] scaled per (e, row)
    dgrad:  dx = g @ W_e          g   [M, N] scaled per row      W_e^T [K, N] scaled per (e, column of W_e)
    wgrad:  dW_e = g_e^T @ x_e    g^T [N, M] scaled per (e, n)   x^T [K, M] scaled per (e, k)

Every scale runs along a dimension the product does not contract, which is what torch's FP8 grouped GEMM takes
(`torch._scaled_grouped_mm`, Hopper, torch >= 2.8: one fp32 scale per row of the left operand and per (group,
column) of the right). The recipes map onto these layouts:
- rowwise: the scales above, each from the values it scales (per token, per expert output channel, ...);
- tensorwise: one scale per expert for each operand (the amax of the expert's rows of x / g, of its weight),
  written out along the same layouts; delayed scaling keeps no history per expert and runs the experts this way.
All operands are E4M3 (the FP8 grouped GEMM takes no E5M2), accumulation in fp32, outputs in the compute dtype.
The router never comes here (it stays fp32: `moe.Router`).

Where the GEMMs run: CUDA -> `torch._scaled_grouped_mm`; elsewhere (the CPU) an emulation: the FP8 operands
dequantized to fp32 and multiplied with `grouped_gemm.gmm` / `gmm_wgrad` (the same FP8 values and scales, fp32
products; only the summation order differs from the GPU kernel).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..grouped_gemm import gmm, gmm_wgrad
from ..model import compute_dtype
from ..moe import GroupedExperts
from .kernels.primitives import amax_to_scale, quantize
from .recipe import E4M3, FP8_MAX, Recipe, experts_problem
from .state import FP8GlobalStateManager

log = logging.getLogger("megadlms")

SCALINGS = ("rowwise", "tensorwise")


def expert_scaling(recipe: Recipe) -> str:
    """'rowwise' or 'tensorwise': how the expert GEMMs scale under `recipe` (see the module docstring)."""
    problem = experts_problem(recipe)
    if problem or recipe.experts is None:
        raise ValueError(problem)
    return recipe.experts


# ------------------------------------------------------------------ scales
def _scale(amax: torch.Tensor) -> torch.Tensor:
    return amax_to_scale(amax, FP8_MAX[E4M3])


def _group_ids(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """[M] int64: the expert of each row (rows past offs[-1] count as the last expert's)."""
    ids = torch.bucketize(torch.arange(rows, device=offs.device, dtype=offs.dtype), offs, right=True)
    return ids.clamp_(max=offs.shape[0] - 1)


def _group_col_amax(x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [M, C] -> [E, C]: max |x| over each expert's rows (0 for an expert without rows)."""
    lengths = torch.diff(offs.long(), prepend=offs.new_zeros(1).long())
    return torch.segment_reduce(x.abs().float(), "max", lengths=lengths, axis=0, unsafe=True, initial=0.0)


def _row_scales(x: torch.Tensor, gid: torch.Tensor, num_experts: int, scaling: str) -> torch.Tensor:
    """x [M, C] -> fp32 [M]: the scale of each row (its own amax, or its expert's)."""
    amax = x.abs().amax(dim=1).float()
    if scaling == "tensorwise":
        amax = amax.new_zeros(num_experts).scatter_reduce(0, gid, amax, "amax")[gid]
    return _scale(amax)


def _group_col_scales(x: torch.Tensor, offs: torch.Tensor, scaling: str) -> torch.Tensor:
    """x [M, C] -> fp32 [E, C]: the scale of each (expert, column) for x^T's rows."""
    amax = _group_col_amax(x, offs)
    if scaling == "tensorwise":
        amax = amax.amax(dim=1, keepdim=True).expand_as(amax)
    return _scale(amax).contiguous()


def _weight_scales(w: torch.Tensor, contracted: int, scaling: str) -> torch.Tensor:
    """w [E, N, K] -> fp32 [E, N] (contracted=2: fprop's scales per output row) or [E, K] (contracted=1: dgrad's
    per column of W_e)."""
    amax = w.abs().amax(dim=contracted).float()
    if scaling == "tensorwise":
        amax = amax.amax(dim=1, keepdim=True).expand_as(amax)
    return _scale(amax).contiguous()


# ------------------------------------------------------------------ GEMMs
def scaled_gmm(a: torch.Tensor, sa_inv: torch.Tensor, b: torch.Tensor, sb_inv: torch.Tensor, offs: torch.Tensor,
               out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """a fp8 [M, K] with sa_inv [M] and b fp8 [E, N, K] (row-major) with sb_inv [E, N] -> per row group
    (a * sa_inv) @ (b[e] * sb_inv[e])^T [M, N] in out_dtype."""
    if a.is_cuda:
        out = torch._scaled_grouped_mm(a, b.transpose(-2, -1), sa_inv, sb_inv, offs=offs, out_dtype=torch.bfloat16,
                                       use_fast_accum=fast_accum)
        return out.to(out_dtype)
    ad = a.float() * sa_inv[:, None]
    bd = b.float() * sb_inv[:, :, None]
    return gmm(ad, bd.transpose(-2, -1), offs).to(out_dtype)


def scaled_gmm_wgrad(a_t: torch.Tensor, sa_inv: torch.Tensor, b_t: torch.Tensor, sb_inv: torch.Tensor,
                     offs: torch.Tensor, gid: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a_t fp8 [N, M] with sa_inv [E, N] and b_t fp8 [K, M] with sb_inv [E, K], both grouped along M -> [E, N, K]:
    per expert (a_t * sa_inv[e])[:, group] @ (b_t * sb_inv[e])[:, group]^T, in out_dtype."""
    if a_t.is_cuda:
        out = torch._scaled_grouped_mm(a_t, b_t.t(), sa_inv.reshape(-1), sb_inv.reshape(-1), offs=offs,
                                       out_dtype=torch.bfloat16)
        return out.to(out_dtype)
    ad = a_t.float() * sa_inv[gid].t()
    bd = b_t.float() * sb_inv[gid].t()
    return gmm_wgrad(ad, bd.t(), offs).to(out_dtype)


class _Float8GroupedLinearFn(torch.autograd.Function):
    """x [M, K], w [E, N, K] -> x @ w[e]^T per row group [M, N], the three GEMMs in FP8 (module docstring). Saved
    for backward: x^T in FP8 (1 byte/element) with its scales, and the weight itself (a parameter)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, scaling: str, fast_accum: bool,
                out_dtype: torch.dtype, fp8_wgrad: bool) -> torch.Tensor:
        m, e = x.shape[0], w.shape[0]
        gid = _group_ids(offs, m)
        sx = _row_scales(x, gid, e, scaling)
        sw = _weight_scales(w, 2, scaling)
        y = scaled_gmm(quantize(x, sx[:, None], E4M3), sx.reciprocal(), quantize(w, sw[:, :, None], E4M3),
                       sw.reciprocal(), offs, out_dtype, fast_accum)
        x_t = sx_t = None
        if ctx.needs_input_grad[1] and fp8_wgrad:
            sx_t = _group_col_scales(x, offs, scaling)  # [E, K]
            x_t = quantize(x, sx_t[gid], E4M3).t().contiguous()  # [K, M]
        elif ctx.needs_input_grad[1]:
            x_t = x.to(out_dtype)  # the weight gradient in the compute dtype needs the unquantized input
        ctx.save_for_backward(x_t, sx_t, w, offs, gid)
        ctx.scaling, ctx.x_dtype, ctx.fp8_wgrad = scaling, x.dtype, fp8_wgrad
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_t, sx_t, w, offs, gid = ctx.saved_tensors
        scaling, e = ctx.scaling, w.shape[0]
        g = g.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            sg = _row_scales(g, gid, e, scaling)
            sw = _weight_scales(w, 1, scaling)  # [E, K]
            w_t = quantize(w.transpose(-2, -1), sw[:, :, None], E4M3).contiguous()  # [E, K, N]
            dx = scaled_gmm(quantize(g, sg[:, None], E4M3), sg.reciprocal(), w_t, sw.reciprocal(), offs,
                            ctx.x_dtype, False)
        if ctx.needs_input_grad[1] and not ctx.fp8_wgrad:
            dw = gmm_wgrad(g.to(x_t.dtype).t(), x_t, offs).to(w.dtype)
        elif ctx.needs_input_grad[1]:
            sg_t = _group_col_scales(g, offs, scaling)  # [E, N]
            g_t = quantize(g, sg_t[gid], E4M3).t().contiguous()  # [N, M]
            dw = scaled_gmm_wgrad(g_t, sg_t.reciprocal(), x_t, sx_t.reciprocal(), offs, gid, w.dtype)
        return dx, dw, None, None, None, None, None


def fp8_grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, scaling: str,
                       fast_accum: bool = True, fp8_wgrad: bool = True) -> torch.Tensor:
    """x [M, K] (rows grouped by `offs`, int32 [E]) and w [E, N, K] -> [M, N] in the compute dtype, its GEMMs in
    FP8 with `scaling` ('rowwise' | 'tensorwise'). K and N must be multiples of 16, and so must every group's rows
    on CUDA (`moe.dispatch_plan` pads them). fp8_wgrad=False: the weight gradient as a grouped GEMM in the compute
    dtype from the unquantized x (saved in that dtype) and g."""
    out_dtype = compute_dtype(x)
    return _Float8GroupedLinearFn.apply(x, w, offs, scaling, fast_accum, out_dtype, fp8_wgrad)


class Float8GroupedExperts(GroupedExperts):
    """`GroupedExperts` whose grouped GEMMs run in FP8 inside an enabled `fp8_autocast` (as `Float8Linear`), in high
    precision outside. Same parameters and state_dict keys; `scaling` from the recipe (`expert_scaling`)."""

    def __init__(self, *args: Any, recipe: Recipe, fprop_fast_accum: bool = True, fp8_wgrad: bool = True,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.recipe, self.scaling, self.fprop_fast_accum = recipe, expert_scaling(recipe), fprop_fast_accum
        self.fp8_wgrad = fp8_wgrad

    @classmethod
    def from_experts(cls, experts: GroupedExperts, recipe: Recipe, fprop_fast_accum: bool = True,
                     fp8_wgrad: bool = True) -> Float8GroupedExperts:
        """A Float8GroupedExperts sharing `experts`' weight Parameters and activation module (no copy)."""
        with torch.device("meta"):
            new = cls(experts.num_experts, experts.hidden_size, experts.ffn_hidden_size, experts.act_fn,
                      recipe=recipe, fprop_fast_accum=fprop_fast_accum, fp8_wgrad=fp8_wgrad)
        new.gate_proj, new.up_proj, new.down_proj = experts.gate_proj, experts.up_proj, experts.down_proj
        return new.train(experts.training)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.scaling}, fp8_wgrad={self.fp8_wgrad}"

    def linear(self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        if not FP8GlobalStateManager.is_fp8_enabled() or x.numel() == 0:
            return super().linear(x, w, offs)
        return fp8_grouped_linear(x, w, offs, self.scaling, self.fprop_fast_accum, self.fp8_wgrad)


def fp8_grouped_eligible(experts: torch.nn.Module) -> bool:
    """High-precision GroupedExperts whose hidden and FFN widths are multiples of 16 (what FP8 GEMMs tile)."""
    return (isinstance(experts, GroupedExperts) and not isinstance(experts, Float8GroupedExperts)
            and experts.hidden_size % 16 == 0 and experts.ffn_hidden_size % 16 == 0)


__all__ = ["Float8GroupedExperts", "fp8_grouped_linear", "fp8_grouped_eligible", "expert_scaling", "scaled_gmm",
           "scaled_gmm_wgrad", "SCALINGS"]
