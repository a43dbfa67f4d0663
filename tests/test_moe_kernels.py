"""megadlms.moe_kernels: the fused routing, permute and combine kernels against the eager PyTorch they replace, run
by Triton's interpreter on the CPU (in a subprocess, as the interpreter must be on before Triton is imported;
skipped where Triton is not installed). Forward and backward, fp32 and BF16 rows, ties, padding rows, k = 1."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megadlms import moe_kernels

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")


@pytest.mark.parametrize("score", moe_kernels.SCORE_FUNCTIONS)
@pytest.mark.parametrize("k, scaling", [(1, None), (3, None), (3, 2.5)])
def test_routing_backward_is_the_gradient_of_the_weights(score, k, scaling):
    """The fused routing's closed-form backward against autograd through the eager weights."""
    torch.manual_seed(0)
    logits = (torch.randn(11, 7, dtype=torch.float64) * 2).requires_grad_()
    experts = logits.detach().topk(k, dim=-1).indices
    g = torch.randn(11, k, dtype=torch.float64)
    (want,) = torch.autograd.grad(moe_kernels.topk_weights(logits, experts, score, k, scaling), logits, g)
    got = moe_kernels.topk_weights_backward(logits.detach(), experts, g, score, k, scaling)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)

SCRIPT = textwrap.dedent("""
    import os
    import torch
    from megadlms import moe_kernels as mk
    from megadlms.moe import dispatch_plan

    torch.manual_seed(0)
    assert mk.available(torch.zeros(1))

    def grads(fn, *inputs):
        leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
        outs = fn(*leaves)
        out = outs[0] if isinstance(outs, tuple) else outs
        g = torch.randn_like(out, dtype=torch.float32).to(out.dtype)
        (out.float() * g.float()).sum().backward()
        return outs, [t.grad for t in leaves if t.is_floating_point()]

    # routing: every score function, with and without scaling, k = 1, E not a power of two, a bias that steers
    for t, e, k in ((37, 6, 2), (20, 64, 8), (9, 5, 1)):
        logits = torch.randn(t, e) * 2
        for score in mk.SCORE_FUNCTIONS:
            for scaling in (None, 2.5):
                bias = torch.randn(e) if score == "sigmoid" else None
                (w, ex), (dl,) = grads(lambda l: mk.route_topk(l, k, score, bias, scaling), logits)
                (rw, rex), (rdl,) = grads(lambda l: mk.route_topk_eager(l, k, score, bias, scaling), logits)
                assert torch.equal(ex, rex), (t, e, k, score)
                torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-7)
                # the same upstream gradient (seeded alike) through both
    for t, e, k in ((37, 6, 2), (20, 64, 8)):
        logits = torch.randn(t, e)
        g = torch.randn(t, k)
        for score in mk.SCORE_FUNCTIONS:
            a = logits.clone().requires_grad_()
            b = logits.clone().requires_grad_()
            wa, _ = mk.route_topk(a, k, score, None, 1.5)
            wb, _ = mk.route_topk_eager(b, k, score, None, 1.5)
            (wa * g).sum().backward()
            (wb * g).sum().backward()
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
    # ties go to the lower index, as in the eager top-k
    w, ex = mk.route_topk(torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]]), 2, "softmax")
    assert ex.tolist() == [[1, 2]] and torch.allclose(w, torch.tensor([[0.5, 0.5]]))

    # permute and combine over a real plan (padding rows, an expert without tokens), fp32 and BF16 rows
    for dtype in (torch.float32, torch.bfloat16):
        for t, e, k, h in ((13, 5, 2, 72), (8, 4, 1, 64), (6, 8, 3, 130)):
            experts = torch.stack([torch.randperm(e - 1)[:k] for _ in range(t)])  # the last expert gets nothing
            plan = dispatch_plan(experts, e)
            x = torch.randn(t, h).to(dtype)
            g = torch.randn(plan.rows, h).to(dtype)
            rows = mk.permute_rows(x, plan.pos, plan.row_pair, k)
            assert torch.equal(rows, mk.permute_rows_eager(x, plan.pos, k, plan.rows)), (dtype, t, k)
            xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
            mk.permute_rows(xa, plan.pos, plan.row_pair, k).backward(g)
            mk.permute_rows_eager(xb, plan.pos, k, plan.rows).backward(g)
            torch.testing.assert_close(xa.grad.float(), xb.grad.float(), rtol=1e-2 if dtype != torch.float32 else 1e-6,
                                       atol=1e-6)
            y = torch.randn(plan.rows, h).to(dtype)
            weights = torch.rand(t, k)
            gy = torch.randn(t, h)
            ya, wa = y.clone().requires_grad_(), weights.clone().requires_grad_()
            yb, wb = y.clone().requires_grad_(), weights.clone().requires_grad_()
            out_a = mk.combine_rows(ya, wa, plan.pos, plan.row_pair)
            out_b = mk.combine_rows_eager(yb, plan.pos, wb)
            assert out_a.dtype == torch.float32 and out_a.shape == (t, h)
            torch.testing.assert_close(out_a, out_b, rtol=1e-6, atol=1e-6)
            out_a.backward(gy)
            out_b.backward(gy)
            assert torch.equal(ya.grad[plan.row_pair < 0].float().abs().sum(), torch.tensor(0.0))  # padding: zeros
            torch.testing.assert_close(ya.grad.float(), yb.grad.float(), rtol=1e-2 if dtype != torch.float32 else 1e-6,
                                       atol=1e-6)
            torch.testing.assert_close(wa.grad, wb.grad, rtol=1e-5, atol=1e-5)
            # [B, S, k] weights, the output in the rows' dtype: made in [B, S, H], not a view
            out = mk.combine_rows(y, weights.view(1, t, k), plan.pos, plan.row_pair, dtype)
            assert out.shape == (1, t, h) and out.dtype == dtype and out._base is None
            torch.testing.assert_close(out, mk.combine_rows_eager(y, plan.pos, weights.view(1, t, k), dtype))

    # the padding rows of the combine's dy are zeros whatever the memory held (here NaN), the others untouched
    plan = dispatch_plan(torch.tensor([[0, 2], [2, 1], [0, 1]]), 3)
    buf = torch.full((plan.rows, 40), float("nan"))
    mk._zero_padding(buf, plan.row_pair)
    pad = plan.row_pair < 0
    assert pad.sum() == plan.rows - 6 and not buf[pad].any() and buf[~pad].isnan().all()

    # the whole block: kernels on vs off, forward and backward
    from megadlms.config import TransformerConfig
    from megadlms.model import moe_block
    from megadlms.moe import add_aux_losses
    for kw in ({}, {"moe_router_pre_softmax": True},
               {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True}):
        cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                                vocab_size=97, seq_length=8, num_moe_experts=6, moe_router_topk=2,
                                moe_ffn_hidden_size=16, moe_aux_loss_coeff=0.01, **kw)
        torch.manual_seed(1)
        m = moe_block(cfg, 0)
        for p in m.parameters():
            torch.nn.init.normal_(p, 0, 0.3)
        x = torch.randn(2, 8, 32)
        results = []
        for flag in ("1", "0"):
            os.environ["MEGADLMS_MOE_TRITON"] = flag
            m.zero_grad()
            xi = x.clone().requires_grad_()
            out = m(xi)
            add_aux_losses(m, out.square().mean()).backward()
            results.append([out, xi.grad] + [p.grad for p in m.parameters()])
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    print("moe kernels ok")
""")


@needs_triton
def test_kernels_match_eager_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
           "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "moe kernels ok" in r.stdout
