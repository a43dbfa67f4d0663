"""FP8 weights cast once per optimizer step for layers replayed from CUDA graphs.

A CUDA graph of the layers' forward that contains the FP8 weight casts repeats them on every replay, i.e. on
every micro-batch: with gradient accumulation that is N casts of every weight per step where eager execution
makes one (the cache of `Float8Linear.fp8_weight`). `StepFP8Weights` moves the casts out of the graph: the
graph is captured reading the layers' cached FP8 weights as they are ("frozen": no version check, no cast), and
after each optimizer step the first replay is preceded by `refresh()`, which casts every weight eagerly, as the
eager path would, and copies the results into the captured cache tensors (their addresses are baked into the
graph). A refresh costs one cast and one copy of the FP8 weights per step, so it pays from two micro-batches
per step on; with one micro-batch the casts stay inside the graph.

The caches it manages: each `FusedFloat8Projection` group's concatenated weight (q/k/v, gate/up) with its
members' views, and the own cache of every other Float8Linear of the layers. Every tensor the graph reads from
them (q, the scale inverses and the group scales of delayed scaling) exists before the capture, so that nothing
in them is allocated inside the graph's memory pool. They hold q only: the transposed copy for the input
gradient is made from q in the backward graph, each replay, and freed with the layer's backward. Held for the
step it would take one more byte per weight for the whole step; made per micro-batch it costs one read and one
write of that byte.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ..fusions.fused_linear import FusedFloat8Projection
from ..fusions.fused_mlp import fused_projections
from ..linear import WEIGHT, Float8Linear, FP8WeightCache


def _copy_into(dst: torch.Tensor | None, src: torch.Tensor | None) -> None:
    if dst is None or src is None or dst is src:
        return
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise RuntimeError(f"FP8 weight refresh: captured {tuple(dst.shape)} {dst.dtype}, new {tuple(src.shape)} "
                           f"{src.dtype}")
    dst.copy_(src)


def _copy_weight(old: FP8WeightCache, new: FP8WeightCache) -> None:
    """A fresh cast into the captured cache's tensors: the FP8 rows, their scale inverse and the step's delayed
    scales (a layer's own are its scale buffer itself); no dgrad: these caches hold the rows only."""
    _copy_into(old.rows.data, new.rows.data)
    _copy_into(old.rows.scale_inv, new.rows.scale_inv)
    if old.step is not None and new.step is not None:
        _copy_into(old.step.scales, new.step.scales)
        _copy_into(old.step.scale_invs, new.step.scale_invs)


class StepFP8Weights:
    """The FP8 weight caches of `layers` (a module holding Float8Linears), kept at fixed addresses for CUDA graphs
    and recast once per optimizer step (see the module docstring)."""

    def __init__(self, layers: nn.Module):
        self.groups = fused_projections(layers)
        grouped = {id(m) for g in self.groups for m in g.members()}
        self.modules = [m for m in layers.modules() if isinstance(m, Float8Linear)]
        self.single = [m for m in self.modules if id(m) not in grouped]
        self.captured_groups: list[FP8WeightCache] = []
        self.captured_single: list[FP8WeightCache] = []
        self.num_refreshes = 0

    @staticmethod
    def supported(layers: nn.Module) -> bool:
        """Whether the layers' FP8 weights can be cast outside the graphs: per-tensor recipes, caching on."""
        mods = [m for m in layers.modules() if isinstance(m, Float8Linear)]
        return bool(mods) and all(type(m) is Float8Linear and m.cache_weight and
                                  m.quantizers[WEIGHT].per_tensor for m in mods)

    # ----------------------------------------------------------------- casts
    # Each cast is the eager cache path, writing q only: the backward graph transposes it for the input gradient
    # on every replay and does not keep the transpose.
    @staticmethod
    def _cast_group(g: FusedFloat8Projection) -> FP8WeightCache:
        c = g.fp8_weight(False, want_t=False)
        for mc in (c, *c.members):
            mc.keep_dgrad = False
        return c

    @staticmethod
    def _cast_single(m: Float8Linear) -> FP8WeightCache:
        c = m.fp8_weight(False, want_t=False)
        c.keep_dgrad = False
        return c

    def _invalidate(self) -> None:
        for m in self.modules:
            m.invalidate_fp8_weight_cache()

    def precast(self) -> None:
        """Cast the weights for the capture; the caches made here are the ones the graphs will read."""
        with torch.no_grad():
            self._invalidate()
            self.captured_groups = [self._cast_group(g) for g in self.groups]
            self.captured_single = [self._cast_single(m) for m in self.single]

    def stale(self) -> bool:
        """Whether any cache was dropped or replaced since the last cast (an optimizer step and `fp8_step`, a
        load, or an eager call after the weights changed)."""
        for g, c in zip(self.groups, self.captured_groups):
            if g.weight_cache is not c or any(m.weight_cache is not mc for m, mc in zip(g.members(), c.members)):
                return True
        return any(m.weight_cache is not c for m, c in zip(self.single, self.captured_single))

    def refresh(self) -> None:
        """Recast every weight and write the results into the captured caches, which become current again.

        One fused group or weight at a time: each fresh cast is freed once copied, so a refresh needs memory for one
        group's FP8 copies beside the captured ones, not for a second copy of all of them (which would have to be
        free at the start of every step)."""
        with torch.no_grad():
            self._invalidate()
            for g, old in zip(self.groups, self.captured_groups):
                self._refresh_group(g, old)
            for m, kept in zip(self.single, self.captured_single):
                self._refresh_single(m, kept)
        self.num_refreshes += 1

    def _refresh_group(self, g: FusedFloat8Projection, old: FP8WeightCache) -> None:
        new = self._cast_group(g)
        _copy_weight(old, new)
        old.recorded = new.recorded
        for m, om, nm in zip(g.members(), old.members, new.members):
            om.key, om.recorded = nm.key, nm.recorded
            m.restore_weight_cache(om)
        g.restore_weight_cache(old)

    def _refresh_single(self, m: Float8Linear, old: FP8WeightCache) -> None:
        new = self._cast_single(m)
        _copy_weight(old, new)
        old.key, old.recorded = new.key, new.recorded
        m.restore_weight_cache(old)

    # ----------------------------------------------------------------- use
    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """Inside, the layers use their cached FP8 weights as they are (the captured forward)."""
        for m in self.modules:
            m.freeze_weights(True)
        try:
            yield
        finally:
            for m in self.modules:
                m.freeze_weights(False)
