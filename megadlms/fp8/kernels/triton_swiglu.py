"""SwiGLU fused with the FP8 casts around it (Triton, CUDA): the pointwise work of the FP8 MLP in one pass each.

forward   `swiglu_cast`:      y = [gate, up] [M, 2F] -> h = silu(gate) * up cast to FP8 as q [M, F] and q^T [F, M]
                              (the down projection's fprop and wgrad operands), amax |h| into a history slot
backward  `swiglu_bwd_cast`:  dh [M, F], gate, up -> [d_gate, d_up] cast to FP8 as q [M, 2F] and q^T [2F, M]
                              (the gate/up projection's dgrad and wgrad operands), amax into the history slots

current scaling, before them: `swiglu_amax` / `swiglu_bwd_amax` read the same inputs and give the amax of the
                              values the cast will scale (its scale), writing nothing

Unfused, each of these is a BF16 pointwise kernel whose output a cast kernel reads back: h (M x F) and
[d_gate, d_up] (M x 2F) make a round trip through memory in BF16. Here they stay in registers and go to FP8
from fp32 (one rounding instead of two), with the scale known before the pass (delayed scaling) or taken from
the amax pass (current scaling: one read of the inputs in place of h's BF16 write, its amax pass and its cast's
read).

The casts and stores are `triton_cast`'s (`store_q_qt`: the same roundings and formulations of the transposed
store). Production runs one formulation per kernel (`production_formulation`). The first call of each variant is
checked against the torch computation (`swiglu_ref`, `swiglu_bwd_ref`), with its outputs filled with a marker
first (so that elements a kernel leaves unwritten show): every FP8 code of q and q^T within one step of the
reference's and at most 0.1% of them different (silu's exp may differ in the last fp32 bit), the amax within 1e-3.
A variant that fails is switched off with a warning (the caller then takes the unfused path).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..recipe import FP8_MAX
from . import triton_cast
from .primitives import FP8_GRID

try:  # the kernels exist where Triton does; `available` says whether they can run
    import triton
    import triton.language as tl
except Exception:
    triton = None

# per variant key: whether its first call agreed with torch ("checked"; False: off), why not ("rejected": what a
# benchmark reports), and the verdicts of the amax kernels' first-call checks ("amax_ok")
_state: dict[str, Any] = {"checked": {}, "rejected": {}, "amax_ok": {}}
MAX_AMAX_OUTS = 2


def available(y: torch.Tensor) -> bool:
    """Whether the fused kernels can run on y's device (CUDA with Triton, or Triton's CPU interpreter); off with
    MEGADLMS_FP8_TRITON=0, like the cast kernel."""
    if triton is None or os.environ.get("MEGADLMS_FP8_TRITON", "1") == "0":
        return False
    return y.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    from .triton_cast import max_keeping_nan, store_q_qt

    @triton.jit
    def swiglu_fp32(gate, up):
        return gate * tl.sigmoid(gate) * up

    @triton.jit
    def swiglu_grads_fp32(dh, gate, up):
        sig = tl.sigmoid(gate)
        d_gate = dh * up * sig * (1.0 + gate * (1.0 - sig))  # d silu(x)/dx = s(x) (1 + x (1 - s(x)))
        return d_gate, dh * gate * sig

    @triton.jit
    def h_tile(y_ptr, ld_y, M, F, r0, c0, EVEN: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        # h = silu(gate) * up in fp32 on the tile at (r0, c0) of y = [gate, up] [M, 2F] (0 outside [M, F]): what
        # the forward kernels scale and take the amax of
        lr = tl.arange(0, BR)
        lc = tl.arange(0, BC)
        y_tile = y_ptr + r0.to(tl.int64) * ld_y + c0
        offs = lr[:, None] * ld_y + lc[None, :]
        if EVEN:
            gate = tl.load(y_tile + offs).to(tl.float32)
            up = tl.load(y_tile + F + offs).to(tl.float32)
        else:
            mask = (r0 + lr[:, None] < M) & (c0 + lc[None, :] < F)
            gate = tl.load(y_tile + offs, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(y_tile + F + offs, mask=mask, other=0.0).to(tl.float32)
        return swiglu_fp32(gate, up)

    @triton.jit
    def grads_tile(dh_ptr, ld_dh, g_ptr, u_ptr, ld_gu, gs_ptr, us_ptr, M, F, r0, c0, ROW_SCALES: tl.constexpr,
                   EVEN: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        # (d_gate, d_up) in fp32 on the tile at (r0, c0) of dh, gate, up [M, F] (0 outside): what the backward
        # kernels scale and take the amax of
        lr = tl.arange(0, BR)
        lc = tl.arange(0, BC)
        dh_offs = lr[:, None] * ld_dh + lc[None, :]
        offs = lr[:, None] * ld_gu + lc[None, :]
        dh_tile = dh_ptr + r0.to(tl.int64) * ld_dh + c0
        gu_origin = r0.to(tl.int64) * ld_gu + c0
        if EVEN:
            dh = tl.load(dh_tile + dh_offs)
            gate = tl.load(g_ptr + gu_origin + offs).to(tl.float32)
            up = tl.load(u_ptr + gu_origin + offs).to(tl.float32)
        else:
            mask = (r0 + lr[:, None] < M) & (c0 + lc[None, :] < F)
            dh = tl.load(dh_tile + dh_offs, mask=mask, other=0.0)
            gate = tl.load(g_ptr + gu_origin + offs, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(u_ptr + gu_origin + offs, mask=mask, other=0.0).to(tl.float32)
        if ROW_SCALES:  # gate and up kept in FP8 with one scale per row (activation_func_fp8_input_store)
            rows = r0 + lr
            gate = gate * tl.load(gs_ptr + rows, mask=rows < M, other=0.0)[:, None]
            up = up * tl.load(us_ptr + rows, mask=rows < M, other=0.0)[:, None]
        return swiglu_grads_fp32(dh.to(tl.float32), gate, up)

    @triton.jit
    def swiglu_amax_kernel(y_ptr, ld_y, M, F, out_ptr, EVEN: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        # max |silu(gate) * up| over y = [gate, up] [M, 2F] into out_ptr (fp32, zero before the call), each value
        # computed as swiglu_cast_kernel computes it: the scale current scaling needs before that cast. Each
        # program strides over tiles keeping an elementwise max, then one atomic max; NaN wins (as amax_kernel)
        n_cb = tl.cdiv(F, BC)
        acc = tl.zeros((BR, BC), tl.float32)
        for tile in range(tl.program_id(0), tl.cdiv(M, BR) * n_cb, tl.num_programs(0)):
            h = h_tile(y_ptr, ld_y, M, F, (tile // n_cb) * BR, (tile % n_cb) * BC, EVEN, BR, BC)
            acc = tl.maximum(acc, tl.abs(h), propagate_nan=tl.PropagateNan.ALL)
        tl.atomic_max(out_ptr, max_keeping_nan(tl.reshape(acc, (BR * BC,))))

    @triton.jit
    def swiglu_bwd_amax_kernel(dh_ptr, ld_dh, g_ptr, u_ptr, ld_gu, gs_ptr, us_ptr, M, F, out_ptr,
                               ROW_SCALES: tl.constexpr, EVEN: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        # max |.| of [d_gate, d_up] as swiglu_bwd_cast_kernel computes them, into out_ptr (as swiglu_amax_kernel)
        n_cb = tl.cdiv(F, BC)
        acc = tl.zeros((BR, BC), tl.float32)
        for tile in range(tl.program_id(0), tl.cdiv(M, BR) * n_cb, tl.num_programs(0)):
            d_gate, d_up = grads_tile(dh_ptr, ld_dh, g_ptr, u_ptr, ld_gu, gs_ptr, us_ptr, M, F, (tile // n_cb) * BR,
                                      (tile % n_cb) * BC, ROW_SCALES, EVEN, BR, BC)
            acc = tl.maximum(acc, tl.abs(d_gate), propagate_nan=tl.PropagateNan.ALL)
            acc = tl.maximum(acc, tl.abs(d_up), propagate_nan=tl.PropagateNan.ALL)
        tl.atomic_max(out_ptr, max_keeping_nan(tl.reshape(acc, (BR * BC,))))

    @triton.jit
    def swiglu_cast_kernel(y_ptr, ld_y, M, F, q_ptr, t_ptr, ld_q, ld_t, scale_ptr, amax_ptr, FMAX: tl.constexpr,
                           MBITS: tl.constexpr, EMIN: tl.constexpr, WANT_T: tl.constexpr, HAS_AMAX: tl.constexpr,
                           T_MODE: tl.constexpr, SW_ROUND: tl.constexpr, EVEN: tl.constexpr, BR: tl.constexpr,
                           BC: tl.constexpr):
        r0 = tl.program_id(0) * BR
        c0 = tl.program_id(1) * BC
        h = h_tile(y_ptr, ld_y, M, F, r0, c0, EVEN, BR, BC)
        store_q_qt(h, tl.load(scale_ptr), r0, c0, M, F, q_ptr, t_ptr, ld_q, ld_t, FMAX, MBITS, EMIN, True, WANT_T,
                   T_MODE, SW_ROUND, EVEN, BR, BC)
        if HAS_AMAX:
            tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(h), axis=1), axis=0))

    @triton.jit
    def swiglu_bwd_cast_kernel(dh_ptr, ld_dh, g_ptr, u_ptr, ld_gu, gs_ptr, us_ptr, M, F, q_ptr, q2_ptr, t_ptr, t2_ptr,
                               ld_q, ld_t, scale_ptr, amax_ptr, amax_ptr2, FMAX: tl.constexpr, MBITS: tl.constexpr,
                               EMIN: tl.constexpr, WANT_Q: tl.constexpr, WANT_T: tl.constexpr,
                               ROW_SCALES: tl.constexpr, N_AMAX: tl.constexpr, T_MODE: tl.constexpr,
                               SW_ROUND: tl.constexpr, EVEN: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        r0 = tl.program_id(0) * BR
        c0 = tl.program_id(1) * BC
        d_gate, d_up = grads_tile(dh_ptr, ld_dh, g_ptr, u_ptr, ld_gu, gs_ptr, us_ptr, M, F, r0, c0, ROW_SCALES, EVEN,
                                  BR, BC)
        scale = tl.load(scale_ptr)
        store_q_qt(d_gate, scale, r0, c0, M, F, q_ptr, t_ptr, ld_q, ld_t, FMAX, MBITS, EMIN, WANT_Q, WANT_T,
                   T_MODE, SW_ROUND, EVEN, BR, BC)
        store_q_qt(d_up, scale, r0, c0, M, F, q2_ptr, t2_ptr, ld_q, ld_t, FMAX, MBITS, EMIN, WANT_Q, WANT_T,
                   T_MODE, SW_ROUND, EVEN, BR, BC)
        if N_AMAX > 0:
            tile_amax = tl.maximum(tl.max(tl.max(tl.abs(d_gate), axis=1), axis=0),
                                   tl.max(tl.max(tl.abs(d_up), axis=1), axis=0))
            tl.atomic_max(amax_ptr, tile_amax)
            if N_AMAX > 1:
                tl.atomic_max(amax_ptr2, tile_amax)


# How each kernel stores q^T (`triton_cast.TRANSPOSE_MODES`): production runs the first (`production_formulation`:
# the faster at the kernel's tile, benchmarks/fp8_cast_sweep.py), the other computes the same bits (the tests and
# benchmarks/fp8_store_check.py run both).
FORMULATIONS = {"fwd": (1, 0), "bwd": (0, 1)}


def production_formulation(kernel: str) -> tuple[int, bool]:
    """(t_mode, sw_round) of `kernel` ("fwd" or "bwd") in training: its first formulation with the conversion
    instruction's rounding (compiled with torch's ptxas, `megadlms.triton_setup.use_torch_ptxas`); under Triton's
    interpreter the rounding in fp32 arithmetic (`triton_cast.production_formulation`)."""
    return FORMULATIONS[kernel][0], triton_cast.production_formulation()[1]


# (rows, columns, warps) of one program: the fastest tile whose transposed store passes its check at the trainer's
# shapes (benchmarks/fp8_cast_sweep.py measures them). The backward kernel holds five fp32 tiles, hence 8 warps for
# its 64x64 tile (fewer registers a thread, more warps in flight)
TILES = {"fwd": (32, 128, 4), "bwd": (64, 64, 8)}


def _kwargs(fp8_dtype: torch.dtype, t_mode: int, tile: tuple[int, int, int], sw_round: bool, m: int, f: int
            ) -> dict[str, Any]:
    if t_mode not in triton_cast.TRANSPOSE_MODES:
        raise ValueError(f"swiglu casts: t_mode={t_mode} is not one of the formulations {triton_cast.TRANSPOSE_MODES}")
    br, bc, warps = tile
    kw = {"FMAX": FP8_MAX[fp8_dtype], "MBITS": FP8_GRID[fp8_dtype][0], "EMIN": FP8_GRID[fp8_dtype][1],
          "T_MODE": t_mode, "SW_ROUND": sw_round,
          "EVEN": m % br == 0 and f % bc == 0, "BR": br, "BC": bc}
    if os.environ.get("TRITON_INTERPRET") != "1":
        kw["num_warps"] = warps
    return kw


def _grid(m: int, f: int, kw: dict[str, Any]) -> tuple[int, int]:
    return triton_cast.triton_cdiv(m, kw["BR"]), triton_cast.triton_cdiv(f, kw["BC"])


# ---------------------------------------------------------------------------------------------------- references
def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32 (what the forward kernel computes before its cast)."""
    return F.silu(gate.float()) * up.float()


def swiglu_bwd_ref(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_gate, d_up) in fp32 for dh = d(silu(gate) * up) (what the backward kernel computes before its cast)."""
    gate, up, dh = gate.float(), up.float(), dh.float()
    sig = torch.sigmoid(gate)
    return dh * up * sig * (1.0 + gate * (1.0 - sig)), dh * gate * sig


# ---------------------------------------------------------------------------------------------------- kernels
def _empty(shape: tuple[int, int], dtype: torch.dtype, device: torch.device, marker: bool) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    if marker:  # a checked call: unwritten elements must show (triton_cast.fill_unwritten_marker)
        triton_cast.fill_unwritten_marker(out)
    return out


def swiglu_cast(y: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, want_t: bool,
                amax_out: torch.Tensor | None = None, t_mode: int = 0, tile: tuple[int, int, int] | None = None,
                marker: bool = False, sw_round: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y [M, 2F] (gate in columns [0, F), up in [F, 2F), unit column stride) -> (q [M, F], q^T [F, M] or None)
    of h = silu(gate) * up cast with `scale`; amax_out (fp32 scalar) raised in place to max(amax_out, max |h|).
    t_mode: one of FORMULATIONS["fwd"]; sw_round: as in `triton_cast.cast_transpose`."""
    m, f2 = y.shape
    f = f2 // 2
    q = _empty((m, f), fp8_dtype, y.device, marker)
    t = _empty((f, m), fp8_dtype, y.device, marker) if want_t else None
    kw = _kwargs(fp8_dtype, t_mode, tile or TILES["fwd"], sw_round, m, f)
    swiglu_cast_kernel[_grid(m, f, kw)](
        y, y.stride(0), m, f, q, t if t is not None else q, f, m, scale,
        amax_out if amax_out is not None else scale, WANT_T=want_t, HAS_AMAX=amax_out is not None, **kw)
    return q, t


def swiglu_bwd_cast(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, scale: torch.Tensor,
                    fp8_dtype: torch.dtype, want_q: bool, want_t: bool,
                    row_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                    amax_out: Sequence[torch.Tensor] = (), t_mode: int = 0, tile: tuple[int, int, int] | None = None,
                    marker: bool = False, sw_round: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """dh [M, F], gate and up [M, F] (unit column stride, same row stride; FP8 with `row_scales` = their
    per-row scale_invs [M] each, else any float dtype) -> (q [M, 2F] or None, q^T [2F, M] or None) of
    [d_gate, d_up] cast with `scale`; each of `amax_out` raised to the max |.| of both. t_mode: one of
    FORMULATIONS["bwd"]; sw_round: as in `triton_cast.cast_transpose`."""
    m, f = dh.shape
    if len(amax_out) > MAX_AMAX_OUTS:
        raise ValueError(f"swiglu_bwd_cast takes at most {MAX_AMAX_OUTS} amax outputs, got {len(amax_out)}")
    q = _empty((m, 2 * f), fp8_dtype, dh.device, marker) if want_q else None
    t = _empty((2 * f, m), fp8_dtype, dh.device, marker) if want_t else None
    any_out = q if q is not None else t
    q1, q2 = (q[:, :f], q[:, f:]) if q is not None else (any_out, any_out)
    t1, t2 = (t[:f], t[f:]) if t is not None else (any_out, any_out)
    amaxes = (list(amax_out) + [scale] * MAX_AMAX_OUTS)[:MAX_AMAX_OUTS]
    gs, us = row_scales if row_scales is not None else (scale, scale)
    kw = _kwargs(fp8_dtype, t_mode, tile or TILES["bwd"], sw_round, m, f)
    swiglu_bwd_cast_kernel[_grid(m, f, kw)](
        dh, dh.stride(0), gate, up, gate.stride(0), gs, us, m, f, q1, q2, t1, t2, 2 * f, m, scale, *amaxes,
        WANT_Q=want_q, WANT_T=want_t, ROW_SCALES=row_scales is not None, N_AMAX=len(amax_out), **kw)
    return q, t


# (rows, columns, warps, programs per SM) of the amax kernels of current scaling (benchmarks/fp8_cast_sweep.py
# --kinds swiglu_amax measures them)
AMAX_TILES = {"fwd": (32, 256, 4, 4), "bwd": (16, 512, 4, 8)}


def _amax_launch(m: int, f: int, device: torch.device, tile: tuple[int, int, int, int]
                 ) -> tuple[tuple[int], dict[str, Any]]:
    br, bc, warps, per_sm = tile
    tiles = triton_cast.triton_cdiv(m, br) * triton_cast.triton_cdiv(f, bc)
    kw: dict[str, Any] = {"EVEN": m % br == 0 and f % bc == 0, "BR": br, "BC": bc}
    if os.environ.get("TRITON_INTERPRET") != "1":
        kw["num_warps"] = warps
    return (triton_cast.streaming_programs(device, per_sm, tiles),), kw


def swiglu_amax(y: torch.Tensor, tile: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """y [M, 2F] as `swiglu_cast` takes it -> max |silu(gate) * up| (fp32 scalar tensor) over the values that
    kernel casts: one read of y, nothing written (current scaling's amax of h, with h never in memory)."""
    m, f2 = y.shape
    out = torch.zeros((), dtype=torch.float32, device=y.device)
    grid, kw = _amax_launch(m, f2 // 2, y.device, tile or AMAX_TILES["fwd"])
    swiglu_amax_kernel[grid](y, y.stride(0), m, f2 // 2, out, **kw)
    return out


def swiglu_bwd_amax(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                    row_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                    tile: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """dh, gate, up as `swiglu_bwd_cast` takes them -> max |.| of [d_gate, d_up] (fp32 scalar tensor) over the
    values that kernel casts: one read of its inputs, nothing written."""
    m, f = dh.shape
    out = torch.zeros((), dtype=torch.float32, device=dh.device)
    gs, us = row_scales if row_scales is not None else (out, out)
    grid, kw = _amax_launch(m, f, dh.device, tile or AMAX_TILES["bwd"])
    swiglu_bwd_amax_kernel[grid](dh, dh.stride(0), gate, up, gate.stride(0), gs, us, m, f, out,
                                 ROW_SCALES=row_scales is not None, **kw)
    return out


# ---------------------------------------------------------------------------------------------------- checked calls
def _reference_amax(m: int, values: Any) -> torch.Tensor:
    """max |values(r0, r1)| over all rows, `triton_cast.CHECK_ROWS` rows at a time (NaN if any is)."""
    blocks = [values(r0, r1).abs().amax().float() for r0, r1 in triton_cast.row_blocks(m)]
    return torch.stack(blocks).amax() if blocks else torch.zeros(())


def _codes_close(q: torch.Tensor, ref: torch.Tensor, max_share: float = 1e-3) -> bool:
    """Every FP8 code of q within one step of ref's (FP8 codes are monotone in magnitude within a sign), and at most
    `max_share` of them different at all: the kernel's fp32 value may differ from torch's in the last bit (silu's
    exp), which moves a code only next to a rounding boundary; a wrong rounding moves a large share. Compared
    `triton_cast.CHECK_ROWS` rows at a time (the int32 temporaries are 4 bytes an element)."""
    differ = 0
    for r0, r1 in triton_cast.row_blocks(q.shape[0]):
        a, b = q[r0:r1].view(torch.uint8).int(), ref[r0:r1].view(torch.uint8).int()
        mag_a, mag_b = a & 0x7F, b & 0x7F
        same_sign = ((a ^ b) & 0x80) == 0
        if not bool((((mag_a - mag_b).abs() <= 1) & (same_sign | (mag_a + mag_b <= 1))).all()):
            return False
        differ += int((a != b).sum())
    return differ <= max_share * q.numel()


def _first_call(key: tuple, run: Any, ref: torch.Tensor, amax_outs: Sequence[torch.Tensor],
                amax_ref: torch.Tensor) -> tuple | None:
    """Run `run(marker=True)` (the kernel in its production formulation) and check its outputs against the torch
    computation (`_codes_close` for q and q^T, the amax outputs within 1e-3); records the verdict, and on a
    disagreement switches the variant off (None) with a warning and the amax outputs restored."""
    before = [a.clone() for a in amax_outs]
    problems = []
    try:
        q, t = run(True)
    except Exception as e:  # e.g. a Triton build without these FP8 conversions: the unfused path computes it
        problems.append(f"{type(e).__name__}: {str(e)[:200]}")
    else:
        if q is not None and not _codes_close(q, ref):
            problems.append("q differs from the torch computation by more than one FP8 step")
        if t is not None and not _codes_close(t.t(), ref):
            problems.append("q^T differs from the torch computation by more than one FP8 step")
        want = [torch.maximum(b, amax_ref) for b in before]
        if any(not torch.allclose(a, w, rtol=1e-3, atol=0.0) for a, w in zip(amax_outs, want)):
            problems.append("amax differs from the torch computation")
    _state["checked"][key] = not problems
    if not problems:
        return q, t
    _state["rejected"][key] = problems
    warnings.warn(f"megadlms.fp8: the fused SwiGLU + FP8 cast kernel disagreed with torch for {key} "
                  f"({'; '.join(problems)}); the FP8 MLP runs unfused for this variant", RuntimeWarning, stacklevel=3)
    for a, b in zip(amax_outs, before):
        a.copy_(b)
    return None


def checked_swiglu_cast(y: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, want_t: bool,
                        amax_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """`swiglu_cast` in its production formulation, checked on the first call of each variant; None when the
    variant is off."""
    key = ("fwd", y.dtype, fp8_dtype, want_t, amax_out is not None)
    verdict = _state["checked"].get(key)
    mode, sw_round = production_formulation("fwd")
    if verdict is not None:
        return swiglu_cast(y, scale, fp8_dtype, want_t, amax_out, mode, sw_round=sw_round) if verdict else None
    m, f = y.shape[0], y.shape[1] // 2
    ref, h_amax = triton_cast.reference_cast(m, f, scale, fp8_dtype,
                                             lambda r0, r1: swiglu_ref(y[r0:r1, :f], y[r0:r1, f:]))
    outs = [amax_out] if amax_out is not None else []
    assert h_amax is not None  # reference_cast computes it by default
    return _first_call(key, lambda marker: swiglu_cast(y, scale, fp8_dtype, want_t, amax_out, mode, marker=marker,
                                                       sw_round=sw_round), ref, outs, h_amax)


def checked_swiglu_bwd_cast(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, scale: torch.Tensor,
                            fp8_dtype: torch.dtype, want_q: bool, want_t: bool,
                            row_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                            amax_out: Sequence[torch.Tensor] = ()
                            ) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
    """`swiglu_bwd_cast` in its production formulation, checked on the first call of each variant; None when the
    variant is off."""
    key = ("bwd", dh.dtype, gate.dtype, fp8_dtype, want_q, want_t, row_scales is not None, len(amax_out))
    verdict = _state["checked"].get(key)
    mode, sw_round = production_formulation("bwd")
    if verdict is not None:
        return swiglu_bwd_cast(dh, gate, up, scale, fp8_dtype, want_q, want_t, row_scales, amax_out, mode,
                               sw_round=sw_round) if verdict else None
    m, f = dh.shape
    ref, d_amax = triton_cast.reference_cast(m, 2 * f, scale, fp8_dtype,
                                             lambda r0, r1: _derivatives(dh, gate, up, row_scales, r0, r1))
    assert d_amax is not None  # reference_cast computes it by default
    return _first_call(key, lambda marker: swiglu_bwd_cast(
        dh, gate, up, scale, fp8_dtype, want_q, want_t, row_scales, amax_out, mode, marker=marker, sw_round=sw_round),
        ref, list(amax_out), d_amax)


def _derivatives(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                 row_scales: tuple[torch.Tensor, torch.Tensor] | None, r0: int, r1: int) -> torch.Tensor:
    """[d_gate, d_up] of rows r0:r1 in fp32 as the backward kernels compute them (gate and up dequantized first when
    they are kept in FP8 with `row_scales`)."""
    g, u = gate[r0:r1], up[r0:r1]
    if row_scales is not None:
        g, u = g.float() * row_scales[0][r0:r1, None], u.float() * row_scales[1][r0:r1, None]
    return torch.cat(swiglu_bwd_ref(dh[r0:r1], g, u), dim=1)


def _amax_close(got: torch.Tensor, want: torch.Tensor) -> bool:
    # silu's exp may differ from torch's in the last bit: the amaxes within 1e-3, as `_first_call` checks them
    return bool(torch.allclose(got, want, rtol=1e-3, atol=0.0, equal_nan=True))


def _checked_amax(key: tuple, x: torch.Tensor, run: Any, values: Any, what: str) -> torch.Tensor | None:
    """run() (an amax kernel over x's rows), checked on its first call per key against max |values(r0, r1)| over
    x's rows (`triton_cast.checked_once`); None when it is off."""
    return triton_cast.checked_once(_state["amax_ok"], key, run, lambda: _reference_amax(x.shape[0], values), what,
                                    _amax_close)


def checked_swiglu_amax(y: torch.Tensor) -> torch.Tensor | None:
    """`swiglu_amax`, checked against torch on its first call per input dtype; None when it is off (the caller
    takes the unfused path)."""
    f = y.shape[1] // 2
    return _checked_amax(("fwd", y.dtype), y, lambda: swiglu_amax(y),
                         lambda r0, r1: swiglu_ref(y[r0:r1, :f], y[r0:r1, f:]), f"SwiGLU amax kernel ({y.dtype})")


def checked_swiglu_bwd_amax(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                            row_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
    """`swiglu_bwd_amax`, checked against torch on its first call per variant; None when it is off."""
    key = ("bwd", dh.dtype, gate.dtype, row_scales is not None)
    return _checked_amax(key, dh, lambda: swiglu_bwd_amax(dh, gate, up, row_scales),
                         lambda r0, r1: _derivatives(dh, gate, up, row_scales, r0, r1),
                         f"SwiGLU derivative amax kernel {key}")


__all__ = ["available", "swiglu_cast", "swiglu_bwd_cast", "checked_swiglu_cast", "checked_swiglu_bwd_cast",
           "swiglu_amax", "swiglu_bwd_amax", "checked_swiglu_amax", "checked_swiglu_bwd_amax",
           "swiglu_ref", "swiglu_bwd_ref"]
