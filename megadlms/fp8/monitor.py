"""FP8 numerics telemetry: amax, underflow and saturation per tensor role, summarised over a model.

Collection is off by default. `enable_fp8_stats(model)` makes every Float8Linear accumulate, on
the device and without host syncs, the statistics of each cast it does (inputs and gradients on
every micro-batch, the weight once per step); `fp8_stats(model)` reads them (one device-to-host
copy) and starts a new window. A trainer turns collection on for the step it logs.
"""

from __future__ import annotations

import torch
from torch import nn

from .convert import fp8_modules
from .linear import ROLES


def enable_fp8_stats(model: nn.Module, enabled: bool = True) -> None:
    """Turn statistics collection on (or off) for every Float8Linear of `model`."""
    for m in fp8_modules(model):
        m.collect_fp8_stats = bool(enabled)


def fp8_stats_enabled(model: nn.Module) -> bool:
    """Whether any Float8Linear of `model` is collecting telemetry (`enable_fp8_stats`)."""
    return any(m.collect_fp8_stats for m in fp8_modules(model))


@torch.no_grad()
def fp8_stats(model: nn.Module, reset: bool = True) -> dict[str, float]:
    """The statistics collected since the last reset, summarised over the model.

    Returns, for each role in (input, weight, grad) that was cast while collection was on:
      '{role}_amax': the largest |value| seen;
      '{role}_underflow': the fraction of values that were nonzero but became zero in FP8;
      '{role}_saturation': the fraction of values whose scaled magnitude reached the FP8 maximum.
    Empty when no Float8Linear recorded anything. reset=True zeroes the accumulators.
    """
    modules = list(fp8_modules(model))
    if not modules:
        return {}
    total = torch.stack([m.fp8_stats_buffer for m in modules])  # [n, 3, 4]
    summary = torch.stack([total[..., 0].amax(0), total[..., 1].sum(0), total[..., 2].sum(0),
                           total[..., 3].sum(0)], dim=1)  # [3, 4]
    values = summary.cpu().tolist()  # the one host sync
    if reset:
        for m in modules:
            m.fp8_stats_buffer.zero_()
            m._stats_epoch += 1
    out: dict[str, float] = {}
    for role, (amax, under, sat, numel) in zip(ROLES, values):
        if numel > 0:
            out[f"{role}_amax"] = amax
            out[f"{role}_underflow"] = under / numel
            out[f"{role}_saturation"] = sat / numel
    return out
