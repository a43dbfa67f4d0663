"""The fusions `convert_to_fp8` can install, as a registry: which module of the model each one fills and when it
applies. Each fused module fills a slot of its parent (hooks of megadlms.model that the parent calls), so the
module tree of a converted model says what runs:

    (self_attn): Attention(
      (q_proj): Float8Linear(...) ...
      (qkv_fusion): FusedFloat8Projection(q_proj, k_proj, v_proj)
    (mlp): MLP(
      (gate_up_fusion): FusedFloat8Projection(gate_proj, up_proj)
      (fusion): FusedFloat8MLP(gate_proj, up_proj, act_fn, down_proj)

A fused module holds no parameters or buffers (its members keep theirs: state_dict keys are unchanged). Whether a
fusion applies is decided once, here, when the model is converted, and logged (`install_fusions`); a fused module
checks on each forward that the decision still holds and raises `FusionError` where it does not (`remove_fusions`
takes them out first, e.g. before tensor parallelism). A new fusion is an entry here and a module built from the
quantizers (`quantizer.py`) and the GEMM helper (`gemm.py`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ...model import MLP, Attention
from .fused_linear import FusedFloat8Projection, FusionError
from .fused_mlp import FusedFloat8MLP

log = logging.getLogger("megadlms")

__all__ = ["Fusion", "FUSIONS", "FusionError", "install_fusions", "log_fusion_decisions", "remove_fusions"]


@dataclass(frozen=True)
class Fusion:
    """option: the `convert_to_fp8` keyword that switches it; parent: the module type it attaches to; slot: the
    parent's attribute it fills; build: the fused module for one parent, or why it does not apply (a string);
    what: its name in the log."""

    option: str
    parent: type
    slot: str
    build: Callable[[nn.Module], nn.Module | str]
    what: str


# in order: the fused MLP shares the gate/up group installed before it
FUSIONS = (
    Fusion("fuse_projections", Attention, "qkv_fusion",
           lambda m: FusedFloat8Projection.of(m, ("q_proj", "k_proj", "v_proj")), "fused q/k/v"),
    Fusion("fuse_projections", MLP, "gate_up_fusion",
           lambda m: FusedFloat8Projection.of(m, ("gate_proj", "up_proj")), "fused gate/up"),
    Fusion("fuse_mlp", MLP, "fusion", FusedFloat8MLP.of, "fused MLP"),
)

# one decision: (fusion name, None where installed else why not)
Decision = tuple[str, "str | None"]


def install_fusions(module: nn.Module, options: dict[str, bool]) -> list[Decision]:
    """Fill the slots of every submodule of `module` for which an enabled fusion (`options[fusion.option]`)
    applies: the one decision per (fusion, module), made at conversion. Returns the decisions (for
    `log_fusion_decisions`)."""
    decisions: list[Decision] = []
    for fusion in FUSIONS:
        if not options.get(fusion.option, False):
            continue
        for sub in list(module.modules()):
            if isinstance(sub, fusion.parent) and getattr(sub, fusion.slot, None) is None:
                fused = fusion.build(sub)
                if isinstance(fused, str):
                    decisions.append((fusion.what, fused))
                else:
                    setattr(sub, fusion.slot, fused)
                    decisions.append((fusion.what, None))
    return decisions


def log_fusion_decisions(decisions: list[Decision]) -> None:
    """One log line: per fusion, on how many modules it was installed, and why not on the others."""
    if not decisions:
        return
    parts = []
    for what in dict.fromkeys(w for w, _ in decisions):
        mine = [why for w, why in decisions if w == what]
        why_not = Counter(why for why in mine if why is not None)
        part = f"{what} on {mine.count(None)} of {len(mine)}"
        if why_not:
            part += " (" + "; ".join(f"{n}: {why}" for why, n in why_not.items()) + ")"
        parts.append(part)
    log.info("FP8 fusions (decided at conversion): %s", ", ".join(parts))


def remove_fusions(model: nn.Module, why: str) -> int:
    """Empty every fusion slot of `model` (its layers then run one by one, as unfused), e.g. before tensor
    parallelism changes the members; logged with `why`. Returns how many fused modules were removed."""
    removed = 0
    for fusion in FUSIONS:
        for sub in model.modules():
            if isinstance(sub, fusion.parent) and getattr(sub, fusion.slot, None) is not None:
                setattr(sub, fusion.slot, None)
                removed += 1
    if removed:
        log.info("FP8 fusions: %d fused modules removed (%s); their layers run one by one", removed, why)
    return removed
