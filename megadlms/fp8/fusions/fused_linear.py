"""Horizontal fusion of sibling Float8Linears that read the same input: q/k/v and gate/up.

`FusedFloat8Projection` is the module `convert_to_fp8` puts in `Attention.qkv_fusion` / `MLP.gate_up_fusion`
(slots of megadlms.model, which `project_qkv` / `project_gate_up` call; `fusions.FUSIONS`). Instead of N
Float8Linears each casting the same input, running its own GEMMs and saving its own FP8 copy of the input, it runs
the linear's own function (`linear.run_fp8_projection`) over the concatenated weights:

    forward:  one cast of x (q and x^T), one GEMM  y = x @ [W_1; ...; W_n]^T, outputs split (views)
    backward: one cast of g = [g_1, ..., g_n], one dgrad GEMM (no adds of partial input gradients),
              one wgrad GEMM whose row blocks are the n weight gradients

What it fuses is in its three group quantizers (`quantizer.GroupQuantizer`): the per-step FP8 weight written from
the separate high-precision parameters into one concatenated FP8 buffer (and its transpose), and the input and
the gradient parts each cast once for the whole group. Parameters, module names and state_dict keys are
unchanged: the member modules keep their weights, amax histories and scales.

Scaling: one scale per GEMM operand. The input scale, the concatenated weight's scale and the
gradient's scale are the smallest of the members' scales for that role (delayed scaling, i.e. the
largest amax seen by any member), or come from the amax of the operand being cast (current scaling
and the first step of delayed scaling). Delayed scaling records each member's own weight amax and
the shared input/gradient amax into every member's history, so after one `fp8_step` the members of
a group hold equal input and gradient scales. With equal member scales every output equals the
unfused layers' output for the same inputs (each element is the same FP8 product). Members that FSDP2 gathered
in FP8 (`param_gather`) arrive cast with that weight scale: their rows, concatenated, are the step's weight
(uncached, no second rounding).

Whether the members can be fused is decided once, when the model is converted (`group_problem`: Float8Linears of a
per-tensor recipe, the same input width, dimensions that are multiples of 16, equal settings, no hooks, no DTensor
weights); conversion logs the decision (`registry.install_fusions`). A forward checks that the decision still holds
and raises `FusionError` naming what changed where it does not (e.g. tensor parallelism applied after conversion
without `registry.remove_fusions`). Hooks are the exception: the user's own (debugging, capturing activations,
profiling) may come and go on any module at any time, so while a member has hooks (or global module hooks are set)
the members run one by one, each call firing them with the tensors an unfused model has, logged once. Outside an
enabled fp8_autocast (and for an empty input) the members run one by one, as their own modules do there. FP8
telemetry (`enable_fp8_stats`) is recorded on the fused path itself: each member gets the statistics of the shared
input cast, of its rows of the weight cast and of its columns of the gradient cast.
"""

from __future__ import annotations

import logging
import sys
from typing import cast

import torch
from torch import nn
from torch.nn.modules import module as nn_module

from ...errors import MegaDLMsError
from ...model import compute_dtype
from ..integrations.param_gather import gathered_fp8, gathered_scale_group
from ..kernels.primitives import quant_stats, round_up16
from ..linear import (
    GRAD,
    INPUT,
    WEIGHT,
    Float8Linear,
    FP8WeightCache,
    check_device_once,
    run_fp8_projection,
    weight_dgrad,
)
from ..quantizer import FP8Copies, GroupQuantizer, StepScales
from ..state import FP8GlobalStateManager, cast_from_forward, keep_for_recompute
from ..tensor import FP8Tensor

# what the members of a fusion share (decided at conversion, checked on every forward)
SHARED_SETTINGS = ("recipe", "fp8_wgrad", "cache_weight", "fprop_fast_accum", "backward_fast_accum", "training")


log = logging.getLogger("megadlms")


class FusionError(MegaDLMsError, RuntimeError):
    """A fusion decided at conversion no longer holds (its members changed); the message says what and the fix."""


_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


def has_own_hooks(m: nn.Module) -> bool:
    """Whether `m` has forward, pre-forward or backward hooks of its own."""
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


def has_hooks(m: nn.Module) -> bool:
    """Whether calling `m` now would run hooks that a fused path skips: its own, or global module hooks
    (`torch.nn.modules.module.register_module_forward_hook` and the like)."""
    return has_own_hooks(m) or any(getattr(nn_module, name, None) for name in _GLOBAL_HOOKS)


_logged_hooks: set[str] = set()  # the kinds of fused module whose hooked fallback was logged


def log_hooked_once(what: str) -> None:
    """One log line per kind of fused module the first time one runs unfused because of hooks."""
    if what not in _logged_hooks:
        _logged_hooks.add(what)
        log.info("FP8 fusions: %s with hooked members run their layers one by one (unfused) so that the hooks fire; "
                 "the fused path resumes once the hooks are removed", what)


def group_problem(mods: tuple[nn.Module, ...] | list[nn.Module], *, hooks: bool = True) -> str | None:
    """Why sibling linears reading the same input cannot run as one fused FP8 GEMM, or None: they are
    Float8Linears of a per-tensor recipe, with the same input width K, N and K multiples of 16, equal
    `SHARED_SETTINGS`, one device, no hooks of their own (unless `hooks` is False: a forward's check, where hooks
    mean running unfused) and no DTensor weights."""
    if not all(type(m) is Float8Linear for m in mods):
        return "its members are not all Float8Linears"
    first = cast(Float8Linear, mods[0])
    if not first.recipe.per_tensor:
        return f"--fp8-recipe {first.recipe.name}: the fused GEMMs take per-tensor scales"
    dtensor = sys.modules.get("torch.distributed.tensor")
    k, device = first.weight.shape[1], first.weight.device
    for m in cast("tuple[Float8Linear, ...]", tuple(mods)):
        if hooks and has_own_hooks(m):
            return "a member has hooks (e.g. tensor parallelism)"
        if dtensor is not None and isinstance(m.weight, dtensor.DTensor):
            return "a member's weight is a DTensor (tensor parallelism)"
        if m.weight.shape[1] != k or m.weight.device != device:
            return "its members differ in input width or device"
        if m.weight.shape[0] % 16 or k % 16:
            return f"weight {tuple(m.weight.shape)}: the fused GEMM needs dimensions that are multiples of 16"
        for s in SHARED_SETTINGS:
            if getattr(m, s) != getattr(first, s):
                return f"its members' {s} differ ({getattr(first, s)} vs {getattr(m, s)})"
    return None


class FusedFloat8Projection(nn.Module):
    """x [..., K] -> tuple of the members' outputs [..., N_i]: one FP8 GEMM for sibling Float8Linears that read
    the same input (see the module docstring). Holds no parameters or buffers: the members (named `names` in
    their parent) keep theirs, and stay the parent's submodules (they are not this module's children). Runs with
    the first member's settings (the fused path requires the members' to be equal)."""

    def __init__(self, members: tuple[Float8Linear, ...], names: tuple[str, ...]):
        super().__init__()
        self._members = tuple(members)  # a tuple: not registered as children (no second state_dict key)
        self.names = tuple(names)
        # input, weight, grad: one scale for the group per role
        self.quantizers = tuple(GroupQuantizer([m.quantizers[role] for m in members], role)
                                for role in (INPUT, WEIGHT, GRAD))
        self.weight_cache: FP8WeightCache | None = None
        self.num_fused_calls = 0  # forwards that took the fused path (tests, debugging)

    @classmethod
    def of(cls, parent: nn.Module, names: tuple[str, ...]) -> FusedFloat8Projection | str:
        """The fusion of `parent.<names>`, or why it cannot be (`group_problem`): decided here, once."""
        mods = tuple(getattr(parent, n) for n in names)
        problem = group_problem(mods)
        if problem is not None:
            return problem
        return cls(cast("tuple[Float8Linear, ...]", mods), names)

    def check_still_holds(self, x: torch.Tensor) -> None:
        """Raise FusionError unless the decision made at conversion still holds for these members and input x
        (hooks aside: `fusable` runs hooked members unfused)."""
        problem = group_problem(self._members, hooks=False)
        if problem is None and x.shape[-1] != self._members[0].weight.shape[1]:
            problem = f"input width {x.shape[-1]} is not the members' {self._members[0].weight.shape[1]}"
        if problem is None and x.device != self._members[0].weight.device:
            problem = f"input on {x.device}, members on {self._members[0].weight.device}"
        if problem is not None:
            raise FusionError(f"FusedFloat8Projection({self.extra_repr()}): the fusion decided at conversion no "
                              f"longer holds: {problem}; convert without fuse_projections, or remove the fusions "
                              "(megadlms.fp8.fusions.registry.remove_fusions) before changing the members")

    def extra_repr(self) -> str:
        return ", ".join(self.names)

    def members(self) -> list[Float8Linear]:
        return list(self._members)

    # the settings the fused path runs with (`linear.FP8Projection`)
    @property
    def fp8_wgrad(self) -> bool:
        return self._members[0].fp8_wgrad

    @property
    def cache_weight(self) -> bool:
        return self._members[0].cache_weight

    @property
    def fprop_fast_accum(self) -> bool:
        return self._members[0].fprop_fast_accum

    @property
    def backward_fast_accum(self) -> bool:
        return self._members[0].backward_fast_accum

    def invalidate_fp8_weight_cache(self) -> None:
        """Drop the concatenated FP8 weight (the members drop theirs themselves)."""
        self.weight_cache = None

    def restore_weight_cache(self, cache: FP8WeightCache) -> None:
        """`cache` (a captured one, just recast in place: `graph_weights.StepFP8Weights`) is the current FP8 weight."""
        self.weight_cache = cache

    def fusable(self, mods: list[Float8Linear], x: torch.Tensor) -> bool:
        """Whether this call runs fused: inside an enabled fp8_autocast of the members' recipe, for a non-empty x
        (else the members run one by one, as outside FP8; under another recipe they raise the mismatch error), with
        no member hooked (else they run one by one, firing their hooks). Raises FusionError where the decision made
        at conversion no longer holds."""
        if not FP8GlobalStateManager.is_fp8_enabled() or x.numel() == 0:
            return False
        explicit = FP8GlobalStateManager.get_explicit_recipe()
        if explicit is not None and explicit != mods[0].recipe:
            return False  # the members raise the mismatch error
        self.check_still_holds(x)
        if any(has_hooks(m) for m in mods):
            log_hooked_once("fused projections (q/k/v, gate/up)")
            return False
        return True

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        mods = self.members()
        if not self.fusable(mods, x):
            return tuple(m(x) for m in mods)
        if x.device.type == "cuda":
            check_device_once(x.device)
        ws = tuple(m.weight for m in mods)
        k = ws[0].shape[1]
        x2 = x.reshape(-1, k).contiguous()
        grad_follows = torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in ws))
        self.num_fused_calls += 1
        ys = run_fp8_projection(self, x2, compute_dtype(x), grad_follows, ws, tuple(m.bias for m in mods))
        return tuple(y.view(*x.shape[:-1], w.shape[0]) for y, w in zip(ys, ws))

    # ------------------------------------------------------------------ weights
    def step_scales(self) -> StepScales | None:
        """Delayed scaling once every member has scales: per role the smallest of the members' scales (the largest
        amax any of them saw), shared by the group's casts of this step; else None."""
        mods = self._members
        if not self.quantizers[INPUT].keeps_history or not all(m.scales_ready() for m in mods):
            return None
        return StepScales(torch.stack([cast(torch.Tensor, m.fp8_scale) for m in mods]).amin(0))  # [3]

    def fp8_weight(self, grad_follows: bool, want_t: bool | None = None) -> FP8WeightCache:
        """The concatenated FP8 weight for this step: cast on the first micro-batch after any member's weight
        changed (same detection as `Float8Linear.fp8_weight`; `fp8_step` drops the members' caches). want_t:
        whether the transpose for the input gradient is made with it (None: when a backward follows and the cache
        keeps it; uncached, W^T is made in the backward)."""
        mods = self._members
        if want_t is None:
            want_t = grad_follows and any(m.weight.requires_grad for m in mods) and self.cache_weight
        c = self.weight_cache
        if mods[0].weights_frozen and c is not None:
            return c  # recast outside the graph, into this cache's tensors (fp8.integrations.graph_weights)
        gathered = [gathered_fp8(m.weight) for m in mods]
        if any(op is not None for op in gathered):  # FSDP2 gathered them in FP8 (fp8.integrations.param_gather)
            return self._gathered_weight(gathered)
        keys = [(m.weight._version, m.weight.data_ptr(), m.weight.dtype, m.weight.device) for m in mods]
        if (c is not None and (c.recorded or not mods[0].training)
                and all(m.weight_cache is mc and mc.key == key for m, mc, key in zip(mods, c.members, keys))):
            if want_t and c.keep_dgrad:
                self.fp8_weight_dgrad(c)  # made now and kept for the step's later micro-batches
        else:
            c = None if self.cache_weight else cast_from_forward(self, tuple(keys))  # a recomputation
            if c is None:
                c = self._cast_weights(keys, want_t)
                if not self.cache_weight:
                    keep_for_recompute(self, c)
        if mods[0].collect_fp8_stats:
            self._record_weight_stats(c)
        return c

    def _cast_weights(self, keys: list[tuple], want_t: bool) -> FP8WeightCache:
        mods = self._members
        step = self.step_scales()
        ws = [m.weight.detach() for m in mods]
        t = self.quantizers[WEIGHT].quantize_cat(ws, want_t, record=mods[0].training,
                                                 amaxes=[m.kept_weight_amax() for m in mods], step=step)
        rows = t.row_copy()
        member_caches, row = [], 0
        for m, w, key in zip(mods, ws, keys):
            n = w.shape[0]
            mc = FP8WeightCache(key, rows.with_data(rows.data[row:row + n]))  # what the member uses if called alone
            row += n
            m.keep_group_cast(mc)
            member_caches.append(mc)
        group = FP8WeightCache(tuple(keys), rows, step, tuple(member_caches))
        group.dgrad = t.cols  # the input-gradient GEMM's operand, when made in the same pass
        group.recorded = mods[0].training or not self.quantizers[WEIGHT].keeps_history
        for mc in member_caches:
            mc.recorded = group.recorded
        self.weight_cache = group if self.cache_weight else None
        return group

    def _gathered_weight(self, gathered: list[FP8Tensor | None]) -> FP8WeightCache:
        """The concatenated FP8 weight from members FSDP2 gathered in FP8 (`param_gather`), uncached. They were
        cast with the group's one scale (the one `quantize_cat` uses), so their rows concatenate into the operand
        the fused cast makes: the same FP8 values, no second rounding."""
        mods = self._members
        group = gathered_scale_group(mods[0].weight)
        if (group is None or group.members != mods or any(op is None for op in gathered)
                or any(gathered_scale_group(m.weight) is not group for m in mods)):
            raise RuntimeError(f"the members of {self.extra_repr()} were not gathered in FP8 as one scale group: "
                               "enable_fp8_param_gather must get a fused projection's members together")
        first = cast(FP8Tensor, gathered[0])
        datas = [cast(FP8Tensor, op).data for op in gathered]
        q = torch.cat(datas)
        members = tuple(FP8WeightCache(None, first.with_data(rows)) for rows in q.split([d.shape[0] for d in datas]))
        return FP8WeightCache(None, first.with_data(q), self.step_scales(), members)

    def fp8_weight_dgrad(self, cache: FP8WeightCache) -> FP8Tensor:
        """[W_1; ...]^T [K, sum N_i]: the dgrad GEMM's operand, transposed from the cached q."""
        return weight_dgrad(cache, self.quantizers[WEIGHT],
                            lambda: torch.cat([m.weight.detach() for m in self._members]))

    # ------------------------------------------------------------------ casts
    def quantize_input(self, x: torch.Tensor, numel: int, cols: bool, w: FP8WeightCache) -> FP8Copies:
        """The shared input x [Mp, K], cast once for the group (see `Float8Linear.quantize_input`)."""
        first = self._members[0]
        xq = self.quantizers[INPUT].quantize(x, True, cols, record=first.training, step=w.step)
        if first.collect_fp8_stats:  # one input: its statistics computed once, recorded by every member
            xr = xq.row_copy()
            stats = quant_stats(x, xr.data, xr.scale_inv.reciprocal(), xr.data.dtype, numel)
            for mod in self._members:
                mod.add_stats(INPUT, stats)
        return xq

    def quantize_grad(self, gs: tuple[torch.Tensor, ...], rows: bool, cols: bool, w: FP8WeightCache) -> FP8Copies:
        """The members' output gradients gs[i] [M, N_i] as one operand [Mp, sum N_i], cast once for the group."""
        m = gs[0].shape[0]
        gq = self.quantizers[GRAD].quantize_cols(gs, round_up16(m), rows, cols, record=True, step=w.step)
        if self._members[0].collect_fp8_stats:  # each member: its gradient against its columns of the FP8 gradient
            copy = gq.rows if gq.rows is not None else gq.col_copy()
            q_all, scale, col = copy.data, copy.scale_inv.reciprocal(), 0
            for mod, g in zip(self._members, gs):
                n = g.shape[1]
                q = q_all[:m, col:col + n] if gq.rows is not None else q_all[col:col + n, :m].t()
                mod.record_stats(GRAD, g, q, scale, g.numel())
                col += n
        return gq

    def _record_weight_stats(self, c: FP8WeightCache) -> None:
        """Each member's rows of the concatenated weight cast, once per statistics window (as
        `Float8Linear.fp8_weight` records its weight)."""
        w_scale = None
        for mod, mc in zip(self._members, c.members):
            if mc.stats_epoch != mod.stats_epoch:
                w_scale = w_scale if w_scale is not None else c.rows.scale_inv.reciprocal()
                wi = mod.weight.detach()
                mod.record_stats(WEIGHT, wi, mc.rows.data, w_scale, wi.numel())
                mc.stats_epoch = mod.stats_epoch
