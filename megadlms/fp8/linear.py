"""`Float8Linear`: an `nn.Linear` whose three GEMMs run in FP8 inside an enabled `fp8_autocast`.

fprop:  y  = x @ W^T      E4M3 x E4M3
dgrad:  dx = g @ W        g in E5M2 (HYBRID) or E4M3, W in E4M3
wgrad:  dW = g^T @ x      g as above, x in E4M3 (or in BF16 with fp8_wgrad=False)

The layer's three quantizers (input, weight, grad: `quantizer.py`, one kind per recipe) make the FP8
operands, each as itself (`rows`) and/or transposed (`cols`); `gemm.fp8_gemm` runs the three GEMMs
(fp32 accumulation): fprop(x.rows, W.rows), dgrad(g.rows, W.cols), wgrad(g.cols, x.cols). Token counts
(and feature dims) that are not multiples of 16 are zero-padded inside the layer and the results
sliced, so any batch shape works. The gradient is always the left operand, which keeps E5M2 x E4M3
within what the CUDA kernels accept. Nothing here depends on the recipe: a new recipe is a new
quantizer kind (and its GEMM call in gemm.py).

What is saved for backward: the FP8 copy of the input (1 byte/element) and the FP8 weight, which
is shared with the per-step weight cache. Without that cache (`cache_weight=False`) the FP8 weight is
freed when the layer's backward returns, and its transpose for the input gradient is made in the
backward rather than kept from the forward. With fp8_wgrad=False the input is saved in the compute
dtype instead (2 bytes/element in BF16): that is the price of a weight gradient that is exactly
the BF16 GEMM of the unquantized tensors.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..model import compute_dtype
from .gemm import Operand, aligned_scalars, bias_grad, dequant_scale, fp8_gemm, wgrad_high_precision
from .hardware import check_fp8_support
from .param_gather import gathered_fp8
from .quantize import pad_2d, quant_stats, round_up16
from .quantizer import FP8Tensor, make_quantizer
from .recipe import DelayedScaling, Recipe, check_recipe
from .state import FP8GlobalStateManager

ROLES = ("input", "weight", "grad")
INPUT, WEIGHT, GRAD = 0, 1, 2

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

    from .kept_amax import KeptAmax

    _ModuleMixin = nn.Module  # the mixins below are mixed into nn.Modules: the checker sees their methods
else:
    _ModuleMixin = object

M = TypeVar("M", bound=nn.Module)

_checked_devices: set[int] = set()


def check_device_once(device: torch.device) -> None:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _checked_devices:
        check_fp8_support(torch.device("cuda", index))
        _checked_devices.add(index)


def apply_keeping_dtypes(module: M, fn: Any, names: tuple[str, ...], recurse: bool = True) -> M:
    """`nn.Module._apply` that lets `fn` move the buffers `names` to another device but not change
    their dtype (`model.to(torch.bfloat16)` must not turn FP8 scales into BF16 or FP8 weights into BF16)."""
    kept = {n: t for n in names if (t := module._buffers.get(n)) is not None}
    for n in kept:
        del module._buffers[n]
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


class FP8WeightCache:
    """The FP8 copies of one weight for one optimizer step (reused by every micro-batch of the step).

    q [Np, Kp] row-major with scale_inv (0-dim, or [Np, 1] rowwise): the fprop operand (`rows`); `dgrad`: W^T
    [Kp, Np] with its scale_inv, the dgrad operand (`gemm.Operand`), made on first use unless the cast made it.
    """

    __slots__ = ("key", "q", "scale_inv", "dgrad", "stats_epoch", "scale_invs", "keep_dgrad")

    def __init__(self, key: tuple | None, q: torch.Tensor, scale_inv: torch.Tensor,
                 scale_invs: torch.Tensor | None = None):
        self.key, self.q, self.scale_inv = key, q, scale_inv
        self.dgrad: Operand | None = None
        self.stats_epoch = -1
        # delayed scaling: 1 / fp8_scale [3] of this step, for the input and gradient casts of every micro-batch
        self.scale_invs = scale_invs
        # whether a dgrad copy the backward makes is kept for later micro-batches; False for the caches CUDA graphs
        # read (fp8.graph_weights), which hold q only
        self.keep_dgrad = True

    @property
    def rows(self) -> Operand:
        """q with its scale_inv: the fprop GEMM's operand."""
        return Operand(self.q, self.scale_inv)

    def scale_inv_of(self, role: int) -> torch.Tensor | None:
        return self.scale_invs[role] if self.scale_invs is not None else None


class DelayedScalingState(_ModuleMixin):
    """Mixin for FP8 modules with delayed-scaling state, one column per tensor role: the persistent fp32 buffers
    `fp8_amax_history` [history_len, roles] and `fp8_scale` [roles] and the bool `fp8_initialized` (None for other
    recipes), and a host mirror of `fp8_initialized` that is read once after a load (no sync per use)."""

    fp8_amax_history: torch.Tensor | None
    fp8_scale: torch.Tensor | None
    fp8_initialized: torch.Tensor | None

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

    def scales_ready(self) -> bool:
        """Whether delayed scales exist (a `fp8_step` has run). Reads the buffer once after a load."""
        if self._ready is None:
            self._ready = bool(self.fp8_initialized)
        return self._ready

    def step_scale_invs(self) -> torch.Tensor | None:
        """Delayed scaling once scales exist: 1 / fp8_scale [roles], each entry a 16-byte aligned 0-dim view (a
        GEMM scale without a copy), computed once per step with the FP8 weight; else None."""
        if self.fp8_scale is None or not self.scales_ready():
            return None
        return aligned_scalars(self.fp8_scale.reciprocal())[:, 0]

    def mark_scales_ready(self) -> None:
        """Scales exist from now on (`fp8_step` wrote them)."""
        if not self.scales_ready():
            assert self.fp8_initialized is not None  # delayed scaling
            self.fp8_initialized.fill_(True)
        self._ready = True


class FP8Telemetry(_ModuleMixin):
    """Mixin for FP8 modules that can record the statistics of their casts (`monitor.enable_fp8_stats`): the fp32
    buffer `fp8_stats_buffer` [roles, (amax, underflow count, saturation count, numel)], not persistent, filled only
    while `collect_fp8_stats` is on (`stats_epoch` counts the statistics windows); `fp8_stats_roles` names the rows."""

    fp8_stats_roles: tuple[str, ...] = ()
    fp8_stats_buffer: torch.Tensor

    def _register_fp8_stats(self, device: Any) -> None:
        self.register_buffer("fp8_stats_buffer", torch.zeros(len(self.fp8_stats_roles), 4, device=device),
                             persistent=False)
        self.collect_fp8_stats = False
        self.stats_epoch = 0

    def record_stats(self, role: int, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, numel: int) -> None:
        """Merge the statistics of one cast (x -> q with `scale`, `numel` elements without padding) into `role`'s."""
        self.add_stats(role, quant_stats(x, q, scale, q.dtype, numel))

    def record_cast(self, role: int, x: torch.Tensor, t: FP8Tensor, numel: int) -> None:
        """`record_stats` of x against whichever FP8 copy `t` holds."""
        q, si = t.any_copy()  # padded further than x by the blockwise (128) and MX (32) casts
        self.record_stats(role, pad_2d(x, *q.shape), q, si.reciprocal(), numel)

    def add_stats(self, role: int, s: torch.Tensor) -> None:
        """Merge one cast's [amax, underflow, saturation, numel] into this window's statistics of `role`."""
        buf = self.fp8_stats_buffer[role]
        buf.copy_(torch.cat([torch.maximum(buf[:1], s[:1]), buf[1:] + s[1:]]))


class Float8Linear(FP8Telemetry, DelayedScalingState, nn.Linear):
    """nn.Linear with FP8 GEMMs under `fp8_autocast(enabled=True)`; a plain linear outside it.

    Same parameters (`weight` [out, in], `bias` [out] or None) and state_dict keys as nn.Linear,
    plus, for DelayedScaling, the persistent buffers `fp8_amax_history` [history_len, 3] and
    `fp8_scale` [3] (fp32; columns: input, weight, grad) and `fp8_initialized` (bool).

    recipe: DelayedScaling (default), Float8CurrentScaling, Float8RowwiseScaling, Float8BlockwiseScaling or
        Float8MXScaling; it picks the kind of the
        three quantizers `quantizers` (input, weight, grad: `quantizer.make_quantizer`).
    fp8_wgrad: False runs the weight-gradient GEMM in the compute dtype (BF16), saving the input
        in that dtype (twice the memory of its FP8 copy).
    cache_weight: keep the FP8 weight between micro-batches of a step (`weight_cache`; off when the weight is
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
        fmt = self.recipe.fp8_format
        self.quantizers = tuple(make_quantizer(self.recipe, fmt.bwd_dtype if role == GRAD else fmt.fwd_dtype, self,
                                               role) for role in (INPUT, WEIGHT, GRAD))
        self.weight_cache: FP8WeightCache | None = None
        # set while a CUDA graph is captured (or emulated) reading `weight_cache` as it is (fp8.graph_weights)
        self.weights_frozen = False
        self.num_weight_casts = 0  # how many times the FP8 weight was made (tests, debugging)
        # current scaling: max |weight| kept by whoever writes the weight (fp8.kept_amax.KeptAmax), or None:
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
        self.weight_cache = None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self.weight_cache = None
        self.refresh_weight_amax()

    def refresh_weight_amax(self) -> None:
        """Set `weight_amax` (when attached) to max |weight| now."""
        if self.weight_amax is not None:
            self.weight_amax.refresh(self.local_params()[0])

    def kept_weight_amax(self) -> torch.Tensor | None:
        """max |weight| as kept by its writer (fp8.weight_amax), or None: the cast computes it."""
        return self.weight_amax.of(self.local_params()[0]) if self.weight_amax is not None else None

    def local_params(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, bias) as this rank computes with them: the local shards when tensor parallelism made
        them DTensors (its style hands this layer local inputs: megadlms.distributed.tensor_parallel)."""
        dtensor = sys.modules.get("torch.distributed.tensor")  # not loaded: no DTensor exists (and no import cost)
        if dtensor is None or not isinstance(self.weight, dtensor.DTensor):
            return self.weight, self.bias
        weight, bias = cast("DTensor", self.weight), cast("DTensor | None", self.bias)
        return weight.to_local(), bias.to_local() if bias is not None else None

    def weight_key(self) -> tuple | None:
        """What identifies the weight's current values: its version counter, storage and dtype (an optimizer's
        in-place update bumps the version). None under torch.compile, which cannot trace data-pointer comparisons:
        compiled code relies on the explicit invalidation alone (fp8_step, load_state_dict)."""
        w = self.local_params()[0]
        return None if torch.compiler.is_compiling() else (w._version, w.data_ptr(), w.dtype, w.device)

    # ------------------------------------------------------------------ casts
    def quantize(self, x: torch.Tensor, role: int, numel: int, rows: bool = True, cols: bool = False,
                 record: bool = True, scale_inv: torch.Tensor | None = None, stats: bool = True) -> FP8Tensor:
        """x [R, C] (padded) cast by this layer's quantizer of `role`; telemetry records it when on."""
        t = self.quantizers[role].quantize(x, rows, cols, record, scale_inv=scale_inv)
        if stats and self.collect_fp8_stats:
            self.record_cast(role, x, t, numel)
        return t

    def fp8_weight(self, grad_follows: bool, want_t: bool | None = None) -> FP8WeightCache:
        """The FP8 weight for this step: cast on the first micro-batch after the weight changed (`weight_key`);
        `fp8_step` also drops the cache explicitly, which covers updates that leave the counter alone (fused
        optimizers, writes through `.data`). A weight FSDP2 gathered in FP8 (--fp8-param-gather) is used as it
        came, uncached: each gather brings the current weight (its cast's statistics are recorded by the gather).

        grad_follows: whether a backward can follow this forward. want_t: whether a new cast also writes the
        transposed copy for the input gradient in the same pass (None: when a backward follows and the cache keeps
        it for later micro-batches; without the cache it is made from q in the backward, not held from the forward
        to the backward).
        """
        if self.weights_frozen and self.weight_cache is not None:
            return self.weight_cache  # recast outside the graph, into this cache's tensors (fp8.graph_weights)
        w = self.local_params()[0]
        gathered = gathered_fp8(w)
        if gathered is not None:  # FSDP2 gathered it in FP8, cast as this layer casts (fp8.param_gather)
            return FP8WeightCache(None, *gathered, self.step_scale_invs())
        key = self.weight_key()
        cache = self.weight_cache
        if cache is None or (key is not None and cache.key != key):
            n, k = w.shape
            wp = pad_2d(w.detach(), round_up16(n), round_up16(k))
            quantizer = self.quantizers[WEIGHT]
            if want_t is None:
                want_t = grad_follows and w.requires_grad and self.cache_weight
            want_t = want_t and quantizer.cols_in_same_pass
            scale_invs = self.step_scale_invs()
            t = quantizer.quantize(wp, True, want_t, record=self.training, amax=self.kept_weight_amax(),
                                   scale_inv=scale_invs[WEIGHT] if scale_invs is not None else None)
            cache = FP8WeightCache(key, *t.row_copy(), scale_invs)
            cache.dgrad = t.cols  # the input-gradient GEMM's operand, when made in the same pass
            self.num_weight_casts += 1
            if self.cache_weight:
                self.weight_cache = cache
        if self.collect_fp8_stats and cache.stats_epoch != self.stats_epoch:
            self.record_stats(WEIGHT, pad_2d(w.detach(), *cache.q.shape), cache.q,
                              dequant_scale(cache.rows).reciprocal(), w.numel())
            cache.stats_epoch = self.stats_epoch
        return cache

    def fp8_weight_dgrad(self, cache: FP8WeightCache) -> Operand:
        """W^T [Kp, Np] with its scale_inv: the right operand of dx = g @ W (made from `cache` or, rowwise, cast
        again from the master weight), kept in the cache for later micro-batches when it may."""
        if cache.dgrad is not None:
            return cache.dgrad
        def master() -> torch.Tensor:
            return pad_2d(self.local_params()[0].detach(), *cache.q.shape)

        dgrad = self.quantizers[WEIGHT].cols_of(cache.rows, master)
        if cache.keep_dgrad:
            cache.dgrad = dgrad
        return dgrad

    # ------------------------------------------------------------------ forward
    # Outside torch.compile's graphs: a compiled model breaks its graph here and runs this layer
    # eagerly (its per-step weight cache and scale bookkeeping are Python state), while the FP8
    # casts inside are compiled functions (`kernels.cast_fp8`) and the GEMMs cuBLASLt calls.
    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.local_params()
        if not FP8GlobalStateManager.is_fp8_enabled() or x.numel() == 0:
            return F.linear(x, weight, bias)
        check_recipe_in_force(self.recipe, "Float8Linear")
        n, k = weight.shape  # the local shard's under tensor parallelism
        if x.shape[-1] != k:
            raise ValueError(f"Float8Linear expects input [..., {k}], got {tuple(x.shape)}")
        if x.device.type == "cuda":
            check_device_once(x.device)
        x2 = x.reshape(-1, k).contiguous()
        # whether a backward can follow (grad mode is off inside autograd.Function.forward): then the
        # casts also write the transposed FP8 copies the backward GEMMs take
        grad_follows = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        y = _Float8LinearFn.apply(x2, weight, bias, self, compute_dtype(x), grad_follows)
        return y.reshape(*x.shape[:-1], n)


def check_recipe_in_force(recipe: Recipe, what: str) -> None:
    """Raise unless the recipe of the enclosing `fp8_autocast` (when it names one) is `recipe`."""
    explicit = FP8GlobalStateManager.get_explicit_recipe()
    if explicit is not None and explicit != recipe:
        raise ValueError(f"{what} was converted with {recipe} but runs under fp8_autocast with "
                         f"{explicit}; convert the model with the recipe you run it with "
                         "(convert_to_fp8(model, recipe)) or run it under its own recipe")


class _Float8LinearFn(torch.autograd.Function):
    """x [M, K], weight [N, K], bias [N] | None -> y [M, N] with FP8 GEMMs (see the module docstring): the layer's
    three quantizers make the operands, `gemm` runs fprop, dgrad and wgrad."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: Float8Linear,
                out_dtype: torch.dtype, grad_follows: bool) -> torch.Tensor:
        m, k = x.shape
        n = weight.shape[0]
        xp = pad_2d(x, round_up16(m), round_up16(k))
        w = layer.fp8_weight(grad_follows)
        # with an FP8 weight gradient ahead, the input's cast also makes x^T (K-major over tokens) for it
        fp8_wgrad = ctx.needs_input_grad[1] and layer.fp8_wgrad
        xq = layer.quantize(xp, INPUT, m * k, cols=fp8_wgrad, record=layer.training, scale_inv=w.scale_inv_of(INPUT))
        y = fp8_gemm(xq.row_copy(), w.rows, out_dtype, layer.fprop_fast_accum)[:m, :n]
        if bias is not None:
            y = y + bias.to(out_dtype)
        x_saved = x_saved_si = None
        if ctx.needs_input_grad[1]:
            if fp8_wgrad:
                x_saved, x_saved_si = xq.col_copy()  # [Kp, Mp]: the wgrad GEMM's right operand
            else:
                x_saved = x.to(out_dtype)  # the BF16 weight gradient needs the unquantized input
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
        x_saved, x_saved_si = ctx.saved_tensors
        (wcache,) = take_fp8_weights(ctx, "wcache")
        m, k, n = ctx.dims
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        fp8_wgrad = need_dw and ctx.fp8_wgrad
        g = g.contiguous()
        dx = dw = db = None
        if need_dx or fp8_wgrad:
            # from g at once: g for the input gradient, g^T (K-major over tokens) for the weight gradient
            gq = layer.quantize(pad_2d(g, round_up16(m), round_up16(n)), GRAD, m * n, rows=need_dx, cols=fp8_wgrad,
                                scale_inv=wcache.scale_inv_of(GRAD))
            if need_dx:
                dx = fp8_gemm(gq.row_copy(), layer.fp8_weight_dgrad(wcache), ctx.x_dtype,
                              layer.backward_fast_accum)[:m, :k]
            if fp8_wgrad:
                dw = fp8_gemm(gq.col_copy(), Operand(x_saved, x_saved_si), ctx.w_dtype,
                              layer.backward_fast_accum)[:n, :k]
        if need_dw and not ctx.fp8_wgrad:
            dw = wgrad_high_precision(g, x_saved, ctx.out_dtype, ctx.w_dtype)
        if need_db:
            db = bias_grad(g, ctx.bias_dtype)
        return dx, dw, db, None, None, None
