"""FP8 recipes: small dataclasses with Transformer Engine's names and meanings.

A recipe says which FP8 formats are used and how the scale of each FP8 tensor is chosen:

- `DelayedScaling`: one scale per tensor, derived from a history of past amaxes (the scale used in
  step t comes from amaxes seen up to step t-1); histories are reduced across ranks once a step.
- `Float8CurrentScaling`: one scale per tensor, from the amax of the tensor being cast.
- `Float8RowwiseScaling`: one scale per row of activations/gradients and per output channel of
  weights, from the rows being cast (`torch._scaled_mm` rowwise scales).
- `Float8BlockwiseScaling`: one scale per 1x128 tile of activations/gradients and per 128x128 block of
  weights (DeepSeek-V3; `blockwise.py`), E4M3 everywhere.
- `Float8MXScaling`: MXFP8, one power-of-two E8M0 scale per 32 elements along K (`mx.py`), E4M3.

In the per-tensor and rowwise recipes: scale = (fp8_max / amax) / 2**margin,
q = cast(clamp(x * scale, -fp8_max, fp8_max)), x ~= q / scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..config import TransformerConfig

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: float(torch.finfo(E4M3).max), E5M2: float(torch.finfo(E5M2).max)}  # 448, 57344


class Format(Enum):
    """Which FP8 format is used where (Transformer Engine's `Format`).

    E4M3: E4M3 (max 448) for activations, weights and gradients.
    HYBRID: E4M3 for activations and weights in the forward pass, E5M2 (max 57344, more range,
        less precision) for gradients in the backward pass.
    """

    E4M3 = "e4m3"
    HYBRID = "hybrid"

    @property
    def fwd_dtype(self) -> torch.dtype:
        return E4M3

    @property
    def bwd_dtype(self) -> torch.dtype:
        return E5M2 if self is Format.HYBRID else E4M3

    @property
    def max_fwd(self) -> float:
        return FP8_MAX[self.fwd_dtype]

    @property
    def max_bwd(self) -> float:
        return FP8_MAX[self.bwd_dtype]


def _check_common(name: str, fp8_format: object, margin: object) -> None:
    if not isinstance(fp8_format, Format):
        raise TypeError(f"{name}.fp8_format={fp8_format!r} must be a Format (Format.E4M3 or Format.HYBRID)")
    if not isinstance(margin, int) or isinstance(margin, bool) or margin < 0:
        raise ValueError(f"{name}.margin={margin!r} must be an integer >= 0 (0 is the usual value)")


@dataclass(frozen=True)
class DelayedScaling:
    """Per-tensor delayed scaling (Transformer Engine's `DelayedScaling`).

    margin: scale = (fp8_max / amax) / 2**margin; a margin > 0 leaves headroom for growing values.
    fp8_format: Format.HYBRID (E4M3 forward, E5M2 gradients) or Format.E4M3.
    amax_history_len: amaxes kept per tensor (one per optimizer step).
    amax_compute_algo: 'max' (max over the history) or 'most_recent' (the newest entry).
    reduce_amax: reduce the amaxes (MAX) across the data/tensor-parallel ranks in `fp8_step`, so all
        ranks use the same scales.

    Megatron-Core's defaults are history 1 and 'most_recent' (see `recipe_from_config`).
    Before the first `fp8_step` there is no history yet: those micro-batches use the amax of the
    tensor being cast (current scaling) instead of the initial scale 1.0, which would flush most
    gradients to zero in E5M2.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    reduce_amax: bool = True

    def __post_init__(self) -> None:
        _check_common("DelayedScaling", self.fp8_format, self.margin)
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(f"DelayedScaling.amax_history_len={self.amax_history_len!r} must be an integer >= 1 "
                             "(1 = Megatron's default, 1024 = Transformer Engine's)")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"DelayedScaling.amax_compute_algo={self.amax_compute_algo!r} must be 'max' or "
                             "'most_recent'")


@dataclass(frozen=True)
class Float8CurrentScaling:
    """Per-tensor current (dynamic) scaling: the amax comes from the tensor being cast, no history.

    `margin` (default 0) works as in `DelayedScaling`.
    """

    fp8_format: Format = Format.HYBRID
    margin: int = 0

    def __post_init__(self) -> None:
        _check_common("Float8CurrentScaling", self.fp8_format, self.margin)


@dataclass(frozen=True)
class Float8RowwiseScaling:
    """Row-wise current scaling: one scale per row of the activation/gradient matrix (per token)
    and per output channel of the weight, taken from the values being cast.

    An operand that a backward GEMM contracts along its rows (the input and the gradient in the
    weight-gradient GEMM, the weight in the input-gradient GEMM) is quantized a second time from
    its high-precision values with one scale per column, since `torch._scaled_mm` takes scales only
    along the outer (non-contracted) dimensions. Under Format.HYBRID the E5M2 gradient is always
    the left operand, which the CUDA rowwise kernels accept (E5M2 x E4M3).
    """

    fp8_format: Format = Format.HYBRID
    margin: int = 0

    def __post_init__(self) -> None:
        _check_common("Float8RowwiseScaling", self.fp8_format, self.margin)


def _check_e4m3_only(name: str, flag: str, fp8_format: object, why: str) -> None:
    _check_common(name, fp8_format, 0)
    if fp8_format is not Format.E4M3:
        raise ValueError(f"{name}.fp8_format={fp8_format}: {why}; use --fp8-format e4m3 with --fp8-recipe {flag}")


@dataclass(frozen=True)
class Float8BlockwiseScaling:
    """Blockwise current scaling (DeepSeek-V3): one fp32 scale per 1x128 tile of activations and gradients (the
    operands of the weight-gradient GEMM tiled along their own contracted dimension) and per 128x128 block of
    weights, each from the values being cast (`blockwise.quantize_tiles` / `quantize_blocks`).

    fp8_format: Format.E4M3 only (torch's blockwise GEMM takes E4M3 operands). pow2_scales: scales rounded down
    to powers of two, so that dequantising is exact.
    """

    fp8_format: Format = Format.E4M3
    pow2_scales: bool = False

    def __post_init__(self) -> None:
        _check_e4m3_only("Float8BlockwiseScaling", "blockwise", self.fp8_format,
                         "E4M3 is what torch's blockwise GEMM takes for every operand, gradients included")

    @property
    def margin(self) -> int:
        return 0


@dataclass(frozen=True)
class Float8MXScaling:
    """MXFP8 (OCP MX): E4M3 elements, one E8M0 (power-of-two) scale per 32 consecutive elements along the
    contracted dimension of each GEMM operand (`mx.quantize_mx`).

    rounding: 'ceil' (the scale rounded up: nothing saturates; the default) or 'floor' (the OCP MX spec).
    """

    fp8_format: Format = Format.E4M3
    rounding: str = "ceil"

    def __post_init__(self) -> None:
        _check_e4m3_only("Float8MXScaling", "mxfp8", self.fp8_format, "MXFP8 is E4M3 for every operand")
        if self.rounding not in ("ceil", "floor"):
            raise ValueError(f"Float8MXScaling.rounding={self.rounding!r} must be 'ceil' or 'floor'")

    @property
    def margin(self) -> int:
        return 0


Recipe = DelayedScaling | Float8CurrentScaling | Float8RowwiseScaling | Float8BlockwiseScaling | Float8MXScaling
# --fp8-recipe NAME -> its recipe class
RECIPE_CLASSES: dict[str, type[Recipe]] = {"delayed": DelayedScaling, "tensorwise": Float8CurrentScaling,
                                           "rowwise": Float8RowwiseScaling, "blockwise": Float8BlockwiseScaling,
                                           "mxfp8": Float8MXScaling}
RECIPE_TYPES = tuple(RECIPE_CLASSES.values())


def check_recipe(recipe: object) -> Recipe:
    if not isinstance(recipe, RECIPE_TYPES):
        raise TypeError(f"fp8 recipe {recipe!r} is not one of DelayedScaling, Float8CurrentScaling, "
                        "Float8RowwiseScaling, Float8BlockwiseScaling, Float8MXScaling (from megadlms.fp8)")
    return recipe


def recipe_from_config(cfg: TransformerConfig) -> Recipe:
    """The recipe described by a TransformerConfig's FP8 fields.

    fp8_recipe: 'delayed' -> DelayedScaling(fp8_margin, fp8_format, fp8_amax_history_len,
    fp8_amax_compute_algo); 'tensorwise' -> Float8CurrentScaling; 'rowwise' -> Float8RowwiseScaling;
    'blockwise' -> Float8BlockwiseScaling(pow2_scales=fp8_pow2_scales); 'mxfp8' -> Float8MXScaling.
    fp8_format: 'hybrid' -> Format.HYBRID, 'e4m3' -> Format.E4M3.
    """
    fmt = Format(cfg.fp8_format)
    if cfg.fp8_recipe == "delayed":
        return DelayedScaling(margin=cfg.fp8_margin, fp8_format=fmt, amax_history_len=cfg.fp8_amax_history_len,
                              amax_compute_algo=cfg.fp8_amax_compute_algo)
    if cfg.fp8_recipe == "tensorwise":
        return Float8CurrentScaling(fp8_format=fmt, margin=cfg.fp8_margin)
    if cfg.fp8_recipe == "rowwise":
        return Float8RowwiseScaling(fp8_format=fmt, margin=cfg.fp8_margin)
    if cfg.fp8_recipe == "blockwise":
        return Float8BlockwiseScaling(fp8_format=fmt, pow2_scales=cfg.fp8_pow2_scales)
    if cfg.fp8_recipe == "mxfp8":
        return Float8MXScaling(fp8_format=fmt)
    raise ValueError(f"fp8_recipe={cfg.fp8_recipe!r} is not one of 'delayed', 'tensorwise', 'rowwise', 'blockwise', "
                     "'mxfp8'")
