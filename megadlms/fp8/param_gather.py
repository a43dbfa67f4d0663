"""FP8 parameter all-gather under FSDP2: each rank casts its weight shard to FP8 before the all-gather, so the
collective carries 1 byte per weight element (plus the block scales), and the gathered FP8 weight feeds the GEMM.

`Float8GatherWeight` wraps a high-precision weight (it stays the parameter the optimizer updates) and implements
FSDP2's all-gather extension points:
- `fsdp_pre_all_gather` casts the local shard: `tensorwise` with one scale from the amax reduced (MAX) across the
  shard group, so every rank casts with the scale of the whole weight; `blockwise` per 128x128 block, which is
  the cast of the whole weight when every shard holds whole 128-row blocks (checked). The FP8 bytes travel as
  uint8 (gloo cannot send FP8), the block scales as fp32.
- `fsdp_post_all_gather` returns a `Float8GatheredWeight`: the gathered FP8 data and scale, which the FP8 linear
  reads with `gathered_fp8` instead of casting the weight itself.
Either way the FP8 weight equals the cast of the unsharded weight bit for bit, so training is unchanged.

How it plugs into the FP8 core: the weight quantizer of a `tensorwise` (current scaling) or `blockwise` recipe
first asks `gathered_fp8(weight)`; the FSDP step of the model transformation pipeline calls
`enable_fp8_param_gather` on the FP8 linears before `fully_shard` (flag --fp8-param-gather). Delayed scaling is
left out: its weight scale comes from a history, not from the weight being gathered.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from ..errors import MegaDLMsError
from .blockwise import BLOCK, quantize_blocks, tile_scale
from .recipe import E4M3, FP8_MAX

__all__ = ["KINDS", "Float8GatherWeight", "Float8GatheredWeight", "GatheredFP8", "ParamGatherError",
           "enable_fp8_param_gather", "gathered_fp8", "check_gather_shardable", "quantize_weight_tensorwise"]

KINDS = ("tensorwise", "blockwise")


class ParamGatherError(MegaDLMsError, ValueError):
    """The FP8 parameter all-gather cannot be exact for this weight and sharding; the message says what to change."""


class GatheredFP8(NamedTuple):
    """A gathered FP8 weight: data [N, K] fp8; scale_inv [] (tensorwise) or [N/128, K/128] fp32 (blockwise)."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    kind: str


def quantize_weight_tensorwise(w: torch.Tensor, amax: torch.Tensor, fp8_dtype: torch.dtype = E4M3,
                               pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale_inv []) of w cast with the scale of `amax` (the whole weight's amax, possibly reduced across
    ranks): q = cast(clamp(w * scale)), scale = fp8_max / amax."""
    scale = tile_scale(amax.reshape(()), fp8_dtype, pow2)
    fmax = FP8_MAX[fp8_dtype]
    return (w.float() * scale).clamp_(-fmax, fmax).to(fp8_dtype), scale.reciprocal()


def check_gather_shardable(name: str, shape: torch.Size | tuple[int, ...], kind: str, world_size: int) -> None:
    """Raise ParamGatherError unless gathering weight `name` [N, K] in FP8 over `world_size` shards is exact."""
    if kind not in KINDS:
        raise ParamGatherError(f"--fp8-param-gather works with the recipes {', '.join(KINDS)}, not {kind!r} (its "
                               "weight scale does not come from the weight being gathered); drop --fp8-param-gather")
    if len(shape) != 2:
        raise ParamGatherError(f"FP8 parameter all-gather: {name} has shape {tuple(shape)}; only 2-D weights [N, K] "
                               "are cast")
    if kind == "blockwise" and shape[0] % (BLOCK * world_size):
        raise ParamGatherError(
            f"blockwise FP8 parameter all-gather: {name} has {shape[0]} rows, which {world_size} FSDP shards cannot "
            f"split into whole 128-row blocks (needs a multiple of {BLOCK * world_size}); use --fp8-recipe tensorwise "
            "with --fp8-param-gather, a shard group size that divides the row blocks, or drop --fp8-param-gather")


def enable_fp8_param_gather(linears: Iterable[nn.Linear], kind: str, world_size: int, fp8_dtype: torch.dtype = E4M3,
                            pow2: bool = False) -> int:
    """Wrap the `weight` of each module in `linears` in a Float8GatherWeight (call before `fully_shard`).

    Returns the number of weights wrapped. Raises ParamGatherError where the gather could not be exact."""
    n = 0
    for mod in linears:
        w = mod.weight
        check_gather_shardable(f"{type(mod).__name__}.weight", w.shape, kind, world_size)
        if not isinstance(w.data, Float8GatherWeight):
            mod.weight = nn.Parameter(Float8GatherWeight(w.data, kind, fp8_dtype, pow2), requires_grad=w.requires_grad)
        n += 1
    return n


def gathered_fp8(weight: torch.Tensor) -> GatheredFP8 | None:
    """The FP8 data and scale that FSDP2 gathered for `weight`, or None when it was gathered in high precision."""
    if isinstance(weight, Float8GatheredWeight):
        return GatheredFP8(weight._data, weight._scale_inv, weight._kind)
    return None


# ops after which a wrapped weight stays wrapped: the ones FSDP2 uses to shard, pad, view and copy a parameter
_KEEP = {
    torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.empty_like.default,
    torch.ops.aten.new_zeros.default, torch.ops.aten.new_empty.default, torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default, torch.ops.aten.view.default, torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default, torch.ops.aten._pin_memory.default, torch.ops.aten.split.Tensor,
    torch.ops.aten.split_with_sizes.default, torch.ops.aten.clone.default, torch.ops.aten.narrow.default,
}


class Float8GatherWeight(torch.Tensor):
    """A high-precision weight (any float dtype) that FSDP2 all-gathers in FP8.

    Every op runs on the wrapped tensor (the optimizer updates it in place); the sharding ops in `_KEEP` return a
    wrapped result, so FSDP2's shard of this weight is again a Float8GatherWeight and calls the hooks below."""

    _tensor: torch.Tensor
    _kind: str
    _fp8_dtype: torch.dtype
    _pow2: bool

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, kind: str, fp8_dtype: torch.dtype = E4M3, pow2: bool = False):
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(), dtype=tensor.dtype,
            layout=tensor.layout, device=tensor.device, requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor, kind: str, fp8_dtype: torch.dtype = E4M3, pow2: bool = False):
        if kind not in KINDS:
            raise ParamGatherError(f"FP8 parameter all-gather kind={kind!r} must be one of {', '.join(KINDS)}")
        self._tensor, self._kind, self._fp8_dtype, self._pow2 = tensor, kind, fp8_dtype, pow2

    def __repr__(self) -> str:  # type: ignore[override]  # a plain repr, without torch's tensor_contents
        return f"Float8GatherWeight({self._kind}, {self._fp8_dtype}, {self._tensor})"

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
        return tree_map(lambda t: Float8GatherWeight(t, w._kind, w._fp8_dtype, w._pow2)
                        if isinstance(t, torch.Tensor) else t, out)

    def __tensor_flatten__(self):
        return ["_tensor"], (self._kind, self._fp8_dtype, self._pow2)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Float8GatherWeight(inner["_tensor"], *meta)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """Cast this shard to FP8. Returns ((data as uint8 [, block scales]), metadata)."""
        w = self._tensor
        ws = mesh.size()
        check_gather_shardable(type(module).__name__ + ".weight", tuple(outer_size), self._kind, ws)
        rows = -(-outer_size[0] // ws)  # FSDP2 pads every shard to the first one's rows
        group = mesh.get_group() if mesh.ndim == 1 else mesh.get_group(mesh.ndim - 1)
        if self._kind == "tensorwise":
            amax = w.abs().amax().float() if w.numel() else torch.zeros((), device=w.device)
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
            q, scale_inv = quantize_weight_tensorwise(w, amax, self._fp8_dtype, self._pow2)
            q = F.pad(q.view(torch.uint8), (0, 0, 0, rows - q.shape[0]))
            return (q,), ("tensorwise", self._fp8_dtype, scale_inv)
        blocks, _ = quantize_blocks(w, self._fp8_dtype, self._pow2)
        k = w.shape[1]
        scale_inv = blocks.scale_inv[:, : -(-k // BLOCK)].contiguous()
        return (blocks.data[:, :k].contiguous().view(torch.uint8), scale_inv), ("blockwise", self._fp8_dtype, None)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The gathered FP8 weight (and the tensors whose storage FSDP2 frees after use)."""
        kind, fp8_dtype, scale_inv = metadata
        data = all_gather_outputs[0].view(fp8_dtype)
        if kind == "blockwise":
            scale_inv = all_gather_outputs[1]
        if out is not None:  # a later all-gather into the same storage: only the scale is new
            out._scale_inv = scale_inv
            return None
        return Float8GatheredWeight(data, scale_inv, kind, param_dtype), (all_gather_outputs[0],)


class Float8GatheredWeight(torch.Tensor):
    """The unsharded weight after an FP8 all-gather: FP8 data [N, K] and its scale, presenting as a `dtype`
    tensor of shape [N, K]. Views FSDP2 takes keep the FP8 data; any other op sees the dequantised weight."""

    _data: torch.Tensor
    _scale_inv: torch.Tensor
    _kind: str

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, kind: str, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, data.size(), strides=data.stride(),
                                                   storage_offset=data.storage_offset(), dtype=dtype,
                                                   device=data.device, requires_grad=False)

    def __init__(self, data: torch.Tensor, scale_inv: torch.Tensor, kind: str, dtype: torch.dtype):
        self._data, self._scale_inv, self._kind = data, scale_inv, kind

    def __repr__(self) -> str:  # type: ignore[override]  # a plain repr, without torch's tensor_contents
        return f"Float8GatheredWeight({self._kind}, {tuple(self._data.shape)}, {self._data.dtype})"

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # torch's idiom

    def dequantize(self) -> torch.Tensor:
        if self._kind == "tensorwise":
            return (self._data.float() * self._scale_inv).to(self.dtype)
        s = self._scale_inv.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        return (self._data.float() * s[: self._data.shape[0], : self._data.shape[1]]).to(self.dtype)

    def _rewrap(self, data: torch.Tensor) -> Float8GatheredWeight:
        scale = self._scale_inv if self._kind == "tensorwise" else self._scale_inv[: -(-data.shape[0] // BLOCK)]
        return Float8GatheredWeight(data, scale, self._kind, self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        w = args[0]
        aten = torch.ops.aten
        if func in (aten.detach.default, aten.alias.default):
            return w._rewrap(func(w._data))
        if func is aten.as_strided.default and isinstance(w, cls):  # FSDP2: the padded gather -> the weight
            size, stride = args[1], args[2]
            offset = args[3] if len(args) > 3 else kwargs.get("storage_offset", 0)
            if offset in (0, None) and list(stride) == [size[1], 1] and w._data.is_contiguous():
                return w._rewrap(w._data[: size[0]])
        return func(*tree_map(lambda t: t.dequantize() if isinstance(t, cls) else t, args),
                    **tree_map(lambda t: t.dequantize() if isinstance(t, cls) else t, kwargs))
