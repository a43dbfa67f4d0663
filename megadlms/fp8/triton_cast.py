"""One-pass FP8 cast on CUDA (Triton): reads x [R, C] once and writes q [R, C], its transpose q^T [C, R]
(the K-major operand of the backward GEMMs) and, optionally, max |x| into an fp32 scalar (atomic max: with
delayed scaling the scale is known before the cast, so the amax of this step needs no pass of its own).

Each element is cast(clamp(x * scale, -fp8_max, fp8_max)) in fp32 with round-to-nearest-even, i.e. what
`quantize.quantize` computes. The rounding is done in fp32 arithmetic before the conversion
(`quantize.round_to_fp8_grid`), so the result does not depend on how a GPU's conversion instruction
rounds. `available()` is False without Triton, off CUDA, or with MEGADLMS_FP8_TRITON=0; the first call
of each variant (input dtype, FP8 format, outputs) is checked bitwise against the ATen cast, and a
variant that differs falls back to the compiled torch cast, with a warning that shows the first
differing elements.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from .quantize import FP8_GRID
from .recipe import E4M3, E5M2, FP8_MAX

_state: dict[str, Any] = {"ok": None, "checked": set(), "bad": set()}


def available(x: torch.Tensor) -> bool:
    if x.dim() != 2 or not x.is_contiguous() or (x.device.type != "cuda" and not _interpret()):
        return False
    if _state["ok"] is None:
        _state["ok"] = os.environ.get("MEGADLMS_FP8_TRITON", "1") != "0" and _build()
    return bool(_state["ok"])


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _build() -> bool:
    try:
        import triton
        import triton.language as tl
    except Exception:  # no Triton: the compiled torch path is used
        return False

    @triton.jit
    def cast_transpose_kernel(x_ptr, q_ptr, t_ptr, scale_ptr, amax_ptr, R, C, ld_q, ld_t,
                              FMAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, WANT_Q: tl.constexpr,
                              WANT_T: tl.constexpr, WANT_AMAX: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        pid_r = tl.program_id(0)
        pid_c = tl.program_id(1)
        rows = pid_r * BR + tl.arange(0, BR)
        cols = pid_c * BC + tl.arange(0, BC)
        mask = (rows[:, None] < R) & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(scale_ptr)
        y = tl.minimum(tl.maximum(x * scale, -FMAX), FMAX)
        # round to the FP8 grid in fp32 (quantize.round_to_fp8_grid): |y| scaled so the FP8 spacing at its
        # exponent is 1, rounded half-to-even by the 1.5 * 2**23 trick (|v| <= 16; fp32 adds round to nearest
        # even), scaled back, sign bit restored; the conversions below are then exact
        bits = y.to(tl.int32, bitcast=True)
        exp = tl.maximum(((bits >> 23) & 0xFF) - 127, EMIN) - MBITS
        up = ((127 - exp) << 23).to(tl.float32, bitcast=True)
        down = ((127 + exp) << 23).to(tl.float32, bitcast=True)
        r = ((tl.abs(y) * up + 12582912.0) - 12582912.0) * down
        y = (r.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)
        if WANT_Q:
            tl.store(q_ptr + rows[:, None].to(tl.int64) * ld_q + cols[None, :],
                     y.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
        if WANT_T:
            yt = tl.trans(y)
            tl.store(t_ptr + cols[:, None].to(tl.int64) * ld_t + rows[None, :],
                     yt.to(t_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=tl.trans(mask))
        if WANT_AMAX:
            tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(x), axis=1), axis=0))

    _state["kernel"] = cast_transpose_kernel
    return True


def cast_transpose(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, want_q: bool, want_t: bool,
                   amax_out: torch.Tensor | None = None, q_out: torch.Tensor | None = None,
                   t_out: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """x [R, C] contiguous (any float dtype), scale fp32 scalar tensor -> (q [R, C] | None, q^T [C, R] | None).

    amax_out: fp32 scalar tensor raised in place to max(amax_out, max |x|) (atomic), or None.
    q_out / t_out: where to write (q_out [R, C] with unit column stride, t_out [C, R] with unit column stride,
    e.g. row/column blocks of a larger buffer); allocated when None.
    """
    r, c = x.shape
    if want_q and q_out is None:
        q_out = torch.empty(r, c, dtype=fp8_dtype, device=x.device)
    if want_t and t_out is None:
        t_out = torch.empty(c, r, dtype=fp8_dtype, device=x.device)
    q_arg = q_out if want_q else (t_out if want_t else x)
    t_arg = t_out if want_t else q_arg
    amax_arg = amax_out if amax_out is not None else scale
    br, bc = 64, 64
    grid = (triton_cdiv(r, br), triton_cdiv(c, bc))
    kwargs = {} if _interpret() else {"num_warps": 4}
    _state["kernel"][grid](x, q_arg, t_arg, scale, amax_arg, r, c,
                           q_out.stride(0) if want_q else c, t_out.stride(0) if want_t else r,
                           FMAX=FP8_MAX[fp8_dtype], MBITS=FP8_GRID[fp8_dtype][0], EMIN=FP8_GRID[fp8_dtype][1],
                           WANT_Q=want_q, WANT_T=want_t, WANT_AMAX=amax_out is not None,
                           BR=br, BC=bc, **kwargs)
    return (q_out if want_q else None), (t_out if want_t else None)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def checked_cast_transpose(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, want_q: bool,
                           want_t: bool, amax_out: torch.Tensor | None = None, q_out: torch.Tensor | None = None,
                           t_out: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
    """`cast_transpose`, checked bitwise against the ATen cast on the first call of each variant.
    Returns None when the kernel is (or has just been) switched off: the caller takes its own path."""
    if not _state["ok"]:
        return None
    key = (x.dtype, fp8_dtype, want_q, want_t, amax_out is not None, q_out is not None, t_out is not None)
    if key in _state["bad"]:
        return None
    if key in _state["checked"]:
        return cast_transpose(x, scale, fp8_dtype, want_q, want_t, amax_out, q_out, t_out)
    amax_before = amax_out.clone() if amax_out is not None else None
    try:
        q, t = cast_transpose(x, scale, fp8_dtype, want_q, want_t, amax_out, q_out, t_out)
    except Exception as e:  # e.g. a Triton build without these FP8 conversions
        _state["ok"] = False
        warnings.warn(f"megadlms.fp8: the Triton FP8 cast kernel failed ({type(e).__name__}: {str(e)[:200]}); "
                      "using the compiled torch cast instead", RuntimeWarning, stacklevel=2)
        if amax_out is not None:
            amax_out.copy_(amax_before)
        return None
    fmax = FP8_MAX[fp8_dtype]
    ref = (x.float() * scale).clamp(-fmax, fmax).to(fp8_dtype)
    problems = []
    if q is not None and not torch.equal(q.view(torch.uint8), ref.view(torch.uint8)):
        problems.append("q: " + _first_differences(x, scale, q, ref))
    if t is not None and not torch.equal(t.view(torch.uint8), ref.t().contiguous().view(torch.uint8)):
        problems.append("q^T: " + _first_differences(x.t(), scale, t, ref.t()))
    want_amax = torch.maximum(amax_before, x.abs().amax().float()) if amax_out is not None else None
    if amax_out is not None and not torch.equal(amax_out, want_amax):
        problems.append(f"amax {amax_out.item()!r} instead of {want_amax.item()!r}")
    if problems:
        _state["bad"].add(key)
        warnings.warn(f"megadlms.fp8: the Triton FP8 cast kernel disagreed with the ATen cast for {x.dtype} -> "
                      f"{fp8_dtype} ({'; '.join(problems)}); this variant uses the compiled torch cast instead",
                      RuntimeWarning, stacklevel=2)
        if amax_out is not None:
            amax_out.copy_(want_amax)
        return None
    _state["checked"].add(key)
    return q, t


def _first_differences(x: torch.Tensor, scale: torch.Tensor, got: torch.Tensor, ref: torch.Tensor, n: int = 3) -> str:
    """'k of N elements differ, e.g. x=... -> 0x.. (kernel) vs 0x.. (ATen)' for a mismatch warning."""
    diff = got.view(torch.uint8) != ref.view(torch.uint8)
    idx = diff.nonzero()[:n].tolist()
    examples = ", ".join(f"x={x[i, j].item()!r} * scale {scale.item()!r} -> {got.view(torch.uint8)[i, j].item():#04x} "
                         f"vs {ref.view(torch.uint8)[i, j].item():#04x}" for i, j in idx)
    return f"{int(diff.sum())} of {diff.numel()} elements differ, e.g. {examples}"


__all__ = ["available", "cast_transpose", "checked_cast_transpose", "E4M3", "E5M2"]
