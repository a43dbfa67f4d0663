"""FP8 casts for Float8Linear: scale -> clamp -> cast to q and/or the transposed q^T, after one amax
reduction pass where the scale or the amax history needs it.

A `_scaled_mm` operand must be K-major, so the weight-gradient GEMM (which contracts over tokens)
needs the transposes of the FP8 input and gradient, and the input-gradient GEMM the transpose of
the FP8 weight. `cast_fp8` makes q^T from the high-precision x at cast time (no later transpose
pass over a saved FP8 tensor in backward).

On CUDA the cast is a compiled pointwise function (torch.compile, dynamic shapes; inductor emits
one kernel per output layout); the amax is ATen's one-pass inf-norm reduction (an amax compiled
with dynamic shapes ran ~3x slower per call on an H200: benchmarks/RESULTS.md). Elsewhere
everything runs eagerly. Both compute exactly what `quantize.quantize` / `amax_to_scale` compute.
"""

from __future__ import annotations

from typing import Any

import torch

from .quantize import FP8_MAX, amax_to_scale


def _amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as an fp32 scalar tensor (one reduction pass; exact, as max is)."""
    return torch.linalg.vector_norm(x, float("inf")).float()


def _cast_current(x: torch.Tensor, amax: torch.Tensor, amax_slot: torch.Tensor | None, fp8_dtype: torch.dtype,
                  margin: int, want_q: bool, want_t: bool
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    fmax = FP8_MAX[fp8_dtype]
    if amax_slot is not None:
        amax_slot.copy_(torch.maximum(amax_slot, amax))
    scale = amax_to_scale(amax, fmax, margin)
    xf = x.float()
    q = (xf * scale).clamp(-fmax, fmax).to(fp8_dtype) if want_q else None
    t = (xf.t() * scale).clamp(-fmax, fmax).to(fp8_dtype).contiguous() if want_t else None
    return q, t, scale.reciprocal()


def _cast_scaled(x: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor | None, amax_slot: torch.Tensor | None,
                 fp8_dtype: torch.dtype, want_q: bool, want_t: bool
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    fmax = FP8_MAX[fp8_dtype]
    if amax_slot is not None:
        amax_slot.copy_(torch.maximum(amax_slot, amax))
    xf = x.float()
    q = (xf * scale).clamp(-fmax, fmax).to(fp8_dtype) if want_q else None
    t = (xf.t() * scale).clamp(-fmax, fmax).to(fp8_dtype).contiguous() if want_t else None
    return q, t, scale.reciprocal()


# Compiled lazily on the first CUDA call. Separate functions (separate code objects), so that the
# variants each one meets in training (input / weight / gradient casts, fp32 or bf16 sources, E4M3
# or E5M2) stay within torch.compile's per-function recompile limit.
_compiled: dict[str, Any] = {}


def _get(name: str, fn: Any) -> Any:
    c = _compiled.get(name)
    if c is None:
        c = _compiled[name] = torch.compile(fn, dynamic=True)
    return c


def cast_fp8(x: torch.Tensor, scale: torch.Tensor | None, amax_slot: torch.Tensor | None, fp8_dtype: torch.dtype,
             margin: int = 0, want_q: bool = True, want_t: bool = False
             ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """Per-tensor FP8 cast of a 2-D x [R, C] (any float dtype).

    scale: fp32 scalar tensor (delayed scaling), or None to take it from x's amax (current scaling:
        (fp8_max / amax) / 2**margin, 1.0 where amax is 0 or not finite).
    amax_slot: fp32 scalar tensor updated in place to max(slot, amax(|x|)) (delayed-scaling history), or None.
    Returns (q [R, C] row-major or None, q^T [C, R] contiguous or None, scale_inv [] fp32,
    amax [] fp32 or None when neither the scale nor the slot needed it).
    """
    x = x.detach()
    cuda = x.device.type == "cuda"
    amax = _amax(x) if scale is None or amax_slot is not None else None
    if scale is None:
        fn = _get("current", _cast_current) if cuda else _cast_current
        q, t, scale_inv = fn(x, amax, amax_slot, fp8_dtype, margin, want_q, want_t)
    else:
        fn = _get("scaled", _cast_scaled) if cuda else _cast_scaled
        q, t, scale_inv = fn(x, scale, amax, amax_slot, fp8_dtype, want_q, want_t)
    return q, t, scale_inv, amax


def _transpose(q: torch.Tensor) -> torch.Tensor:
    return q.t().contiguous()


def transpose_fp8(q: torch.Tensor) -> torch.Tensor:
    """q [R, C] -> q^T [C, R] contiguous (a tiled transpose kernel on CUDA)."""
    if q.device.type != "cuda":
        return _transpose(q)
    return _get("transpose", _transpose)(q)
