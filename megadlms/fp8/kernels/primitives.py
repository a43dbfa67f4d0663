"""The FP8 cast and GEMM primitives: small pure tensor functions (no host syncs, no data-dependent
Python control flow), so that torch.compile can fuse amax -> scale -> clamp -> cast.

Conventions: `scale` multiplies a high-precision value into FP8 range (q = x * scale); the
"scale_inv" (1 / scale) is what `torch._scaled_mm` takes to dequantize (x ~= q * scale_inv).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..recipe import E4M3, E5M2, FP8_MAX

__all__ = ["E4M3", "E5M2", "FP8_MAX", "amax_to_scale", "quantize", "quantize_tensorwise", "quantize_rowwise",
           "dequantize", "pad_2d", "round_up16", "quant_stats", "round_to_fp8_grid"]

# (mantissa bits, smallest normal exponent) of each FP8 format
FP8_GRID = {E4M3: (3, -6), E5M2: (2, -14)}


def round_up16(n: int) -> int:
    return (n + 15) // 16 * 16


def pad_2d(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad a 2-D tensor to [rows, cols] (a no-op when it already has that shape).

    Zeros leave amaxes unchanged and contribute nothing to the GEMMs.
    """
    r, c = x.shape
    if r == rows and c == cols:
        return x
    return F.pad(x, (0, cols - c, 0, rows - r))


def amax_to_scale(amax: torch.Tensor, fp8_max: float | torch.Tensor, margin: int = 0,
                  fallback: torch.Tensor | float = 1.0) -> torch.Tensor:
    """scale = (fp8_max / amax) / 2**margin, in fp32, elementwise over any shape of `amax` (fp8_max: a number, or
    a tensor broadcast to amax's shape, e.g. one maximum per role).

    Where amax is zero or not finite, or the scale would overflow fp32, the result is `fallback`
    (the previous scale under delayed scaling; 1.0 for a fresh tensor, whose values are all zero).
    """
    amax = amax.float()
    # a true division (`number / tensor` in torch is reciprocal-then-multiply, rounded twice)
    num = fp8_max.float().expand_as(amax).clone() if isinstance(fp8_max, torch.Tensor) else \
        torch.full_like(amax, fp8_max)
    scale = num.div_(amax) / (2.0 ** margin)
    ok = (amax > 0) & torch.isfinite(amax) & torch.isfinite(scale)
    return torch.where(ok, scale, fallback)


def quantize(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """q = cast(clamp(x * scale, -fp8_max, fp8_max)) with the product in fp32.

    x: any float dtype and shape; scale: fp32, broadcastable to x (a scalar, [M, 1] or [1, K]).
    Clamping first makes overflow saturate on every backend (a bare cast gives inf/NaN on some).
    """
    fmax = FP8_MAX[fp8_dtype]
    return (x.float() * scale).clamp(-fmax, fmax).to(fp8_dtype)


def round_to_fp8_grid(y: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """fp32 y (already clamped to +-fp8_max) rounded to the nearest FP8 value, ties to even, still in fp32.

    The same bits as ATen's fp32 -> FP8 cast, computed with fp32 arithmetic: |y| is scaled by the power
    of two that makes the FP8 spacing at its exponent 1, rounded (`torch.round` is half-to-even), scaled
    back, and the sign bit put back (so -0.0 and negatives that round to zero stay -0). The result is
    exactly representable, so any later cast to `fp8_dtype` is exact whatever its own rounding: generated
    kernels (torch.compile) then cannot round differently from the eager cast.
    """
    mbits, emin = FP8_GRID[fp8_dtype]
    bits = y.view(torch.int32)
    exp = torch.clamp(((bits >> 23) & 0xFF) - 127, min=emin) - mbits  # log2 of the FP8 spacing at |y|
    up = ((127 - exp) << 23).view(torch.float32)  # 2**-exp
    down = ((127 + exp) << 23).view(torch.float32)  # 2**exp
    r = torch.round(y.abs() * up) * down
    return (r.view(torch.int32) | ((bits >> 31) << 31)).view(torch.float32)


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q (fp8) * scale_inv (broadcastable fp32) -> `dtype`."""
    return (q.float() * scale_inv).to(dtype)


def quantize_tensorwise(x: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Current per-tensor scaling. Returns (q, scale_inv [] fp32, amax [] fp32)."""
    amax = x.abs().amax().float()
    scale = amax_to_scale(amax, FP8_MAX[fp8_dtype], margin)
    return quantize(x, scale, fp8_dtype), scale.reciprocal(), amax


def quantize_rowwise(x: torch.Tensor, fp8_dtype: torch.dtype, dim: int = -1, margin: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Current scaling with one scale per slice of x along `dim` (the amax reduced over it, kept as size 1).

    x [R, C]: dim=1 (or -1): one scale per row -> scale_inv [R, 1]; dim=0: one per column -> scale_inv [1, C].
    x [..., F], dim=-1: one per row of the last dim -> scale_inv [..., 1] (the FP8 SwiGLU input store).
    Returns (q, same shape as x, scale_inv fp32 contiguous).
    """
    amax = x.abs().amax(dim=dim, keepdim=True).float()
    scale = amax_to_scale(amax, FP8_MAX[fp8_dtype], margin)
    return quantize(x, scale, fp8_dtype), scale.reciprocal().contiguous()


# |x * scale| at or above these would round past the largest finite value: max + half its ulp
OVERFLOW = {E4M3: 464.0, E5M2: 61440.0}


def quant_stats(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor | None, fp8_dtype: torch.dtype,
                valid_numel: int | None = None) -> torch.Tensor:
    """On-device numerics of one cast: [amax, underflow count, saturation count, numel] (fp32).

    Underflow: nonzero values that became zero. Saturation: values out of the FP8 range, i.e. that
    the clamp changed (|x * scale| would round past fp8_max). scale None: derive it as fp8_max / amax
    (current scaling); for a rowwise cast pass the reciprocal of its scale_inv. valid_numel: the
    element count without padding (padding zeros neither underflow nor saturate).
    """
    xf = x.float()
    amax = xf.abs().amax()
    if scale is None:
        scale = amax_to_scale(amax, FP8_MAX[fp8_dtype])
    under = ((xf != 0) & (q.float() == 0)).sum()
    sat = ((xf * scale).abs() >= OVERFLOW[fp8_dtype]).sum()
    numel = torch.full((), float(x.numel() if valid_numel is None else valid_numel), device=x.device)
    return torch.stack([amax, under.float(), sat.float(), numel])
