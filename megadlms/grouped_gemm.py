"""Grouped matrix products: one GEMM per expert over contiguous row groups, issued as one call.

The tokens routed to the experts are sorted by expert into one [M, K] matrix whose row groups end at `offs`
(int32 [E], cumulative; group e is rows offs[e-1]:offs[e]). Two products cover an expert layer, forward and
backward:

    gmm(a, b, offs)         a [M, K], b [E, K, N]  ->  [M, N]      row group e times b[e]      (fprop, dgrad)
    gmm_wgrad(a_t, b, offs) a_t [N, M], b [M, K]   ->  [E, N, K]   a_t's column group e times b's row group e
                                                                   (wgrad: the sum over expert e's tokens)

Where they run (`backend`): `torch._grouped_mm` (one kernel for all experts) where the installed torch has it for
the device and dtype: CUDA (Hopper, BF16) and the CPU builds that ship a CPU kernel (torch >= 2.9). Elsewhere a loop
over the experts, one `torch.mm` each (a correct fallback, e.g. for fp32 on CUDA or an older CPU build).
`grouped_linear` is the differentiable y = x @ W_e^T over both products; `grouped_gate_up` the gate and up
projections of SwiGLU experts as one product against the two weights stacked (one GEMM each way, no sum of two
dgrads, the weights cast to the compute dtype and their gradients back in one pass each).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .copy_kernels import copy_rows
from .swiglu_kernels import adjacent_halves

ALIGN = 16  # rows per group are padded to a multiple of this (FP8 grouped GEMMs need it; BF16 wgrad likes it)
BACKENDS = ("grouped_mm", "loop")


@functools.cache
def _grouped_mm_works(device_type: str, index: int | None, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs on this device and dtype (probed once with a tiny product)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    try:
        a = torch.ones(32, 16, device=device, dtype=dtype)
        b = torch.ones(2, 16, 16, device=device, dtype=dtype)
        offs = torch.tensor([16, 32], device=device, dtype=torch.int32)
        out = torch._grouped_mm(a, b, offs=offs)
        return bool((out == 16).all())
    except (RuntimeError, NotImplementedError):  # no kernel for this device / dtype / architecture
        return False


def backend(device: torch.device, dtype: torch.dtype) -> str:
    """'grouped_mm' where `torch._grouped_mm` runs for `device` and `dtype`, else 'loop'."""
    index = device.index if device.type == "cuda" else None
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    return "grouped_mm" if _grouped_mm_works(device.type, index, dtype) else "loop"


def _bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()  # host copy: the loop fallback only
    return list(zip([0] + ends[:-1], ends))


def gmm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, impl: str | None = None) -> torch.Tensor:
    """a [M, K] (rows grouped by `offs`) times b [E, K, N] per group -> [M, N] in a's dtype. Rows past offs[-1]
    are not computed (zero in the loop; callers keep none)."""
    impl = impl or backend(a.device, a.dtype)
    if impl == "grouped_mm":
        return torch._grouped_mm(a, b, offs=offs)
    out = a.new_zeros(a.shape[0], b.shape[-1])
    for e, (s, t) in enumerate(_bounds(offs)):
        if t > s:
            torch.mm(a[s:t], b[e], out=out[s:t])
    return out


def gmm_wgrad(a_t: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, impl: str | None = None) -> torch.Tensor:
    """a_t [N, M] and b [M, K], both grouped along M by `offs` -> [E, N, K]: a_t[:, group e] @ b[group e]
    (zero for an expert without rows)."""
    impl = impl or backend(b.device, b.dtype)
    if impl == "grouped_mm":
        return torch._grouped_mm(a_t, b, offs=offs)
    out = b.new_zeros(offs.shape[0], a_t.shape[0], b.shape[1])
    for e, (s, t) in enumerate(_bounds(offs)):
        if t > s:
            torch.mm(a_t[:, s:t], b[s:t], out=out[e])
    return out


def _in_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype: t itself where it is, else a copy made in one pass (`copy_rows`)."""
    return t if t.dtype == dtype else copy_rows(t, torch.empty(t.shape, device=t.device, dtype=dtype))


class _GroupedLinearFn(torch.autograd.Function):
    """y[group e] = x[group e] @ w[e]^T; dx = g @ w[e] per group; dw[e] = g[group e]^T @ x[group e]. The products
    run in x's dtype: w is cast to it in the forward and dw back to w's dtype in the backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, impl: str) -> torch.Tensor:
        wc = _in_dtype(w, x.dtype)
        ctx.save_for_backward(x, wc, offs)
        ctx.impl, ctx.weight_dtype = impl, w.dtype
        return gmm(x, wc.transpose(-2, -1), offs, impl)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w, offs = ctx.saved_tensors
        g = g.contiguous()
        dx = gmm(g, w, offs, ctx.impl) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            dw = _in_dtype(gmm_wgrad(g.t(), x, offs, ctx.impl), ctx.weight_dtype)
        return dx, dw, None, None


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, impl: str | None = None) -> torch.Tensor:
    """x [M, K] (rows grouped by `offs`, int32 [E] cumulative ends) and w [E, N, K] -> [M, N]: each row group times
    its expert's weight transposed, in the compute dtype (the autocast dtype where autocast is on, else x's)."""
    dev = x.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    x = x.to(dtype)
    with torch.autocast(dev, enabled=False):
        return _GroupedLinearFn.apply(x, w, offs, impl or backend(x.device, dtype))


def _stack(w_gate: torch.Tensor, w_up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[E, N, K] twice -> [E, 2N, K] in dtype (expert e's rows: w_gate[e], then w_up[e]), one copy pass each."""
    e, n, k = w_gate.shape
    w = torch.empty(e, 2 * n, k, device=w_gate.device, dtype=dtype)
    flat = w.view(e, 2 * n * k)
    copy_rows(w_gate.reshape(e, n * k), flat[:, :n * k])
    copy_rows(w_up.reshape(e, n * k), flat[:, n * k:])
    return w


def _unstack(dw: torch.Tensor, dtypes: tuple[torch.dtype, torch.dtype]) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, 2N, K] -> its two [E, N, K] halves, contiguous, in dtypes (the weights' own), one copy pass each."""
    e, n2, k = dw.shape
    n = n2 // 2
    flat = dw.view(e, n2 * k)
    halves = [torch.empty(e, n, k, device=dw.device, dtype=dt) for dt in dtypes]
    copy_rows(flat[:, :n * k], halves[0].view(e, n * k))
    copy_rows(flat[:, n * k:], halves[1].view(e, n * k))
    return halves[0], halves[1]


def _joined(a: torch.Tensor | None, b: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The gradients of the two halves of an [M, 2N] output as one contiguous [M, 2N]: the tensor they are the
    halves of where they are (no copy), else concatenated (None: zeros)."""
    a = torch.zeros_like(like) if a is None else a
    b = torch.zeros_like(like) if b is None else b
    m, n = a.shape
    if not torch.compiler.is_compiling() and adjacent_halves(a, b):
        return a.as_strided((m, 2 * n), (2 * n, 1))
    return torch.cat([a, b], dim=1)


class _GroupedGateUpFn(torch.autograd.Function):
    """(gate, up) = the two halves of y = x @ [w_gate; w_up][e]^T per row group (one GEMM); backward:
    dx = [d_gate, d_up] @ [w_gate; w_up][e] (one GEMM), d[w_gate; w_up][e] = [d_gate, d_up][group e]^T @ x[group e]
    (one GEMM), its halves written to the weights' gradients in their dtypes."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, offs: torch.Tensor, impl: str
                ) -> tuple[torch.Tensor, torch.Tensor]:
        w = _stack(w_gate, w_up, x.dtype)
        ctx.save_for_backward(x, w, offs)
        ctx.impl, ctx.weight_dtypes = impl, (w_gate.dtype, w_up.dtype)
        y = gmm(x, w.transpose(-2, -1), offs, impl)  # [M, 2N]
        n = w_gate.shape[1]
        return y[:, :n], y[:, n:]

    @staticmethod
    def backward(ctx: Any, d_gate: torch.Tensor | None, d_up: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        x, w, offs = ctx.saved_tensors
        like = (d_gate if d_gate is not None else d_up)
        assert like is not None
        g = _joined(d_gate, d_up, like).to(x.dtype)
        dx = gmm(g, w, offs, ctx.impl) if ctx.needs_input_grad[0] else None
        dw_gate = dw_up = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            dw_gate, dw_up = _unstack(gmm_wgrad(g.t(), x, offs, ctx.impl), ctx.weight_dtypes)
        return dx, dw_gate, dw_up, None, None


def grouped_gate_up(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, offs: torch.Tensor,
                    impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows grouped by `offs`) and w_gate, w_up [E, N, K] -> (gate, up) [M, N], each row group times its
    expert's weights transposed, in the compute dtype (as `grouped_linear`): one grouped GEMM against the weights
    stacked to [E, 2N, K], gate and up the two halves of its [M, 2N] output."""
    dev = x.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    x = x.to(dtype)
    with torch.autocast(dev, enabled=False):
        return _GroupedGateUpFn.apply(x, w_gate, w_up, offs, impl or backend(x.device, dtype))


__all__ = ["ALIGN", "BACKENDS", "backend", "gmm", "gmm_wgrad", "grouped_gate_up", "grouped_linear"]
