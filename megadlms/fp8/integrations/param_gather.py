"""FP8 parameter all-gather under FSDP2 (--fp8-param-gather): each rank casts its shard of an FP8 linear's weight
to FP8 before the all-gather, so the collective carries 1 byte per weight element (plus, blockwise, one fp32
scale per 128x128 block), and the gathered FP8 weight is the GEMM operand: the layer casts nothing.

The gathered FP8 weight is, bit for bit, the cast the layer would have made of the unsharded weight, so training
is unchanged (`megadlms.distributed.parallelize` applies it between the FP8 conversion and `fully_shard`):

    tensorwise  one scale per weight from the weight's amax: each rank computes its shard's amax, the amaxes are
                MAX-reduced across the shard group (one small all-reduce per weight and gather), and every rank
                casts its rows with the scale of the whole weight through the layer's own quantizer.
    delayed     the weight scale of the last `fp8_step` (the same on every rank: buffers are replicated, the
                histories reduced), or before the first step the scale of the reduced amax; the reduced amax is
                what the cast records in the history, as the cast of the unsharded weight would.
    blockwise   each 128x128 block has its own scale: a shard holding whole 128-row blocks casts them exactly as
                the unsharded weight's cast would, with no collective (checked: rows divisible by 128 x shards).

Rowwise and MXFP8 cannot: the transposed weight of their input-gradient GEMM is cast from the high-precision
weight along the other dimension, which the gathered FP8 weight no longer has.

Fused projections (q/k/v, gate/up: `fused_linear.FusedFloat8Projection`) run one GEMM over the concatenated
weights with one scale, from the largest of the members' amaxes (or, delayed, the smallest member scale). The
members of such a group are therefore cast with the group's scale before the all-gather (a `ScaleGroup`: each
member's hook reduces the amaxes of all members' shards), and the fused path concatenates the gathered FP8 rows.
That is exact: concatenating FP8 values cast with one shared scale is the cast of the concatenation, which is
what the fused path does without the gather. (Concatenating members cast with their own scales and re-scaling
them to a shared one would round twice.) A member that runs alone uses the group's scale too: still a valid
cast of its weight (its amax is within the group's), only not the bits of its own-scale cast.

The FSDP2 extension points (`fsdp_pre_all_gather` / `fsdp_post_all_gather`, as torchao's float8 all-gather uses):
`Float8GatherWeight` wraps the high-precision weight (it stays the parameter the optimizer updates and the
checkpoint saves); FSDP2 shards it with the ops in `_KEEP`, so each shard is again a `Float8GatherWeight`, whose
pre-all-gather hook casts it (FP8 bytes sent as uint8: gloo has no FP8 type). The post-all-gather hook returns a
`Float8GatheredWeight`, which `gathered_fp8` hands to the layer as its GEMM operand.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map

from ...errors import MegaDLMsError
from ..formats.blockwise import BLOCK, block_scale_buffer
from ..kernels.ops import amax_of, cast_fp8, current_scale, record_amax
from ..quantizer import WEIGHT_ROLE, FP8Copies, StepScales
from ..recipe import Recipe, param_gather_problem, recipe_class
from ..tensor import FP8Tensor, Scaling

# a Float8Linear, the layer whose weight is gathered (linear.py, which imports this module, defines it)
FP8Layer = Any

__all__ = ["ParamGatherError", "ScaleGroup", "Float8GatherWeight", "Float8GatheredWeight",
           "check_gather_recipe", "check_gather_shardable", "enable_fp8_param_gather", "gathered_fp8",
           "gathered_scale_group", "unwrap_gather_weight"]

class ParamGatherError(MegaDLMsError, ValueError):
    """The FP8 parameter all-gather cannot be exact for this recipe, weight or sharding; the message says what to
    change."""


def check_gather_recipe(recipe: str) -> None:
    """Raise ParamGatherError unless --fp8-recipe `recipe` can gather its weights in FP8 (`param_gather_problem`)."""
    problem = param_gather_problem(recipe)
    if problem:
        raise ParamGatherError(problem)


def check_gather_shardable(name: str, shape: torch.Size | tuple[int, ...], recipe: str, shards: int) -> None:
    """Raise ParamGatherError unless weight `name` [N, K] gathered in FP8 over `shards` ranks is exact."""
    check_gather_recipe(recipe)
    if len(shape) != 2:
        raise ParamGatherError(f"--fp8-param-gather: {name} has shape {tuple(shape)}; only 2-D weights [N, K] are "
                               "gathered in FP8")
    if recipe_class(recipe).weight_scaling == "block" and shape[0] % (BLOCK * shards):
        raise ParamGatherError(
            f"--fp8-param-gather with --fp8-recipe blockwise: {name} has {shape[0]} rows, which {shards} FSDP "
            f"shards cannot split into whole 128-row blocks (it needs a multiple of {BLOCK * shards}); use "
            "--fp8-recipe tensorwise, fewer data-parallel ranks, or drop --fp8-param-gather")


def _shard(layer: FP8Layer) -> torch.Tensor:
    """The high-precision local shard of `layer`'s weight, as FSDP2 holds it between gathers."""
    w = layer.weight
    local = getattr(w, "_local_tensor", w)  # a DTensor's local tensor
    if not isinstance(local, Float8GatherWeight):
        raise RuntimeError(f"{type(layer).__name__}.weight is {type(local).__name__}, not the sharded "
                           "Float8GatherWeight: the FP8 all-gather of a fused group reads its members' shards")
    return local._tensor


class ScaleGroup:
    """FP8 linears whose gathered weights share one per-tensor scale: a fused projection's members (the fused
    GEMM's weight scale), or one linear alone (its own scale)."""

    def __init__(self, members: Sequence[FP8Layer]):
        self.members: tuple[FP8Layer, ...] = tuple(members)
        self._stats_epochs = [-1] * len(self.members)

    def __repr__(self) -> str:
        return f"ScaleGroup({', '.join(type(m).__name__ for m in self.members)})"

    def local_amaxes(self, index: int, shard: torch.Tensor) -> torch.Tensor:
        """[members] fp32: max |shard| of each member's weight on this rank (0 for an empty shard), given member
        `index`'s shard (the others' are read from their modules). Computed afresh for every gather: the version
        counters of FSDP2's local shards do not see the optimizer's in-place updates (they happen on the DTensor),
        so nothing cheap says a kept value is current; a group costs one amax pass per member and gather more."""
        shards = [shard if i == index else _shard(m) for i, m in enumerate(self.members)]
        return torch.stack([amax_of(s) if s.numel() else s.new_zeros((), dtype=torch.float32) for s in shards])

    def cast_shard(self, index: int, shard: torch.Tensor, group: Any) -> FP8Tensor:
        """The FP8 cast of member `index`'s weight shard [rows, K] with the scale the unsharded weight's cast
        would use (module docstring): q [rows, K'] fp8 per tensor (scale_inv 0-dim) or in 128x128 blocks
        (scale_inv [rows/128, L4]).
        group: the shard group (None: one rank holds the whole weight)."""
        layer = self.members[index]
        quantizer = layer.quantizers[WEIGHT_ROLE]
        if not quantizer.per_tensor:  # blockwise: blocks local to the shard
            return quantizer.quantize(shard, rows=True).row_copy()
        amaxes = self.local_amaxes(index, shard)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)
        if len(self.members) == 1:  # the layer's own cast, with the unsharded weight's amax
            return quantizer.quantize(shard, rows=True, record=layer.training, amax=amaxes[0],
                                      step=layer.step_scales()).row_copy()
        # the fused GEMM's scale, as `FusedFloat8Projection` takes it (`step_scales`, `GroupQuantizer.quantize_cat`)
        fp8_dtype = quantizer.fp8_dtype
        delayed = quantizer.keeps_history
        if delayed and all(m.scales_ready() for m in self.members):
            step = StepScales(torch.stack([m.fp8_scale for m in self.members]).amin(0))
            scale, scale_inv = step.scales[WEIGHT_ROLE], step.scale_invs[WEIGHT_ROLE]
        else:
            scale, scale_inv = current_scale(list(amaxes.unbind()), fp8_dtype, layer.recipe.margin)
        if delayed and layer.training:  # each member's own amax into its own history
            record_amax(quantizer.amax_slots(), amaxes[index])
        q, _, scale_inv, _ = cast_fp8(shard, scale, None, fp8_dtype, layer.recipe.margin, scale_inv=scale_inv)
        assert q is not None  # asked for
        return FP8Tensor(q, scale_inv, Scaling.TENSOR)

    def record_stats(self, index: int, shard: torch.Tensor, op: FP8Tensor) -> None:
        """FP8 telemetry of the weight role: this rank's shard cast, once per statistics window."""
        layer = self.members[index]
        if layer.collect_fp8_stats and self._stats_epochs[index] != layer.stats_epoch and shard.numel():
            layer.record_cast(WEIGHT_ROLE, shard, FP8Copies(rows=op), shard.numel())
            self._stats_epochs[index] = layer.stats_epoch


def enable_fp8_param_gather(groups: Iterable[Sequence[FP8Layer]], shards: int) -> int:
    """Wrap the weight of every FP8 linear in `groups` in a Float8GatherWeight (call before `fully_shard`).

    groups: the linears, as the sets that share one scale (a fused projection's members) or one each.
    shards: the FSDP shard group's size. Returns the number of weights wrapped; raises ParamGatherError where the
    gather cannot be exact."""
    n = 0
    for members in groups:
        group = ScaleGroup(members)
        kinds = {m.recipe.name for m in group.members}
        if len(group.members) > 1 and (len(kinds) > 1 or not group.members[0].quantizers[WEIGHT_ROLE].per_tensor):
            raise ParamGatherError(f"FP8 parameter all-gather: the members of {group} must share one per-tensor "
                                   "recipe to share a scale")
        for i, layer in enumerate(group.members):
            recipe: Recipe = layer.recipe
            name = recipe.name
            check_gather_shardable(f"{type(layer).__name__}({layer.in_features}, {layer.out_features}).weight",
                                   layer.weight.shape, name, shards)
            w = layer.weight
            inner = w._tensor if isinstance(w, Float8GatherWeight) else w.data
            layer.weight = nn.Parameter(Float8GatherWeight(inner, group, i), requires_grad=w.requires_grad)
            if not getattr(layer, "_plain_weight_hook", False):
                layer.register_state_dict_post_hook(_plain_weight_in_state_dict)
                layer._plain_weight_hook = True
            n += 1
    return n


def unwrap_gather_weight(t: torch.Tensor) -> torch.Tensor:
    """The high-precision tensor of a (possibly DTensor-sharded) Float8GatherWeight, sharing its storage; other
    tensors as they are."""
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, Float8GatherWeight):
        from torch.distributed.tensor import DTensor

        assert isinstance(t, DTensor)  # it has a local tensor
        return DTensor.from_local(local._tensor, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                  stride=t.stride())
    return t._tensor if isinstance(t, Float8GatherWeight) else t


def _plain_weight_in_state_dict(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
                                ) -> None:
    """Checkpoints hold the master weight as a plain (DTensor of a) tensor: the FP8 all-gather leaves no trace in
    them, so they load with or without --fp8-param-gather."""
    key = prefix + "weight"
    if key in state_dict:
        state_dict[key] = unwrap_gather_weight(state_dict[key])


def gathered_fp8(weight: torch.Tensor) -> FP8Tensor | None:
    """The FP8 GEMM operand FSDP2 gathered for `weight` (padded as the layer's own cast pads: per-tensor to
    multiples of 16, blockwise to 128 with the block-scale buffer), or None when it was not gathered in FP8."""
    if not isinstance(weight, Float8GatheredWeight):
        return None
    fp8 = weight._fp8
    q, si = fp8.data, fp8.scale_inv
    n, k = q.shape
    if fp8.scaling is Scaling.BLOCK:
        rows, cols = -(-n // BLOCK) * BLOCK, -(-k // BLOCK) * BLOCK
        si = block_scale_buffer(si)
    else:
        rows, cols = -(-n // 16) * 16, -(-k // 16) * 16
    if (rows, cols) != (n, k):
        q = F.pad(q.view(torch.uint8), (0, cols - k, 0, rows - n)).view(q.dtype)  # FP8 zeros are 0x00
    return fp8.with_data(q, si)


def gathered_scale_group(weight: torch.Tensor) -> ScaleGroup | None:
    """The ScaleGroup whose scale an FP8-gathered weight was cast with (None when it was not gathered in FP8)."""
    return weight._group if isinstance(weight, Float8GatheredWeight) else None


# ops after which a wrapped weight stays wrapped: the ones FSDP2 uses to shard, pad, view and copy a parameter
_KEEP = {
    torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.empty_like.default,
    torch.ops.aten.new_zeros.default, torch.ops.aten.new_empty.default, torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default, torch.ops.aten.view.default, torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default, torch.ops.aten._pin_memory.default, torch.ops.aten.split.Tensor,
    torch.ops.aten.split_with_sizes.default, torch.ops.aten.clone.default, torch.ops.aten.narrow.default,
}


class Float8GatherWeight(torch.Tensor):
    """A high-precision weight [N, K] (any float dtype) that FSDP2 all-gathers in FP8: member `index` of `group`.

    Every op runs on the wrapped tensor (the optimizer updates it in place); the sharding ops in `_KEEP` return a
    wrapped result, so FSDP2's shard of this weight is again a Float8GatherWeight and calls the hooks below."""

    _tensor: torch.Tensor
    _group: ScaleGroup
    _index: int

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, group: ScaleGroup, index: int):
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(), dtype=tensor.dtype,
            layout=tensor.layout, device=tensor.device, requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor, group: ScaleGroup, index: int):
        self._tensor, self._group, self._index = tensor, group, index

    def __repr__(self) -> str:  # type: ignore[override]  # a plain repr, without torch's tensor_contents
        return f"Float8GatherWeight({self._tensor})"

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # torch's idiom

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (),  # type: ignore[override]
                           kwargs: dict | None = None) -> Any:  # torch's stub declares another signature
        like: list[Float8GatherWeight] = []

        def unwrap(t: Any) -> Any:
            if isinstance(t, Float8GatherWeight):
                like.append(t)
                return t._tensor
            return t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        if func not in _KEEP:
            return out
        w = like[0]
        return tree_map(lambda t: Float8GatherWeight(t, w._group, w._index) if isinstance(t, torch.Tensor) else t,
                        out)

    def __tensor_flatten__(self):
        return ["_tensor"], (self._group, self._index)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Float8GatherWeight(inner["_tensor"], *meta)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """Cast this shard to FP8. Returns ((FP8 bytes as uint8 [, block scales fp32]), metadata)."""
        layer = self._group.members[self._index]
        recipe = layer.recipe.name
        shards = mesh.size()
        check_gather_shardable(f"{type(layer).__name__}.weight", tuple(outer_size), recipe, shards)
        w = self._tensor
        rows, k = -(-outer_size[0] // shards), outer_size[1]  # FSDP2 pads every shard to the first one's rows
        op = self._group.cast_shard(self._index, w, mesh.get_group())
        self._group.record_stats(self._index, w, op)
        q = op.data[: w.shape[0], :k].contiguous().view(torch.uint8)  # the casts pad to 16 or 128 columns
        fp8_dtype = op.data.dtype
        if op.scaling is Scaling.TENSOR:  # the same scale on every rank, kept as metadata
            q = F.pad(q, (0, 0, 0, rows - q.shape[0]))
            return (q,), (fp8_dtype, op.scale_inv)
        blocks = op.scale_inv[:, : -(-k // BLOCK)].contiguous()  # [rows/128, K/128]: the buffer's padding off
        return (q, blocks), (fp8_dtype, None)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The gathered FP8 weight (and the tensors whose storage FSDP2 frees after use)."""
        fp8_dtype, scale_inv = metadata
        data = all_gather_outputs[0].view(fp8_dtype)
        blocks = scale_inv is None
        if blocks:
            scale_inv = all_gather_outputs[1]
        if out is not None:  # a later all-gather into the same storage: only the scale is new
            out._fp8 = out._fp8.with_data(out._fp8.data, scale_inv)
            return None
        fp8 = FP8Tensor(data, scale_inv, Scaling.BLOCK if blocks else Scaling.TENSOR)
        return Float8GatheredWeight(fp8, self._group, param_dtype), (all_gather_outputs[0],)


class Float8GatheredWeight(torch.Tensor):
    """The unsharded weight after an FP8 all-gather, carrying it as an `FP8Tensor` (`_fp8`: data [N, K] per tensor
    with a 0-dim scale_inv, or in 128x128 blocks with scales [N/128, K/128]), presenting as a `dtype` tensor [N, K].
    The views FSDP2 takes keep the FP8 data; any other op sees the dequantised weight (a plain linear outside
    fp8_autocast, for instance)."""

    _fp8: FP8Tensor
    _group: ScaleGroup

    @staticmethod
    def __new__(cls, fp8: FP8Tensor, group: ScaleGroup, dtype: torch.dtype):
        data = fp8.data
        return torch.Tensor._make_wrapper_subclass(cls, data.size(), strides=data.stride(),
                                                   storage_offset=data.storage_offset(), dtype=dtype,
                                                   device=data.device, requires_grad=False)

    def __init__(self, fp8: FP8Tensor, group: ScaleGroup, dtype: torch.dtype):
        self._fp8, self._group = fp8, group

    def __repr__(self) -> str:  # type: ignore[override]  # a plain repr, without torch's tensor_contents
        return f"Float8GatheredWeight({self._fp8})"

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # torch's idiom

    def dequantize(self) -> torch.Tensor:
        data, s = self._fp8.data, self._fp8.scale_inv
        if self._fp8.scaling is not Scaling.BLOCK:
            return (data.float() * s).to(self.dtype)
        s = s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        return (data.float() * s[: data.shape[0], : data.shape[1]]).to(self.dtype)

    def _rewrap(self, data: torch.Tensor) -> Float8GatheredWeight:
        scale = self._fp8.scale_inv
        if self._fp8.scaling is Scaling.BLOCK:
            scale = scale[: -(-data.shape[0] // BLOCK)]
        return Float8GatheredWeight(self._fp8.with_data(data, scale), self._group, self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        w = args[0]
        aten = torch.ops.aten
        if func in (aten.detach.default, aten.alias.default):
            return w._rewrap(func(w._fp8.data))
        if func is aten.as_strided.default and isinstance(w, cls):  # FSDP2: the padded gather -> the weight
            size, stride = args[1], args[2]
            offset = args[3] if len(args) > 3 else kwargs.get("storage_offset", 0)
            if offset in (0, None) and list(stride) == [size[1], 1] and w._fp8.data.is_contiguous():
                return w._rewrap(w._fp8.data[: size[0]])
        return func(*tree_map(lambda t: t.dequantize() if isinstance(t, cls) else t, args),
                    **tree_map(lambda t: t.dequantize() if isinstance(t, cls) else t, kwargs))
