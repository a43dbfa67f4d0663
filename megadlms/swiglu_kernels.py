"""SwiGLU as one Triton kernel each way, for the eager (uncompiled) MLPs and MoE experts.

    swiglu           gate, up [M, F] -> h = silu(gate) * up                            (reads 2, writes 1)
    swiglu_backward  dh, gate, up [M, F] -> d_gate = dh up s (1 + gate (1 - s)),       (reads 3, writes 2)
                                            d_up = dh gate s          (s = sigmoid(gate))

Eager PyTorch runs these as separate pointwise kernels (silu, mul; mul, silu_backward, silu, mul) whose
intermediates make round trips through memory: about twice the traffic. Here every value is computed in fp32 from
the inputs and rounded once to the output dtype (eager rounds each intermediate to it: BF16 results may differ
in the last bit, fp32 ones agree to fp32 rounding).

gate and up may be row-strided views (the two halves of one [M, 2F] product); the last dimension must be
contiguous. The kernels run where Triton runs (CUDA, or its interpreter on the CPU with TRITON_INTERPRET=1, as the
tests do); `available` says where, and MEGADLMS_SWIGLU_TRITON=0 turns them off (the eager ops run).
"""

from __future__ import annotations

import os

import torch

from .copy_kernels import rows_view as _rows_view

try:  # the kernels exist where Triton does; `available` says whether they can run
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001  (any import failure of an optional dependency: the eager path runs)
    triton = None

BLOCK_ROWS, BLOCK_COLS = 8, 256


def available(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether the kernels run for gate and up: Triton runs on their device, they match in shape and dtype, and
    each is a row-strided matrix (see the module docstring); off with MEGADLMS_SWIGLU_TRITON=0."""
    if triton is None or os.environ.get("MEGADLMS_SWIGLU_TRITON", "1") == "0":
        return False
    if not (gate.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.numel() == 0 or not gate.is_floating_point():
        return False
    return _rows_view(gate) is not None and _rows_view(up) is not None


if triton is not None:

    @triton.jit
    def _tile(r0, c0, M, F, BR: tl.constexpr, BC: tl.constexpr):
        rows = r0 + tl.arange(0, BR)
        cols = c0 + tl.arange(0, BC)
        mask = (rows < M)[:, None] & (cols < F)[None, :]
        return rows.to(tl.int64), cols, mask

    @triton.jit
    def swiglu_fwd_kernel(g_ptr, u_ptr, h_ptr, M, F, ld_g, ld_u, BR: tl.constexpr, BC: tl.constexpr):
        """h = silu(gate) * up on one [BR, BC] tile, in fp32, stored in h's dtype (h contiguous [M, F])."""
        rows, cols, mask = _tile(tl.program_id(0) * BR, tl.program_id(1) * BC, M, F, BR, BC)
        g = tl.load(g_ptr + rows[:, None] * ld_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + rows[:, None] * ld_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        h = g * tl.sigmoid(g) * u
        tl.store(h_ptr + rows[:, None] * F + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def swiglu_bwd_kernel(dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, M, F, ld_dh, ld_g, ld_u, ld_out, BR: tl.constexpr,
                          BC: tl.constexpr):
        """d_gate and d_up of h = silu(gate) * up on one tile, in fp32 (d_gate, d_up [M, F] of row stride ld_out)."""
        rows, cols, mask = _tile(tl.program_id(0) * BR, tl.program_id(1) * BC, M, F, BR, BC)
        dh = tl.load(dh_ptr + rows[:, None] * ld_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rows[:, None] * ld_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + rows[:, None] * ld_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        dg = dh * u * s * (1.0 + g * (1.0 - s))  # d silu(x) / dx = s(x) (1 + x (1 - s(x)))
        du = dh * g * s
        out = rows[:, None] * ld_out + cols[None, :]
        tl.store(dg_ptr + out, dg.to(dg_ptr.dtype.element_ty), mask=mask)
        tl.store(du_ptr + out, du.to(du_ptr.dtype.element_ty), mask=mask)


def _grid(m: int, f: int) -> tuple[int, int]:
    return triton.cdiv(m, BLOCK_ROWS), triton.cdiv(f, BLOCK_COLS)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, a new contiguous tensor of gate's shape and dtype (one kernel; `available` must hold)."""
    (m, ld_g), (_, ld_u) = _rows_view(gate), _rows_view(up)  # type: ignore[misc]
    f = gate.shape[-1]
    h = torch.empty(gate.shape, device=gate.device, dtype=gate.dtype)
    swiglu_fwd_kernel[_grid(m, f)](gate, up, h, m, f, ld_g, ld_u, BR=BLOCK_ROWS, BC=BLOCK_COLS)
    return h


def adjacent_halves(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether gate and up are the two halves of one [..., 2F] tensor (gate its first F columns, up the rest)."""
    g, u = _rows_view(gate), _rows_view(up)
    f = gate.shape[-1]
    return (g is not None and g == u and g[1] == 2 * f and gate.shape == up.shape and gate.dtype == up.dtype
            and gate.untyped_storage().data_ptr() == up.untyped_storage().data_ptr()
            and up.data_ptr() == gate.data_ptr() + f * gate.element_size())


def swiglu_backward(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, joint: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_gate, d_up) of silu(gate) * up for the output gradient dh, in gate's dtype (one kernel). With `joint`,
    where gate and up are the two halves of one [..., 2F] tensor, so are d_gate and d_up (of a new one: for a
    product that made gate and up and takes its gradient whole); else each is contiguous."""
    if _rows_view(dh) is None:
        dh = dh.contiguous()
    (m, ld_g), (_, ld_u), (_, ld_dh) = _rows_view(gate), _rows_view(up), _rows_view(dh)  # type: ignore[misc]
    f = gate.shape[-1]
    if joint and adjacent_halves(gate, up):
        both = torch.empty(*gate.shape[:-1], 2 * f, device=gate.device, dtype=gate.dtype)
        d_gate, d_up = both[..., :f], both[..., f:]
    else:
        d_gate = torch.empty(gate.shape, device=gate.device, dtype=gate.dtype)
        d_up = torch.empty_like(d_gate)
    ld_out = _rows_view(d_gate)[1]  # type: ignore[index]
    swiglu_bwd_kernel[_grid(m, f)](dh, gate, up, d_gate, d_up, m, f, ld_dh, ld_g, ld_u, ld_out, BR=BLOCK_ROWS,
                                   BC=BLOCK_COLS)
    return d_gate, d_up


__all__ = ["adjacent_halves", "available", "swiglu", "swiglu_backward"]
