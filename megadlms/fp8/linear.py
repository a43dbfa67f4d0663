"""`Float8Linear`: an `nn.Linear` whose three GEMMs run in FP8 inside an enabled `fp8_autocast`.

fprop:  y  = x @ W^T      E4M3 x E4M3
dgrad:  dx = g @ W        g in E5M2 (HYBRID) or E4M3, W in E4M3
wgrad:  dW = g^T @ x      g as above, x in E4M3 (or in BF16 with fp8_wgrad=False)

Every GEMM goes through `torch._scaled_mm` (fp32 accumulation; row-major x column-major
operands). Token counts (and feature dims) that are not multiples of 16 are zero-padded inside
the layer and the results sliced, so any batch shape works. The gradient is always the left
operand, which keeps E5M2 x E4M3 within what the CUDA kernels accept.

What is saved for backward: the FP8 copy of the input (1 byte/element) and the FP8 weight, which
is shared with the per-step weight cache. Without that cache (`cache_weight=False`) the FP8 weight is
freed when the layer's backward returns, and its transpose for the input gradient is made in the
backward rather than kept from the forward. With fp8_wgrad=False the input is saved in the compute
dtype instead (2 bytes/element in BF16): that is the price of a weight gradient that is exactly
the BF16 GEMM of the unquantized tensors.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ..model import compute_dtype
from .fused import cast_fp8, transpose_fp8
from .hardware import check_fp8_support
from .quantize import aligned_scalars, pad_2d, quant_stats, quantize_rowwise, round_up16, scaled_mm
from .recipe import DelayedScaling, Float8RowwiseScaling, Recipe, check_recipe
from .state import FP8GlobalStateManager

ROLES = ("input", "weight", "grad")
INPUT, WEIGHT, GRAD = 0, 1, 2

if TYPE_CHECKING:
    from .weight_amax import KeptAmax

_checked_devices: set[int] = set()


def _check_device_once(device: torch.device) -> None:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _checked_devices:
        check_fp8_support(torch.device("cuda", index))
        _checked_devices.add(index)


def apply_keeping_dtypes(module: nn.Module, fn: Any, names: tuple[str, ...], recurse: bool = True) -> nn.Module:
    """`nn.Module._apply` that lets `fn` move the buffers `names` to another device but not change
    their dtype (`model.to(torch.bfloat16)` must not turn FP8 scales into BF16 or FP8 weights into BF16)."""
    kept = {n: module._buffers.pop(n) for n in names if module._buffers.get(n) is not None}
    try:
        nn.Module._apply(module, fn, recurse)
    finally:
        for n, t in kept.items():
            device = fn(torch.empty(0, device=t.device)).device  # where fn sends tensors
            module._buffers[n] = t.to(device)
    return module


def take_fp8_weights(ctx: Any, *names: str) -> tuple[Any, ...]:
    """The FP8 weights a backward reads from `ctx` (attributes `names`, set by its forward).

    Where the layers do not cache their FP8 weights (`cache_weight=False`: one micro-batch per step, CUDA-graph
    capture, FSDP), `ctx` lets go of them here, so each one is freed when its layer's backward returns, as the
    saved activations are, instead of when the whole autograd graph is; in a CUDA graph's pool that memory then
    serves the rest of the backward. A second backward through the same graph (retain_graph) then has nothing
    to read and says so.
    """
    weights = tuple(getattr(ctx, n) for n in names)
    if any(w is None for w in weights):
        raise RuntimeError("this FP8 layer's weights were released after its first backward (layers with "
                           "cache_weight=False keep them for one backward only); to backward twice through one "
                           "graph (retain_graph=True), set cache_weight=True on the Float8Linears")
    if not ctx.keep_weights:
        for n in names:
            setattr(ctx, n, None)
    return weights


class _Fp8Weight:
    """The FP8 copies of one weight for one optimizer step (reused by every micro-batch of the step).

    q [Np, Kp] row-major with scale_inv (scalar, or [1, Np] rowwise) for fprop; the column-major
    copy for dgrad is made on first use.
    """

    __slots__ = ("key", "q", "scale_inv", "dgrad", "stats_epoch", "scale_invs", "keep_dgrad")

    def __init__(self, key: tuple, q: torch.Tensor, scale_inv: torch.Tensor, scale_invs: torch.Tensor | None = None):
        self.key, self.q, self.scale_inv = key, q, scale_inv
        self.dgrad: tuple[torch.Tensor, torch.Tensor] | None = None
        self.stats_epoch = -1
        # delayed scaling: 1 / fp8_scale [3] of this step, for the input and gradient casts of every micro-batch
        self.scale_invs = scale_invs
        # whether a dgrad copy the backward makes is kept for later micro-batches; False for the caches CUDA graphs
        # read (fp8.graph_weights), which hold q only
        self.keep_dgrad = True

    def scale_inv_of(self, role: int) -> torch.Tensor | None:
        return self.scale_invs[role] if self.scale_invs is not None else None


class DelayedScalingState:
    """Mixin for FP8 modules with delayed-scaling state, one column per tensor role: the persistent fp32 buffers
    `fp8_amax_history` [history_len, roles] and `fp8_scale` [roles] and the bool `fp8_initialized` (None for other
    recipes), and a host mirror of `fp8_initialized` that is read once after a load (no sync per use)."""

    def _register_fp8_state(self, recipe: Recipe, roles: int, device: Any) -> None:
        if isinstance(recipe, DelayedScaling):
            self.register_buffer("fp8_amax_history", torch.zeros(recipe.amax_history_len, roles, device=device))
            self.register_buffer("fp8_scale", torch.ones(roles, device=device))
            self.register_buffer("fp8_initialized", torch.zeros((), dtype=torch.bool, device=device))
        else:
            for name in ("fp8_amax_history", "fp8_scale", "fp8_initialized"):
                self.register_buffer(name, None)
        self._ready: bool | None = False  # host mirror of fp8_initialized; None = read it on next use

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._ready = None

    def _is_ready(self) -> bool:
        """Whether delayed scales exist (a `fp8_step` has run). Reads the buffer once after a load."""
        if self._ready is None:
            self._ready = bool(self.fp8_initialized)
        return self._ready

    def _mark_ready(self) -> None:
        self._ready = True


class FP8Telemetry:
    """Mixin for FP8 modules that can record the statistics of their casts (`monitor.enable_fp8_stats`): the fp32
    buffer `fp8_stats_buffer` [roles, (amax, underflow count, saturation count, numel)], not persistent, filled only
    while `collect_fp8_stats` is on; `fp8_stats_roles` names the rows."""

    fp8_stats_roles: tuple[str, ...] = ()

    def _register_fp8_stats(self, device: Any) -> None:
        self.register_buffer("fp8_stats_buffer", torch.zeros(len(self.fp8_stats_roles), 4, device=device),
                             persistent=False)
        self.collect_fp8_stats = False
        self._stats_epoch = 0

    def _record_stats(self, role: int, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, numel: int) -> None:
        self._add_stats(role, quant_stats(x, q, scale, q.dtype, numel))

    def _add_stats(self, role: int, s: torch.Tensor) -> None:
        """Merge one cast's [amax, underflow, saturation, numel] into this window's statistics of `role`."""
        buf = self.fp8_stats_buffer[role]
        buf.copy_(torch.cat([torch.maximum(buf[:1], s[:1]), buf[1:] + s[1:]]))


class Float8Linear(FP8Telemetry, DelayedScalingState, nn.Linear):
    """nn.Linear with FP8 GEMMs under `fp8_autocast(enabled=True)`; a plain linear outside it.

    Same parameters (`weight` [out, in], `bias` [out] or None) and state_dict keys as nn.Linear,
    plus, for DelayedScaling, the persistent buffers `fp8_amax_history` [history_len, 3] and
    `fp8_scale` [3] (fp32; columns: input, weight, grad) and `fp8_initialized` (bool).

    recipe: DelayedScaling (default), Float8CurrentScaling or Float8RowwiseScaling.
    fp8_wgrad: False runs the weight-gradient GEMM in the compute dtype (BF16), saving the input
        in that dtype (twice the memory of its FP8 copy).
    cache_weight: keep the FP8 weight between micro-batches of a step (off when the weight is
        gathered per use, e.g. under FSDP, to not hold unsharded copies).
    fprop_fast_accum / backward_fast_accum: `use_fast_accum` of the CUDA GEMMs (torchao's choice:
        fast forward, precise backward).

    Input x [..., in] (any float dtype) -> [..., out] in the compute dtype (the autocast dtype, else
    x's dtype). Delayed scaling records amaxes only in training mode; `fp8_step` turns them into
    scales once per optimizer step.
    """

    fp8_bwd_roles = (GRAD,)  # the roles in the recipe's backward format (fp8_step's scale update)
    fp8_stats_roles = ROLES

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: Any = None,
                 dtype: torch.dtype | None = None, *, recipe: Recipe | None = None, fp8_wgrad: bool = True,
                 cache_weight: bool = True, fprop_fast_accum: bool = True, backward_fast_accum: bool = False):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._init_fp8(recipe, fp8_wgrad=fp8_wgrad, cache_weight=cache_weight, fprop_fast_accum=fprop_fast_accum,
                       backward_fast_accum=backward_fast_accum)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Recipe | None = None, **kwargs: Any) -> Float8Linear:
        """A Float8Linear sharing `linear`'s weight and bias Parameter objects (no copy)."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                  recipe=recipe, **kwargs)
        new.weight = linear.weight
        new.bias = linear.bias
        new._init_fp8(new.recipe, **{k: getattr(new, k) for k in
                                     ("fp8_wgrad", "cache_weight", "fprop_fast_accum", "backward_fast_accum")})
        new.train(linear.training)
        return new

    def _init_fp8(self, recipe: Recipe | None, *, fp8_wgrad: bool, cache_weight: bool, fprop_fast_accum: bool,
                  backward_fast_accum: bool) -> None:
        self.recipe = check_recipe(recipe if recipe is not None else DelayedScaling())
        self.fp8_wgrad, self.cache_weight = bool(fp8_wgrad), bool(cache_weight)
        self.fprop_fast_accum, self.backward_fast_accum = bool(fprop_fast_accum), bool(backward_fast_accum)
        dev = self.weight.device
        self._register_fp8_state(self.recipe, 3, dev)
        self._register_fp8_stats(dev)
        self._wcache: _Fp8Weight | None = None
        # set while a CUDA graph is captured (or emulated) reading the cache as it is (fp8.graph_weights)
        self._weights_frozen = False
        self.num_weight_casts = 0  # how many times the FP8 weight was made (tests, debugging)
        # current scaling: max |weight| kept by whoever writes the weight (fp8.weight_amax.KeptAmax), or None:
        # each weight cast computes it
        self.weight_amax: KeptAmax | None = None

    # ------------------------------------------------------------------ state
    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}, fp8_wgrad={self.fp8_wgrad}"

    def _apply(self, fn: Any, recurse: bool = True) -> Float8Linear:
        # moved or cast, the weight is another tensor, which no optimizer keeps an amax of (fp8.weight_amax)
        self.weight_amax = None
        # the FP8 metadata stays fp32 whatever dtype the parameters are cast to
        return apply_keeping_dtypes(self, fn, ("fp8_amax_history", "fp8_scale", "fp8_stats_buffer"), recurse)

    def invalidate_fp8_weight_cache(self) -> None:
        """Drop the cached FP8 weight; the next forward casts the weight again."""
        self._wcache = None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self._wcache = None
        self.refresh_weight_amax()

    def refresh_weight_amax(self) -> None:
        """Set `weight_amax` (when attached) to max |weight| now."""
        if self.weight_amax is not None:
            self.weight_amax.refresh(self._local_params()[0])

    def kept_weight_amax(self) -> torch.Tensor | None:
        """max |weight| as kept by its writer (fp8.weight_amax), or None: the cast computes it."""
        return self.weight_amax.of(self._local_params()[0]) if self.weight_amax is not None else None

    def _local_params(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, bias) as this rank computes with them: the local shards when tensor parallelism made
        them DTensors (its style hands this layer local inputs: megadlms.distributed.tensor_parallel)."""
        dtensor = sys.modules.get("torch.distributed.tensor")  # not loaded: no DTensor exists (and no import cost)
        if dtensor is None or not isinstance(self.weight, dtensor.DTensor):
            return self.weight, self.bias
        return self.weight.to_local(), self.bias.to_local() if self.bias is not None else None

    # ------------------------------------------------------------------ casts
    def _cast_qt(self, x: torch.Tensor, role: int, fp8_dtype: torch.dtype, record: bool, numel: int,
                 want_q: bool = True, want_t: bool = False, scale_inv: torch.Tensor | None = None,
                 amax: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """Per-tensor cast of x with this layer's recipe: q and/or the transposed FP8 copy, both made from x in
        one pass (`fused.cast_fp8`); with delayed scaling and `record`, x's amax goes into the history slot.
        amax: max |x| when it is known (a weight's kept amax). Returns (q [R, C] or None, scale_inv [] fp32,
        q^T [C, R] contiguous or None)."""
        delayed = isinstance(self.recipe, DelayedScaling)
        scale = self.fp8_scale[role] if delayed and self._is_ready() else None
        slot = self.fp8_amax_history[0, role] if delayed and record else None
        q, t, scale_inv, _ = cast_fp8(x, scale, slot, fp8_dtype, self.recipe.margin, want_q, want_t, amax=amax,
                                      scale_inv=scale_inv if scale is not None else None)
        if self.collect_fp8_stats:  # telemetry compares x with what the cast made (q, or q^T transposed back)
            self._record_stats(role, x, q if q is not None else t.t(), scale_inv.reciprocal(), numel)
        return q, scale_inv, t

    def _cast_rowwise(self, x: torch.Tensor, role: int, fp8_dtype: torch.dtype, dim: int, numel: int,
                      stats: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Rowwise (dim=1, scale_inv [R, 1]) or columnwise (dim=0, [1, C]) current cast of a 2-D x."""
        q, scale_inv, _ = quantize_rowwise(x, fp8_dtype, dim, self.recipe.margin)
        if stats and self.collect_fp8_stats:
            self._record_stats(role, x, q, scale_inv.reciprocal(), numel)
        return q, scale_inv

    def _fp8_weight(self, want_t: bool | None = None) -> _Fp8Weight:
        """The FP8 weight for this step: cast on the first micro-batch after the weight changed.

        want_t: whether a new cast also writes the transposed copy for the input gradient (None: when a backward
        follows and the cache keeps it for later micro-batches).

        A change is detected by the weight's version counter, storage and dtype (an optimizer's
        in-place update bumps the version); `fp8_step` also drops the cache explicitly, which covers
        updates that leave the counter alone (fused optimizers, writes through `.data`).
        """
        if self._weights_frozen and self._wcache is not None:
            return self._wcache  # recast outside the graph, into this cache's tensors (fp8.graph_weights)
        w = self._local_params()[0]
        # torch.compile cannot trace data-pointer comparisons: compiled code relies on the explicit
        # invalidation alone (fp8_step, load_state_dict)
        key = None if torch.compiler.is_compiling() else (w._version, w.data_ptr(), w.dtype, w.device)
        cache = self._wcache
        if cache is None or (key is not None and cache.key != key):
            n, k = w.shape
            wp = pad_2d(w.detach(), round_up16(n), round_up16(k))
            fwd = self.recipe.fp8_format.fwd_dtype
            if isinstance(self.recipe, Float8RowwiseScaling):
                q, scale_inv = self._cast_rowwise(wp, WEIGHT, fwd, dim=1, numel=w.numel(), stats=False)
                scale_inv = scale_inv.reshape(1, -1)  # [Np, 1] -> [1, Np]: scale_b of x @ W^T
                wt = None
                scale_invs = None
            else:
                # the transposed copy for the input gradient: made with q in one pass when the cache keeps it for
                # later micro-batches; without the cache, transposed from q in the backward (not held from the
                # forward to the backward: 1 byte per weight less at the end of the forward)
                if want_t is None:
                    want_t = (getattr(self, "_grad_follows", torch.is_grad_enabled()) and w.requires_grad
                              and self.cache_weight)
                delayed_ready = isinstance(self.recipe, DelayedScaling) and self._is_ready()
                scale_invs = aligned_scalars(self.fp8_scale.reciprocal())[:, 0] if delayed_ready else None
                q, scale_inv, wt = self._cast_qt(wp, WEIGHT, fwd, record=self.training, numel=w.numel(),
                                                 want_t=want_t, scale_inv=scale_invs[WEIGHT] if delayed_ready else None,
                                                 amax=self.kept_weight_amax())
            cache = _Fp8Weight(key, q, scale_inv, scale_invs)
            if wt is not None:  # the column-major operand of the input-gradient GEMM
                cache.dgrad = (wt.t(), scale_inv)
            if self.collect_fp8_stats:
                cache.stats_epoch = self._stats_epoch  # recorded by the cast (tensorwise)
            self.num_weight_casts += 1
            if self.cache_weight:
                self._wcache = cache
        if self.collect_fp8_stats and cache.stats_epoch != self._stats_epoch:
            si = cache.scale_inv
            scale = (si.reshape(-1, 1) if si.dim() else si).reciprocal()  # rowwise [1, Np]: one per row of W
            self._record_stats(WEIGHT, pad_2d(w.detach(), *cache.q.shape), cache.q, scale, w.numel())
            cache.stats_epoch = self._stats_epoch
        return cache

    def _fp8_weight_dgrad(self, cache: _Fp8Weight) -> tuple[torch.Tensor, torch.Tensor]:
        """W as the column-major [Np, Kp] right operand of dx = g @ W, with its scale_inv."""
        if cache.dgrad is not None:
            return cache.dgrad
        if isinstance(self.recipe, Float8RowwiseScaling):
            # dgrad contracts over W's rows: re-quantize from the master weight, one scale per column
            w = self._local_params()[0].detach()
            wp = pad_2d(w, *cache.q.shape)
            q, scale_inv, _ = quantize_rowwise(wp, self.recipe.fp8_format.fwd_dtype, 0, self.recipe.margin)
            dgrad = (q.t().contiguous().t(), scale_inv)
        else:
            dgrad = (transpose_fp8(cache.q).t(), cache.scale_inv)
        if cache.keep_dgrad:
            cache.dgrad = dgrad
        return dgrad

    # ------------------------------------------------------------------ forward
    # Outside torch.compile's graphs: a compiled model breaks its graph here and runs this layer
    # eagerly (its per-step weight cache and scale bookkeeping are Python state), while the FP8
    # casts inside are compiled functions (`fused.cast_fp8`) and the GEMMs cuBLASLt calls.
    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self._local_params()
        if not FP8GlobalStateManager.is_fp8_enabled() or x.numel() == 0:
            return F.linear(x, weight, bias)
        explicit = FP8GlobalStateManager.get_explicit_recipe()
        if explicit is not None and explicit != self.recipe:
            raise ValueError(f"Float8Linear was converted with {self.recipe} but runs under fp8_autocast with "
                             f"{explicit}; convert the model with the recipe you run it with "
                             "(convert_to_fp8(model, recipe)) or run it under its own recipe")
        n, k = weight.shape  # the local shard's under tensor parallelism
        if x.shape[-1] != k:
            raise ValueError(f"Float8Linear expects input [..., {k}], got {tuple(x.shape)}")
        if x.device.type == "cuda":
            _check_device_once(x.device)
        x2 = x.reshape(-1, k).contiguous()
        # whether a backward can follow (grad mode is off inside autograd.Function.forward): then the
        # casts also write the transposed FP8 copies the backward GEMMs take
        self._grad_follows = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        y = _Float8LinearFn.apply(x2, weight, bias, self, compute_dtype(x))
        return y.reshape(*x.shape[:-1], n)


class _Float8LinearFn(torch.autograd.Function):
    """x [M, K], weight [N, K], bias [N] | None -> y [M, N] with FP8 GEMMs (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: Float8Linear,
                out_dtype: torch.dtype) -> torch.Tensor:
        recipe = layer.recipe
        fwd = recipe.fp8_format.fwd_dtype
        rowwise = isinstance(recipe, Float8RowwiseScaling)
        m, k = x.shape
        n = weight.shape[0]
        mp, kp = round_up16(m), round_up16(k)
        xp = pad_2d(x, mp, kp)
        w = layer._fp8_weight()
        if rowwise:
            xq, x_si = layer._cast_rowwise(xp, INPUT, fwd, dim=1, numel=m * k)
        else:
            # with an FP8 weight gradient ahead, the same cast also makes x^T (K-major over tokens) for it
            want_t = ctx.needs_input_grad[1] and layer.fp8_wgrad
            xq, x_si, xt = layer._cast_qt(xp, INPUT, fwd, record=layer.training, numel=m * k, want_t=want_t,
                                          scale_inv=w.scale_inv_of(INPUT))
        y = scaled_mm(xq, w.q.t(), x_si, w.scale_inv, out_dtype, layer.fprop_fast_accum)
        y = y[:m, :n]
        if bias is not None:
            y = y + bias.to(out_dtype)

        x_saved = x_saved_si = None
        if ctx.needs_input_grad[1]:
            if not layer.fp8_wgrad:
                x_saved = x.to(out_dtype)  # the BF16 weight gradient needs the unquantized input
            elif rowwise:
                # wgrad contracts over tokens: one scale per input feature, cast from x (not from xq)
                x_saved, x_saved_si, _ = quantize_rowwise(xp, fwd, 0, recipe.margin)
            else:  # [Mp, Kp] with the values of xq, stored column-major: the wgrad GEMM's right operand
                x_saved, x_saved_si = xt.t(), x_si
        ctx.save_for_backward(x_saved, x_saved_si)
        ctx.layer, ctx.wcache, ctx.fp8_wgrad = layer, w, layer.fp8_wgrad
        ctx.keep_weights = layer.cache_weight
        ctx.dims = (m, k, n)
        ctx.x_dtype, ctx.w_dtype, ctx.out_dtype = x.dtype, weight.dtype, out_dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        layer: Float8Linear = ctx.layer
        recipe = layer.recipe
        bwd = recipe.fp8_format.bwd_dtype
        rowwise = isinstance(recipe, Float8RowwiseScaling)
        x_saved, x_saved_si = ctx.saved_tensors
        (wcache,) = take_fp8_weights(ctx, "wcache")
        m, k, n = ctx.dims
        mp, np_ = round_up16(m), round_up16(n)
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        fp8_wgrad = need_dw and ctx.fp8_wgrad
        g = g.contiguous()
        gp = pad_2d(g, mp, np_)
        dx = dw = db = None

        if rowwise:
            if need_dx:
                gq, g_si = layer._cast_rowwise(gp, GRAD, bwd, dim=1, numel=m * n)
                wq, w_si = layer._fp8_weight_dgrad(wcache)
                dx = scaled_mm(gq, wq, g_si, w_si, ctx.x_dtype, layer.backward_fast_accum)
            if fp8_wgrad:
                # one scale per output feature (column of g), taken from g itself
                gcq, gc_si = layer._cast_rowwise(gp, GRAD, bwd, dim=0, numel=m * n, stats=not need_dx)
                dw = scaled_mm(gcq.t().contiguous(), x_saved.t().contiguous().t(), gc_si.reshape(-1, 1),
                               x_saved_si, ctx.w_dtype, layer.backward_fast_accum)
        elif need_dx or fp8_wgrad:
            # from g at once: gq for the input gradient, g^T (K-major over tokens) for the weight gradient
            gq, g_si, gt = layer._cast_qt(gp, GRAD, bwd, record=True, numel=m * n, want_q=need_dx, want_t=fp8_wgrad,
                                          scale_inv=wcache.scale_inv_of(GRAD))
            if need_dx:
                wq, w_si = layer._fp8_weight_dgrad(wcache)
                dx = scaled_mm(gq, wq, g_si, w_si, ctx.x_dtype, layer.backward_fast_accum)
            if fp8_wgrad:
                dw = scaled_mm(gt, x_saved, g_si, x_saved_si, ctx.w_dtype,
                               layer.backward_fast_accum)

        if need_dw and not ctx.fp8_wgrad:
            dw = (g.to(ctx.out_dtype).t() @ x_saved).to(ctx.w_dtype)
        if dx is not None:
            dx = dx[:m, :k]
        if dw is not None:
            dw = dw[:n, :k]
        if need_db:
            db = g.float().sum(0).to(ctx.bias_dtype)
        return dx, dw, db, None, None
