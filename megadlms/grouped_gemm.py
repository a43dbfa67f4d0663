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
`grouped_linear` is the differentiable y = x @ W_e^T over both products.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

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


class _GroupedLinearFn(torch.autograd.Function):
    """y[group e] = x[group e] @ w[e]^T; dx = g @ w[e] per group; dw[e] = g[group e]^T @ x[group e]."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, impl: str) -> torch.Tensor:
        ctx.save_for_backward(x, w, offs)
        ctx.impl = impl
        return gmm(x, w.transpose(-2, -1), offs, impl)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w, offs = ctx.saved_tensors
        g = g.contiguous()
        dx = gmm(g, w, offs, ctx.impl) if ctx.needs_input_grad[0] else None
        dw = gmm_wgrad(g.t(), x, offs, ctx.impl) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, impl: str | None = None) -> torch.Tensor:
    """x [M, K] (rows grouped by `offs`, int32 [E] cumulative ends) and w [E, N, K] -> [M, N]: each row group times
    its expert's weight transposed, in the compute dtype (the autocast dtype where autocast is on, else x's)."""
    dev = x.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    x, w = x.to(dtype), w.to(dtype)
    with torch.autocast(dev, enabled=False):
        return _GroupedLinearFn.apply(x, w, offs, impl or backend(x.device, dtype))


__all__ = ["ALIGN", "BACKENDS", "backend", "gmm", "gmm_wgrad", "grouped_linear"]
