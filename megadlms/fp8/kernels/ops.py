"""The FP8 kernels behind one small interface, each with its exact torch reference.

    kernel            call                         CUDA (Triton, one formulation)     torch reference
    cast (+transpose) `cast_fp8`                   triton_cast.cast_transpose          primitives.quantize (compiled)
    cast of a concat  `cast_fp8_cat` (rows),       triton_cast.cast_transpose per part the same, over torch.cat
                      `cast_fp8_cols` (columns)
    transpose         `transpose_fp8`              triton_cast.cast_transpose (scale 1) q.t().contiguous()
    amax              `amax_of`                    triton_cast.amax                    ATen's inf-norm
    current scale     `current_scale`              triton_cast.current_scale           primitives.amax_to_scale
    SwiGLU casts      triton_swiglu.checked_*      swiglu_cast, swiglu_bwd_cast, ...   swiglu_ref, swiglu_bwd_ref

Each Triton kernel runs one formulation; its first call per variant is checked against the reference, and a
variant that disagrees falls back to the reference (with a warning). The reference runs where Triton does not
(the CPU, MEGADLMS_FP8_TRITON=0): compiled with torch.compile on CUDA (dynamic shapes; inductor emits one kernel
per output layout), eagerly elsewhere; the generated kernels round like ATen's cast (`primitives.round_to_fp8_grid`).

A `_scaled_mm` operand must be K-major, so the weight-gradient GEMM (which contracts over tokens) needs the
transposes of the FP8 input and gradient, and the input-gradient GEMM the transpose of the FP8 weight: `cast_fp8`
makes q^T from the high-precision x at cast time, in the same pass as q (no later transpose pass over a saved FP8
tensor in backward). With a known scale (delayed scaling) the cast also writes the amax for the history.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import triton_cast
from .primitives import FP8_MAX, amax_to_scale, pad_2d, round_to_fp8_grid


def amax_of(x: torch.Tensor) -> torch.Tensor:
    """max |x| as an fp32 scalar tensor (exact, as max is; NaN when x holds one): the Triton kernel where it runs
    (`triton_cast.amax`), else ATen's inf-norm reduction on CUDA and abs + amax on the CPU (whose inf-norm is not
    vectorised: ~15x slower)."""
    out = triton_cast.checked_amax(x)
    if out is not None:
        return out
    if x.device.type == "cpu":
        return x.abs().amax().float()
    return torch.linalg.vector_norm(x, float("inf")).float()


def _to_fp8(y: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """fp32 y in range -> FP8 with ATen's rounding, also inside generated kernels (`round_to_fp8_grid`); eagerly on
    the CPU ATen's cast itself (the same bits, without the grid arithmetic's ten passes)."""
    if y.device.type == "cpu" and not torch.compiler.is_compiling():
        return y.to(fp8_dtype)
    return round_to_fp8_grid(y, fp8_dtype).to(fp8_dtype)


def record_amax(slots: Sequence[torch.Tensor], amax: torch.Tensor) -> None:
    """slot = max(slot, amax) for every slot (0-dim views into amax histories): one foreach kernel."""
    if slots:
        torch._foreach_maximum_(list(slots), [amax] * len(slots))


def _slots(amax_slot: torch.Tensor | Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
    if amax_slot is None:
        return []
    return [amax_slot] if isinstance(amax_slot, torch.Tensor) else list(amax_slot)


def current_scale(amaxes: Sequence[torch.Tensor], fp8_dtype: torch.dtype, margin: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, scale_inv) fp32 scalars of current scaling from the largest of `amaxes` (fp32 scalar tensors):
    `amax_to_scale` and its reciprocal, in one small kernel where Triton runs (`triton_cast.current_scale`)."""
    if len(amaxes) <= triton_cast.MAX_SCALE_INPUTS:
        out = triton_cast.checked_current_scale(amaxes, fp8_dtype, margin)
        if out is not None:
            return out
    amax = amaxes[0] if len(amaxes) == 1 else torch.stack(list(amaxes)).amax()
    scale = amax_to_scale(amax, FP8_MAX[fp8_dtype], margin)
    return scale, scale.reciprocal()


def _cast_current(x: torch.Tensor, amax: torch.Tensor, fp8_dtype: torch.dtype, margin: int, want_q: bool,
                  want_t: bool) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    fmax = FP8_MAX[fp8_dtype]
    scale = amax_to_scale(amax, fmax, margin)
    xf = x.float()
    q = _to_fp8((xf * scale).clamp(-fmax, fmax), fp8_dtype) if want_q else None
    t = _to_fp8((xf.t() * scale).clamp(-fmax, fmax), fp8_dtype).contiguous() if want_t else None
    return q, t, scale.reciprocal()


def _cast_scaled(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, want_q: bool, want_t: bool
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    fmax = FP8_MAX[fp8_dtype]
    xf = x.float()
    q = _to_fp8((xf * scale).clamp(-fmax, fmax), fp8_dtype) if want_q else None
    t = _to_fp8((xf.t() * scale).clamp(-fmax, fmax), fp8_dtype).contiguous() if want_t else None
    return q, t


# Compiled lazily on the first CUDA call, one function per kind of cast. Each meets several variants in
# training (fp32 or bf16 sources, E4M3 or E5M2, which outputs, inside or outside autocast), each a
# recompilation: past torch.compile's default limit of 8 per function it would silently run eagerly
# (unfused, several kernels per cast), so these calls raise the limit to cover every variant.
_compiled: dict[str, Any] = {}
_RECOMPILE_LIMIT = 64


def compiled(name: str, fn: Any) -> Any:
    """`fn` compiled with dynamic shapes, once per name, with the raised recompilation limit (CUDA callers)."""
    c = _compiled.get(name)
    if c is None:
        compiled = torch.compile(fn, dynamic=True)

        def c(*args: Any) -> Any:
            with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT):
                return compiled(*args)

        _compiled[name] = c
    return c


def cast_fp8(x: torch.Tensor, scale: torch.Tensor | None,
             amax_slot: torch.Tensor | Sequence[torch.Tensor] | None, fp8_dtype: torch.dtype, margin: int = 0,
             want_q: bool = True, want_t: bool = False, amax: torch.Tensor | None = None,
             scale_inv: torch.Tensor | None = None
             ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """Per-tensor FP8 cast of a 2-D x [R, C] (any float dtype).

    scale: fp32 scalar tensor (delayed scaling), or None to take it from x's amax (current scaling:
        (fp8_max / amax) / 2**margin, 1.0 where amax is 0 or not finite).
    amax_slot: fp32 scalar tensor, or a list of them (the members of a fused group), each updated in place to
        max(slot, amax(|x|)) (delayed-scaling history), or None.
    amax: max |x| when the caller has it already (fp32 scalar tensor); computed here when needed otherwise.
    scale_inv: 1 / scale when the caller has it already (delayed scaling: once per step, not per cast).
    Returns (q [R, C] row-major or None, q^T [C, R] contiguous or None, scale_inv [] fp32,
    amax [] fp32 or None when neither the scale nor the slot needed it).
    """
    x = x.detach()
    slots = _slots(amax_slot)
    cuda = x.device.type == "cuda"
    if (want_q or want_t) and triton_cast.available(x):
        out = _cast_fp8_triton(x, scale, slots, fp8_dtype, margin, want_q, want_t, amax, scale_inv)
        if out is not None:
            return out
    if amax is None and (scale is None or slots):
        amax = amax_of(x)
    if amax is not None:  # None only without slots
        record_amax(slots, amax)
    if scale is None:
        assert amax is not None  # computed above when there is no scale
        fn = compiled("current", _cast_current) if cuda else _cast_current
        q, t, scale_inv = fn(x, amax, fp8_dtype, margin, want_q, want_t)
    else:
        fn = compiled("scaled", _cast_scaled) if cuda else _cast_scaled
        q, t = fn(x, scale, fp8_dtype, want_q, want_t)
        if scale_inv is None:
            scale_inv = scale.reciprocal()
    return q, t, scale_inv, amax


def _cast_fp8_triton(x: torch.Tensor, scale: torch.Tensor | None, slots: list[torch.Tensor], fp8_dtype: torch.dtype,
                     margin: int, want_q: bool, want_t: bool, amax: torch.Tensor | None,
                     scale_inv: torch.Tensor | None
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor | None] | None:
    """`cast_fp8` through the one-pass Triton kernel; None when the kernel is off (the caller falls back).

    With a scale (delayed scaling) the amax the histories need comes out of the cast itself (atomic max
    straight into the slots): one read of x. Without one (current scaling) the amax pass comes first."""
    if scale is None:
        if amax is None:
            amax = amax_of(x)
        scale, scale_inv = current_scale([amax], fp8_dtype, margin)
        in_kernel: list[torch.Tensor] = []
    else:
        in_kernel = slots if amax is None and len(slots) <= triton_cast.MAX_AMAX_OUTS else []
    out = triton_cast.checked_cast_transpose(x, scale, fp8_dtype, want_q, want_t, in_kernel)
    if out is None:
        return None
    if slots and not in_kernel:
        record_amax(slots, amax if amax is not None else amax_of(x))
    return out[0], out[1], scale_inv if scale_inv is not None else scale.reciprocal(), amax


def _transpose(q: torch.Tensor) -> torch.Tensor:
    return q.t().contiguous()


_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}


def transpose_fp8(q: torch.Tensor) -> torch.Tensor:
    """q [R, C] -> q^T [C, R] contiguous.

    On CUDA the Triton cast-transpose kernel writes only q^T, with scale 1: an FP8 value cast to its own format
    is itself, so the result is the bytes of q transposed, at the kernel's near-copy speed (checked bitwise on the
    first call like every variant of it). inductor's transpose of the 1-byte elements, the fallback, is several
    times slower (benchmarks/RESULTS.md)."""
    if triton_cast.available(q):
        one = _UNIT_SCALES.get(q.device)
        if one is None and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
            one = _UNIT_SCALES[q.device] = torch.ones((), dtype=torch.float32, device=q.device)
        out = triton_cast.checked_cast_transpose(q, one, q.dtype, False, True) if one is not None else None
        if out is not None and out[1] is not None:  # q^T was asked for: it is there
            return out[1]
    if q.device.type != "cuda":
        return _transpose(q)
    return compiled("transpose", _transpose)(q)


def _cast_cat(ws: list[torch.Tensor], scale: torch.Tensor, fp8_dtype: torch.dtype, want_t: bool
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    fmax = FP8_MAX[fp8_dtype]
    xf = torch.cat([w.float() for w in ws])
    q = _to_fp8((xf * scale).clamp(-fmax, fmax), fp8_dtype)
    t = _to_fp8((xf.t() * scale).clamp(-fmax, fmax), fp8_dtype).contiguous() if want_t else None
    return q, t


def cast_fp8_cat(ws: list[torch.Tensor], scale: torch.Tensor, fp8_dtype: torch.dtype, want_t: bool = False,
                 amax_outs: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-tensor FP8 cast of the row-concatenation of 2-D tensors ws[i] [R_i, C] with one scale (fp32 scalar
    tensor), without materializing the high-precision concatenation on CUDA (inductor writes each input's rows
    straight into the FP8 outputs). Returns (q [sum R_i, C], q^T [C, sum R_i] contiguous or None); each element is
    what `cast_fp8` with the same scale gives for it. amax_outs: fp32 scalars raised in place to
    max(amax_outs[i], max |ws[i]|) (on CUDA in the cast's own pass), or None."""
    ws = [w.detach() for w in ws]
    if all(triton_cast.available(w) for w in ws):
        out = _cast_cat_triton(ws, scale, fp8_dtype, want_t, amax_outs)
        if out is not None:
            return out
    if amax_outs is not None:
        for a, w in zip(amax_outs, ws):
            a.copy_(torch.maximum(a, amax_of(w)))
    fn = compiled("cat", _cast_cat) if ws[0].device.type == "cuda" else _cast_cat
    return fn(ws, scale, fp8_dtype, want_t)


def _cast_cat_triton(ws: list[torch.Tensor], scale: torch.Tensor, fp8_dtype: torch.dtype, want_t: bool,
                     amax_outs: list[torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """`cast_fp8_cat` with each input cast by the Triton kernel straight into its row block of q and its
    column block of q^T."""
    n, c = sum(w.shape[0] for w in ws), ws[0].shape[1]
    q = torch.empty(n, c, dtype=fp8_dtype, device=ws[0].device)
    t = torch.empty(c, n, dtype=fp8_dtype, device=ws[0].device) if want_t else None
    row = 0
    for i, w in enumerate(ws):
        r = w.shape[0]
        out = triton_cast.checked_cast_transpose(w, scale, fp8_dtype, True, want_t,
                                                 amax_outs[i] if amax_outs is not None else None, q[row:row + r],
                                                 t[:, row:row + r] if t is not None else None)
        if out is None:
            if amax_outs is not None:  # the ones done so far are max-updates: repeating them is harmless
                for a, w2 in zip(amax_outs, ws):
                    a.copy_(torch.maximum(a, amax_of(w2)))
                amax_outs.clear()
            return None
        row += r
    return q, t


def cast_fp8_cols(parts: Sequence[torch.Tensor], scale: torch.Tensor | None,
                  amax_slot: torch.Tensor | Sequence[torch.Tensor] | None, fp8_dtype: torch.dtype, margin: int,
                  padded_rows: int, want_q: bool = True, want_t: bool = False, scale_inv: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Per-tensor FP8 cast of the column-concatenation [p_1, ..., p_n] of 2-D tensors p_i [M, C_i] (contiguous),
    zero-padded to `padded_rows` rows, with one scale: (q [padded_rows, sum C_i] or None, q^T [sum C_i, padded_rows]
    or None, scale_inv). scale, amax_slot, margin, scale_inv: as `cast_fp8` (the amax is that of all parts). Where
    the Triton kernel runs each part is cast straight into its blocks of q and q^T (no concatenation pass);
    elsewhere the parts are concatenated, padded and cast by `cast_fp8`."""
    m = parts[0].shape[0]
    slots = _slots(amax_slot)
    if all(triton_cast.available(p) for p in parts):
        amaxes: list[torch.Tensor] = []
        if scale is not None:
            kernel_scale, kernel_scale_inv = scale, scale_inv if scale_inv is not None else scale.reciprocal()
            in_kernel = slots if len(slots) <= triton_cast.MAX_AMAX_OUTS else []
        else:
            amaxes = [amax_of(p) for p in parts]
            kernel_scale, kernel_scale_inv = current_scale(amaxes, fp8_dtype, margin)
            in_kernel = []
        ncat = sum(p.shape[1] for p in parts)
        alloc = torch.empty if padded_rows == m else torch.zeros  # padding rows: zeros
        q = alloc(padded_rows, ncat, dtype=fp8_dtype, device=parts[0].device) if want_q else None
        t = alloc(ncat, padded_rows, dtype=fp8_dtype, device=parts[0].device) if want_t else None
        col = 0
        for p in parts:
            n = p.shape[1]
            out = triton_cast.checked_cast_transpose(p, kernel_scale, fp8_dtype, want_q, want_t, in_kernel,
                                                     q[:m, col:col + n] if q is not None else None,
                                                     t[col:col + n, :m] if t is not None else None)
            if out is None:
                # the kernel is off for this part: the path below casts (and records) again; the parts cast so
                # far raised the slots by max-updates, which are harmless to repeat
                break
            col += n
        else:
            if slots and not in_kernel:
                record_amax(slots, torch.stack(amaxes or [amax_of(p) for p in parts]).amax())
            return q, t, kernel_scale_inv
    g = torch.cat(list(parts), dim=1) if len(parts) > 1 else parts[0]
    q, t, scale_inv, _ = cast_fp8(pad_2d(g, padded_rows, g.shape[1]), scale, slots, fp8_dtype, margin, want_q, want_t,
                                  scale_inv=scale_inv)
    return q, t, scale_inv
