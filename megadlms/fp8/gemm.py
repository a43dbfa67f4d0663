"""The FP8 GEMMs of the linear layers: the only caller of `torch._scaled_mm` in the engine (on the CPU: a
dequantized fp32 matmul, checked against it, `cpu_scaled_mm`).

Every GEMM of a linear is `a @ b^T` over two quantized operands, each a `tensor.FP8Tensor`: FP8 data [rows, K]
row-major (K, the contracted dimension, contiguous) with its dequantization scale and the scaling it states:

    fprop:  y  = x @ W^T    fp8_gemm(x.rows, W.rows)      x [M, K], W [N, K]
    dgrad:  dx = g @ W      fp8_gemm(g.rows, W.cols)      W.cols = W^T [K, N]
    wgrad:  dW = g^T @ x    fp8_gemm(g.cols, x.cols)      g^T [N, M], x^T [K, M]

(`rows` / `cols`: a quantizer's FP8 copy of a tensor and of its transpose: `quantizer.FP8Copies`). The operands
are already padded to multiples of 16 (`pad_2d`); callers slice the results. `wgrad_high_precision` is the weight
gradient without FP8 (fp8_wgrad=False), `bias_grad` the bias gradient.

`fp8_gemm` dispatches on the operands' `Scaling`: per tensor or per row -> `torch._scaled_mm`; 1x128 tiles /
128x128 blocks (`blockwise.py`) -> `blockwise.blockwise_gemm`; 1x32 MX (`mx.py`) -> `mx.mx_gemm`. A new scaling
recipe adds its `Scaling` and its GEMM here; the layers do not change. `fp8_grouped_gemm` is the MoE experts' FP8
GEMM: the same products per expert group (`torch._scaled_grouped_mm`), over per-row or per-expert scaled operands.
"""

from __future__ import annotations

import warnings

import torch

from ..grouped_gemm import gmm, gmm_wgrad
from .formats.blockwise import blockwise_gemm, dequantize_blocks, dequantize_tiles
from .formats.mx import dequantize_mx, mx_gemm
from .kernels.triton_grouped_cast import group_ids
from .recipe import E4M3, E5M2
from .tensor import FP8Tensor, Scaling


def dequant_scale(t: FP8Tensor) -> torch.Tensor:
    """t's scale_inv expanded to broadcast against t.data [R, K] (fp32): what telemetry compares a cast with."""
    ones = torch.ones(t.data.shape, device=t.data.device)
    if t.scaling is Scaling.MX:
        return dequantize_mx(ones, t.scale_inv)
    if t.scaling is Scaling.TILE:
        return dequantize_tiles(ones, t.scale_inv)
    if t.scaling is Scaling.BLOCK:
        return dequantize_blocks(ones, t.scale_inv)
    return t.scale_inv


def _check_operands(a: torch.Tensor, b: torch.Tensor) -> None:
    """The layout/shape rules CUDA's `_scaled_mm` enforces, checked on every backend (the CPU kernel
    is lenient), so that CPU tests catch what would fail on a GPU. Metadata only: no sync."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"scaled_mm: shapes {tuple(a.shape)} x {tuple(b.shape)} do not multiply")
    if a.shape[0] % 16 or a.shape[1] % 16 or b.shape[1] % 16:
        raise ValueError(f"scaled_mm: dims of {tuple(a.shape)} x {tuple(b.shape)} must be multiples of 16 "
                         "(pad the operands)")
    if a.stride(1) != 1:
        raise ValueError(f"scaled_mm: a must be row-major, got strides {a.stride()}")
    if b.stride(0) != 1:
        raise ValueError(f"scaled_mm: b must be column-major, got strides {b.stride()}")
    if a.dtype == E5M2 and b.dtype == E5M2:
        raise ValueError("scaled_mm: E5M2 x E5M2 is not supported by the GPU kernels; one operand must be E4M3")


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_inv_a: torch.Tensor, scale_inv_b: torch.Tensor,
              out_dtype: torch.dtype, use_fast_accum: bool = False) -> torch.Tensor:
    """(a * scale_inv_a) @ (b * scale_inv_b), accumulated in fp32, rounded once to out_dtype.

    a: fp8 [M, K] row-major; b: fp8 [K, N] column-major (e.g. `w.t()` of a row-major [N, K]);
    M, K, N multiples of 16. Scales fp32: both scalars (tensorwise), or scale_inv_a [M, 1] and
    scale_inv_b [1, N] (rowwise). Returns [M, N] in out_dtype.

    CUDA: `torch._scaled_mm`. CPU: the same product as a dequantization and an fp32 matmul (`cpu_scaled_mm`),
    since the CPU `_scaled_mm` kernel is far slower than an fp32 matmul on some CPUs; its first use per variant
    is checked against `torch._scaled_mm`.
    """
    _check_operands(a, b)
    if a.device.type == "cpu":
        return cpu_scaled_mm(a, b, scale_inv_a, scale_inv_b, out_dtype, use_fast_accum)
    return scaled_mm_kernel(a, b, scale_inv_a, scale_inv_b, out_dtype, use_fast_accum)


def scaled_mm_kernel(a: torch.Tensor, b: torch.Tensor, scale_inv_a: torch.Tensor, scale_inv_b: torch.Tensor,
                     out_dtype: torch.dtype, use_fast_accum: bool = False) -> torch.Tensor:
    """`scaled_mm` through `torch._scaled_mm` itself (CUDA; same arguments), with 16-byte aligned scales."""
    return torch._scaled_mm(a, b, scale_a=_aligned(scale_inv_a), scale_b=_aligned(scale_inv_b), out_dtype=out_dtype,
                            use_fast_accum=use_fast_accum)


def _dequantized_mm(a: torch.Tensor, b: torch.Tensor, scale_inv_a: torch.Tensor, scale_inv_b: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """((a * scale_inv_a) @ (b * scale_inv_b)) in fp32, then rounded to out_dtype: the CPU `_scaled_mm`'s
    arithmetic (each operand dequantized to fp32 first, one rounding of the fp32 result)."""
    return ((a.float() * scale_inv_a) @ (b.float() * scale_inv_b)).to(out_dtype)


# variant (a dtype, b dtype, per-tensor or per-row scales, out dtype) -> whether `_dequantized_mm` agreed with
# torch._scaled_mm on its first use (True), or torch._scaled_mm is what runs for it (False)
_CPU_CHECKED: dict[tuple[torch.dtype, torch.dtype, bool, torch.dtype], bool] = {}


def cpu_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_inv_a: torch.Tensor, scale_inv_b: torch.Tensor,
                  out_dtype: torch.dtype, use_fast_accum: bool = False) -> torch.Tensor:
    """`scaled_mm` on the CPU (same arguments): `_dequantized_mm`. The first call of each variant also runs
    `torch._scaled_mm` and compares: equal up to the fp32 accumulation order (|diff| <= K * 2**-22 * (|a| @ |b|)
    dequantized, plus one rounding to out_dtype), else the variant keeps `torch._scaled_mm` with a warning. A torch
    whose CPU `_scaled_mm` rejects the variant (older builds take per-tensor scales only) uses `_dequantized_mm`."""
    out = _dequantized_mm(a, b, scale_inv_a, scale_inv_b, out_dtype)
    key = (a.dtype, b.dtype, scale_inv_a.dim() > 0, out_dtype)
    ok = _CPU_CHECKED.get(key)
    if ok is None:
        ok = _CPU_CHECKED[key] = _agrees_with_scaled_mm(out, a, b, scale_inv_a, scale_inv_b, out_dtype,
                                                        use_fast_accum)
    if ok:
        return out
    return torch._scaled_mm(a, b, scale_a=scale_inv_a, scale_b=scale_inv_b, out_dtype=out_dtype,
                            use_fast_accum=use_fast_accum)


def _agrees_with_scaled_mm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale_inv_a: torch.Tensor,
                           scale_inv_b: torch.Tensor, out_dtype: torch.dtype, use_fast_accum: bool) -> bool:
    """Whether `out` (`_dequantized_mm`) equals `torch._scaled_mm` of the same operands up to the fp32
    accumulation order; True also when this torch's CPU `_scaled_mm` does not take the variant."""
    try:
        ref = torch._scaled_mm(a, b, scale_a=scale_inv_a, scale_b=scale_inv_b, out_dtype=out_dtype,
                               use_fast_accum=use_fast_accum)
    except RuntimeError:  # this build's CPU kernel rejects the variant (e.g. per-row scales): nothing to compare
        return True
    bound = (a.float().abs() * scale_inv_a.abs()) @ (b.float().abs() * scale_inv_b.abs())
    out_ulp = torch.finfo(out_dtype).eps
    tol = bound * (a.shape[1] * 2.0 ** -22 + 2 * out_ulp)
    ok = bool(((out.float() - ref.float()).abs() <= tol).all())
    if not ok:
        warnings.warn(f"FP8 on CPU: the dequantized fp32 GEMM disagrees with torch._scaled_mm for "
                      f"{a.dtype} x {b.dtype} -> {out_dtype} ({'per-row' if scale_inv_a.dim() else 'per-tensor'} "
                      "scales); running torch._scaled_mm for it", RuntimeWarning, stacklevel=3)
    return ok


def _aligned(scale: torch.Tensor) -> torch.Tensor:
    """cuBLASLt rejects scale pointers that are not 16-byte aligned (CUBLAS_STATUS_NOT_SUPPORTED), e.g. a 0-dim
    view into the middle of a [3] scale buffer: such a view is copied (`aligned_scalars` avoids the copy)."""
    return scale if scale.data_ptr() % 16 == 0 else scale.clone()


def aligned_scalars(values: torch.Tensor) -> torch.Tensor:
    """values [n] -> [n, 4] whose row i starts with values[i]: `out[i, 0]` is a 0-dim view at a 16-byte aligned
    address, usable as a `_scaled_mm` scale without a copy (one small kernel for all n)."""
    return values.reshape(-1, 1).expand(-1, 4).contiguous()


def fp8_gemm(a: FP8Tensor, b: FP8Tensor, out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """a [M, K] @ b [N, K]^T -> [M, N] in out_dtype, fp32 accumulation (`fast_accum`: Hopper's faster,
    reduced-precision accumulation, which the layers use in the forward GEMM only). Dispatches on the operands'
    stated scaling: 1x128 tiles (b: tiles or 128x128 blocks) and MX operands run their recipe's GEMM (fp32
    accumulation always), per-tensor and per-row ones `scaled_mm`."""
    if a.scaling is Scaling.TILE:
        if b.scaling not in (Scaling.TILE, Scaling.BLOCK):
            raise ValueError(f"fp8_gemm: a 1x128-tile operand takes tiles or 128x128 blocks, got {b}")
        return blockwise_gemm(a.data, a.scale_inv, b.data, b.scale_inv, out_dtype,
                              b_blocks=b.scaling is Scaling.BLOCK)
    if a.scaling is Scaling.MX or b.scaling is Scaling.MX:
        if a.scaling is not b.scaling:
            raise ValueError(f"fp8_gemm: MX operands multiply MX operands, got {a} and {b}")
        return mx_gemm(a.data, a.scale_inv, b.data, b.scale_inv, out_dtype)
    if a.scaling not in _SCALED_MM or b.scaling not in _SCALED_MM:
        raise ValueError(f"fp8_gemm: no GEMM takes {a} and {b}")
    b_si = b.scale_inv.reshape(1, -1) if b.scaling is Scaling.ROW else b.scale_inv  # per row of b: [1, N] for scale_b
    return scaled_mm(a.data, b.data.t(), a.scale_inv, b_si, out_dtype, fast_accum)


_SCALED_MM = (Scaling.TENSOR, Scaling.ROW)  # the scalings `torch._scaled_mm` takes


_GROUPED = (Scaling.ROW, Scaling.EXPERT)  # the scalings `torch._scaled_grouped_mm` takes (as per-row scales)


def fp8_grouped_gemm(a: FP8Tensor, b: FP8Tensor, out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """The experts' grouped GEMMs, a @ b^T per expert group (`expert_quantizer.py`; layouts in `tensor.py`):

    a rows [M, K] grouped by a.offs, b expert weights [E, N, K]      -> [M, N]     (fprop, dgrad)
    a [N, M] and b [K, M], transposed copies grouped along M         -> [E, N, K]  (wgrad)

    in out_dtype, fp32 accumulation (`fast_accum`: Hopper's faster one). Rows of a past a.offs[-1] give no output
    rows worth keeping (callers keep none). CUDA: `torch._scaled_grouped_mm` (Hopper; K and N multiples of 16, every
    group's rows too); elsewhere the FP8 operands dequantized to fp32 and multiplied by `grouped_gemm.gmm` /
    `gmm_wgrad` (the same products; only the summation order differs)."""
    if a.scaling not in _GROUPED or b.scaling not in _GROUPED or a.offs is None:
        raise ValueError(f"fp8_grouped_gemm: takes per-row or per-expert scaled operands grouped by expert, got {a} "
                         f"and {b}")
    _check_grouped_operands(a, b)
    offs = a.offs
    if a.transposed:  # wgrad: both operands grouped along the contracted M
        if a.data.is_cuda:
            return torch._scaled_grouped_mm(a.data, b.data.t(), a.scale_inv.reshape(-1), b.scale_inv.reshape(-1),
                                            offs=offs, out_dtype=torch.bfloat16,
                                            use_fast_accum=fast_accum).to(out_dtype)
        gid = group_ids(offs, a.data.shape[1])
        ad = a.data.float() * a.scale_inv[gid].t()
        bd = b.data.float() * b.scale_inv[gid].t()
        return gmm_wgrad(ad, bd.t(), offs).to(out_dtype)
    if a.data.is_cuda:
        return torch._scaled_grouped_mm(a.data, b.data.transpose(-2, -1), a.scale_inv, b.scale_inv, offs=offs,
                                        out_dtype=torch.bfloat16, use_fast_accum=fast_accum).to(out_dtype)
    ad = a.data.float() * a.scale_inv[:, None]
    bd = b.data.float() * b.scale_inv[:, :, None]
    return gmm(ad, bd.transpose(-2, -1), offs).to(out_dtype)


def _check_grouped_operands(a: FP8Tensor, b: FP8Tensor) -> None:
    """What CUDA's `torch._scaled_grouped_mm` requires of the operands (E4M3 row-major data, K and N multiples of
    16, fp32 scales of the layouts in `tensor.py`, int32 offsets, one group per expert), checked on every backend
    so that CPU tests catch what would fail on a GPU. Metadata only: no sync (every group's rows being a multiple
    of 16, which the GPU also needs, is `moe.dispatch_plan`'s to keep)."""
    assert a.offs is not None  # checked by the caller
    e = a.offs.shape[0]
    scale_shapes: tuple[tuple[int, ...], tuple[int, ...]]
    if a.transposed:
        if not b.transposed or b.offs is None or a.data.dim() != 2 or b.data.dim() != 2:
            raise ValueError(f"fp8_grouped_gemm: a transposed grouped {a} multiplies another one, got {b}")
        scale_shapes = ((e, a.data.shape[0]), (e, b.data.shape[0]))
        if a.data.shape[1] != b.data.shape[1]:
            raise ValueError(f"fp8_grouped_gemm: {a} and {b} are grouped along different lengths")
    else:
        if a.data.dim() != 2 or b.data.dim() != 3 or b.data.shape[0] != e or a.data.shape[1] != b.data.shape[2]:
            raise ValueError(f"fp8_grouped_gemm: grouped rows {a} multiply {e} expert weights [E, N, K], got {b}")
        scale_shapes = ((a.data.shape[0],), tuple(b.data.shape[:2]))
    for t, shape in zip((a, b), scale_shapes):
        if t.data.dtype != E4M3 or t.data.stride(-1) != 1 or t.data.shape[-1] % 16 or t.data.shape[-2] % 16:
            raise ValueError(f"fp8_grouped_gemm: {t} must be E4M3, row-major, with both dims multiples of 16")
        if t.scale_inv.dtype != torch.float32 or tuple(t.scale_inv.shape) != shape:
            raise ValueError(f"fp8_grouped_gemm: {t}'s scale_inv is {t.scale_inv.dtype} {tuple(t.scale_inv.shape)}, "
                             f"not fp32 {shape}")
    if a.offs.dtype != torch.int32 or a.offs.dim() != 1:
        raise ValueError(f"fp8_grouped_gemm: the expert offsets must be int32 [E], got {a.offs.dtype} "
                         f"{tuple(a.offs.shape)}")


def wgrad_high_precision(g: torch.Tensor, x: torch.Tensor, compute_dtype: torch.dtype,
                         w_dtype: torch.dtype) -> torch.Tensor:
    """dW = g^T @ x in the compute dtype from the unquantized g [M, N] and x [M, K] (fp8_wgrad=False) -> [N, K]."""
    return (g.to(compute_dtype).t() @ x).to(w_dtype)


def bias_grad(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """d bias = the sum of g [M, N] over tokens, accumulated in fp32 -> [N] in `dtype`."""
    return g.float().sum(0).to(dtype)


__all__ = ["dequant_scale", "fp8_gemm", "fp8_grouped_gemm", "scaled_mm", "cpu_scaled_mm",
           "aligned_scalars", "wgrad_high_precision", "bias_grad"]
