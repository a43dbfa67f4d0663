"""megadlms.fp8.fusions.swiglu: the SwiGLU that keeps its inputs for backward in E4M3."""

from __future__ import annotations

import torch

from megadlms.fp8 import SwiGLUFP8InputStore, fp8_autocast
from megadlms.model import SwiGLU

from .helpers import ref_fake_quant, rel


def _saved_bytes(fn, *inputs) -> tuple[int, list[torch.dtype], torch.Tensor]:
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    return sum(t.numel() * t.element_size() for t in saved), [t.dtype for t in saved], out


def _inputs(dtype=torch.bfloat16):
    torch.manual_seed(0)
    gate = (torch.randn(4, 33, 64) * 2).to(dtype).requires_grad_()
    up = torch.randn(4, 33, 64).to(dtype).requires_grad_()
    return gate, up


def test_saved_bytes_are_half_of_bf16_inputs():
    gate, up = _inputs()
    plain_bytes, _, _ = _saved_bytes(SwiGLU(), gate, up)
    with fp8_autocast():
        fp8_bytes, dtypes, _ = _saved_bytes(SwiGLUFP8InputStore(), gate, up)
    numel, rows = gate.numel(), gate.numel() // 64
    assert fp8_bytes == 2 * numel + 2 * rows * 4  # two E4M3 tensors + one fp32 scale per row each
    bf16_inputs = 2 * numel * 2
    assert fp8_bytes <= 0.5 * bf16_inputs + 2 * rows * 4
    assert plain_bytes == bf16_inputs  # SwiGLU keeps gate and up in BF16 (and recomputes silu(gate))
    assert dtypes.count(torch.float8_e4m3fn) == 2


def test_forward_exact_backward_from_fp8_copies():
    gate, up = _inputs()
    with fp8_autocast():
        out = SwiGLUFP8InputStore()(gate, up)
    ref = SwiGLU()(gate.detach(), up.detach())
    assert torch.equal(out, ref)
    g = torch.randn_like(out)
    out.backward(g)
    # float64 reference from the same E4M3 (per-row scaled) copies
    gq = torch.from_numpy(ref_fake_quant(gate.detach().reshape(-1, 64), torch.float8_e4m3fn, axis=1))
    uq = torch.from_numpy(ref_fake_quant(up.detach().reshape(-1, 64), torch.float8_e4m3fn, axis=1))
    g64 = g.double().reshape(-1, 64)
    s = torch.sigmoid(gq)
    assert rel(up.grad.reshape(-1, 64), g64 * gq * s) < 1e-2  # bf16 output rounding only
    assert rel(gate.grad.reshape(-1, 64), g64 * uq * s * (1 + gq * (1 - s))) < 1e-2
    # and against the exact gradient, within the E4M3 budget
    g2, u2 = gate.detach().double(), up.detach().double()
    s2 = torch.sigmoid(g2)
    assert 1e-3 < rel(gate.grad, g.double() * u2 * s2 * (1 + g2 * (1 - s2))) < 0.06
    assert gate.grad.dtype == up.grad.dtype == torch.bfloat16


def test_outside_fp8_autocast_is_plain_swiglu():
    gate, up = _inputs(torch.float32)
    bytes_, dtypes, out = _saved_bytes(SwiGLUFP8InputStore(), gate, up)
    assert torch.float8_e4m3fn not in dtypes
    assert torch.equal(out, SwiGLU()(gate, up))
