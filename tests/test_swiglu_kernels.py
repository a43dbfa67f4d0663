"""megadlms.swiglu_kernels: the fused SwiGLU forward and backward against an fp64 reference, run by Triton's
interpreter on the CPU (in a subprocess: the interpreter must be on before Triton is imported; skipped where Triton
is not installed). fp32 and BF16, ragged tiles, row-strided halves of one [M, 2F] product, and the model's SwiGLU
module and an MoE block taking the fused path."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megadlms import swiglu_kernels

SCRIPT = textwrap.dedent("""
    import os
    import torch
    import torch.nn.functional as F
    from megadlms import swiglu_kernels as sk
    from megadlms.model import SwiGLU

    torch.manual_seed(0)

    def reference(gate, up, dh):
        g, u = gate.double().requires_grad_(), up.double().requires_grad_()
        h = F.silu(g) * u
        dg, du = torch.autograd.grad(h, (g, u), dh.double())
        return h, dg, du

    # shapes: tiles that do not divide them (M 37, F 300), 3-D, one row; fp32 and BF16
    for shape in ((37, 300), (2, 5, 64), (1, 17)):
        for dtype in (torch.float32, torch.bfloat16):
            gate, up = (torch.randn(shape) * 3).to(dtype), torch.randn(shape).to(dtype)
            dh = torch.randn(shape).to(dtype)
            assert sk.available(gate, up)
            h = sk.swiglu(gate, up)
            dg, du = sk.swiglu_backward(dh, gate, up)
            rh, rdg, rdu = reference(gate, up, dh)
            for got, want in ((h, rh), (dg, rdg), (du, rdu)):
                assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous()
                # each element one rounding of an fp32 result: within one ulp of its dtype (plus the fp32
                # math's error, 1e-6 of the largest value)
                bound = want.abs() * torch.finfo(dtype).eps + 1e-6 * want.abs().max()
                excess = ((got.double() - want).abs() - bound).max().item()
                assert excess <= 0, (shape, dtype, excess)

    # row-strided views: gate and up the two halves of one [M, 2F] product, dh a column slice
    y = torch.randn(29, 2 * 160)
    gate, up = y.chunk(2, dim=-1)
    dh_full = torch.randn(29, 200)
    dh = dh_full[:, :160]
    assert sk.available(gate, up) and not gate.is_contiguous()
    rh, rdg, rdu = reference(gate, up, dh)
    dg, du = sk.swiglu_backward(dh, gate, up)
    torch.testing.assert_close(sk.swiglu(gate, up).double(), rh, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dg.double(), rdg, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(du.double(), rdu, rtol=1e-6, atol=1e-6)
    # not a row-strided matrix (a transposed view): not taken
    assert not sk.available(gate.t(), up.t())

    # the model's SwiGLU takes the fused path: its output and gradients are the kernels', bit for bit
    gate = torch.randn(33, 96, dtype=torch.bfloat16, requires_grad=True)
    up = torch.randn(33, 96, dtype=torch.bfloat16, requires_grad=True)
    dh = torch.randn(33, 96, dtype=torch.bfloat16)
    out = SwiGLU()(gate, up)
    out.backward(dh)
    assert torch.equal(out, sk.swiglu(gate.detach(), up.detach()))
    dg, du = sk.swiglu_backward(dh, gate.detach(), up.detach())
    assert torch.equal(gate.grad, dg) and torch.equal(up.grad, du)

    # an MoE block: fused and eager SwiGLU agree in fp32 (forward and every gradient)
    from megadlms.config import TransformerConfig
    from megadlms.model import moe_block
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                            vocab_size=64, seq_length=8, num_moe_experts=4, moe_router_topk=2,
                            moe_ffn_hidden_size=24)
    m = moe_block(cfg, 0)
    for p in m.parameters():
        torch.nn.init.normal_(p, 0, 0.3)
    x = torch.randn(2, 8, 32)
    results = []
    for flag in ("1", "0"):
        os.environ["MEGADLMS_SWIGLU_TRITON"] = flag
        m.zero_grad()
        xi = x.clone().requires_grad_()
        out = m(xi)
        out.square().mean().backward()
        results.append([out, xi.grad] + [p.grad for p in m.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    print("swiglu kernels ok")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_kernels_match_the_reference_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
           "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "swiglu kernels ok" in r.stdout


def test_eager_path_without_triton_device(monkeypatch):
    """On the CPU without the interpreter the kernels are not taken, and the model's SwiGLU is eager autograd's."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from megadlms.model import SwiGLU

    gate = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    up = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    assert not swiglu_kernels.available(gate, up)
    SwiGLU()(gate, up).sum().backward()
    g2, u2 = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
    (torch.nn.functional.silu(g2) * u2).sum().backward()
    assert torch.equal(gate.grad, g2.grad) and torch.equal(up.grad, u2.grad)
