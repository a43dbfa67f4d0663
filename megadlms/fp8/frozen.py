"""`FrozenFP8Linear`: a linear whose weight never changes, stored once in FP8 (the frozen base of LoRA, the layers
of RL's frozen reference model: `frozen_copy`).

A frozen weight is a `Float8Linear` weight cache that never refreshes, with the high-precision weight dropped:

    weight_fp8        E4M3 [Np, Kp] (padded to multiples of 16), cast once from the weight
    weight_scale_inv  fp32 [] (tensorwise: max |W| / 448)

1 byte per weight, no BF16 or fp32 copy, no optimizer state. Both GEMMs that a frozen layer runs are FP8:

    fprop:  y  = x @ W^T   x cast E4M3 (current scaling, per call)
    dgrad:  dx = g @ W     g cast to `grad_dtype` (E5M2 for the HYBRID format, else E4M3); W^T transposed from the
                           stored bytes in the backward, freed when it returns

There is no weight gradient, so nothing of the input is saved for the backward. The GEMMs run whether or not an
`fp8_autocast` is entered: the stored weight is FP8 either way.
"""

from __future__ import annotations

import copy
from typing import Any, TypeVar

import torch
from torch import nn

from ..model import compute_dtype
from .gemm import fp8_gemm
from .hardware import check_fp8_support
from .kernels.ops import amax_of, cast_fp8, transpose_fp8
from .kernels.primitives import pad_2d, round_up16
from .linear import apply_keeping_dtypes
from .recipe import E4M3, E5M2
from .tensor import FP8Tensor, Scaling

BUFFERS = ("weight_fp8", "weight_scale_inv")
M = TypeVar("M", bound=nn.Module)


class FrozenFP8Linear(nn.Module):
    """x [..., in_features] -> [..., out_features] in the compute dtype, with a frozen FP8 weight (module docstring).

    Its buffers are not persistent: a frozen base comes from its own checkpoint (`megadlms.lora`), not from the
    checkpoints of what is trained on top of it. A bias, when the linear had one, is a frozen buffer too.
    """

    weight_fp8: torch.Tensor
    weight_scale_inv: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight_fp8: torch.Tensor, weight_scale_inv: torch.Tensor, in_features: int,
                 out_features: int, bias: torch.Tensor | None = None, *, grad_dtype: torch.dtype = E5M2,
                 fprop_fast_accum: bool = True):
        super().__init__()
        if weight_fp8.dtype != E4M3 or weight_fp8.shape != (round_up16(out_features), round_up16(in_features)):
            raise ValueError(f"weight_fp8 must be E4M3 [{round_up16(out_features)}, {round_up16(in_features)}], got "
                             f"{weight_fp8.dtype} {tuple(weight_fp8.shape)}")
        if grad_dtype not in (E4M3, E5M2):
            raise ValueError(f"grad_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {grad_dtype}")
        self.in_features, self.out_features = in_features, out_features
        self.grad_dtype, self.fprop_fast_accum = grad_dtype, fprop_fast_accum
        self.register_buffer("weight_fp8", weight_fp8, persistent=False)
        self.register_buffer("weight_scale_inv", weight_scale_inv.float().reshape(()), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, amax: torch.Tensor | None = None, **kwargs: Any) -> FrozenFP8Linear:
        """The frozen FP8 copy of `linear`'s weight [out, in] (and bias), scaled from `amax` (fp32 scalar; default
        max |weight|, e.g. a fused group's largest). The caller drops `linear` to free its high-precision weight."""
        w = linear.weight.detach()
        check_fp8_support(w.device)
        n, k = w.shape
        q, _, scale_inv, _ = cast_fp8(pad_2d(w, round_up16(n), round_up16(k)), None, None, E4M3, amax=amax)
        assert q is not None  # asked for
        new = cls(q, scale_inv, k, n, linear.bias, **kwargs)
        return new.train(linear.training)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight=E4M3 tensorwise, grad={'E5M2' if self.grad_dtype == E5M2 else 'E4M3'}")

    def _apply(self, fn: Any, recurse: bool = True) -> FrozenFP8Linear:
        # `model.to(torch.bfloat16)` moves the FP8 weight and its scale but keeps their dtypes
        return apply_keeping_dtypes(self, fn, BUFFERS, recurse)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the GEMMs use, W = q * scale_inv, as [out, in] in `dtype`."""
        w = self.weight_fp8[:self.out_features, :self.in_features].float() * self.weight_scale_inv
        return w.to(dtype)

    def weight_operand(self) -> FP8Tensor:
        """The frozen weight as the forward GEMM's operand: E4M3 [Np, Kp], one scale."""
        return FP8Tensor(self.weight_fp8, self.weight_scale_inv, Scaling.TENSOR)

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.in_features
        if x.shape[-1] != k:
            raise ValueError(f"FrozenFP8Linear expects input [..., {k}], got {tuple(x.shape)}")
        if x.numel() == 0:
            return x.new_zeros(*x.shape[:-1], self.out_features, dtype=compute_dtype(x))
        y = _FrozenFP8Fn.apply(x.reshape(-1, k), self, compute_dtype(x))
        return y.reshape(*x.shape[:-1], self.out_features)


def count_parameters(model: nn.Module) -> int:
    """The parameters of `model`, each `FrozenFP8Linear` counted by the weight (and bias) it keeps as buffers: the
    model's size whatever the storage of its frozen layers."""
    n = sum(p.numel() for p in model.parameters())
    for m in model.modules():
        if isinstance(m, FrozenFP8Linear):
            n += m.in_features * m.out_features + (0 if m.bias is None else m.bias.numel())
    return n


class _FrozenFP8Fn(torch.autograd.Function):
    """x [M, K] -> x @ W^T (+ b) [M, N] in out_dtype, and dx only in the backward (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mod: FrozenFP8Linear, out_dtype: torch.dtype) -> torch.Tensor:
        m = x.shape[0]
        kp = mod.weight_fp8.shape[1]
        xq, _, x_si, _ = cast_fp8(pad_2d(x.contiguous(), round_up16(m), kp), None, None, E4M3)
        assert xq is not None  # asked for
        xt = FP8Tensor(xq, x_si, Scaling.TENSOR)
        y = fp8_gemm(xt, mod.weight_operand(), out_dtype, mod.fprop_fast_accum)[:m, :mod.out_features]
        if mod.bias is not None:
            y = y + mod.bias.to(out_dtype)
        ctx.mod, ctx.m, ctx.x_dtype = mod, m, x.dtype
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None
        mod: FrozenFP8Linear = ctx.mod
        np_ = mod.weight_fp8.shape[0]
        gq, _, g_si, _ = cast_fp8(pad_2d(g.contiguous(), round_up16(ctx.m), np_), None, None, mod.grad_dtype)
        assert gq is not None  # asked for
        # W^T [Kp, Np], freed on return
        w_t = FP8Tensor(transpose_fp8(mod.weight_fp8), mod.weight_scale_inv, Scaling.TENSOR, transposed=True)
        dx = fp8_gemm(FP8Tensor(gq, g_si, Scaling.TENSOR), w_t, ctx.x_dtype, False)[:ctx.m, :mod.in_features]
        return dx, None, None


def frozen_copy(model: M) -> M:
    """A copy of `model` to read, never train (e.g. RL's frozen reference model): each `Float8Linear` becomes a
    `FrozenFP8Linear` cast from its weight now (E4M3 + a tensorwise scale: 1 byte a weight, no high-precision copy of
    it), the fused FP8 modules are left out (their members run one by one) and everything else is deep-copied in its
    dtype; in eval mode, so its forwards record no FP8 amaxes, and without gradients. A model without FP8 linears
    gives a plain frozen deep copy.

    Its FP8 layers compute as a tensorwise-scaled policy does (x cast with its own amax, the weight with its own), so
    against a delayed-scaling policy they differ by FP8 rounding alone."""
    from .fusions.fused_linear import FusedFloat8Projection
    from .fusions.fused_mlp import FusedFloat8MLP
    from .linear import Float8Linear

    memo: dict[int, Any] = {}
    group_amax: dict[int, torch.Tensor] = {}  # a fused group's members share one weight scale, as in the group
    for m in model.modules():
        if isinstance(m, FusedFloat8Projection):
            members = m.members()
            amax = torch.stack([amax_of(w.weight.detach()) for w in members]).amax()
            group_amax.update({id(w): amax for w in members})
    for name, m in model.named_modules():
        if isinstance(m, (FusedFloat8Projection, FusedFloat8MLP)):
            memo[id(m)] = None  # the slot stays empty in the copy
        elif isinstance(m, Float8Linear):
            if m.local_params()[0] is not m.weight:
                raise ValueError(f"frozen_copy: {name} holds a sharded (DTensor) weight; copy the model before "
                                 "tensor parallelism or FSDP2 shards it")
            memo[id(m)] = FrozenFP8Linear.from_linear(m, group_amax.get(id(m)), fprop_fast_accum=m.fprop_fast_accum,
                                                      grad_dtype=m.recipe.fp8_format.bwd_dtype)
    ref = copy.deepcopy(model, memo)
    ref.requires_grad_(False)
    return ref.eval()


def frozen_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with the weight and scale of each `FrozenFP8Linear` (which its own state_dict leaves out):
    what restores a `frozen_copy` exactly (`load_frozen_state_dict`)."""
    state = dict(model.state_dict())
    state.update(_frozen_buffers(model))
    return state


@torch.no_grad()
def load_frozen_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy a `frozen_state_dict` into `model`, a copy of the same structure (strict: every key on both sides)."""
    frozen = _frozen_buffers(model)
    missing = sorted(set(frozen) - set(state))
    if missing:
        raise KeyError(f"load_frozen_state_dict: the state has no {missing[0]} (and {len(missing) - 1} more FP8 "
                       "weights): it was not saved from a frozen copy of this model")
    model.load_state_dict({k: v for k, v in state.items() if k not in frozen}, strict=True)
    for k, t in frozen.items():
        t.copy_(state[k])


def _frozen_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weight and scale of each `FrozenFP8Linear` of `model`, by their state_dict-style names."""
    return {f"{name}.{b}" if name else b: getattr(m, b) for name, m in model.named_modules()
            if isinstance(m, FrozenFP8Linear) for b in BUFFERS}
