"""FP8 grouped GEMMs for the MoE experts: `Float8GroupedExperts`, the FP8 swap of `moe.GroupedExperts`.

Each expert projection y = x @ W_e^T (x's rows grouped by expert, `offs`) runs its three products, fprop, dgrad and
wgrad, as `gemm.fp8_grouped_gemm` over the operands of an `expert_quantizer.ExpertQuantizer` of the run's recipe
(per-row or per-expert scaling, as `Recipe.experts` states; the products and their operands are listed there).
Accumulation in fp32, outputs in the compute dtype. The router never comes here (it stays fp32: `moe.Router`).

The experts' weight gradients run in BF16 by default (`EXPERTS_FP8_WGRAD`): a grouped GEMM in the compute dtype
from the unquantized input and output gradient, fprop and dgrad staying FP8. On an H100 (torch 2.11) the FP8
weight-gradient grouped GEMM (2-D x 2-D) ran at less than half the BF16 one's TFLOP/s, and it needs per-(expert,
column) transposed casts of x, h and g that BF16 does without (docs/moe.md). `fp8_wgrad=True` keeps it available.

The backward's FP8 grouped GEMMs use Hopper's fast accumulation by default, as the forward's do
(`EXPERTS_BACKWARD_FAST_ACCUM`, as torchao's FP8 grouped GEMMs): with the exact accumulation, torch's grouped kernel
takes, for groups under 2048 rows, the 128x256 tile that it avoids for that accumulation on larger ones (register
spills); at Qwen3-30B-A3B shapes (128 experts, about 1024 rows each) the FP8 grouped GEMMs took twice the BF16 ones'
time. `backward_fast_accum=False` keeps the exact accumulation.

The FP8 weights are cast once per optimizer step where the module caches them (`cache_weight`, as `Float8Linear`'s
weight cache): the forward's rows and, made by the first backward, the dgrad's W^T, kept while the weight's version
is unchanged and dropped by `fp8_step` (and by `set_fp8_weight_caching(model, False)` where each step has one
micro-batch, whose forward and backward share one cast anyway). The casts read the fp32 master weight directly: no
BF16 copy of the weights is made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..grouped_gemm import gmm_wgrad
from ..model import compute_dtype
from ..moe import GroupedExperts, _local
from .expert_quantizer import ExpertQuantizer
from .gemm import fp8_grouped_gemm
from .recipe import Recipe
from .state import FP8GlobalStateManager
from .tensor import FP8Tensor, Scaling

# The experts' weight gradients in FP8 by default? No: slower than BF16 where measured (module docstring)
EXPERTS_FP8_WGRAD = False
# Fast accumulation in the backward's FP8 grouped GEMMs too (module docstring)
EXPERTS_BACKWARD_FAST_ACCUM = True


@dataclass(eq=False)
class ExpertWeightCast:
    """One expert weight's FP8 casts for a step: `rows` for fprop, `cols` (W^T) for dgrad once a backward made them,
    the per-expert amax that both casts take (per-expert scaling; None per row), and `key`, the weight version cast."""

    key: tuple
    rows: FP8Tensor
    amax: torch.Tensor | None
    cols: FP8Tensor | None = None


class _Float8GroupedLinearFn(torch.autograd.Function):
    """x [M, K], w [E, N, K] -> x @ w[e]^T per row group [M, N], the three GEMMs in FP8. Saved for backward: x^T in
    FP8 (1 byte/element) with its scales (or x in the compute dtype without FP8 wgrad), and the weight itself (a
    parameter)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, quantizer: ExpertQuantizer,
                fast_accum: bool, out_dtype: torch.dtype, fp8_wgrad: bool,
                x_fp8: tuple[FP8Tensor, FP8Tensor | None] | None, backward_fast_accum: bool,
                w_cast: ExpertWeightCast | None) -> torch.Tensor:
        want_x_t = ctx.needs_input_grad[1] and fp8_wgrad
        xq: FP8Tensor | None
        if x_fp8 is not None and (x_fp8[1] is not None or not want_x_t):  # x's casts, shared with another weight
            xq, x_t = x_fp8[0], x_fp8[1] if want_x_t else None
        else:
            xq, x_t = quantizer.quantize(x, offs, rows=True, cols=want_x_t)
        wq: FP8Tensor | None
        if w_cast is not None:  # the step's cached cast
            w_amax, wq = w_cast.amax, w_cast.rows
        else:
            w_amax = quantizer.weight_amax(w)  # per-expert scaling: kept for the backward's cast of W^T
            wq, _ = quantizer.quantize_weight(w, rows=True, amax=w_amax)
        assert xq is not None and wq is not None  # asked for
        y = fp8_grouped_gemm(xq, wq, out_dtype, fast_accum)
        saved_x = saved_si = None
        if x_t is not None:
            saved_x, saved_si = x_t.data, x_t.scale_inv
        elif ctx.needs_input_grad[1]:
            saved_x = x.to(out_dtype)  # the weight gradient in the compute dtype needs the unquantized input
        ctx.save_for_backward(saved_x, saved_si, w, offs, w_amax)
        ctx.quantizer, ctx.x_dtype, ctx.fp8_wgrad = quantizer, x.dtype, fp8_wgrad
        ctx.backward_fast_accum, ctx.w_cast = backward_fast_accum, w_cast
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved_x, saved_si, w, offs, w_amax = ctx.saved_tensors
        quantizer: ExpertQuantizer = ctx.quantizer
        want_dw = ctx.needs_input_grad[1]
        gq, g_t = quantizer.quantize(g, offs, rows=ctx.needs_input_grad[0], cols=want_dw and ctx.fp8_wgrad)
        dx = dw = None
        if gq is not None:
            w_cast: ExpertWeightCast | None = ctx.w_cast
            w_t = w_cast.cols if w_cast is not None else None
            if w_t is None:
                _, w_t = quantizer.quantize_weight(w, rows=False, cols=True, amax=w_amax)
                if w_cast is not None:  # kept for the step's later micro-batches
                    w_cast.cols = w_t
            assert w_t is not None  # asked for
            dx = fp8_grouped_gemm(gq, w_t, ctx.x_dtype, ctx.backward_fast_accum)
        if g_t is not None:
            x_t = FP8Tensor(saved_x, saved_si, quantizer.scaling, transposed=True, offs=offs)
            dw = fp8_grouped_gemm(g_t, x_t, w.dtype, ctx.backward_fast_accum)
        elif want_dw:
            dw = gmm_wgrad(g.to(saved_x.dtype).t(), saved_x, offs).to(w.dtype)
        return dx, dw, None, None, None, None, None, None, None, None


def fp8_grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, quantizer: ExpertQuantizer | Recipe,
                       fast_accum: bool = True, fp8_wgrad: bool = EXPERTS_FP8_WGRAD,
                       x_fp8: tuple[FP8Tensor, FP8Tensor | None] | None = None,
                       backward_fast_accum: bool = EXPERTS_BACKWARD_FAST_ACCUM,
                       w_cast: ExpertWeightCast | None = None) -> torch.Tensor:
    """x [M, K] (rows grouped by `offs`, int32 [E]) and w [E, N, K] -> [M, N] in the compute dtype, its GEMMs in
    FP8 with `quantizer` (or one of the recipe given). K and N must be multiples of 16, and so must every group's
    rows on CUDA (`moe.dispatch_plan` pads them). fp8_wgrad=False (the default): the weight gradient as a grouped
    GEMM in the compute dtype from the unquantized x (saved in that dtype) and g; True: in FP8. x_fp8:
    `quantizer.quantize(x, offs)`'s (rows, cols) when the caller cast x already (projections sharing their input).
    fast_accum / backward_fast_accum: Hopper's fast accumulation in the forward / the backward GEMMs. w_cast: w's
    cached casts (`Float8GroupedExperts.weight_cast`), which the backward completes with W^T; None: cast w here."""
    if not isinstance(quantizer, ExpertQuantizer):
        quantizer = ExpertQuantizer(quantizer)
    out_dtype = compute_dtype(x)
    return _Float8GroupedLinearFn.apply(x, w, offs, quantizer, fast_accum, out_dtype, fp8_wgrad, x_fp8,
                                        backward_fast_accum, w_cast)


class Float8GroupedExperts(GroupedExperts):
    """`GroupedExperts` whose grouped GEMMs run in FP8 inside an enabled `fp8_autocast` (as `Float8Linear`), in high
    precision outside. Same parameters and state_dict keys; `quantizer` from the recipe (`ExpertQuantizer`), its
    `scaling` the recipe's `experts` (ValueError naming the recipes that work for one that does not). fp8_wgrad:
    the weight gradients in FP8 (default `EXPERTS_FP8_WGRAD`: in the compute dtype, module docstring).
    backward_fast_accum: fast accumulation in the backward's FP8 GEMMs (default `EXPERTS_BACKWARD_FAST_ACCUM`).
    cache_weight: keep the FP8 weights between the micro-batches of a step (module docstring)."""

    def __init__(self, *args: Any, recipe: Recipe, fprop_fast_accum: bool = True,
                 fp8_wgrad: bool = EXPERTS_FP8_WGRAD, backward_fast_accum: bool = EXPERTS_BACKWARD_FAST_ACCUM,
                 cache_weight: bool = True, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.recipe, self.quantizer, self.fprop_fast_accum = recipe, ExpertQuantizer(recipe), fprop_fast_accum
        self.scaling: Scaling = self.quantizer.scaling
        self.fp8_wgrad, self.backward_fast_accum = fp8_wgrad, backward_fast_accum
        self.cache_weight = bool(cache_weight)
        self.weight_casts: dict[int, ExpertWeightCast] = {}  # by the weight's data pointer
        self.num_weight_casts = 0  # how many times an FP8 weight was made (tests, debugging)

    @classmethod
    def from_experts(cls, experts: GroupedExperts, recipe: Recipe, fprop_fast_accum: bool = True,
                     fp8_wgrad: bool = EXPERTS_FP8_WGRAD) -> Float8GroupedExperts:
        """A Float8GroupedExperts sharing `experts`' weight Parameters and activation module (no copy)."""
        with torch.device("meta"):
            new = cls(experts.num_experts, experts.hidden_size, experts.ffn_hidden_size, experts.act_fn,
                      recipe=recipe, fprop_fast_accum=fprop_fast_accum, fp8_wgrad=fp8_wgrad)
        new.gate_proj, new.up_proj, new.down_proj = experts.gate_proj, experts.up_proj, experts.down_proj
        return new.train(experts.training)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.scaling.value}, fp8_wgrad={self.fp8_wgrad}"

    # ------------------------------------------------------------------ the per-step weight cache
    def invalidate_fp8_weight_cache(self) -> None:
        """Drop the cached FP8 weights; the next forward casts the weights again."""
        self.weight_casts = {}

    def set_cache_weight(self, enabled: bool) -> None:
        """Keep the FP8 weights for the step's later micro-batches (or not); the casts held now are dropped."""
        self.cache_weight = bool(enabled)
        self.weight_casts = {}

    def _apply(self, fn: Any, recurse: bool = True) -> Float8GroupedExperts:
        self.weight_casts = {}  # moved or cast, the weights are other tensors
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self.weight_casts = {}

    def weight_cast(self, w: torch.Tensor) -> ExpertWeightCast | None:
        """w's FP8 casts for this step: cached, or made now where w changed since (its version counter, storage,
        dtype); None without the cache, and inside CUDA-graph capture (a graph casts the weights it reads itself:
        a cached cast would be a constant of the graph)."""
        if not self.cache_weight or (w.is_cuda and torch.cuda.is_current_stream_capturing()):
            return None
        key = (w._version, w.data_ptr(), w.dtype, w.device, tuple(w.shape))
        cast = self.weight_casts.get(w.data_ptr())
        if cast is None or cast.key != key:
            amax = self.quantizer.weight_amax(w)
            rows, _ = self.quantizer.quantize_weight(w, rows=True, amax=amax)
            assert rows is not None  # asked for
            cast = self.weight_casts[w.data_ptr()] = ExpertWeightCast(key, rows, amax)
            self.num_weight_casts += 1
        return cast

    def linear(self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
               x_fp8: tuple[FP8Tensor, FP8Tensor | None] | None = None) -> torch.Tensor:
        if not FP8GlobalStateManager.is_fp8_enabled() or x.numel() == 0:
            return super().linear(x, w, offs)
        w_cast = self.weight_cast(w)
        if w_cast is None:
            self.num_weight_casts += 1
        return fp8_grouped_linear(x, w, offs, self.quantizer, self.fprop_fast_accum, self.fp8_wgrad, x_fp8,
                                  self.backward_fast_accum, w_cast)

    # Outside torch.compile's graphs, as `Float8Linear.forward`: a compiled layer runs the FP8 experts eagerly (their
    # casts are Triton kernels with a first-call check, the GEMMs torch._scaled_grouped_mm)
    @torch.compiler.disable
    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """`GroupedExperts.forward`, with x cast to FP8 once for the gate and up projections (its rows for their
        fprop, its transposed copy for their weight gradients)."""
        if not FP8GlobalStateManager.is_fp8_enabled() or x.numel() == 0:
            return super().forward(x, offs)
        gate, up, down = (_local(w) for w in (self.gate_proj, self.up_proj, self.down_proj))
        cols = self.fp8_wgrad and torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)
        rows_fp8, cols_fp8 = self.quantizer.quantize(x, offs, rows=True, cols=cols)
        assert rows_fp8 is not None  # asked for
        x_fp8 = (rows_fp8, cols_fp8)
        h = self.act_fn(self.linear(x, gate, offs, x_fp8), self.linear(x, up, offs, x_fp8))
        return self.linear(h, down, offs)


def fp8_grouped_eligible(experts: torch.nn.Module) -> bool:
    """High-precision GroupedExperts whose hidden and FFN widths are multiples of 16 (what FP8 GEMMs tile)."""
    return (isinstance(experts, GroupedExperts) and not isinstance(experts, Float8GroupedExperts)
            and experts.hidden_size % 16 == 0 and experts.ffn_hidden_size % 16 == 0)


__all__ = ["EXPERTS_BACKWARD_FAST_ACCUM", "EXPERTS_FP8_WGRAD", "ExpertWeightCast", "Float8GroupedExperts",
           "fp8_grouped_linear", "fp8_grouped_eligible"]
