"""Inference-time fusion of the projections that read the same input: q/k/v and gate/up as one GEMM each.

`fuse_projections(model)` concatenates each layer's q/k/v (and gate/up) weights into one tensor, makes the
separate parameters views of it (no extra memory; names and state_dict unchanged), and installs a
`project_qkv` / `project_gate_up` hook on the instance (the hooks of megadlms.model) that runs one
`F.linear` and splits its output. One larger GEMM instead of three or two smaller ones: fewer launches
and better tensor-core use at the small N of the K/V projections. For generation only: the parameter
views are frozen, and moving or casting the model afterwards would separate them from the fused tensor
(fuse last, on the final device and dtype). FP8 layers are left alone (they fuse their own way).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..model import PROJECTION_GROUPS


class FusedProjection:
    """x [..., K] -> the member outputs, as views of one x @ W^T (W the row-concatenation of the weights).

    A plain object, not an nn.Module: installed as an instance attribute it adds no submodule, parameter or
    state_dict key."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int]):
        self.weight, self.bias, self.sizes = weight, bias, sizes

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)


@torch.no_grad()
def fuse_projections(model: nn.Module) -> int:
    """Fuse q/k/v and gate/up of every layer of `model` (in place, for inference). Returns the number of
    groups fused; layers whose projections are not plain nn.Linear (FP8) or mix bias settings are skipped."""
    count = 0
    for sub in model.modules():
        for cls, names, hook in PROJECTION_GROUPS:
            if not isinstance(sub, cls) or hook in sub.__dict__:
                continue
            mods = [getattr(sub, n) for n in names]
            if any(type(m) is not nn.Linear for m in mods) or len({m.bias is None for m in mods}) != 1:
                continue
            if len({(m.weight.device, m.weight.dtype) for m in mods}) != 1:
                continue
            weight = torch.cat([m.weight for m in mods])
            bias = torch.cat([m.bias for m in mods]) if mods[0].bias is not None else None
            sizes = [m.out_features for m in mods]
            for m, w in zip(mods, weight.split(sizes)):
                m.weight = nn.Parameter(w, requires_grad=False)
            if bias is not None:
                for m, b in zip(mods, bias.split(sizes)):
                    m.bias = nn.Parameter(b, requires_grad=False)
            setattr(sub, hook, FusedProjection(weight, bias, sizes))
            count += 1
    return count
