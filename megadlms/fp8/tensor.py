"""`FP8Tensor`: the one type of FP8 data in the engine, which states how it is scaled.

Every FP8 GEMM operand, every cast's output and every gathered or frozen FP8 weight is an `FP8Tensor`: FP8 `data`
[R, K], row-major with K contiguous (the dimension a GEMM contracts), its `scale_inv` (x ~= data * scale_inv,
broadcast per `scaling`), the `scaling` and whether `data` holds the tensor it was cast from or its transpose. The
GEMM helper dispatches on `scaling` (`gemm.fp8_gemm`), never on the shape or strides of a scale.

    scaling  granularity                   scale_inv
    TENSOR   one scale                     fp32 0-dim
    ROW      one scale per row of data     fp32 [R, 1]
    TILE     1x128 along K                 fp32 [R, K/128], column-major (what the GPU's blockwise GEMM takes)
    BLOCK    128x128                       fp32 [R/128, L4] buffer, L4 = K/128 rounded up to 4 (`blockwise.py`)
    MX       1x32 along K                  E8M0 [R, K/32] (`mx.py`)
    EXPERT   one scale per expert          fp32, written out per row as ROW's (grouped operands below)

Grouped operands (the MoE experts, `offs`: int32 [E] cumulative ends of the expert groups) keep their scales in the
layout `torch._scaled_grouped_mm` takes: per row for ROW, the row's expert's scale for EXPERT:

    operand                                    data          scale_inv
    rows grouped by expert (x, g)              [M, K]        fp32 [M]
    expert weights (W, or W^T: transposed)     [E, N, K]     fp32 [E, N]
    transposed copy grouped along M (x^T, g^T) [C, M]        fp32 [E, C]: per (expert, row of data)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = ["Scaling", "FP8Tensor"]


class Scaling(enum.Enum):
    """How an `FP8Tensor`'s scale covers its data (module docstring)."""

    TENSOR = "tensor"
    ROW = "row"
    TILE = "tile"
    BLOCK = "block"
    MX = "mx"
    EXPERT = "expert"


@dataclass(frozen=True, eq=False)
class FP8Tensor:
    """FP8 data [R, K] with its scale_inv and `scaling` (module docstring).

    transposed: `data` is x^T [C, R] of the tensor x [R, C] that was cast (the copy the backward GEMMs take), whose
    scales then run along x's dim 0; otherwise `data` is x itself, scaled along its dim 1."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    scaling: Scaling
    transposed: bool = False
    offs: torch.Tensor | None = None  # grouped operands: int32 [E] ends of the expert groups along M (module doc)

    @property
    def axis(self) -> int | None:
        """The dimension of the cast tensor x along which one scale covers consecutive elements: 1 (x's rows) or 0
        (x's columns, a transposed copy); None where a scale covers a whole tensor or a 2-D block."""
        if self.scaling in (Scaling.TENSOR, Scaling.BLOCK, Scaling.EXPERT):
            return None
        return 0 if self.transposed else 1

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def with_data(self, data: torch.Tensor, scale_inv: torch.Tensor | None = None) -> FP8Tensor:
        """The same scaling over other data (a slice, a transpose, a gathered copy) and, when given, scale_inv."""
        return FP8Tensor(data, self.scale_inv if scale_inv is None else scale_inv, self.scaling, self.transposed,
                         self.offs)

    def __repr__(self) -> str:
        t = ", transposed" if self.transposed else ""
        t += f", {self.offs.shape[0]} expert groups" if self.offs is not None else ""
        return f"FP8Tensor({tuple(self.data.shape)}, {self.data.dtype}, {self.scaling.value}{t})"
