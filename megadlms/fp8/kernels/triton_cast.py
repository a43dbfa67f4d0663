"""One-pass FP8 cast on CUDA (Triton): reads x [R, C] once and writes q [R, C], its transpose q^T [C, R]
(the K-major operand of the backward GEMMs) and, optionally, max |x| into up to three fp32 scalars (atomic max:
with delayed scaling the scale is known before the cast, so the amax of this step needs no pass of its own, and
the members of a fused projection get it in their history slots directly).

Each element is cast(clamp(x * scale, -fp8_max, fp8_max)) in fp32 with round-to-nearest-even, i.e. what
`primitives.quantize` computes: by the conversion instruction, or (ROUNDINGS) rounded to the FP8 grid in fp32
arithmetic first (`primitives.round_to_fp8_grid`), which does not depend on how the instruction rounds.
`available()` is False without Triton, off CUDA, or with MEGADLMS_FP8_TRITON=0. Production runs one formulation
(`production_formulation`); the first call of each variant (input dtype, FP8 format, outputs) is checked bitwise
against the ATen cast (its torch reference), and a variant that differs falls back to the torch cast, with a
warning that shows the first differing elements.

Per element the kernel does little besides the cast (32-bit offsets inside a tile, no masks when the tile
divides the tensor): a memory-bound pass is only as fast as its instruction stream lets it be.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from ..recipe import E4M3, E5M2, FP8_MAX
from .primitives import FP8_GRID, amax_to_scale

try:  # the kernel exists where Triton does; `available` says whether it can run
    import triton
    import triton.language as tl
except Exception:  # no Triton: the compiled torch path is used
    triton = None

# ok: the kernels are on; checked: per cast variant, whether its first call agreed with ATen (False: off); scale_ok:
# the current-scale kernel agreed with torch on its first call (None: not called yet); amax_ok: the same for the
# amax kernel, per input dtype
_state: dict[str, Any] = {"ok": None, "checked": {}, "scale_ok": None, "amax_ok": {}, "rowwise_ok": {}}


def available(x: torch.Tensor) -> bool:
    """Whether the cast kernel takes x: a contiguous 2-D tensor where the kernels run (`enabled`)."""
    return x.dim() == 2 and x.is_contiguous() and enabled(x.device)


def enabled(device: torch.device) -> bool:
    """Whether this module's kernels run for tensors on `device`: a GPU (or the CPU under Triton's interpreter),
    with Triton installed and MEGADLMS_FP8_TRITON not 0."""
    if device.type != "cuda" and not _interpret():
        return False
    if _state["ok"] is None:
        _state["ok"] = os.environ.get("MEGADLMS_FP8_TRITON", "1") != "0" and triton is not None
    return bool(_state["ok"])


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    @triton.jit
    def fp8_round(y, MBITS: tl.constexpr, EMIN: tl.constexpr):
        # y fp32 within +-fp8_max -> the nearest FP8 value (ties to even), still fp32 (primitives.round_to_fp8_grid):
        # |y| scaled so the FP8 spacing at its exponent is 1, rounded half-to-even by the 1.5 * 2**23 trick
        # (|v| <= 16; fp32 adds round to nearest even), scaled back, sign bit restored
        bits = y.to(tl.int32, bitcast=True)
        exp = tl.maximum(((bits >> 23) & 0xFF) - 127, EMIN) - MBITS
        up = ((127 - exp) << 23).to(tl.float32, bitcast=True)
        down = ((127 + exp) << 23).to(tl.float32, bitcast=True)
        r = ((tl.abs(y) * up + 12582912.0) - 12582912.0) * down
        return (r.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)

    @triton.jit
    def to_fp8(v, scale, out_ty: tl.constexpr, FMAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
               SW_ROUND: tl.constexpr):
        # cast(clamp(v * scale)) with round-to-nearest-even: by the conversion instruction (cvt.rn.satfinite on
        # sm_89+), or with SW_ROUND rounded in fp32 arithmetic first (then any conversion is exact)
        y = tl.minimum(tl.maximum(v * scale, -FMAX), FMAX)
        if SW_ROUND:
            y = fp8_round(y, MBITS, EMIN)
        return y.to(out_ty, fp_downcast_rounding="rtne")

    @triton.jit
    def store_q_qt(v, scale, r0, c0, R, C, q_ptr, t_ptr, ld_q, ld_t, FMAX: tl.constexpr, MBITS: tl.constexpr,
                   EMIN: tl.constexpr, WANT_Q: tl.constexpr, WANT_T: tl.constexpr, T_MODE: tl.constexpr,
                   SW_ROUND: tl.constexpr, EVEN: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        # v fp32 [BR, BC], the tile at (r0, c0) of an [R, C] tensor -> q[r0:, c0:] and q^T[c0:, r0:], cast with
        # `scale`. 64-bit tile origins, 32-bit offsets inside the tile (less index arithmetic per element); with
        # EVEN (R % BR == C % BC == 0) no masks. Masks are built from the indices (not a transposed boolean
        # tile). T_MODE: one of TRANSPOSE_MODES
        lr = tl.arange(0, BR)
        lc = tl.arange(0, BC)
        if WANT_Q:
            q = to_fp8(v, scale, q_ptr.dtype.element_ty, FMAX, MBITS, EMIN, SW_ROUND)
            q_tile = q_ptr + r0.to(tl.int64) * ld_q + c0
            offs = lr[:, None] * ld_q + lc[None, :]
            if EVEN:
                tl.store(q_tile + offs, q)
            else:
                tl.store(q_tile + offs, q, mask=(r0 + lr[:, None] < R) & (c0 + lc[None, :] < C))
        if WANT_T:
            t_tile = t_ptr + c0.to(tl.int64) * ld_t + r0
            if T_MODE == 0:  # transpose the fp32 tile, then convert
                yt = to_fp8(tl.trans(v), scale, t_ptr.dtype.element_ty, FMAX, MBITS, EMIN, SW_ROUND)
            elif WANT_Q:  # convert, then transpose the FP8 tile
                yt = tl.trans(q)
            else:
                yt = tl.trans(to_fp8(v, scale, t_ptr.dtype.element_ty, FMAX, MBITS, EMIN, SW_ROUND))
            offs_t = lc[:, None] * ld_t + lr[None, :]
            t_mask = (c0 + lc[:, None] < C) & (r0 + lr[None, :] < R)
            if EVEN:
                tl.store(t_tile + offs_t, yt)
            else:
                tl.store(t_tile + offs_t, yt, mask=t_mask)

    @triton.jit
    def cast_transpose_kernel(x_ptr, q_ptr, t_ptr, scale_ptr, amax_ptr, amax_ptr2, amax_ptr3, R, C, ld_q, ld_t,
                              FMAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, WANT_Q: tl.constexpr,
                              WANT_T: tl.constexpr, N_AMAX: tl.constexpr, T_MODE: tl.constexpr,
                              SW_ROUND: tl.constexpr, EVEN: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        r0 = tl.program_id(0) * BR
        c0 = tl.program_id(1) * BC
        lr = tl.arange(0, BR)
        lc = tl.arange(0, BC)
        x_tile = x_ptr + r0.to(tl.int64) * C + c0
        offs = lr[:, None] * C + lc[None, :]
        if EVEN:
            x = tl.load(x_tile + offs).to(tl.float32)
        else:
            x = tl.load(x_tile + offs, mask=(r0 + lr[:, None] < R) & (c0 + lc[None, :] < C), other=0.0).to(tl.float32)
        store_q_qt(x, tl.load(scale_ptr), r0, c0, R, C, q_ptr, t_ptr, ld_q, ld_t, FMAX, MBITS, EMIN, WANT_Q, WANT_T,
                   T_MODE, SW_ROUND, EVEN, BR, BC)
        if N_AMAX > 0:
            tile_amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
            tl.atomic_max(amax_ptr, tile_amax)
            if N_AMAX > 1:
                tl.atomic_max(amax_ptr2, tile_amax)
            if N_AMAX > 2:
                tl.atomic_max(amax_ptr3, tile_amax)


    @triton.jit
    def current_scale_kernel(a0, a1, a2, a3, out_ptr, N_IN: tl.constexpr, FMAX: tl.constexpr,
                             MARGIN_DIV: tl.constexpr):
        # the largest of N_IN amaxes -> scale = (fp8_max / amax) / 2**margin (1.0 where amax is 0 or not finite or
        # the scale overflows) at out_ptr[0] and 1 / scale at out_ptr[4]: `primitives.amax_to_scale` and ATen's
        # reciprocal, with correctly rounded divisions as theirs are; NaN wins the max as in torch.maximum
        amax = tl.load(a0)
        if N_IN > 1:
            amax = tl.maximum(amax, tl.load(a1), propagate_nan=tl.PropagateNan.ALL)
        if N_IN > 2:
            amax = tl.maximum(amax, tl.load(a2), propagate_nan=tl.PropagateNan.ALL)
        if N_IN > 3:
            amax = tl.maximum(amax, tl.load(a3), propagate_nan=tl.PropagateNan.ALL)
        scale = tl.math.div_rn(tl.math.div_rn(tl.full((), FMAX, tl.float32), amax),
                               tl.full((), MARGIN_DIV, tl.float32))
        ok = (amax > 0) & (amax < float("inf")) & (scale < float("inf"))
        scale = tl.where(ok, scale, 1.0)
        tl.store(out_ptr, scale)
        tl.store(out_ptr + 4, tl.math.div_rn(tl.full((), 1.0, tl.float32), scale))


    @triton.jit
    def amax_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, EVEN: tl.constexpr):
        # max |x| of n contiguous elements into out_ptr (fp32, zero before the call): each program strides over
        # blocks keeping an elementwise max in registers, then one atomic max; NaN wins as in ATen's amax (its bits
        # are the largest as an integer, which is how the fp32 atomic max of non-negative values compares)
        acc = tl.zeros((BLOCK,), tl.float32)
        for b in range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0)):
            offs = b * BLOCK + tl.arange(0, BLOCK)  # 32-bit: `checked_amax` takes fewer than 2**31 elements
            if EVEN:
                v = tl.load(x_ptr + offs)
            else:
                v = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
            acc = tl.maximum(acc, tl.abs(v.to(tl.float32)), propagate_nan=tl.PropagateNan.ALL)
        tl.atomic_max(out_ptr, max_keeping_nan(acc))

    @triton.jit
    def max_keeping_nan(acc):
        # the max of a 1-D fp32 block, NaN if it holds one (a NaN may not survive tl.max: put back)
        m = tl.max(acc, 0)
        return tl.where(tl.max((acc != acc).to(tl.int32), 0) > 0, float("nan"), m)

    @triton.jit
    def row_col_amax_kernel(x_ptr, row_ptr, col_ptr, R, C, WANT_ROW: tl.constexpr, WANT_COL: tl.constexpr,
                            EVEN: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        # max |x| of each row (into row_ptr [R]) and of each column (into col_ptr [C]) of x [R, C], fp32, zero before
        # the call: a tile's row and column maxima, then one atomic max per row and per column of the tile
        r0 = tl.program_id(0) * BR
        c0 = tl.program_id(1) * BC
        lr = tl.arange(0, BR)
        lc = tl.arange(0, BC)
        offs = lr[:, None] * C + lc[None, :]
        x_tile = x_ptr + r0.to(tl.int64) * C + c0
        if EVEN:
            a = tl.abs(tl.load(x_tile + offs).to(tl.float32))
        else:
            a = tl.abs(tl.load(x_tile + offs, mask=(r0 + lr[:, None] < R) & (c0 + lc[None, :] < C),
                               other=0.0).to(tl.float32))
        if WANT_ROW:
            tl.atomic_max(row_ptr + r0 + lr, tl.max(a, axis=1), mask=r0 + lr < R)
        if WANT_COL:
            tl.atomic_max(col_ptr + c0 + lc, tl.max(a, axis=0), mask=c0 + lc < C)

    @triton.jit
    def amax_scale(amax, FMAX: tl.constexpr, MARGIN_DIV: tl.constexpr):
        # `primitives.amax_to_scale` elementwise: (fp8_max / amax) / 2**margin with correctly rounded divisions,
        # 1.0 where amax is 0 or not finite or the scale overflows
        scale = tl.math.div_rn(tl.math.div_rn(tl.full(amax.shape, FMAX, tl.float32), amax),
                               tl.full(amax.shape, MARGIN_DIV, tl.float32))
        ok = (amax > 0) & (amax < float("inf")) & (scale < float("inf"))
        return tl.where(ok, scale, 1.0)

    @triton.jit
    def rowwise_cast_kernel(x_ptr, row_amax_ptr, col_amax_ptr, q_ptr, t_ptr, row_si_ptr, col_si_ptr, R, C,
                            FMAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, MARGIN_DIV: tl.constexpr,
                            WANT_Q: tl.constexpr, WANT_T: tl.constexpr, SW_ROUND: tl.constexpr, EVEN: tl.constexpr,
                            BR: tl.constexpr, BC: tl.constexpr):
        # x [R, C] -> q [R, C] scaled per row and q^T [C, R] scaled per column of x, from the maxima of
        # row_col_amax_kernel, in one read of x; the programs of the first tile column / row also write the rows' /
        # columns' scale_inv (1 / scale, correctly rounded as ATen's reciprocal)
        pid_r = tl.program_id(0)
        pid_c = tl.program_id(1)
        r0 = pid_r * BR
        c0 = pid_c * BC
        lr = tl.arange(0, BR)
        lc = tl.arange(0, BC)
        rmask = r0 + lr < R
        cmask = c0 + lc < C
        x_tile = x_ptr + r0.to(tl.int64) * C + c0
        offs = lr[:, None] * C + lc[None, :]
        if EVEN:
            x = tl.load(x_tile + offs).to(tl.float32)
        else:
            x = tl.load(x_tile + offs, mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        if WANT_Q:
            rs = amax_scale(tl.load(row_amax_ptr + r0 + lr, mask=rmask, other=1.0), FMAX, MARGIN_DIV)
            store_q_qt(x, rs[:, None], r0, c0, R, C, q_ptr, q_ptr, C, R, FMAX, MBITS, EMIN, True, False, 0,
                       SW_ROUND, EVEN, BR, BC)
            if pid_c == 0:
                tl.store(row_si_ptr + r0 + lr, tl.math.div_rn(tl.full((BR,), 1.0, tl.float32), rs), mask=rmask)
        if WANT_T:
            cs = amax_scale(tl.load(col_amax_ptr + c0 + lc, mask=cmask, other=1.0), FMAX, MARGIN_DIV)
            # cast with the column scales, then the FP8 tile transposed (formulation 1: the scales broadcast over
            # the untransposed tile)
            store_q_qt(x, cs[None, :], r0, c0, R, C, t_ptr, t_ptr, C, R, FMAX, MBITS, EMIN, False, True, 1,
                       SW_ROUND, EVEN, BR, BC)
            if pid_r == 0:
                tl.store(col_si_ptr + c0 + lc, tl.math.div_rn(tl.full((BC,), 1.0, tl.float32), cs), mask=cmask)


# Formulations of the transposed store (`cast_transpose`'s t_mode, `store_q_qt`'s T_MODE): 0 transposes the fp32
# tile and converts, 1 converts and transposes the FP8 tile. They compute the same bits; the cast runs 0
# (`production_formulation`), the fused SwiGLU's forward 1 (`triton_swiglu.FORMULATIONS`).
TRANSPOSE_MODES = (0, 1)
# The roundings (`cast_transpose`'s sw_round): the conversion instruction's round-to-nearest-even (cvt.rn.satfinite;
# fewer instructions per element), or rounding in fp32 arithmetic before the conversion (`primitives.round_to_fp8_grid`;
# exact whatever the instruction does, e.g. in Triton's interpreter, whose emulated conversion does not round to
# nearest even).
ROUNDINGS = (False, True)
MAX_AMAX_OUTS = 3


def production_formulation() -> tuple[int, bool]:
    """(t_mode, sw_round) of the casts in training: formulation 0 with the conversion instruction's rounding, compiled
    with torch's ptxas (`megadlms.triton_setup.use_torch_ptxas`, which the `megadlms` commands call); under Triton's
    interpreter the rounding in fp32 arithmetic."""
    return 0, _interpret()



def cast_transpose(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, want_q: bool, want_t: bool,
                   amax_out: torch.Tensor | Sequence[torch.Tensor] | None = None, q_out: torch.Tensor | None = None,
                   t_out: torch.Tensor | None = None, t_mode: int = 0, tile: tuple[int, int, int] | None = None,
                   sw_round: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """x [R, C] contiguous (any float dtype), scale fp32 scalar tensor -> (q [R, C] | None, q^T [C, R] | None).

    amax_out: fp32 scalar tensor, or up to MAX_AMAX_OUTS of them (the history slots of a fused group), each raised
    in place to max(amax_out, max |x|) (atomic), or None.
    q_out / t_out: where to write (q_out [R, C] with unit column stride, t_out [C, R] with unit column stride,
    e.g. row/column blocks of a larger buffer); allocated when None.
    t_mode: the formulation of the transposed store (one of TRANSPOSE_MODES).
    tile: (rows, columns, warps) of one program; `tile_config` when None.
    sw_round: round to the FP8 grid in fp32 arithmetic before the conversion (ROUNDINGS) instead of relying on
    the conversion instruction's round-to-nearest-even.
    """
    r, c = x.shape
    amaxes = _amax_list(amax_out)
    if len(amaxes) > MAX_AMAX_OUTS:
        raise ValueError(f"cast_transpose takes at most {MAX_AMAX_OUTS} amax outputs, got {len(amaxes)}")
    if t_mode not in TRANSPOSE_MODES:
        raise ValueError(f"cast_transpose: t_mode={t_mode} is not one of the formulations {TRANSPOSE_MODES}")
    if want_q and q_out is None:
        q_out = torch.empty(r, c, dtype=fp8_dtype, device=x.device)
    if want_t and t_out is None:
        t_out = torch.empty(c, r, dtype=fp8_dtype, device=x.device)
    _launch(x, scale, fp8_dtype, q_out if want_q else None, t_out if want_t else None, amaxes, t_mode, tile,
            sw_round)
    return (q_out if want_q else None), (t_out if want_t else None)


def tile_config(x_dtype: torch.dtype, want_t: bool) -> tuple[int, int, int]:
    """(rows, columns, warps) of one program of the cast kernel: the tile fastest over the trainer's casts among
    those that pass their check (benchmarks/fp8_cast_sweep.py measures them)."""
    if x_dtype == torch.float32:  # the master weights
        return 64, 128, 4
    return 128, 64, 8


def _launch(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, q_out: torch.Tensor | None,
            t_out: torch.Tensor | None, amaxes: list[torch.Tensor], t_mode: int,
            tile: tuple[int, int, int] | None = None, sw_round: bool = False) -> None:
    r, c = x.shape
    q_arg = q_out if q_out is not None else (t_out if t_out is not None else x)
    t_arg = t_out if t_out is not None else q_arg
    amax_args = (amaxes + [scale] * MAX_AMAX_OUTS)[:MAX_AMAX_OUTS]  # unused pointers: any tensor
    br, bc, warps = tile or tile_config(x.dtype, t_out is not None)
    grid = (triton_cdiv(r, br), triton_cdiv(c, bc))
    kwargs = {} if _interpret() else {"num_warps": warps}
    cast_transpose_kernel[grid](x, q_arg, t_arg, scale, *amax_args, r, c,
                                q_out.stride(0) if q_out is not None else c,
                                t_out.stride(0) if t_out is not None else r,
                                FMAX=FP8_MAX[fp8_dtype], MBITS=FP8_GRID[fp8_dtype][0], EMIN=FP8_GRID[fp8_dtype][1],
                                WANT_Q=q_out is not None, WANT_T=t_out is not None, N_AMAX=len(amaxes),
                                T_MODE=t_mode, SW_ROUND=sw_round, EVEN=r % br == 0 and c % bc == 0, BR=br, BC=bc,
                                **kwargs)


def _amax_list(amax_out: torch.Tensor | Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
    if amax_out is None:
        return []
    return [amax_out] if isinstance(amax_out, torch.Tensor) else list(amax_out)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def checked_cast_transpose(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, want_q: bool,
                           want_t: bool, amax_out: torch.Tensor | Sequence[torch.Tensor] | None = None,
                           q_out: torch.Tensor | None = None, t_out: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
    """`cast_transpose` in the production formulation (`production_formulation`), checked bitwise against the ATen
    cast on the first call of each variant. Returns None when the kernel is off for this variant (since an earlier
    call, or now, with a warning that shows the first differing elements): the caller takes the exact torch path,
    with the amax outputs as they were."""
    if not _state["ok"]:
        return None
    amaxes = _amax_list(amax_out)
    key = (x.dtype, fp8_dtype, want_q, want_t, len(amaxes), q_out is not None, t_out is not None)
    verdict = _state["checked"].get(key)
    mode, sw_round = production_formulation()
    if verdict is not None:
        return cast_transpose(x, scale, fp8_dtype, want_q, want_t, amaxes, q_out, t_out, mode, None,
                              sw_round) if verdict else None
    before = [a.clone() for a in amaxes]
    ref, x_amax = _aten_cast(x, scale, fp8_dtype, with_amax=bool(amaxes))
    r, c = x.shape
    if want_q and q_out is None:
        q_out = torch.empty(r, c, dtype=fp8_dtype, device=x.device)
    if want_t and t_out is None:
        t_out = torch.empty(c, r, dtype=fp8_dtype, device=x.device)
    fill_unwritten_marker(q_out, t_out)
    problems = []
    try:
        q, t = cast_transpose(x, scale, fp8_dtype, want_q, want_t, amaxes, q_out, t_out, mode, None, sw_round)
    except Exception as e:  # e.g. a Triton build without these FP8 conversions: the torch path computes it
        problems.append(f"{type(e).__name__}: {str(e)[:200]}")
    else:
        if q is not None and not torch.equal(q.view(torch.uint8), ref.view(torch.uint8)):
            problems.append("q: " + _first_differences(x, scale, q, ref))
        if t is not None and not torch.equal(t.view(torch.uint8), ref.t().contiguous().view(torch.uint8)):
            problems.append("q^T: " + _first_differences(x.t(), scale, t, ref.t()))
        if amaxes:
            assert x_amax is not None  # computed when there are amax outputs
            problems += [f"amax {a.item()!r} instead of {torch.maximum(b, x_amax).item()!r}"
                         for a, b in zip(amaxes, before) if not torch.equal(a, torch.maximum(b, x_amax))]
    _state["checked"][key] = not problems
    if not problems:
        return q, t
    warnings.warn(f"megadlms.fp8: the Triton FP8 cast kernel disagreed with the ATen cast for {x.dtype} -> "
                  f"{fp8_dtype} ({'; '.join(problems)}); this variant uses the torch cast instead (with Triton's "
                  "bundled ptxas: call megadlms.fp8.use_torch_ptxas() before the first FP8 forward)",
                  RuntimeWarning, stacklevel=2)
    for a, b in zip(amaxes, before):
        a.copy_(b)
    return None


# Rows of a first-call check's torch reference computed at once: its fp32 temporaries (a dozen for the fused SwiGLU
# backward's derivatives) stay this many rows tall instead of the whole tensor's (GiBs at 8B-class shapes, on top of
# the first step's activations)
CHECK_ROWS = 1024


def row_blocks(m: int) -> list[tuple[int, int]]:
    """(r0, r1) blocks of CHECK_ROWS rows covering m rows."""
    return [(r, min(r + CHECK_ROWS, m)) for r in range(0, m, CHECK_ROWS)]


def reference_cast(m: int, cols: int, scale: torch.Tensor, fp8_dtype: torch.dtype, values: Any,
                   with_amax: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A kernel's torch reference built CHECK_ROWS rows at a time: values(r0, r1) -> fp32 [r1 - r0, cols] -> (the FP8
    codes [m, cols] of clamp(values * scale), and with_amax max |values| as an fp32 scalar, NaN if any is; else
    None)."""
    fmax = FP8_MAX[fp8_dtype]
    ref = torch.empty(m, cols, dtype=fp8_dtype, device=scale.device)
    amax = torch.zeros((), dtype=torch.float32, device=scale.device) if with_amax else None
    for r0, r1 in row_blocks(m):
        v = values(r0, r1)
        ref[r0:r1] = (v * scale).clamp(-fmax, fmax).to(fp8_dtype)
        if amax is not None:
            amax = torch.maximum(amax, v.abs().amax().float())
    return ref, amax


def _aten_cast(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, with_amax: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ATen cast of x [R, C] and, with_amax, max |x| (`reference_cast`)."""
    return reference_cast(x.shape[0], x.shape[1], scale, fp8_dtype, lambda r0, r1: x[r0:r1].float(), with_amax)


# (elements per block, warps, programs per SM) of the amax kernel: benchmarks/fp8_cast_sweep.py --kinds amax
AMAX_TILE = (8192, 8, 4)
_sm_count: dict[torch.device, int] = {}


def amax(x: torch.Tensor, tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    """max |x| of a contiguous x of 1 to 2**31 - 65536 elements (any float dtype) as an fp32 scalar tensor: one read
    of x at the memory's speed (ATen's inf-norm reduction is slower: benchmarks/fp8_cast_sweep.py --kinds amax).
    tile: (elements per block, warps, programs per SM), AMAX_TILE when None."""
    n = x.numel()
    block, warps, per_sm = tile or AMAX_TILE
    out = torch.zeros((), dtype=torch.float32, device=x.device)
    kwargs = {} if _interpret() else {"num_warps": warps}
    amax_kernel[(streaming_programs(x.device, per_sm, triton_cdiv(n, block)),)](x, out, n, BLOCK=block,
                                                                               EVEN=n % block == 0, **kwargs)
    return out


def streaming_programs(device: torch.device, per_sm: int, blocks: int) -> int:
    """Grid size of a reduction whose programs stride over `blocks` blocks, each keeping its result in registers
    until one atomic at its end: `per_sm` programs per SM (more would only add atomics), at most one per block."""
    sms = _sm_count.get(device)
    if sms is None:
        sms = _sm_count[device] = (torch.cuda.get_device_properties(device).multi_processor_count
                                   if device.type == "cuda" else 1)
    return max(1, min(per_sm * sms, blocks))


def checked_amax(x: torch.Tensor) -> torch.Tensor | None:
    """`amax`, checked bitwise against ATen's on the first call of each input dtype; None where the kernel does not
    take x (not contiguous, empty or of 2**31 elements or more, the kernels off) or has failed its check (the
    caller uses ATen)."""
    if not x.is_contiguous() or not 0 < x.numel() < 2**31 - 65536 or not enabled(x.device):
        return None
    return checked_once(_state["amax_ok"], x.dtype, lambda: amax(x),
                         lambda: torch.linalg.vector_norm(x, float("inf")).float(), f"amax kernel ({x.dtype})")


MAX_SCALE_INPUTS = 4


def current_scale(amaxes: Sequence[torch.Tensor], fp8_dtype: torch.dtype, margin: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, scale_inv) fp32 scalars of current scaling from the largest of up to MAX_SCALE_INPUTS amaxes (fp32
    scalar tensors), in one launch: in place of the eight small kernels of `amax_to_scale` and a reciprocal, which
    ran between every amax and its cast. Both results are 16-byte aligned (`_scaled_mm` scales)."""
    if not 1 <= len(amaxes) <= MAX_SCALE_INPUTS:
        raise ValueError(f"current_scale takes 1 to {MAX_SCALE_INPUTS} amaxes, got {len(amaxes)}")
    out = torch.empty(2, 4, dtype=torch.float32, device=amaxes[0].device)
    args = (list(amaxes) + [amaxes[0]] * MAX_SCALE_INPUTS)[:MAX_SCALE_INPUTS]
    current_scale_kernel[(1,)](*args, out, N_IN=len(amaxes), FMAX=FP8_MAX[fp8_dtype], MARGIN_DIV=2.0 ** margin)
    return out[0, 0], out[1, 0]


def checked_current_scale(amaxes: Sequence[torch.Tensor], fp8_dtype: torch.dtype, margin: int = 0
                          ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`current_scale`, checked bitwise against `amax_to_scale` and ATen's reciprocal on its first call in the
    process; None when the kernel is off (the caller computes the scale with torch)."""
    if not enabled(amaxes[0].device):
        return None

    def reference() -> tuple[torch.Tensor, torch.Tensor]:
        scale = amax_to_scale(torch.stack([a.float() for a in amaxes]).amax(), FP8_MAX[fp8_dtype], margin)
        return scale, scale.reciprocal()

    return checked_once(_state, "scale_ok", lambda: current_scale(amaxes, fp8_dtype, margin), reference,
                         "current-scale kernel")


def checked_once(verdicts: dict, key: Any, run: Any, reference: Any, what: str, same: Any = torch.equal) -> Any:
    """run() where verdicts[key] is True; None where it is False; on the first call (no verdict yet), run() compared
    with reference() (a tensor or a tuple of them; bitwise, or by `same(got, want)`), the verdict recorded and a
    disagreement (or a kernel that fails to run) warned about. None tells the caller to compute it with torch."""
    ok = verdicts.get(key)
    if ok is not None:
        return run() if ok else None
    want = reference()
    try:
        got = run()
        pairs = list(zip(got, want)) if isinstance(want, tuple) else [(got, want)]
        agree = all(same(g, w) for g, w in pairs)
        problem = "; ".join(f"{g.item()!r} instead of {w.item()!r}" for g, w in pairs)
    except Exception as e:  # e.g. a Triton build without these instructions
        agree, problem = False, f"{type(e).__name__}: {str(e)[:200]}"
    verdicts[key] = agree
    if not agree:
        warnings.warn(f"megadlms.fp8: the Triton {what} disagreed with torch ({problem}); torch computes it instead",
                      RuntimeWarning, stacklevel=3)
        return None
    return got


def fill_unwritten_marker(*outs: torch.Tensor | None) -> None:
    """Fill FP8 outputs with 0xFF (NaN in E4M3 and E5M2) before a checked call: an element the kernel fails to
    write then differs from the reference whatever the memory held before (a reused buffer may hold the right
    bytes from an earlier call)."""
    for o in outs:
        if o is not None:
            o.view(torch.uint8).fill_(255)


def _first_differences(x: torch.Tensor, scale: torch.Tensor, got: torch.Tensor, ref: torch.Tensor, n: int = 3) -> str:
    """'k of N elements differ, e.g. x=... -> 0x.. (kernel) vs 0x.. (ATen)' for a mismatch warning."""
    diff = got.view(torch.uint8) != ref.view(torch.uint8)
    idx = diff.nonzero()[:n].tolist()
    examples = ", ".join(f"x={x[i, j].item()!r} * scale {scale.item()!r} -> {got.view(torch.uint8)[i, j].item():#04x} "
                         f"vs {ref.view(torch.uint8)[i, j].item():#04x}" for i, j in idx)
    return f"{int(diff.sum())} of {diff.numel()} elements differ, e.g. {examples}"


# (rows, columns, warps) of one program of the rowwise kernels
ROWWISE_TILE = (64, 128, 8)


def rowwise_cast(x: torch.Tensor, fp8_dtype: torch.dtype, want_q: bool, want_t: bool, margin: int = 0,
                 tile: tuple[int, int, int] | None = None, sw_round: bool | None = None
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Current scaling per row and per column of x [R, C] contiguous (any float dtype) in two reads of x: the row and
    column maxima (one pass), then q [R, C] with one scale per row and q^T [C, R] with one scale per column of x
    (each row of q^T scaled by its own maximum: what the backward GEMMs contract), from one more pass.

    Returns (q | None, q^T | None, scale_inv per row [R, 1] | None, scale_inv per column [C, 1] | None), fp32 scales
    as `primitives.quantize_rowwise(x, fp8_dtype, 1 / 0, margin)` gives them. sw_round: as `cast_transpose`'s
    (default: the production formulation's)."""
    r, c = x.shape
    br, bc, warps = tile or ROWWISE_TILE
    if sw_round is None:
        sw_round = production_formulation()[1]
    dev = x.device
    row_amax = torch.zeros(r, dtype=torch.float32, device=dev) if want_q else None
    col_amax = torch.zeros(c, dtype=torch.float32, device=dev) if want_t else None
    grid = (triton_cdiv(r, br), triton_cdiv(c, bc))
    even = r % br == 0 and c % bc == 0
    kwargs = {} if _interpret() else {"num_warps": warps}
    dummy = row_amax if row_amax is not None else col_amax
    row_col_amax_kernel[grid](x, dummy if row_amax is None else row_amax, dummy if col_amax is None else col_amax,
                              r, c, WANT_ROW=want_q, WANT_COL=want_t, EVEN=even, BR=br, BC=bc, **kwargs)
    q = torch.empty(r, c, dtype=fp8_dtype, device=dev) if want_q else None
    t = torch.empty(c, r, dtype=fp8_dtype, device=dev) if want_t else None
    row_si = torch.empty(r, 1, dtype=torch.float32, device=dev) if want_q else None
    col_si = torch.empty(c, 1, dtype=torch.float32, device=dev) if want_t else None
    any_q = q if q is not None else t
    any_si = row_si if row_si is not None else col_si
    rowwise_cast_kernel[grid](x, dummy if row_amax is None else row_amax, dummy if col_amax is None else col_amax,
                              any_q if q is None else q, any_q if t is None else t,
                              any_si if row_si is None else row_si, any_si if col_si is None else col_si, r, c,
                              FMAX=FP8_MAX[fp8_dtype], MBITS=FP8_GRID[fp8_dtype][0], EMIN=FP8_GRID[fp8_dtype][1],
                              MARGIN_DIV=2.0 ** margin, WANT_Q=want_q, WANT_T=want_t, SW_ROUND=sw_round,
                              EVEN=even, BR=br, BC=bc, **kwargs)
    return q, t, row_si, col_si


def _rowwise_reference(x: torch.Tensor, fp8_dtype: torch.dtype, want_q: bool, want_t: bool, margin: int
                       ) -> tuple[torch.Tensor | None, ...]:
    """`rowwise_cast`'s results by the torch path (`primitives.quantize_rowwise`'s arithmetic), in its layout, built
    CHECK_ROWS rows at a time (its fp32 temporaries stay that many rows tall: see `reference_cast`)."""
    from .primitives import quantize

    r, c = x.shape
    fmax = FP8_MAX[fp8_dtype]
    q = torch.empty(r, c, dtype=fp8_dtype, device=x.device) if want_q else None
    t = torch.empty(c, r, dtype=fp8_dtype, device=x.device) if want_t else None
    row_si = torch.empty(r, 1, dtype=torch.float32, device=x.device) if want_q else None
    col_scale = col_si = None
    if want_t:  # the columns' maxima over all rows first
        col_amax = torch.zeros(1, c, dtype=torch.float32, device=x.device)
        for r0, r1 in row_blocks(r):
            col_amax = torch.maximum(col_amax, x[r0:r1].abs().amax(dim=0, keepdim=True).float())
        col_scale = amax_to_scale(col_amax, fmax, margin)
        col_si = col_scale.reciprocal().reshape(-1, 1)
    for r0, r1 in row_blocks(r):
        block = x[r0:r1]
        if q is not None and row_si is not None:
            scale = amax_to_scale(block.abs().amax(dim=1, keepdim=True).float(), fmax, margin)
            q[r0:r1] = quantize(block, scale, fp8_dtype)
            row_si[r0:r1] = scale.reciprocal()
        if t is not None and col_scale is not None:
            t[:, r0:r1] = quantize(block, col_scale, fp8_dtype).t()
    return q, t, row_si, col_si


def checked_rowwise_cast(x: torch.Tensor, fp8_dtype: torch.dtype, want_q: bool, want_t: bool, margin: int = 0
                         ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None,
                                    torch.Tensor | None] | None:
    """`rowwise_cast` where the kernels take x (`available`), checked bitwise against the torch path on the first
    call of each variant (input dtype, FP8 format, outputs, margin); None where they do not take x or the variant
    failed its check (with a warning): the caller casts with torch."""
    if not (want_q or want_t) or not available(x) or x.numel() >= 2**31:
        return None
    key = (x.dtype, fp8_dtype, want_q, want_t, margin)
    verdicts = _state["rowwise_ok"]
    if verdicts.get(key) is not None:
        return rowwise_cast(x, fp8_dtype, want_q, want_t, margin) if verdicts[key] else None
    want = _rowwise_reference(x, fp8_dtype, want_q, want_t, margin)
    try:
        got = rowwise_cast(x, fp8_dtype, want_q, want_t, margin)
        names = ("q", "q^T", "row scale_inv", "column scale_inv")
        problems = [f"{n} differs" for n, g, w in zip(names, got, want) if w is not None and not _same_bits(g, w)]
    except Exception as e:  # e.g. a Triton build without these FP8 conversions: the torch path computes it
        got, problems = None, [f"{type(e).__name__}: {str(e)[:200]}"]
    verdicts[key] = not problems
    if problems:
        warnings.warn(f"megadlms.fp8: the Triton rowwise cast disagreed with the torch cast for {x.dtype} -> "
                      f"{fp8_dtype} ({'; '.join(problems)}); this variant uses the torch cast instead",
                      RuntimeWarning, stacklevel=2)
        return None
    return got


def _same_bits(got: torch.Tensor | None, want: torch.Tensor) -> bool:
    if got is None or got.shape != want.shape:
        return False
    if got.element_size() == 1:
        return torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    return torch.equal(got, want)


__all__ = ["available", "enabled", "amax", "checked_amax", "cast_transpose", "checked_cast_transpose", "current_scale",
           "checked_current_scale", "rowwise_cast", "checked_rowwise_cast", "TRANSPOSE_MODES", "E4M3", "E5M2"]
