"""SwiGLU that keeps its inputs for backward in FP8 (Megatron's `activation_func_fp8_input_store`).

The forward is exact (it computes silu(gate) * up from the high-precision inputs); only the copies
kept for the backward pass are E4M3, with one fp32 scale per row (per token): 1 byte/element
instead of 2 in BF16. Megatron casts without a scale; the scaled cast keeps small activations
out of the E4M3 subnormal range.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ...model import SwiGLU
from ..kernels.primitives import E4M3, quantize_rowwise
from ..state import FP8GlobalStateManager


class _SwiGLUFP8StoreFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        out = F.silu(gate) * up
        gq, g_si = quantize_rowwise(gate, E4M3)  # one scale per row of the last dim: [..., 1]
        uq, u_si = quantize_rowwise(up, E4M3)
        ctx.save_for_backward(gq, g_si, uq, u_si)
        ctx.dtypes = (gate.dtype, up.dtype)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gq, g_si, uq, u_si = ctx.saved_tensors
        gate = gq.float() * g_si
        up = uq.float() * u_si
        grad = grad.float()
        sig = torch.sigmoid(gate)
        silu = gate * sig
        d_gate = grad * up * sig * (1.0 + gate * (1.0 - sig))  # d silu(x)/dx = s(x) (1 + x (1 - s(x)))
        d_up = grad * silu
        return d_gate.to(ctx.dtypes[0]), d_up.to(ctx.dtypes[1])


class SwiGLUFP8InputStore(SwiGLU):
    """silu(gate) * up with gate, up [..., F] saved for backward in E4M3 (per-row scaled).

    Active inside an enabled `fp8_autocast`; outside it behaves exactly like SwiGLU.
    """

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if not FP8GlobalStateManager.is_fp8_enabled():
            return super().forward(gate, up)
        return _SwiGLUFP8StoreFn.apply(gate, up)
