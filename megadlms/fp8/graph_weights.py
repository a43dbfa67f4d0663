"""FP8 weights cast once per optimizer step for layers replayed from CUDA graphs.

A CUDA graph of the layers' forward that contains the FP8 weight casts repeats them on every replay, i.e. on
every micro-batch: with gradient accumulation that is N casts of every weight per step where eager execution
makes one (the cache of `Float8Linear._fp8_weight`). `StepFP8Weights` moves the casts out of the graph: the
graph is captured reading the layers' cached FP8 weights as they are ("frozen": no version check, no cast), and
after each optimizer step the first replay is preceded by `refresh()`, which casts every weight eagerly, as the
eager path would, and copies the results into the captured cache tensors (their addresses are baked into the
graph). A refresh costs one cast and one copy of the FP8 weights per step, so it pays from two micro-batches
per step on; with one micro-batch the casts stay inside the graph.

The caches it manages: each `FusedFloat8Projection` group's concatenated weight (q/k/v, gate/up) with its
members' views, and the own cache of every other Float8Linear of the layers. Every tensor the graph reads from
them (q, the transposed copy for the input gradient, the scale inverses and the group scales of delayed scaling)
exists before the capture, so that nothing in them is allocated inside the graph's memory pool.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from .fused_linear import _GroupWeight
from .fused_mlp import fused_projections
from .linear import Float8Linear, _Fp8Weight
from .recipe import Float8RowwiseScaling


def _copy_into(dst: torch.Tensor | None, src: torch.Tensor | None) -> None:
    if dst is None or src is None or dst is src:
        return
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise RuntimeError(f"FP8 weight refresh: captured {tuple(dst.shape)} {dst.dtype}, new {tuple(src.shape)} "
                           f"{src.dtype}")
    dst.copy_(src)


class StepFP8Weights:
    """The FP8 weight caches of `layers` (a module holding Float8Linears), kept at fixed addresses for CUDA graphs
    and recast once per optimizer step (see the module docstring)."""

    def __init__(self, layers: nn.Module):
        self.groups = fused_projections(layers)
        grouped = {id(m) for g in self.groups for m in g.members()}
        self.modules = [m for m in layers.modules() if isinstance(m, Float8Linear)]
        self.single = [m for m in self.modules if id(m) not in grouped]
        self.captured_groups: list[_GroupWeight] = []
        self.captured_single: list[_Fp8Weight] = []
        self.num_refreshes = 0

    @staticmethod
    def supported(layers: nn.Module) -> bool:
        """Whether the layers' FP8 weights can be cast outside the graphs: per-tensor recipes, caching on."""
        mods = [m for m in layers.modules() if isinstance(m, Float8Linear)]
        return bool(mods) and all(type(m) is Float8Linear and m.cache_weight and
                                  not isinstance(m.recipe, Float8RowwiseScaling) for m in mods)

    # ----------------------------------------------------------------- casts
    def _cast_all(self) -> tuple[list[_GroupWeight], list[_Fp8Weight]]:
        """Cast every weight afresh (eager, the normal cache path) with the copies the backward needs."""
        for m in self.modules:
            m.invalidate_fp8_weight_cache()
        groups = []
        for g in self.groups:
            mods = g.members()
            for m in mods:
                m._grad_follows = True
            groups.append(g._group_weight(mods, want_t=True))
        single = []
        for m in self.single:
            m._grad_follows = True
            c = m._fp8_weight()
            m._fp8_weight_dgrad(c)  # the column-major copy for the input gradient, made now (not in the graph)
            single.append(c)
        return groups, single

    def precast(self) -> None:
        """Cast the weights for the capture; the caches made here are the ones the graphs will read."""
        with torch.no_grad():
            self.captured_groups, self.captured_single = self._cast_all()

    def stale(self) -> bool:
        """Whether any cache was dropped or replaced since the last cast (an optimizer step and `fp8_step`, a
        load, or an eager call after the weights changed)."""
        for g, c in zip(self.groups, self.captured_groups):
            if g._cache is not c or any(m._wcache is not mc for m, mc in zip(g.members(), c.members)):
                return True
        return any(m._wcache is not c for m, c in zip(self.single, self.captured_single))

    def refresh(self) -> None:
        """Recast every weight and write the results into the captured caches, which become current again."""
        with torch.no_grad():
            groups, single = self._cast_all()
            for g, old, new in zip(self.groups, self.captured_groups, groups):
                for name in ("q", "t", "scale_inv", "scales", "scale_invs"):
                    _copy_into(getattr(old, name), getattr(new, name))
                for m, om, nm in zip(g.members(), old.members, new.members):
                    om.key = nm.key
                    m._wcache = om
                g._cache = old
            for m, old, new in zip(self.single, self.captured_single, single):
                for name in ("q", "scale_inv", "scale_invs"):
                    _copy_into(getattr(old, name), getattr(new, name))
                _copy_into(old.dgrad[0], new.dgrad[0])  # its scale_inv is the cache's own, copied above
                old.key = new.key
                m._wcache = old
        self.num_refreshes += 1

    # ----------------------------------------------------------------- use
    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """Inside, the layers use their cached FP8 weights as they are (the captured forward)."""
        for m in self.modules:
            m._weights_frozen = True
        try:
            yield
        finally:
            for m in self.modules:
                m._weights_frozen = False
