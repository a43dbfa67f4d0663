"""Quantizers: one per (tensor role, recipe) of an FP8 layer, the only place a recipe's scaling happens.

A quantizer turns a high-precision 2-D tensor into the FP8 operands the GEMMs take (`FP8Copies`: `rows`, the
tensor, and/or `cols`, its transpose, each a `tensor.FP8Tensor` stating its scaling) and records the tensor's amax
where its recipe keeps a history. The recipe is a kind of quantizer, chosen once when the layer is built
(`make_quantizer`, through `QUANTIZER_KINDS`):

    DelayedQuantizer     per tensor; the scale of the last `fp8_step` (history of past amaxes), x's own amax
                         before the first one; records x's amax into the history slot of its role
    CurrentQuantizer     per tensor; the scale from x's amax at cast time (or a kept weight amax)
    RowwiseQuantizer     one scale per row of `rows`, and per row of `cols` (i.e. per column of x), each
                         cast from x: `torch._scaled_mm` takes scales only along the non-contracted dimension
    BlockwiseQuantizer   activations/gradients in 1x128 tiles along each copy's own K (`rows` and `cols` from one
                         pass), weights in 128x128 blocks (`blockwise.py`); padded to multiples of 128
    MXQuantizer          MXFP8: one E8M0 scale per 32 elements along each copy's own K (`mx.py`)
    GroupQuantizer       one role of the members of a fused group (per-tensor kinds): one scale for the group's
                         shared operand (the input, the concatenated gradient) and its concatenated weight

A per-tensor cast that another kernel performs (the fused MLP's SwiGLU casts) takes its scale from `fused_scale`
and records into `amax_slots`.

The delayed scaling state (amax history, scales, whether scales exist yet) stays in the owning module's buffers
(`fp8_amax_history[:, role]`, `fp8_scale[role]`: the state_dict keys, reduced across ranks and updated by
`fp8_step` for all modules at once); a delayed quantizer reads and writes its column through `owner`. The scales
of one step, with their inverses, travel with the step's FP8 weight to every cast of the step (`StepScales`).

Adding a recipe: a recipe dataclass, a Quantizer subclass producing `FP8Tensor`s of its `Scaling`, its entry in
`QUANTIZER_KINDS` and its kernel call in `gemm.fp8_gemm`. Kinds whose GEMM needs more than FP8 support check the
device in `check_device` (called when a model is converted on a GPU).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .formats.blockwise import BLOCK, block_scale_buffer, check_blockwise_gemm_support, quantize_blocks, quantize_tiles
from .formats.mx import check_mx_gemm_support, quantize_mx
from .gemm import aligned_scalars, dequant_scale
from .kernels.ops import amax_of, cast_fp8, cast_fp8_cat, cast_fp8_cols, current_scale, transpose_fp8
from .kernels.primitives import quantize_rowwise
from .kernels.triton_cast import checked_rowwise_cast
from .recipe import (
    DelayedScaling,
    Float8BlockwiseScaling,
    Float8CurrentScaling,
    Float8MXScaling,
    Float8RowwiseScaling,
    Recipe,
)
from .tensor import FP8Tensor, Scaling

WEIGHT_ROLE = 1  # the weight's role index in the linears (input, weight, grad)


@dataclass
class FP8Copies:
    """The FP8 copies one cast made of a 2-D tensor x [R, C]: `rows` = x as [R, C], `cols` = x^T as [C, R] (each an
    `FP8Tensor`, row-major with its scale_inv), whichever the caller asked for (None otherwise)."""

    rows: FP8Tensor | None = None
    cols: FP8Tensor | None = None

    @staticmethod
    def per_tensor(q: torch.Tensor | None, t: torch.Tensor | None, scale_inv: torch.Tensor) -> FP8Copies:
        """The copies a per-tensor cast made, q [R, C] and/or q^T [C, R] (None where not made), with their scale."""
        return FP8Copies(FP8Tensor(q, scale_inv, Scaling.TENSOR) if q is not None else None,
                         FP8Tensor(t, scale_inv, Scaling.TENSOR, transposed=True) if t is not None else None)

    def any_copy(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [R, C], scale_inv broadcastable to it) from whichever copy exists: what telemetry compares x with."""
        if self.rows is not None:
            return self.rows.data, dequant_scale(self.rows)
        cols = self.col_copy()
        return cols.data.t(), dequant_scale(cols).t()

    def row_copy(self) -> FP8Tensor:
        """`rows`, where the caller asked the cast for it."""
        assert self.rows is not None, "the cast made no row-major copy"
        return self.rows

    def col_copy(self) -> FP8Tensor:
        """`cols`, where the caller asked the cast for it."""
        assert self.cols is not None, "the cast made no transposed copy"
        return self.cols


class StepScales:
    """Delayed scaling's per-tensor scales of one optimizer step, one per tensor role ([roles] fp32), and their
    inverses; made once per step with the FP8 weight and used by every cast of the step."""

    __slots__ = ("scales", "_scale_invs")

    def __init__(self, scales: torch.Tensor):
        self.scales = scales
        self._scale_invs: torch.Tensor | None = None

    @property
    def scale_invs(self) -> torch.Tensor:
        """1 / scales, each a 16-byte aligned 0-dim view (a GEMM scale without a copy); made on first use."""
        if self._scale_invs is None:
            self._scale_invs = aligned_scalars(self.scales.reciprocal())[:, 0]
        return self._scale_invs


class Quantizer:
    """Casts one tensor role to FP8 with one recipe (see the module docstring).

    per_tensor: one scale for the whole tensor (the fused groups and CUDA-graph weight casts need that).
    cols_in_same_pass: `quantize` makes `cols` in the same pass as `rows` (per-tensor: the transpose of the same
        FP8 values); otherwise `cols` is a cast of its own, which for a weight is made when first needed.
    keeps_history: the scale comes from past amaxes kept in the owner's buffers (delayed scaling), which `fp8_step`
        turns into scales; fused groups then share one scale per operand (the smallest of their members').
    """

    per_tensor = True
    cols_in_same_pass = True
    keeps_history = False

    def __init__(self, recipe: Recipe, fp8_dtype: torch.dtype):
        self.recipe, self.fp8_dtype = recipe, fp8_dtype

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.fp8_dtype})"

    def quantize(self, x: torch.Tensor, rows: bool = True, cols: bool = False, record: bool = False,
                 amax: torch.Tensor | None = None, step: StepScales | None = None) -> FP8Copies:
        """x [R, C] (any float dtype, padded to multiples of 16) -> its FP8 `rows` and/or `cols`.

        record: add x's amax to the scaling history (delayed scaling; ignored elsewhere).
        amax: max |x| when the caller knows it (a weight's kept amax); step: this step's delayed scales, when the
        caller has them (from its FP8 weight)."""
        raise NotImplementedError

    def amax_slots(self) -> list[torch.Tensor]:
        """Where a cast of this role records its amax (delayed scaling's history slots; none for other kinds)."""
        return []

    def fused_scale(self, step: StepScales | None, amax: Callable[[], torch.Tensor | None]
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(scale, scale_inv) of a per-tensor cast that another kernel performs: current scaling's from `amax()`
        (max |x|, computed by the caller's kernel), None when that gives None (its kernel is off)."""
        a = amax()
        return current_scale([a], self.fp8_dtype, self.recipe.margin) if a is not None else None

    def cols_of(self, rows: FP8Tensor, source: Callable[[], torch.Tensor]) -> FP8Tensor:
        """The transposed operand of a tensor x [R, C] whose `rows` exist already (a cached FP8 weight); `source`
        gives x itself, for kinds that cast the transpose from it."""
        return FP8Tensor(transpose_fp8(rows.data), rows.scale_inv, Scaling.TENSOR, transposed=True)

    def check_device(self, device_index: int) -> None:
        """Raise FP8UnsupportedError (one line) unless this kind's GEMM runs on cuda:`device_index`."""


class CurrentQuantizer(Quantizer):
    """Per-tensor current scaling: scale = (fp8_max / amax(x)) / 2**margin (`Float8CurrentScaling`)."""

    def quantize(self, x: torch.Tensor, rows: bool = True, cols: bool = False, record: bool = False,
                 amax: torch.Tensor | None = None, step: StepScales | None = None) -> FP8Copies:
        q, t, si, _ = cast_fp8(x, None, None, self.fp8_dtype, self.recipe.margin, rows, cols, amax=amax)
        return FP8Copies.per_tensor(q, t, si)


class DelayedQuantizer(Quantizer):
    """Per-tensor delayed scaling (`DelayedScaling`): the scale `owner.fp8_scale[role]` of the last `fp8_step`,
    and x's amax recorded into `owner.fp8_amax_history[0, role]`. Before the first `fp8_step` (no scales yet) the
    scale comes from x's own amax, as current scaling."""

    keeps_history = True

    def __init__(self, recipe: Recipe, fp8_dtype: torch.dtype, owner: Any, role: int):
        super().__init__(recipe, fp8_dtype)
        self.owner, self.role = owner, role

    def __repr__(self) -> str:
        return f"DelayedQuantizer({self.fp8_dtype}, role={self.role})"

    def scale(self) -> torch.Tensor | None:
        """The delayed scale of this role (fp32 0-dim view), or None before the first `fp8_step`."""
        return self.owner.fp8_scale[self.role] if self.owner.scales_ready() else None

    def amax_slot(self) -> torch.Tensor:
        """This step's amax of this role in the history (fp32 0-dim view, raised in place by casts)."""
        return self.owner.fp8_amax_history[0, self.role]

    def amax_slots(self) -> list[torch.Tensor]:
        return [self.amax_slot()]

    def quantize(self, x: torch.Tensor, rows: bool = True, cols: bool = False, record: bool = False,
                 amax: torch.Tensor | None = None, step: StepScales | None = None) -> FP8Copies:
        scale: torch.Tensor | None
        if step is not None:
            scale, scale_inv = step.scales[self.role], step.scale_invs[self.role]
        else:
            scale, scale_inv = self.scale(), None
        slot = self.amax_slot() if record else None
        q, t, si, _ = cast_fp8(x, scale, slot, self.fp8_dtype, self.recipe.margin, rows, cols, amax=amax,
                               scale_inv=scale_inv)
        return FP8Copies.per_tensor(q, t, si)

    def fused_scale(self, step: StepScales | None, amax: Callable[[], torch.Tensor | None]
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if step is not None:
            return step.scales[self.role], step.scale_invs[self.role]
        return super().fused_scale(step, amax)


class _SeparateCastsQuantizer(Quantizer):
    """A kind whose transposed copy is a cast of its own from x (its scales run along the other dimension, the one
    the backward GEMMs contract): `rows` from `_rows(x)`, `cols` from `_cols(x)`."""

    per_tensor = False
    cols_in_same_pass = False

    def quantize(self, x: torch.Tensor, rows: bool = True, cols: bool = False, record: bool = False,
                 amax: torch.Tensor | None = None, step: StepScales | None = None) -> FP8Copies:
        return FP8Copies(self._rows(x) if rows else None, self._cols(x) if cols else None)

    def cols_of(self, rows: FP8Tensor, source: Callable[[], torch.Tensor]) -> FP8Tensor:
        return self._cols(source())

    def _rows(self, x: torch.Tensor) -> FP8Tensor:
        raise NotImplementedError

    def _cols(self, x: torch.Tensor) -> FP8Tensor:
        raise NotImplementedError


class RowwiseQuantizer(_SeparateCastsQuantizer):
    """One scale per row (`Float8RowwiseScaling`): `rows` scaled per row of x, `cols` per column of x. Where the
    Triton kernels run, both copies come from two reads of x (the row and column maxima, then both casts:
    `triton_cast.rowwise_cast`); elsewhere each is a torch cast of its own."""

    recipe: Float8RowwiseScaling
    # a cached weight's transposed copy (scaled per input channel) is made with its rows, from the same two reads
    cols_in_same_pass = True

    def quantize(self, x: torch.Tensor, rows: bool = True, cols: bool = False, record: bool = False,
                 amax: torch.Tensor | None = None, step: StepScales | None = None) -> FP8Copies:
        fused = checked_rowwise_cast(x, self.fp8_dtype, rows, cols, self.recipe.margin)
        if fused is None:
            return super().quantize(x, rows, cols, record, amax, step)
        q, t, row_si, col_si = fused
        return FP8Copies(FP8Tensor(q, row_si, Scaling.ROW) if q is not None and row_si is not None else None,
                         FP8Tensor(t, col_si, Scaling.ROW, transposed=True) if t is not None and col_si is not None
                         else None)

    def cols_of(self, rows: FP8Tensor, source: Callable[[], torch.Tensor]) -> FP8Tensor:
        return self.quantize(source(), rows=False, cols=True).col_copy()

    def _rows(self, x: torch.Tensor) -> FP8Tensor:
        q, si = quantize_rowwise(x, self.fp8_dtype, 1, self.recipe.margin)  # si [R, 1]
        return FP8Tensor(q, si, Scaling.ROW)

    def _cols(self, x: torch.Tensor) -> FP8Tensor:
        q, si = quantize_rowwise(x, self.fp8_dtype, 0, self.recipe.margin)  # one scale per column: si [1, C]
        return FP8Tensor(transpose_fp8(q), si.reshape(-1, 1), Scaling.ROW, transposed=True)


class BlockwiseQuantizer(Quantizer):
    """`Float8BlockwiseScaling`: an activation or gradient in 1x128 tiles (`rows` tiled along x's columns, `cols`
    = x^T tiled along x's rows, both from one pass), a weight (`blocks`) in 128x128 blocks, whose transpose is the
    same FP8 values with the block scales transposed. Copies are padded to multiples of 128."""

    per_tensor = False
    recipe: Float8BlockwiseScaling

    def __init__(self, recipe: Recipe, fp8_dtype: torch.dtype, blocks: bool = False):
        super().__init__(recipe, fp8_dtype)
        self.blocks = blocks

    def __repr__(self) -> str:
        return f"BlockwiseQuantizer({self.fp8_dtype}, {'128x128 blocks' if self.blocks else '1x128 tiles'})"

    def quantize(self, x: torch.Tensor, rows: bool = True, cols: bool = False, record: bool = False,
                 amax: torch.Tensor | None = None, step: StepScales | None = None) -> FP8Copies:
        cast = quantize_blocks if self.blocks else quantize_tiles
        q, t = cast(x, self.fp8_dtype, self.recipe.pow2_scales, transpose=cols)
        return FP8Copies(q if rows else None, t)

    def cols_of(self, rows: FP8Tensor, source: Callable[[], torch.Tensor]) -> FP8Tensor:
        if not self.blocks:
            return self.quantize(source(), rows=False, cols=True).col_copy()
        kb = -(-rows.data.shape[1] // BLOCK)
        return FP8Tensor(transpose_fp8(rows.data), block_scale_buffer(rows.scale_inv[:, :kb].t()), Scaling.BLOCK,
                         transposed=True)

    def check_device(self, device_index: int) -> None:
        check_blockwise_gemm_support(device_index)


class MXQuantizer(_SeparateCastsQuantizer):
    """`Float8MXScaling`: `rows` with one E8M0 scale per 32 elements of each row, `cols` the same of x^T (the blocks
    run along the contracted dimension)."""

    recipe: Float8MXScaling

    def _rows(self, x: torch.Tensor) -> FP8Tensor:
        return FP8Tensor(*quantize_mx(x, self.recipe.rounding), Scaling.MX)

    def _cols(self, x: torch.Tensor) -> FP8Tensor:
        return FP8Tensor(*quantize_mx(x.t(), self.recipe.rounding), Scaling.MX, transposed=True)

    def check_device(self, device_index: int) -> None:
        check_mx_gemm_support(device_index)


class GroupQuantizer(Quantizer):
    """One tensor role of the members of a fused group (per-tensor kinds: delayed or current scaling): the casts of
    the group's operands with one scale for the whole group.

    The scale: the step's shared delayed scale (`StepScales` made by the group: the smallest of the members'
    scales, i.e. the largest amax any of them saw), else (current scaling, and delayed scaling before the first
    `fp8_step`) one from the amax of the operand being cast. Delayed scaling records into every member's history:
    a shared operand's amax into each member's slot, each member's own weight amax into its own."""

    def __init__(self, members: Sequence[Quantizer], role: int):
        super().__init__(members[0].recipe, members[0].fp8_dtype)
        self.members, self.role = tuple(members), role
        self.keeps_history = members[0].keeps_history

    def __repr__(self) -> str:
        return f"GroupQuantizer({self.fp8_dtype}, role={self.role}, {len(self.members)} members)"

    def amax_slots(self) -> list[torch.Tensor]:
        return [s for m in self.members for s in m.amax_slots()]

    def _scales(self, step: StepScales | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (step.scales[self.role], step.scale_invs[self.role]) if step is not None else (None, None)

    def quantize(self, x: torch.Tensor, rows: bool = True, cols: bool = False, record: bool = False,
                 amax: torch.Tensor | None = None, step: StepScales | None = None) -> FP8Copies:
        """The shared operand x [R, C] (the group's input), x's amax recorded into every member's slot."""
        scale, scale_inv = self._scales(step)
        slots = self.amax_slots() if record else None
        q, t, si, _ = cast_fp8(x, scale, slots, self.fp8_dtype, self.recipe.margin, rows, cols, amax=amax,
                               scale_inv=scale_inv)
        return FP8Copies.per_tensor(q, t, si)

    def quantize_cat(self, ws: Sequence[torch.Tensor], cols: bool = False, record: bool = False,
                     amaxes: Sequence[torch.Tensor | None] | None = None, step: StepScales | None = None
                     ) -> FP8Copies:
        """The members' weights ws[i] [N_i, K] as one operand [sum N_i, K] (`rows`, and `cols` = its transpose),
        without their high-precision concatenation; each member's own amax recorded into its own slot.
        amaxes: max |ws[i]| where kept by the weights' writer (None entries are computed)."""
        slots = self.amax_slots() if record else []
        if step is not None:
            q, t = cast_fp8_cat(list(ws), step.scales[self.role], self.fp8_dtype, cols, slots or None)
            scale_inv = step.scale_invs[self.role]
        else:  # one current scale from the largest of the members' amaxes
            kept = amaxes if amaxes is not None else [None] * len(ws)
            found = [a if a is not None else amax_of(w) for a, w in zip(kept, ws)]
            if slots:
                torch._foreach_maximum_(slots, found)
            scale, scale_inv = current_scale(found, self.fp8_dtype, self.recipe.margin)
            q, t = cast_fp8_cat(list(ws), scale, self.fp8_dtype, cols)
        return FP8Copies.per_tensor(q, t, scale_inv)

    def quantize_cols(self, parts: Sequence[torch.Tensor], padded_rows: int, rows: bool = True, cols: bool = False,
                      record: bool = False, step: StepScales | None = None) -> FP8Copies:
        """The column blocks parts[i] [M, N_i] (the members' output gradients) as one operand [M, sum N_i] zero-padded
        to `padded_rows` rows, without their high-precision concatenation; the amax of all of them recorded into every
        member's slot."""
        scale, scale_inv = self._scales(step)
        slots = self.amax_slots() if record else None
        q, t, si = cast_fp8_cols(parts, scale, slots, self.fp8_dtype, self.recipe.margin, padded_rows, rows, cols,
                                 scale_inv=scale_inv)
        return FP8Copies.per_tensor(q, t, si)

    def fused_scale(self, step: StepScales | None, amax: Callable[[], torch.Tensor | None]
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        scale, scale_inv = self._scales(step)
        if scale is not None and scale_inv is not None:
            return scale, scale_inv
        return super().fused_scale(step, amax)


QUANTIZER_KINDS: dict[type, type[Quantizer]] = {DelayedScaling: DelayedQuantizer,
                                                Float8CurrentScaling: CurrentQuantizer,
                                                Float8RowwiseScaling: RowwiseQuantizer,
                                                Float8BlockwiseScaling: BlockwiseQuantizer,
                                                Float8MXScaling: MXQuantizer}


def make_quantizer(recipe: Recipe, fp8_dtype: torch.dtype, owner: Any, role: int) -> Quantizer:
    """The quantizer of `recipe`'s kind for tensor role `role` of the module `owner` (whose buffers hold the
    delayed scaling state)."""
    kind = QUANTIZER_KINDS[type(recipe)]
    if kind is DelayedQuantizer:
        return DelayedQuantizer(recipe, fp8_dtype, owner, role)
    if kind is BlockwiseQuantizer:
        return BlockwiseQuantizer(recipe, fp8_dtype, blocks=role == WEIGHT_ROLE)
    return kind(recipe, fp8_dtype)


__all__ = ["FP8Copies", "StepScales", "Quantizer", "CurrentQuantizer", "DelayedQuantizer", "RowwiseQuantizer",
           "BlockwiseQuantizer", "MXQuantizer", "GroupQuantizer", "QUANTIZER_KINDS", "WEIGHT_ROLE", "make_quantizer"]
