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

Each recipe class also says what it can do (class attributes, `RecipeCapabilities`): its `--fp8-recipe` name, the
formats it takes, whether its scales are per tensor (the fusions and shared scales need that), whether it keeps amax
histories, gathers its weights in FP8, runs FP8 attention, runs the FP8 MoE experts, and how an export scales its
weights. Every rule about recipes is written here once (`format_problem`, `attention_problem`,
`param_gather_problem`, `experts_problem`) and asked elsewhere; callers raise their own error type with the message.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar, TypeGuard

import torch

from .tensor import Scaling

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


class RecipeCapabilities:
    """What a recipe class can do: class attributes each recipe sets, asked by the layers, the configs, the
    parameter gather, the export and the CLI (never a type test of the recipe elsewhere).

    name: its `--fp8-recipe` name. formats: the `Format`s it takes (formats_why: why only those).
    per_tensor: one scale per tensor for every role (the fused q/k/v, gate/up and MLP GEMMs, and the members of a
        parameter-gather scale group, share such a scale). keeps_history: delayed scaling's amax histories and
        scales, module buffers updated by `fp8_step`. current_weight_scale: the weight's scale is its current
        per-tensor amax (which the optimizer can keep up to date: `integrations/weight_amax.py`).
    param_gather: its FP8 weight can be all-gathered exactly (one weight scale per tensor or per 128x128 block).
    attention: FP8 dot-product attention runs under it (it needs per-step scales kept across steps).
    experts: the `Scaling` of the FP8 MoE expert GEMMs' operands under it (ROW: per token row, per (expert, output
        row) of a weight, per (expert, column) of the weight gradient's operands; EXPERT: one scale per expert for
        each operand), None where they cannot run (experts_why: why not).
    weight_scaling: how its weights are scaled: "tensor", "row" (per output channel), "block" (128x128) or "mx".
    export_scaling: the weight scaling of an FP8 export of a model trained with it ("tensor" or "block").
    gpu_majors: the compute-capability majors whose GPUs run its GEMM (None: every FP8 GPU, >= 8.9; the GEMM's own
        check adds what else it needs, e.g. the torch build). cpu_emulated: its GEMM is emulated on the CPU (a
        dequantisation and an fp32 matmul of its scale layout), for tests.
    """

    name: ClassVar[str]
    formats: ClassVar[tuple[Format, ...]] = (Format.HYBRID, Format.E4M3)
    formats_why: ClassVar[str] = ""
    per_tensor: ClassVar[bool] = False
    keeps_history: ClassVar[bool] = False
    current_weight_scale: ClassVar[bool] = False
    param_gather: ClassVar[bool] = False
    attention: ClassVar[bool] = False
    experts: ClassVar[Scaling | None] = None
    experts_why: ClassVar[str] = ""
    weight_scaling: ClassVar[str] = "tensor"
    export_scaling: ClassVar[str] = "tensor"
    gpu_majors: ClassVar[tuple[int, ...] | None] = None
    cpu_emulated: ClassVar[bool] = False

    fp8_format: Format  # a field of every recipe dataclass

    def _check_fields(self) -> None:
        name, margin = type(self).__name__, getattr(self, "margin")
        if not isinstance(self.fp8_format, Format):
            raise TypeError(f"{name}.fp8_format={self.fp8_format!r} must be a Format (Format.E4M3 or Format.HYBRID)")
        if not isinstance(margin, int) or isinstance(margin, bool) or margin < 0:
            raise ValueError(f"{name}.margin={margin!r} must be an integer >= 0 (0 is the usual value)")
        if self.fp8_format not in self.formats:
            raise ValueError(f"{name}.fp8_format={self.fp8_format}: {self.formats_why}; use --fp8-format "
                             f"{self.formats[0].value} with --fp8-recipe {self.name}")


@dataclass(frozen=True)
class DelayedScaling(RecipeCapabilities):
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

    name: ClassVar[str] = "delayed"
    per_tensor: ClassVar[bool] = True
    keeps_history: ClassVar[bool] = True
    param_gather: ClassVar[bool] = True
    attention: ClassVar[bool] = True
    experts_why: ClassVar[str] = ("delayed scaling takes a step's scales from past steps' amaxes, while the tokens "
                                  "of each expert change with the routing every step")

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    reduce_amax: bool = True

    def __post_init__(self) -> None:
        self._check_fields()
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(f"DelayedScaling.amax_history_len={self.amax_history_len!r} must be an integer >= 1 "
                             "(1 = Megatron's default, 1024 = Transformer Engine's)")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"DelayedScaling.amax_compute_algo={self.amax_compute_algo!r} must be 'max' or "
                             "'most_recent'")


@dataclass(frozen=True)
class Float8CurrentScaling(RecipeCapabilities):
    """Per-tensor current (dynamic) scaling: the amax comes from the tensor being cast, no history.

    `margin` (default 0) works as in `DelayedScaling`.
    """

    name: ClassVar[str] = "tensorwise"
    per_tensor: ClassVar[bool] = True
    current_weight_scale: ClassVar[bool] = True
    param_gather: ClassVar[bool] = True
    experts: ClassVar[Scaling | None] = Scaling.EXPERT

    fp8_format: Format = Format.HYBRID
    margin: int = 0

    def __post_init__(self) -> None:
        self._check_fields()


@dataclass(frozen=True)
class Float8RowwiseScaling(RecipeCapabilities):
    """Row-wise current scaling: one scale per row of the activation/gradient matrix (per token)
    and per output channel of the weight, taken from the values being cast.

    An operand that a backward GEMM contracts along its rows (the input and the gradient in the
    weight-gradient GEMM, the weight in the input-gradient GEMM) is quantized a second time from
    its high-precision values with one scale per column, since `torch._scaled_mm` takes scales only
    along the outer (non-contracted) dimensions. Under Format.HYBRID the E5M2 gradient is always
    the left operand, which the CUDA rowwise kernels accept (E5M2 x E4M3).
    """

    name: ClassVar[str] = "rowwise"
    weight_scaling: ClassVar[str] = "row"
    experts: ClassVar[Scaling | None] = Scaling.ROW

    fp8_format: Format = Format.HYBRID
    margin: int = 0

    def __post_init__(self) -> None:
        self._check_fields()


@dataclass(frozen=True)
class Float8BlockwiseScaling(RecipeCapabilities):
    """Blockwise current scaling (DeepSeek-V3): one fp32 scale per 1x128 tile of activations and gradients (the
    operands of the weight-gradient GEMM tiled along their own contracted dimension) and per 128x128 block of
    weights, each from the values being cast (`blockwise.quantize_tiles` / `quantize_blocks`).

    fp8_format: Format.E4M3 only (torch's blockwise GEMM takes E4M3 operands). pow2_scales: scales rounded down
    to powers of two, so that dequantising is exact.
    """

    name: ClassVar[str] = "blockwise"
    formats: ClassVar[tuple[Format, ...]] = (Format.E4M3,)
    formats_why: ClassVar[str] = "E4M3 is what torch's blockwise GEMM takes (gradients included)"
    param_gather: ClassVar[bool] = True
    weight_scaling: ClassVar[str] = "block"
    export_scaling: ClassVar[str] = "block"
    gpu_majors: ClassVar[tuple[int, ...] | None] = (9,)  # Hopper: torch's blockwise scaled GEMM
    cpu_emulated: ClassVar[bool] = True

    fp8_format: Format = Format.E4M3
    pow2_scales: bool = False

    def __post_init__(self) -> None:
        self._check_fields()

    @property  # no margin: the scales come from the tile/block amaxes alone
    def margin(self) -> int:
        return 0


@dataclass(frozen=True)
class Float8MXScaling(RecipeCapabilities):
    """MXFP8 (OCP MX): E4M3 elements, one E8M0 (power-of-two) scale per 32 consecutive elements along the
    contracted dimension of each GEMM operand (`mx.quantize_mx`).

    rounding: 'ceil' (the scale rounded up: nothing saturates; the default) or 'floor' (the OCP MX spec).
    """

    name: ClassVar[str] = "mxfp8"
    formats: ClassVar[tuple[Format, ...]] = (Format.E4M3,)
    formats_why: ClassVar[str] = "MXFP8 is E4M3 for every operand"
    weight_scaling: ClassVar[str] = "mx"
    gpu_majors: ClassVar[tuple[int, ...] | None] = (10,)  # Blackwell: MX tensor cores
    cpu_emulated: ClassVar[bool] = True

    fp8_format: Format = Format.E4M3
    rounding: str = "ceil"

    def __post_init__(self) -> None:
        self._check_fields()
        if self.rounding not in ("ceil", "floor"):
            raise ValueError(f"Float8MXScaling.rounding={self.rounding!r} must be 'ceil' or 'floor'")

    @property  # no margin: the E8M0 scales come from the block amaxes alone
    def margin(self) -> int:
        return 0


Recipe = DelayedScaling | Float8CurrentScaling | Float8RowwiseScaling | Float8BlockwiseScaling | Float8MXScaling
# --fp8-recipe NAME -> its recipe class
RECIPE_CLASSES: dict[str, type[Recipe]] = {cls.name: cls for cls in (DelayedScaling, Float8CurrentScaling,
                                                                     Float8RowwiseScaling, Float8BlockwiseScaling,
                                                                     Float8MXScaling)}
RECIPE_NAMES = tuple(RECIPE_CLASSES)  # the choices of --fp8-recipe
RECIPE_TYPES = tuple(RECIPE_CLASSES.values())


def check_recipe(recipe: object) -> Recipe:
    if not isinstance(recipe, RECIPE_TYPES):
        raise TypeError(f"fp8 recipe {recipe!r} is not one of DelayedScaling, Float8CurrentScaling, "
                        "Float8RowwiseScaling, Float8BlockwiseScaling, Float8MXScaling (from megadlms.fp8)")
    return recipe


def recipe_class(recipe: str | Recipe | type[Recipe]) -> type[Recipe]:
    """The recipe class of a `--fp8-recipe` name, a recipe, or a recipe class (ValueError naming the choices)."""
    if isinstance(recipe, type) and recipe in RECIPE_TYPES:
        return recipe
    if isinstance(recipe, RECIPE_TYPES):
        return type(recipe)
    if isinstance(recipe, str) and recipe in RECIPE_CLASSES:
        return RECIPE_CLASSES[recipe]
    raise ValueError(f"fp8_recipe={recipe!r} is not one of {list(RECIPE_NAMES)}")


def keeps_history(recipe: Recipe) -> TypeGuard[DelayedScaling]:
    """Whether `recipe` keeps amax histories and per-step scales (its `keeps_history`), as a type guard."""
    return recipe.keeps_history


def names_with(capability: str) -> list[str]:
    """The `--fp8-recipe` names whose class has a true `capability` (a `RecipeCapabilities` attribute)."""
    return [name for name, cls in RECIPE_CLASSES.items() if getattr(cls, capability)]


def names_for_gpu(major: int) -> list[str]:
    """The `--fp8-recipe` names whose GEMM runs on an FP8 GPU of compute-capability major `major` (`gpu_majors`)."""
    return [name for name, cls in RECIPE_CLASSES.items() if cls.gpu_majors is None or major in cls.gpu_majors]


def alternatives_on_gpu(major: int, instead_of: str) -> str:
    """'a, b or c': the recipes that run on a GPU of major `major`, other than `instead_of` (for messages)."""
    names = [n for n in names_for_gpu(major) if n != instead_of]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def format_problem(recipe: str, fp8_format: str, pow2_scales: bool = False) -> str | None:
    """Why `--fp8-format fp8_format` (and --fp8-pow2-scales) do not go with `--fp8-recipe recipe`, or None."""
    cls = recipe_class(recipe)
    if Format(fp8_format) not in cls.formats:
        return (f"--fp8-format {fp8_format} with --fp8-recipe {recipe}: {cls.formats_why}; use --fp8-format "
                f"{cls.formats[0].value}")
    if pow2_scales and cls is not Float8BlockwiseScaling:
        return f"--fp8-pow2-scales applies to --fp8-recipe blockwise, got --fp8-recipe {recipe}; drop --fp8-pow2-scales"
    return None


def attention_problem(recipe: str | Recipe) -> str | None:
    """Why FP8 attention (--fp8-dot-product-attention) cannot run under `recipe`, or None."""
    if recipe_class(recipe).attention:
        return None
    return (f"FP8 attention (--fp8-dot-product-attention) takes delayed scaling (--fp8-recipe "
            f"{', '.join(names_with('attention'))}), got {recipe}; use --fp8-recipe delayed or drop "
            "--fp8-dot-product-attention")


def param_gather_problem(recipe: str | Recipe) -> str | None:
    """Why --fp8-param-gather cannot gather the weights of `recipe` in FP8 exactly, or None."""
    cls = recipe_class(recipe)
    if cls.param_gather:
        return None
    return (f"--fp8-param-gather works with --fp8-recipe {', '.join(names_with('param_gather'))}, not {cls.name} "
            "(its input-gradient GEMM casts the high-precision weight along the other dimension, which an "
            "FP8-gathered weight no longer has); drop --fp8-param-gather or pick one of those recipes")


def experts_problem(recipe: str | Recipe) -> str | None:
    """Why the FP8 MoE expert GEMMs cannot run under `recipe`, or None."""
    cls = recipe_class(recipe)
    if cls.experts is not None:
        return None
    why = f" ({cls.experts_why})" if cls.experts_why else ""
    return (f"fp8_recipe={cls.name!r}: the FP8 expert GEMMs take {names_with('experts')}{why}; use --fp8-recipe "
            "rowwise or tensorwise with MoE")


def recipe_from_config(cfg: Any) -> Recipe:
    """The recipe described by a TransformerConfig's FP8 fields.

    fp8_recipe: 'delayed' -> DelayedScaling(fp8_margin, fp8_format, fp8_amax_history_len,
    fp8_amax_compute_algo); 'tensorwise' -> Float8CurrentScaling; 'rowwise' -> Float8RowwiseScaling;
    'blockwise' -> Float8BlockwiseScaling(pow2_scales=fp8_pow2_scales); 'mxfp8' -> Float8MXScaling.
    fp8_format: 'hybrid' -> Format.HYBRID, 'e4m3' -> Format.E4M3.
    """
    fmt = Format(cfg.fp8_format)
    cls = recipe_class(cfg.fp8_recipe)
    if cls is DelayedScaling:
        return DelayedScaling(margin=cfg.fp8_margin, fp8_format=fmt, amax_history_len=cfg.fp8_amax_history_len,
                              amax_compute_algo=cfg.fp8_amax_compute_algo)
    if cls is Float8BlockwiseScaling:
        return Float8BlockwiseScaling(fp8_format=fmt, pow2_scales=cfg.fp8_pow2_scales)
    if cls is Float8MXScaling:
        return Float8MXScaling(fp8_format=fmt)
    if cls is Float8RowwiseScaling:
        return Float8RowwiseScaling(fp8_format=fmt, margin=cfg.fp8_margin)
    return Float8CurrentScaling(fp8_format=fmt, margin=cfg.fp8_margin)
