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

The same autograd function runs a group of linears that read one input (`fused_linear.FusedFloat8Projection`:
q/k/v, gate/up) as one GEMM over their concatenated weights: it asks the module it runs for (`FP8Projection`)
for the step's FP8 weight and for the casts of the input and of the output gradient, and does the GEMMs
(`fprop`, `bprop`, which the fused MLP calls too), padding, slicing, biases and the weight-gradient choice itself.

What is saved for backward: the FP8 copy of the input (1 byte/element) and the FP8 weight, which
is shared with the per-step weight cache. Without that cache (`cache_weight=False`) the FP8 weight is
freed when the layer's backward returns, and its transpose for the input gradient is made in the
backward rather than kept from the forward. With fp8_wgrad=False the input is saved in the compute
dtype instead (2 bytes/element in BF16): that is the price of a weight gradient that is exactly
the BF16 GEMM of the unquantized tensors.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..model import compute_dtype
from .gemm import bias_grad, dequant_scale, fp8_gemm, wgrad_high_precision
from .hardware import check_fp8_support
from .integrations.param_gather import gathered_fp8
from .kernels.primitives import amax_to_scale, pad_2d, quant_stats, round_up16
from .quantizer import FP8Copies, Quantizer, StepScales, make_quantizer
from .recipe import DelayedScaling, Recipe, check_recipe, keeps_history
from .state import FP8GlobalStateManager, cast_from_forward, keep_for_recompute
from .tensor import FP8Tensor

ROLES = ("input", "weight", "grad")
INPUT, WEIGHT, GRAD = 0, 1, 2

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

    from .integrations.kept_amax import KeptAmax

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
    """The FP8 weight of one layer, or of a fused group's concatenated weights, for one optimizer step (reused by
    every micro-batch of the step), with what identifies it.

    rows: W [Np, Kp] (`FP8Tensor`), the fprop operand; `dgrad`: W^T [Kp, Np], the dgrad operand, made on first use
    unless the cast made it. key: the weight version it was cast from (`Float8Linear.weight_key`). step: delayed
    scaling's scales of this step (`StepScales`), for the input and gradient casts of every micro-batch; None before
    the first `fp8_step` and for other recipes. members: a group's per-member caches (views of rows' row blocks,
    which a member called on its own uses); () for one weight. recorded: whether the cast put the weight's amax into
    the delayed-scaling history (False for a cast in eval mode, which a training forward then does not reuse: an eval
    forward before the step's first training forward, e.g. an RL rollout, would otherwise leave the weight's amax
    unrecorded and its scale stale).
    """

    __slots__ = ("key", "rows", "dgrad", "stats_epoch", "step", "keep_dgrad", "members", "recorded")

    def __init__(self, key: Any, rows: FP8Tensor, step: StepScales | None = None,
                 members: tuple[FP8WeightCache, ...] = ()):
        self.key, self.rows, self.step, self.members = key, rows, step, members
        self.dgrad: FP8Tensor | None = None
        self.stats_epoch = -1
        # whether a dgrad copy the backward makes is kept for later micro-batches; False for the caches CUDA graphs
        # read (fp8.integrations.graph_weights), which hold rows only
        self.keep_dgrad = True
        self.recorded = True


class DelayedScalingState(_ModuleMixin):
    """Mixin for FP8 modules with delayed-scaling state, one column per tensor role: the persistent fp32 buffers
    `fp8_amax_history` [history_len, roles] and `fp8_scale` [roles] and the bool `fp8_initialized` (None for other
    recipes), and a host mirror of `fp8_initialized` that is read once after a load (no sync per use)."""

    fp8_amax_history: torch.Tensor | None
    fp8_scale: torch.Tensor | None
    fp8_initialized: torch.Tensor | None
    fp8_bwd_roles: tuple[int, ...] = ()  # the roles in the recipe's backward format (the scale update's maxima)

    def _register_fp8_state(self, recipe: Recipe, roles: int, device: Any) -> None:
        if keeps_history(recipe):
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

    def step_scales(self) -> StepScales | None:
        """Delayed scaling once scales exist: this step's scales and their inverses (`StepScales`), computed once
        per step with the FP8 weight; else None."""
        if self.fp8_scale is None or not self.scales_ready():
            return None
        return StepScales(self.fp8_scale)

    def mark_scales_ready(self) -> None:
        """Scales exist from now on (`update_scales` wrote them)."""
        if not self.scales_ready():
            assert self.fp8_initialized is not None  # delayed scaling
            self.fp8_initialized.fill_(True)
        self._ready = True

    def delayed_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(amax history [L, roles], scales [roles]) of a module with delayed scaling."""
        assert self.fp8_amax_history is not None and self.fp8_scale is not None, "delayed scaling keeps both"
        return self.fp8_amax_history, self.fp8_scale

    def save_scaling_state(self) -> list[torch.Tensor]:
        """Copies of the delayed-scaling buffers (none for other recipes), for `restore_scaling_state`."""
        return [b.clone() for b in self._scaling_buffers()]

    def restore_scaling_state(self, saved: list[torch.Tensor]) -> None:
        """The delayed-scaling buffers back to `saved` (`save_scaling_state`), e.g. after a CUDA-graph warm-up
        recorded the amaxes of sample inputs."""
        for b, s in zip(self._scaling_buffers(), saved):
            b.copy_(s)

    def _scaling_buffers(self) -> list[torch.Tensor]:
        return [b for b in (self.fp8_amax_history, self.fp8_scale, self.fp8_initialized) if b is not None]

    @staticmethod
    def update_scales(recipe: DelayedScaling, modules: Sequence[DelayedScalingState]) -> None:
        """New scales from the histories of `modules`, then each history rolled (slot 0 = the new step, zeroed):
        the one writer of the scales (`fp8_step` calls it once per kind of module). The modules share one type (the
        same roles): each role's scale uses the forward or the backward format's maximum.

        Tensor ops on stacked buffers: a fixed number of kernels whatever the layer count, no sync."""
        states = [m.delayed_state() for m in modules]
        hists, scales = [h for h, _ in states], [s for _, s in states]
        # a non-finite amax (a diverging step, skipped by the optimizer) is not kept: 0 leaves that scale as it was
        h = torch.nan_to_num(torch.stack(hists), nan=0.0, posinf=0.0, neginf=0.0)  # [n, L, roles]
        amax = h[:, 0] if recipe.amax_compute_algo == "most_recent" else h.amax(dim=1)  # [n, roles]
        old = torch.stack(scales)  # [n, roles]
        fmax = _role_maxima(recipe.fp8_format, h.shape[2], modules[0].fp8_bwd_roles, h.device)
        new = amax_to_scale(amax, fmax, recipe.margin, old)
        rolled = torch.roll(h, 1, dims=1)
        rolled[:, 0] = 0
        torch._foreach_copy_(hists, list(rolled.unbind(0)))
        torch._foreach_copy_(scales, list(new.unbind(0)))
        for m in modules:
            m.mark_scales_ready()


_ROLE_MAXIMA: dict[tuple, torch.Tensor] = {}


def _role_maxima(fmt: Any, roles: int, bwd_roles: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """[roles] fp32: each role's FP8 maximum (the backward format's for `bwd_roles`). Made once per kind of module
    and device: a tensor made from host data is a host-to-device copy, which on CUDA waits for the stream."""
    key = (fmt, roles, tuple(bwd_roles), device)
    t = _ROLE_MAXIMA.get(key)
    if t is None:
        t = _ROLE_MAXIMA[key] = torch.tensor([fmt.max_bwd if r in bwd_roles else fmt.max_fwd for r in range(roles)],
                                             dtype=torch.float32, device=device)
    return t


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

    def record_cast(self, role: int, x: torch.Tensor, t: FP8Copies, numel: int) -> None:
        """`record_stats` of x against whichever FP8 copy `t` holds."""
        q, si = t.any_copy()  # padded further than x by the blockwise (128) and MX (32) casts
        self.record_stats(role, pad_2d(x, *q.shape), q, si.reciprocal(), numel)

    def add_stats(self, role: int, s: torch.Tensor) -> None:
        """Merge one cast's [amax, underflow, saturation, numel] into this window's statistics of `role`."""
        buf = self.fp8_stats_buffer[role]
        buf.copy_(torch.cat([torch.maximum(buf[:1], s[:1]), buf[1:] + s[1:]]))

    def set_collect_fp8_stats(self, enabled: bool) -> None:
        """Record the statistics of this module's casts from now on (or stop)."""
        self.collect_fp8_stats = bool(enabled)

    def new_stats_window(self) -> None:
        """Zero the statistics and start a new window (the weight's cast is recorded again, once, in it)."""
        self.fp8_stats_buffer.zero_()
        self.stats_epoch += 1


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
        # set while a CUDA graph is captured (or emulated) reading `weight_cache` as it is (integrations.graph_weights)
        self.weights_frozen = False
        self.num_weight_casts = 0  # how many times the FP8 weight was made (tests, debugging)
        # current scaling: max |weight| kept by whoever writes the weight (integrations.kept_amax.KeptAmax), or None:
        # each weight cast computes it
        self.weight_amax: KeptAmax | None = None

    # ------------------------------------------------------------------ state
    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}, fp8_wgrad={self.fp8_wgrad}"

    def _apply(self, fn: Any, recurse: bool = True) -> Float8Linear:
        # moved or cast, the weight is another tensor, which no optimizer keeps an amax of (integrations.weight_amax)
        self.weight_amax = None
        # the FP8 metadata stays fp32 whatever dtype the parameters are cast to
        return apply_keeping_dtypes(self, fn, ("fp8_amax_history", "fp8_scale", "fp8_stats_buffer"), recurse)

    # The per-step state of the layer (its FP8 weight cache, its caching and freezing switches, its kept weight
    # amax) is written here only: conversion, fused groups, CUDA-graph weights and the optimizer's amaxes call these.
    def invalidate_fp8_weight_cache(self) -> None:
        """Drop the cached FP8 weight; the next forward casts the weight again."""
        self.weight_cache = None

    def set_cache_weight(self, enabled: bool) -> None:
        """Keep the FP8 weight for the step's later micro-batches (or not); the cache held now is dropped."""
        self.cache_weight = bool(enabled)
        self.weight_cache = None

    def keep_group_cast(self, cache: FP8WeightCache) -> None:
        """A cast of this layer's weight that its fused group made (`cache`: its rows of the group's FP8 weight):
        counted as this layer's cast and kept as its cache when it caches."""
        self.num_weight_casts += 1
        if self.cache_weight:
            self.weight_cache = cache

    def restore_weight_cache(self, cache: FP8WeightCache) -> None:
        """`cache` (a captured one, just recast in place: `graph_weights.StepFP8Weights`) is the current FP8 weight."""
        self.weight_cache = cache

    def freeze_weights(self, frozen: bool) -> None:
        """Frozen, the forward uses the cached FP8 weight as it is, without a version check or a cast (a CUDA graph
        captured reading it; `graph_weights.StepFP8Weights` recasts into it)."""
        self.weights_frozen = bool(frozen)

    def keep_weight_amax(self, kept: KeptAmax | None) -> None:
        """max |weight| from now on kept by the weight's writer (`weight_amax.attach_weight_amaxes`), or None: each
        weight cast computes it."""
        self.weight_amax = kept

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
        """max |weight| as kept by its writer (fp8.integrations.weight_amax), or None: the cast computes it."""
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
                 record: bool = True, step: StepScales | None = None, stats: bool = True) -> FP8Copies:
        """x [R, C] (padded) cast by this layer's quantizer of `role`; telemetry records it when on."""
        t = self.quantizers[role].quantize(x, rows, cols, record, step=step)
        if stats and self.collect_fp8_stats:
            self.record_cast(role, x, t, numel)
        return t

    def quantize_input(self, x: torch.Tensor, numel: int, cols: bool, w: FP8WeightCache) -> FP8Copies:
        """The input x [Mp, Kp] (padded; `numel` elements without the padding): `rows` for the forward GEMM, and
        `cols` (x^T) for the weight gradient when asked; its amax recorded in training."""
        return self.quantize(x, INPUT, numel, cols=cols, record=self.training, step=w.step)

    def quantize_grad(self, gs: tuple[torch.Tensor, ...], rows: bool, cols: bool, w: FP8WeightCache) -> FP8Copies:
        """The output gradient (gs = (g,), g [M, N] contiguous), padded to multiples of 16: `rows` for the input
        gradient, `cols` (g^T) for the weight gradient."""
        (g,) = gs
        m, n = g.shape
        return self.quantize(pad_2d(g, round_up16(m), round_up16(n)), GRAD, m * n, rows, cols, step=w.step)

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
            return self.weight_cache  # recast outside the graph, into this cache's tensors (integrations.graph_weights)
        w = self.local_params()[0]
        gathered = gathered_fp8(w)
        if gathered is not None:  # FSDP2 gathered it in FP8, cast as this layer casts (fp8.integrations.param_gather)
            return FP8WeightCache(None, gathered, self.step_scales())
        key = self.weight_key()
        cache = self.weight_cache
        if cache is None and not self.cache_weight:
            cache = cast_from_forward(self, key)  # a recomputation: the checkpointed forward's cast
        if cache is None or (key is not None and cache.key != key) or (self.training and not cache.recorded):
            n, k = w.shape
            wp = pad_2d(w.detach(), round_up16(n), round_up16(k))
            quantizer = self.quantizers[WEIGHT]
            if want_t is None:
                want_t = grad_follows and w.requires_grad and self.cache_weight
            want_t = want_t and quantizer.cols_in_same_pass
            step = self.step_scales()
            t = quantizer.quantize(wp, True, want_t, record=self.training, amax=self.kept_weight_amax(), step=step)
            cache = FP8WeightCache(key, t.row_copy(), step)
            cache.dgrad = t.cols  # the input-gradient GEMM's operand, when made in the same pass
            cache.recorded = self.training or not quantizer.keeps_history
            self.num_weight_casts += 1
            if self.cache_weight:
                self.weight_cache = cache
            else:
                keep_for_recompute(self, cache)
        if self.collect_fp8_stats and cache.stats_epoch != self.stats_epoch:
            q = cache.rows.data
            self.record_stats(WEIGHT, pad_2d(w.detach(), *q.shape), q, dequant_scale(cache.rows).reciprocal(),
                              w.numel())
            cache.stats_epoch = self.stats_epoch
        return cache

    def fp8_weight_dgrad(self, cache: FP8WeightCache) -> FP8Tensor:
        """W^T [Kp, Np] with its scale_inv: the right operand of dx = g @ W (made from `cache` or, rowwise, cast
        again from the master weight), kept in the cache for later micro-batches when it may."""
        return weight_dgrad(cache, self.quantizers[WEIGHT], lambda: pad_2d(self.local_params()[0].detach(),
                                                                             *cache.rows.shape))

    # ------------------------------------------------------------------ forward
    # Outside torch.compile's graphs: a compiled model breaks its graph here and runs this layer
    # eagerly (its per-step weight cache and scale bookkeeping are Python state), while the FP8
    # casts inside are compiled functions (`kernels.ops.cast_fp8`) and the GEMMs cuBLASLt calls.
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
        (y,) = run_fp8_projection(self, x2, compute_dtype(x), grad_follows, (weight,), (bias,))
        return y.reshape(*x.shape[:-1], n)


def weight_dgrad(cache: FP8WeightCache, quantizer: Quantizer, master: Callable[[], torch.Tensor]) -> FP8Tensor:
    """`cache.dgrad`, or the transposed operand made now from the cached rows (`master`: the padded high-precision
    weight, for kinds that cast the transpose from it), kept in the cache when it may."""
    if cache.dgrad is not None:
        return cache.dgrad
    dgrad = quantizer.cols_of(cache.rows, master)
    if cache.keep_dgrad:
        cache.dgrad = dgrad
    return dgrad


def check_recipe_in_force(recipe: Recipe, what: str) -> None:
    """Raise unless the recipe of the enclosing `fp8_autocast` (when it names one) is `recipe`."""
    explicit = FP8GlobalStateManager.get_explicit_recipe()
    if explicit is not None and explicit != recipe:
        raise ValueError(f"{what} was converted with {recipe} but runs under fp8_autocast with "
                         f"{explicit}; convert the model with the recipe you run it with "
                         "(convert_to_fp8(model, recipe)) or run it under its own recipe")


class FP8Projection(Protocol):
    """What `run_fp8_projection` computes with: a module whose FP8 GEMM is y = x @ W^T for one weight (a
    `Float8Linear`) or for the row-concatenation [W_1; ...; W_n] of a fused group's weights
    (`fused_linear.FusedFloat8Projection`). It owns the FP8 weight of the step and the casts of the input and of the
    output gradient (its quantizers, telemetry included); the GEMMs, padding, slicing, bias and weight-gradient
    choices are the function's."""

    @property
    def fp8_wgrad(self) -> bool: ...  # the weight gradient as an FP8 GEMM (else in the compute dtype)

    @property
    def cache_weight(self) -> bool: ...  # the FP8 weight kept for the step's later micro-batches

    @property
    def fprop_fast_accum(self) -> bool: ...

    @property
    def backward_fast_accum(self) -> bool: ...

    def fp8_weight(self, grad_follows: bool) -> FP8WeightCache: ...

    def fp8_weight_dgrad(self, cache: FP8WeightCache) -> FP8Tensor: ...

    def quantize_input(self, x: torch.Tensor, numel: int, cols: bool, w: FP8WeightCache) -> FP8Copies: ...

    def quantize_grad(self, gs: tuple[torch.Tensor, ...], rows: bool, cols: bool, w: FP8WeightCache
                      ) -> FP8Copies: ...


def run_fp8_projection(proj: FP8Projection, x: torch.Tensor, out_dtype: torch.dtype, grad_follows: bool,
                       weights: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor | None, ...]
                       ) -> tuple[torch.Tensor, ...]:
    """x [M, K] -> the outputs x @ W_i^T + b_i [M, N_i] of `proj`'s weights (`_Float8LinearFn`), in out_dtype."""
    out = _Float8LinearFn.apply(x, proj, out_dtype, grad_follows, *weights, *biases)
    return cast("tuple[torch.Tensor, ...]", out)


def fprop(proj: FP8Projection, xp: torch.Tensor, numel: int, w: FP8WeightCache, want_cols: bool,
          out_dtype: torch.dtype) -> tuple[torch.Tensor, FP8Copies]:
    """The forward GEMM of `proj`: xp [Mp, Kp] (padded; `numel` elements without the padding) cast (with x^T for
    the weight gradient when `want_cols`), y = x @ W^T -> (y [Mp, Np] in out_dtype, padded; the FP8 input)."""
    xq = proj.quantize_input(xp, numel, want_cols, w)
    return fp8_gemm(xq.row_copy(), w.rows, out_dtype, proj.fprop_fast_accum), xq


def bprop(proj: FP8Projection, w: FP8WeightCache, gq: FP8Copies, x_cols: FP8Tensor | None, dims: tuple[int, int],
          sizes: tuple[int, ...], x_dtype: torch.dtype, w_dtypes: tuple[torch.dtype, ...], need_dx: bool,
          need_w: tuple[bool, ...]) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """The backward GEMMs of `proj` from its FP8 output gradient gq [Mp, sum N_i] (`rows` where need_dx, `cols`
    where x_cols): dx = g @ W -> [M, K] in x_dtype, and with x_cols (x^T [Kp, Mp]) the weight gradients
    dW_i = g_i^T @ x -> [N_i, K] in w_dtypes[i] (one GEMM, the row blocks of its output) where need_w[i]."""
    m, k = dims
    fast = proj.backward_fast_accum
    dx = None
    dws: list[torch.Tensor | None] = [None] * len(sizes)
    if need_dx:
        dx = fp8_gemm(gq.row_copy(), proj.fp8_weight_dgrad(w), x_dtype, fast)[:m, :k]
    if x_cols is not None:
        dw = fp8_gemm(gq.col_copy(), x_cols, w_dtypes[0], fast)[:sum(sizes), :k]
        parts = dw.split(sizes) if len(sizes) > 1 else (dw,)
        dws = [d.to(dt) if need else None for d, dt, need in zip(parts, w_dtypes, need_w)]
    return dx, dws


class _Float8LinearFn(torch.autograd.Function):
    """x [M, K], weights W_i [N_i, K], biases b_i [N_i] | None -> the outputs y_i = x @ W_i^T + b_i [M, N_i], column
    blocks of one FP8 GEMM over the concatenated weights (n = 1: a Float8Linear; see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, proj: FP8Projection, out_dtype: torch.dtype, grad_follows: bool,
                *params: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        n_w = len(params) // 2
        ws = cast("tuple[torch.Tensor, ...]", params[:n_w])
        bs = params[n_w:]
        m, k = x.shape
        sizes = tuple(wi.shape[0] for wi in ws)
        xp = pad_2d(x, round_up16(m), round_up16(k))
        w = proj.fp8_weight(grad_follows)
        # with an FP8 weight gradient ahead, the input's cast also makes x^T (K-major over tokens) for it
        need_w = any(ctx.needs_input_grad[4:4 + n_w])
        fp8_wgrad = need_w and proj.fp8_wgrad
        y, xq = fprop(proj, xp, m * k, w, fp8_wgrad, out_dtype)
        y = y[:m, :sum(sizes)]
        if any(b is not None for b in bs):
            y = y + _concat_biases(bs, sizes, out_dtype, y.device)
        x_saved = x_saved_si = None
        ctx.x_scaling = None  # the FP8 x^T's scaling (its tensors are saved for backward, not held by ctx)
        if need_w:
            if fp8_wgrad:
                x_cols = xq.col_copy()  # [Kp, Mp]: the wgrad GEMM's right operand
                x_saved, x_saved_si, ctx.x_scaling = x_cols.data, x_cols.scale_inv, x_cols.scaling
            else:
                x_saved = x.to(out_dtype)  # the weight gradient in the compute dtype needs the unquantized input
        ctx.save_for_backward(x_saved, x_saved_si)
        ctx.proj, ctx.wcache, ctx.fp8_wgrad = proj, w, proj.fp8_wgrad
        ctx.keep_weights = proj.cache_weight
        ctx.dims, ctx.sizes = (m, k), sizes
        ctx.x_dtype, ctx.out_dtype = x.dtype, out_dtype
        ctx.w_dtypes = tuple(wi.dtype for wi in ws)
        ctx.b_dtypes = tuple(b.dtype if b is not None else None for b in bs)
        # column blocks of one GEMM output; their gradients arrive separately and are cast straight into the
        # blocks of one FP8 gradient (no concatenation pass)
        return tuple(y.split(sizes, dim=1)) if n_w > 1 else (y,)

    @staticmethod
    def backward(ctx: Any, *gs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        proj: FP8Projection = ctx.proj
        x_saved, x_saved_si = ctx.saved_tensors
        (w,) = take_fp8_weights(ctx, "wcache")
        n_w = len(ctx.sizes)
        need_dx = ctx.needs_input_grad[0]
        need_w, need_b = ctx.needs_input_grad[4:4 + n_w], ctx.needs_input_grad[4 + n_w:]
        fp8_wgrad = any(need_w) and ctx.fp8_wgrad
        gs = tuple(g.contiguous() for g in gs)
        dx = None
        dws: list[torch.Tensor | None] = [None] * n_w
        if need_dx or fp8_wgrad:
            # from g at once: g for the input gradient, g^T (K-major over tokens) for the weight gradient
            gq = proj.quantize_grad(gs, need_dx, fp8_wgrad, w)
            x_cols = FP8Tensor(x_saved, x_saved_si, ctx.x_scaling, transposed=True) if fp8_wgrad else None
            dx, dws = bprop(proj, w, gq, x_cols, ctx.dims, ctx.sizes, ctx.x_dtype, ctx.w_dtypes, need_dx, need_w)
        if any(need_w) and not ctx.fp8_wgrad:  # per weight: exactly the unfused layers' GEMMs
            dws = [wgrad_high_precision(g, x_saved, ctx.out_dtype, dt) if need else None
                   for g, dt, need in zip(gs, ctx.w_dtypes, need_w)]
        dbs = [bias_grad(g, dt) if need else None for g, dt, need in zip(gs, ctx.b_dtypes, need_b)]
        return (dx, None, None, None, *dws, *dbs)


def _concat_biases(bs: tuple[torch.Tensor | None, ...], sizes: tuple[int, ...], dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
    """The biases of the output's column blocks as one row [sum N_i] in `dtype` (zeros for a weight without)."""
    if len(bs) == 1:
        assert bs[0] is not None
        return bs[0].to(dtype)
    return torch.cat([(b if b is not None else torch.zeros(n, device=device)).to(dtype) for b, n in zip(bs, sizes)])
