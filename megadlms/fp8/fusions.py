"""The fusions `convert_to_fp8` can install, as a registry: which module of the model each one fills and when it
applies. Each fused module fills a slot of its parent (hooks of megadlms.model that the parent calls), so the
module tree of a converted model says what runs:

    (self_attn): Attention(
      (q_proj): Float8Linear(...) ...
      (qkv_fusion): FusedFloat8Projection(q_proj, k_proj, v_proj)
    (mlp): MLP(
      (gate_up_fusion): FusedFloat8Projection(gate_proj, up_proj)
      (fusion): FusedFloat8MLP(gate_proj, up_proj, act_fn, down_proj)

A fused module holds no parameters or buffers (its members keep theirs: state_dict keys are unchanged) and runs
its members one by one wherever its fused path does not apply. A new fusion is an entry here and a module built
from the quantizers (`quantizer.py`) and the GEMM helper (`gemm.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ..model import MLP, Attention
from .fused_linear import FusedFloat8Projection
from .fused_mlp import FusedFloat8MLP


@dataclass(frozen=True)
class Fusion:
    """option: the `convert_to_fp8` keyword that switches it; parent: the module type it attaches to; slot: the
    parent's attribute it fills; build: the fused module for one parent, or None where it does not apply."""

    option: str
    parent: type
    slot: str
    build: Callable[[nn.Module], nn.Module | None]


# in order: the fused MLP shares the gate/up group installed before it
FUSIONS = (
    Fusion("fuse_projections", Attention, "qkv_fusion", lambda m: FusedFloat8Projection.of(m, ("q_proj", "k_proj",
                                                                                              "v_proj"))),
    Fusion("fuse_projections", MLP, "gate_up_fusion", lambda m: FusedFloat8Projection.of(m, ("gate_proj",
                                                                                              "up_proj"))),
    Fusion("fuse_mlp", MLP, "fusion", FusedFloat8MLP.of),
)


def install_fusions(module: nn.Module, options: dict[str, bool]) -> int:
    """Fill the slots of every submodule of `module` for which an enabled fusion (`options[fusion.option]`)
    applies. Returns how many fused modules were installed."""
    count = 0
    for fusion in FUSIONS:
        if not options.get(fusion.option, False):
            continue
        for sub in list(module.modules()):
            if isinstance(sub, fusion.parent) and getattr(sub, fusion.slot, None) is None:
                fused = fusion.build(sub)
                if fused is not None:
                    setattr(sub, fusion.slot, fused)
                    count += 1
    return count
