"""Horizontal fusion of sibling Float8Linears that read the same input: q/k/v and gate/up.

`FusedFloat8Projection` is the module `convert_to_fp8` puts in `Attention.qkv_fusion` / `MLP.gate_up_fusion`
(slots of megadlms.model, which `project_qkv` / `project_gate_up` call; `fusions.FUSIONS`). Instead of N
Float8Linears each casting the same input, running its own GEMMs and saving its own FP8 copy of the input, it runs

    forward:  one cast of x (q and x^T), one GEMM  y = x @ [W_1; ...; W_n]^T, outputs split (views)
    backward: one cast of g = [g_1, ..., g_n], one dgrad GEMM (no adds of partial input gradients),
              one wgrad GEMM whose row blocks are the n weight gradients

with the per-step FP8 weight written from the separate high-precision parameters into one
concatenated FP8 buffer (and its transpose). Parameters, module names and state_dict keys are
unchanged: the member modules keep their weights, amax histories and scales.

Scaling: one scale per GEMM operand. The input scale, the concatenated weight's scale and the
gradient's scale are the smallest of the members' scales for that role (delayed scaling, i.e. the
largest amax seen by any member), or come from the amax of the operand being cast (current scaling
and the first step of delayed scaling). Delayed scaling records each member's own weight amax and
the shared input/gradient amax into every member's history, so after one `fp8_step` the members of
a group hold equal input and gradient scales. With equal member scales every output equals the
unfused layers' output for the same inputs (each element is the same FP8 product).

Whenever fusion does not apply (outside an enabled fp8_autocast, rowwise recipe, hooks on a member
(tensor parallelism), DTensor weights, mixed member settings), the call falls back to calling the
member modules one by one. FP8 telemetry (`enable_fp8_stats`) is recorded on the fused path itself:
each member gets the statistics of the shared input cast, of its rows of the weight cast and of its
columns of the gradient cast.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from ..model import compute_dtype
from . import triton_cast
from .gemm import Operand, aligned_scalars, bias_grad, fp8_gemm, wgrad_high_precision
from .kernels import amax_of, cast_fp8, cast_fp8_cat, current_scale, record_amax, transpose_fp8
from .linear import GRAD, INPUT, WEIGHT, Float8Linear, FP8WeightCache, check_device_once, take_fp8_weights
from .param_gather import gathered_fp8, gathered_scale_group
from .quantize import pad_2d, quant_stats, round_up16
from .state import FP8GlobalStateManager

_SETTINGS = ("recipe", "fp8_wgrad", "cache_weight", "fprop_fast_accum", "backward_fast_accum", "training")


class GroupWeightCache:
    """The concatenated FP8 weight of one group for one optimizer step."""

    __slots__ = ("members", "q", "t", "scale_inv", "scales", "scale_invs", "sizes", "keep_t")

    def __init__(self, members: tuple[FP8WeightCache, ...], q: torch.Tensor, t: torch.Tensor | None,
                 scale_inv: torch.Tensor, scales: torch.Tensor | None, scale_invs: torch.Tensor | None,
                 sizes: tuple[int, ...]):
        self.members, self.q, self.t, self.scale_inv, self.sizes = members, q, t, scale_inv, sizes
        # delayed scaling: the group's [3] scales (input, weight, grad) and their inverses, computed once per step
        # for the casts of every micro-batch; None before the first fp8_step and for current scaling
        self.scales, self.scale_invs = scales, scale_invs
        # whether a transpose the backward makes (t None) is kept for later micro-batches; False for the caches
        # CUDA graphs read (fp8.graph_weights), which hold q only
        self.keep_t = True

    @property
    def rows(self) -> Operand:
        """q [N, K] with its scale_inv: the fprop GEMM's operand."""
        return Operand(self.q, self.scale_inv)

    def cols(self) -> Operand:
        """q^T [K, N] with its scale_inv: the dgrad GEMM's operand."""
        return Operand(self.transposed(), self.scale_inv)

    def transposed(self) -> torch.Tensor:
        """q^T [K, N] row-major: t, or transposed from q now."""
        if self.t is not None:
            return self.t
        t = transpose_fp8(self.q)
        if self.keep_t:
            self.t = t
        return t


class FusedFloat8Projection(nn.Module):
    """x [..., K] -> tuple of the members' outputs [..., N_i]: one FP8 GEMM for sibling Float8Linears that read
    the same input (see the module docstring). Holds no parameters or buffers: the members (named `names` in
    their parent) keep theirs, and stay the parent's submodules (they are not this module's children)."""

    def __init__(self, members: tuple[nn.Module, ...], names: tuple[str, ...]):
        super().__init__()
        self._members = tuple(members)  # a tuple: not registered as children (no second state_dict key)
        self.names = tuple(names)
        self.weight_cache: GroupWeightCache | None = None
        self.num_fused_calls = 0  # forwards that took the fused path (tests, debugging)

    @classmethod
    def of(cls, parent: nn.Module, names: tuple[str, ...]) -> FusedFloat8Projection | None:
        """The fusion of `parent.<names>`, or None unless they are Float8Linears with a per-tensor recipe."""
        mods = tuple(getattr(parent, n) for n in names)
        if all(type(m) is Float8Linear for m in mods) and mods[0].quantizers[WEIGHT].per_tensor:
            return cls(mods, names)
        return None

    def extra_repr(self) -> str:
        return ", ".join(self.names)

    def members(self) -> list[nn.Module]:
        return list(self._members)

    def invalidate_fp8_weight_cache(self) -> None:
        """Drop the concatenated FP8 weight (the members drop theirs themselves)."""
        self.weight_cache = None

    def fusable(self, mods: list[nn.Module], x: torch.Tensor) -> bool:
        if not FP8GlobalStateManager.is_fp8_enabled() or x.numel() == 0:
            return False
        first = mods[0]
        if not all(type(m) is Float8Linear for m in mods) or not first.quantizers[WEIGHT].per_tensor:
            return False
        explicit = FP8GlobalStateManager.get_explicit_recipe()
        if explicit is not None and explicit != first.recipe:
            return False  # the members raise the mismatch error
        dtensor = sys.modules.get("torch.distributed.tensor")
        k = first.weight.shape[1]
        for m in mods:
            if m._forward_hooks or m._forward_pre_hooks:
                return False
            if dtensor is not None and isinstance(m.weight, dtensor.DTensor):
                return False
            if m.weight.shape[1] != k or m.weight.shape[0] % 16 or k % 16 or m.weight.device != x.device:
                return False
            if any(getattr(m, s) != getattr(first, s) for s in _SETTINGS):
                return False
        return x.shape[-1] == k

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        mods = self.members()
        if not self.fusable(mods, x):
            return tuple(m(x) for m in mods)
        if x.device.type == "cuda":
            check_device_once(x.device)
        ws = [m.weight for m in mods]
        bs = [m.bias for m in mods]
        k = ws[0].shape[1]
        sizes = tuple(w.shape[0] for w in ws)
        x2 = x.reshape(-1, k).contiguous()
        grad_follows = torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in ws))
        self.num_fused_calls += 1
        ys = _FusedFloat8LinearFn.apply(x2, self, tuple(mods), compute_dtype(x), grad_follows, *ws, *bs)
        return tuple(y.view(*x.shape[:-1], n) for y, n in zip(ys, sizes))

    # ------------------------------------------------------------------ weights
    def group_weight(self, mods: list[Float8Linear], want_t: bool) -> GroupWeightCache:
        """The concatenated FP8 weight for this step: cast on the first micro-batch after any member's weight
        changed (same detection as `Float8Linear.fp8_weight`; `fp8_step` drops the members' caches)."""
        c = self.weight_cache
        if mods[0].weights_frozen and c is not None:
            return c  # recast outside the graph, into this cache's tensors (fp8.graph_weights)
        gathered = [gathered_fp8(m.weight) for m in mods]
        if any(op is not None for op in gathered):
            return self._gathered_weight(mods, gathered)
        keys = [(m.weight._version, m.weight.data_ptr(), m.weight.dtype, m.weight.device) for m in mods]
        if c is not None and all(m.weight_cache is mc and mc.key == key for m, mc, key in zip(mods, c.members, keys)):
            if want_t and c.keep_t:
                c.transposed()  # made now and kept for the step's later micro-batches
            return c
        first = mods[0]
        recipe = first.recipe
        fwd = recipe.fp8_format.fwd_dtype
        delayed = first.quantizers[INPUT].keeps_history
        ready = delayed and all(m.scales_ready() for m in mods)
        scales = torch.stack([m.fp8_scale for m in mods]).amin(0) if ready else None  # [3]: input, weight, grad
        ws = [m.weight.detach() for m in mods]
        record = delayed and first.training
        if ready:  # the weights' amaxes (for the histories) come out of the cast itself
            amax_outs = [m.fp8_amax_history[0, WEIGHT] for m in mods] if record else None
            q, t = cast_fp8_cat(ws, scales[WEIGHT], fwd, want_t, amax_outs)
            scale_invs = aligned_scalars(scales.reciprocal())[:, 0]
            scale_inv = scale_invs[WEIGHT]
        else:
            kept = [m.kept_weight_amax() for m in mods]
            amaxes = [a if a is not None else amax_of(w) for a, w in zip(kept, ws)]
            if record:
                torch._foreach_maximum_([m.fp8_amax_history[0, WEIGHT] for m in mods], amaxes)
            scale, scale_inv = current_scale(amaxes, fwd, recipe.margin)
            q, t = cast_fp8_cat(ws, scale, fwd, want_t)
            scale_invs = None
        member_caches, row = [], 0
        for m, w, key in zip(mods, ws, keys):
            n = w.shape[0]
            mc = FP8WeightCache(key, q[row:row + n], scale_inv)  # what the member itself uses if called alone
            row += n
            m.num_weight_casts += 1
            if first.cache_weight:
                m.weight_cache = mc
            member_caches.append(mc)
        group = GroupWeightCache(tuple(member_caches), q, t, scale_inv, scales, scale_invs,
                                 tuple(w.shape[0] for w in ws))
        self.weight_cache = group if first.cache_weight else None
        return group

    def _gathered_weight(self, mods: list[Float8Linear], ops: list[Operand | None]) -> GroupWeightCache:
        """The concatenated FP8 weight from members FSDP2 gathered in FP8 (`param_gather`), uncached. They were
        cast with the group's one scale (the one `group_weight` computes), so their rows concatenate into the
        operand the fused cast makes: the same FP8 values, no second rounding."""
        group = gathered_scale_group(mods[0].weight)
        if group is None or group.members != tuple(mods) or any(gathered_scale_group(m.weight) is not group
                                                                 for m in mods):
            raise RuntimeError(f"the members of {self.extra_repr()} were not gathered in FP8 as one scale group: "
                               "enable_fp8_param_gather must get a fused projection's members together")
        first = mods[0]
        ready = first.quantizers[INPUT].keeps_history and all(m.scales_ready() for m in mods)
        scales = torch.stack([m.fp8_scale for m in mods]).amin(0) if ready else None  # [3]: input, weight, grad
        scale_invs = aligned_scalars(scales.reciprocal())[:, 0] if scales is not None else None
        datas = [op.data for op in ops if op is not None]
        scale_inv = ops[0].scale_inv if ops[0] is not None else None
        assert scale_inv is not None  # every member was gathered
        members = tuple(FP8WeightCache(None, d, scale_inv) for d in datas)
        return GroupWeightCache(members, torch.cat(datas), None, scale_inv, scales, scale_invs,
                                tuple(d.shape[0] for d in datas))


def cast_group_operand(mods: tuple[Float8Linear, ...], x: torch.Tensor, role: int, fp8_dtype: torch.dtype,
                 w: GroupWeightCache, record: bool, want_q: bool, want_t: bool
                 ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """Cast of an operand shared by the group (the input, or the concatenated gradient): one scale (the
    smallest member scale when delayed scales exist, else from x's amax); with `record`, x's amax goes into
    every member's history slot of `role` (straight out of the cast with a known scale). Returns (q, scale_inv, q^T)."""
    slots = [m.fp8_amax_history[0, role] for m in mods] if record else None
    margin = mods[0].recipe.margin
    if w.scales is not None:
        q, t, scale_inv, _ = cast_fp8(x, w.scales[role], slots, fp8_dtype, margin, want_q, want_t,
                                      scale_inv=w.scale_invs[role])
    else:
        q, t, scale_inv, _ = cast_fp8(x, None, slots, fp8_dtype, margin, want_q, want_t)
    return q, scale_inv, t


def cast_grad_parts(mods: tuple[Float8Linear, ...], parts: tuple[torch.Tensor, ...], fp8_dtype: torch.dtype,
                     w: GroupWeightCache, record: bool, want_q: bool, want_t: bool, mp: int
                     ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """The FP8 cast of the gradient [g_1, ..., g_n] ([M, N_i] each, contiguous) as one operand, padded to mp rows:
    (q [mp, sum N_i] or None, scale_inv, q^T [sum N_i, mp] or None). On CUDA each part is cast straight into
    its blocks of q and q^T; elsewhere the parts are concatenated and cast by `cast_group_operand`."""
    m = parts[0].shape[0]
    if all(triton_cast.available(p) for p in parts):
        slots = [mod.fp8_amax_history[0, GRAD] for mod in mods] if record else []
        amaxes: list[torch.Tensor] = []
        if w.scales is not None:
            scale, scale_inv = w.scales[GRAD], w.scale_invs[GRAD]
            in_kernel = slots if len(slots) <= triton_cast.MAX_AMAX_OUTS else []
        else:
            amaxes = [amax_of(p) for p in parts]
            scale, scale_inv = current_scale(amaxes, fp8_dtype, mods[0].recipe.margin)
            in_kernel = []
        ncat = sum(p.shape[1] for p in parts)
        alloc = torch.empty if mp == m else torch.zeros  # padding rows: zeros
        gq = alloc(mp, ncat, dtype=fp8_dtype, device=parts[0].device) if want_q else None
        gt = alloc(ncat, mp, dtype=fp8_dtype, device=parts[0].device) if want_t else None
        col = 0
        for p in parts:
            n = p.shape[1]
            out = triton_cast.checked_cast_transpose(p, scale, fp8_dtype, want_q, want_t, in_kernel,
                                                     gq[:m, col:col + n] if want_q else None,
                                                     gt[col:col + n, :m] if want_t else None)
            if out is None:
                # the kernel is off for this part: the path below casts (and records) again; the parts cast so
                # far raised the slots by max-updates, which are harmless to repeat
                break
            col += n
        else:
            if slots and not in_kernel:
                record_amax(slots, torch.stack(amaxes or [amax_of(p) for p in parts]).amax())
            return gq, scale_inv, gt
    g = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
    return cast_group_operand(mods, pad_2d(g, mp, g.shape[1]), GRAD, fp8_dtype, w, record, want_q, want_t)


def _record_group_stats(mods: tuple[Float8Linear, ...], w: GroupWeightCache, ws: tuple[torch.Tensor, ...],
                        xp: torch.Tensor, xq: torch.Tensor, x_si: torch.Tensor, numel: int) -> None:
    """FP8 telemetry of a fused forward: the shared input cast for every member, and each member's rows of the
    concatenated weight cast once per statistics window (as `Float8Linear.fp8_weight` records its weight)."""
    x_stats = quant_stats(xp, xq, x_si.reciprocal(), xq.dtype, numel)  # one input: computed once
    w_scale = w.scale_inv.reciprocal()
    for mod, mc, wi in zip(mods, w.members, ws):
        mod.add_stats(INPUT, x_stats)
        if mc.stats_epoch != mod.stats_epoch:
            mod.record_stats(WEIGHT, wi.detach(), mc.q, w_scale, wi.numel())
            mc.stats_epoch = mod.stats_epoch


class _FusedFloat8LinearFn(torch.autograd.Function):
    """x [M, K], weights W_i [N_i, K], biases b_i [N_i] | None -> y [M, sum N_i] = x @ [W_1; ...]^T (+ [b_1, ...])."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: FusedFloat8Projection, mods: tuple[Float8Linear, ...],
                out_dtype: torch.dtype, grad_follows: bool, *params: torch.Tensor | None
                ) -> tuple[torch.Tensor, ...]:
        n_mod = len(mods)
        ws, bs = params[:n_mod], params[n_mod:]
        first = mods[0]
        recipe = first.recipe
        fwd = recipe.fp8_format.fwd_dtype
        delayed = first.quantizers[INPUT].keeps_history
        m, k = x.shape
        mp = round_up16(m)
        xp = pad_2d(x, mp, k)
        need_w = any(ctx.needs_input_grad[5:5 + n_mod])
        want_wt = grad_follows and any(w.requires_grad for w in ws)
        w = group.group_weight(list(mods), want_wt and first.cache_weight)  # uncached: W^T made in the backward
        want_xt = need_w and first.fp8_wgrad
        xq, x_si, xt = cast_group_operand(mods, xp, INPUT, fwd, w, delayed and first.training, True, want_xt)
        if first.collect_fp8_stats:
            _record_group_stats(mods, w, ws, xp, xq, x_si, m * k)
        y = fp8_gemm(Operand(xq, x_si), w.rows, out_dtype, first.fprop_fast_accum)
        y = y[:m]
        if any(b is not None for b in bs):
            y = y + torch.cat([(b if b is not None else torch.zeros(wi.shape[0], device=y.device)).to(out_dtype)
                               for b, wi in zip(bs, ws)])
        x_saved = x_si_saved = None
        if need_w:
            if not first.fp8_wgrad:
                x_saved = x.to(out_dtype)
            else:
                x_saved, x_si_saved = xt, x_si  # [K, Mp]: the wgrad GEMM's right operand
        ctx.save_for_backward(x_saved, x_si_saved)
        ctx.mods, ctx.wcache, ctx.keep_weights = mods, w, first.cache_weight
        ctx.dims = (m, k)
        ctx.x_dtype, ctx.out_dtype = x.dtype, out_dtype
        ctx.w_dtypes = tuple(wi.dtype for wi in ws)
        ctx.b_dtypes = tuple(b.dtype if b is not None else None for b in bs)
        # column blocks of one GEMM output; their gradients arrive separately and are cast straight into
        # the blocks of one FP8 gradient (no concatenation pass)
        return tuple(y.split(w.sizes, dim=1))

    @staticmethod
    def backward(ctx: Any, *gs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        mods: tuple[Float8Linear, ...] = ctx.mods
        n_mod = len(mods)
        first = mods[0]
        recipe = first.recipe
        bwd = recipe.fp8_format.bwd_dtype
        delayed = first.quantizers[INPUT].keeps_history
        x_saved, x_si = ctx.saved_tensors
        w: GroupWeightCache
        (w,) = take_fp8_weights(ctx, "wcache")
        m, k = ctx.dims
        mp = round_up16(m)
        need_dx = ctx.needs_input_grad[0]
        need_w = ctx.needs_input_grad[5:5 + n_mod]
        need_b = ctx.needs_input_grad[5 + n_mod:]
        fp8_wgrad = any(need_w) and first.fp8_wgrad
        gs = tuple(g.contiguous() for g in gs)
        dx = None
        dws: list[torch.Tensor | None] = [None] * n_mod
        if need_dx or fp8_wgrad:
            gq, g_si, gt = cast_grad_parts(mods, gs, bwd, w, delayed, need_dx, fp8_wgrad, mp)
            if first.collect_fp8_stats:  # each member: its gradient against its columns of the FP8 gradient
                col, scale = 0, g_si.reciprocal()
                for mod, g in zip(mods, gs):
                    n = g.shape[1]
                    q = gq[:m, col:col + n] if gq is not None else gt[col:col + n, :m].t()
                    mod.record_stats(GRAD, g, q, scale, g.numel())
                    col += n
            if need_dx:
                dx = fp8_gemm(Operand(gq, g_si), w.cols(), ctx.x_dtype, first.backward_fast_accum)[:m]
            if fp8_wgrad:
                dw = fp8_gemm(Operand(gt, g_si), Operand(x_saved, x_si), ctx.w_dtypes[0], first.backward_fast_accum)
                parts = dw[:, :k].split(w.sizes)
                dws = [d.to(dt) if need else None for d, dt, need in zip(parts, ctx.w_dtypes, need_w)]
        if any(need_w) and not first.fp8_wgrad:  # per member: exactly the unfused layers' BF16 GEMMs
            dws = [wgrad_high_precision(g, x_saved, ctx.out_dtype, dt) if need else None
                   for g, dt, need in zip(gs, ctx.w_dtypes, need_w)]
        dbs = [bias_grad(g, dt) if need else None for g, dt, need in zip(gs, ctx.b_dtypes, need_b)]
        return (dx, None, None, None, None, *dws, *dbs)
