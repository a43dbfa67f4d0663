"""Weight amaxes kept by the optimizer step, for current (tensorwise) scaling.

Current scaling needs max |W| before each weight cast: a pass over the fp32 master weight of its own, ahead of the
cast's pass (benchmarks/fp8_block.py times it). The update that writes the weight
can produce it in the pass it makes anyway (`StreamingAdamW`: one atomic max per tile), and the cast then reads a
scalar. The values are the same: max is exact, so the casts, and training, are bit for bit what they are when each
cast computes its own amax.

`attach_weight_amaxes(model)` gives each current-scaling `Float8Linear` whose weight is a plain tensor a
`weight_amax` (`KeptAmax`): an fp32 scalar (a view into one buffer) set to max |weight| now, with the weight's
version counter at that moment. `StreamingAdamW.publish_amaxes` keeps them through its updates. A cast uses the
value only while the weight's version counter is the one recorded, so an in-place write that autograd sees (an EMA
copy's `lerp_`, a `copy_` under no_grad) makes the cast compute its own amax again; writes that bypass the
counter (through `.data`) must call `refresh_weight_amaxes(model)`, as they must invalidate the FP8 weight caches.
`Float8Linear.load_state_dict` refreshes its own. `detach_weight_amaxes(model)` goes back to an amax pass per cast.
"""

from __future__ import annotations

import sys
from typing import TypeGuard

import torch
from torch import nn

from ..linear import Float8Linear
from .kept_amax import KeptAmax


def _eligible(m: nn.Module) -> TypeGuard[Float8Linear]:
    dtensor = sys.modules.get("torch.distributed.tensor")
    return (isinstance(m, Float8Linear) and m.recipe.current_weight_scale
            and not (dtensor is not None and isinstance(m.weight, dtensor.DTensor)))


def attach_weight_amaxes(model: nn.Module) -> list[tuple[torch.Tensor, KeptAmax]]:
    """Give every eligible layer (current scaling, a plain weight) of `model` a `weight_amax` = max |weight| (fp32
    scalar views into one buffer per device). Returns the (weight, KeptAmax) pairs, for the optimizer to keep
    current (`StreamingAdamW.publish_amaxes`); empty when no layer is eligible."""
    layers = [m for m in model.modules() if _eligible(m)]
    pairs: list[tuple[torch.Tensor, KeptAmax]] = []
    by_device: dict[torch.device, list[Float8Linear]] = {}
    for m in layers:
        by_device.setdefault(m.weight.device, []).append(m)
    for device, ms in by_device.items():
        buf = torch.zeros(len(ms), dtype=torch.float32, device=device)
        for i, m in enumerate(ms):
            kept = KeptAmax(buf[i], -1)
            m.keep_weight_amax(kept)
            pairs.append((m.weight, kept))
    refresh_weight_amaxes(model)
    return pairs


def refresh_weight_amaxes(model: nn.Module) -> None:
    """Set every attached `weight_amax` of `model` to max |weight| now (after writing the weights other than by
    an optimizer that publishes them)."""
    for m in model.modules():
        if isinstance(m, Float8Linear):
            m.refresh_weight_amax()


def detach_weight_amaxes(model: nn.Module) -> None:
    """Back to an amax pass before each weight cast (an optimizer that was publishing them may stop)."""
    for m in model.modules():
        if isinstance(m, Float8Linear):
            m.keep_weight_amax(None)


__all__ = ["KeptAmax", "attach_weight_amaxes", "refresh_weight_amaxes", "detach_weight_amaxes"]
