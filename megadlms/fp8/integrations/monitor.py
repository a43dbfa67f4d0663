"""FP8 numerics telemetry: amax, underflow and saturation per tensor role, summarised over a model.

Collection is off by default. `enable_fp8_stats(model)` makes every FP8 module accumulate, on the device and
without host syncs, the statistics of each cast it does: a Float8Linear's inputs and gradients on every
micro-batch and its weight once per step (roles input, weight, grad); FP8 attention's q, k, v and output
gradient (roles attn_q, attn_k, attn_v, attn_grad). `fp8_stats(model)` reads them (one device-to-host copy) and
starts a new window. A trainer turns collection on for the step it logs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

import torch
from torch import nn

from ..linear import FP8Telemetry


def fp8_telemetry_modules(model: nn.Module) -> Iterator[FP8Telemetry]:
    """The modules of `model` that can record FP8 cast statistics (Float8Linears, FP8 attention)."""
    return (m for m in model.modules() if isinstance(m, FP8Telemetry))


def enable_fp8_stats(model: nn.Module, enabled: bool = True) -> None:
    """Turn statistics collection on (or off) for every FP8 module of `model`."""
    for m in fp8_telemetry_modules(model):
        m.set_collect_fp8_stats(enabled)


def fp8_stats_enabled(model: nn.Module) -> bool:
    """Whether any FP8 module of `model` is collecting telemetry (`enable_fp8_stats`)."""
    return any(m.collect_fp8_stats for m in fp8_telemetry_modules(model))


@torch.no_grad()
def fp8_stats(model: nn.Module, reset: bool = True) -> dict[str, float]:
    """The statistics collected since the last reset, summarised over the model.

    Returns, for each role that was cast while collection was on (input, weight, grad of the linears; attn_q,
    attn_k, attn_v, attn_grad of FP8 attention):
      '{role}_amax': the largest |value| seen;
      '{role}_underflow': the fraction of values that were nonzero but became zero in FP8;
      '{role}_saturation': the fraction of values whose scaled magnitude reached the FP8 maximum.
    Empty when no FP8 module recorded anything. reset=True zeroes the accumulators.
    """
    groups: dict[tuple[str, ...], list[FP8Telemetry]] = defaultdict(list)
    for m in fp8_telemetry_modules(model):
        groups[m.fp8_stats_roles].append(m)
    if not groups:
        return {}
    summaries = []
    for mods in groups.values():
        total = torch.stack([m.fp8_stats_buffer for m in mods])  # [n, roles, 4]
        summaries.append(torch.stack([total[..., 0].amax(0), total[..., 1].sum(0), total[..., 2].sum(0),
                                      total[..., 3].sum(0)], dim=1))  # [roles, 4]
    values = torch.cat(summaries).cpu().tolist()  # the one host sync
    if reset:
        for mods in groups.values():
            for m in mods:
                m.new_stats_window()
    out: dict[str, float] = {}
    roles = [r for names in groups for r in names]
    for role, (amax, under, sat, numel) in zip(roles, values):
        if numel > 0:
            out[f"{role}_amax"] = amax
            out[f"{role}_underflow"] = under / numel
            out[f"{role}_saturation"] = sat / numel
    return out
