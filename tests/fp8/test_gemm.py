"""megadlms.fp8.gemm: the FP8 GEMM helper (a @ b^T over quantized operands), the high-precision weight gradient
and the bias gradient."""

from __future__ import annotations

import pytest
import torch

from megadlms.fp8.gemm import bias_grad, fp8_gemm, wgrad_high_precision
from megadlms.fp8.kernels.primitives import E4M3, E5M2, quantize_rowwise, quantize_tensorwise
from megadlms.fp8.tensor import FP8Tensor, Scaling


def test_fp8_gemm_is_the_dequantized_product_per_tensor_and_per_row():
    torch.manual_seed(0)
    a, b = torch.randn(32, 48), torch.randn(16, 48) * 5
    qa, sa, _ = quantize_tensorwise(a, E5M2)
    qb, sb, _ = quantize_tensorwise(b, E4M3)
    want = (qa.double() * sa.double()) @ (qb.double() * sb.double()).t()
    got = fp8_gemm(FP8Tensor(qa, sa, Scaling.TENSOR), FP8Tensor(qb, sb, Scaling.TENSOR), torch.float32,
                   fast_accum=False)
    assert got.shape == (32, 16) and torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4)
    ra, rsa = quantize_rowwise(a, E4M3, 1)  # [32, 1]
    rb, rsb = quantize_rowwise(b, E4M3, 1)  # [16, 1]: one scale per row of b, i.e. per output column
    want = (ra.double() * rsa.double()) @ (rb.double() * rsb.double()).t()
    got = fp8_gemm(FP8Tensor(ra, rsa, Scaling.ROW), FP8Tensor(rb, rsb, Scaling.ROW), torch.float32, fast_accum=False)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4)


def test_fp8_gemm_dispatches_on_the_stated_scaling_not_the_scale_shape():
    """A per-row scale of a K = 128 operand is [R, 1], as a 1x128 tile scale is: the stated scaling decides, and
    operands that no GEMM multiplies are refused with both named."""
    torch.manual_seed(0)
    a, b = torch.randn(16, 128), torch.randn(32, 128)
    ra, rsa = quantize_rowwise(a, E4M3)
    rb, rsb = quantize_rowwise(b, E4M3)
    rows = fp8_gemm(FP8Tensor(ra, rsa, Scaling.ROW), FP8Tensor(rb, rsb, Scaling.ROW), torch.float32, False)
    tiles = fp8_gemm(FP8Tensor(ra, rsa, Scaling.TILE), FP8Tensor(rb, rsb, Scaling.TILE), torch.float32, False)
    want = (ra.double() * rsa.double()) @ (rb.double() * rsb.double()).t()
    for got in (rows, tiles):  # one tile per row: the same product through either GEMM
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="tiles or 128x128 blocks"):
        fp8_gemm(FP8Tensor(ra, rsa, Scaling.TILE), FP8Tensor(rb, rsb, Scaling.ROW), torch.float32, False)
    with pytest.raises(ValueError, match="MX operands"):
        fp8_gemm(FP8Tensor(ra, rsa, Scaling.ROW), FP8Tensor(rb, rsb, Scaling.MX), torch.float32, False)
    with pytest.raises(ValueError, match="no GEMM takes"):
        fp8_gemm(FP8Tensor(ra, rsa, Scaling.BLOCK), FP8Tensor(rb, rsb, Scaling.TENSOR), torch.float32, False)


def test_fp8_tensor_states_its_axis():
    q, s = torch.zeros(16, 32, dtype=E4M3), torch.ones(16, 1)
    assert FP8Tensor(q, s, Scaling.ROW).axis == 1 and FP8Tensor(q, s, Scaling.ROW, transposed=True).axis == 0
    assert FP8Tensor(q, s[0, 0], Scaling.TENSOR).axis is None and FP8Tensor(q, s, Scaling.BLOCK).axis is None


def test_high_precision_wgrad_and_bias_grad():
    g, x = torch.randn(40, 16, dtype=torch.bfloat16), torch.randn(40, 32, dtype=torch.bfloat16)
    dw = wgrad_high_precision(g, x, torch.bfloat16, torch.float32)
    assert dw.dtype == torch.float32 and torch.equal(dw, (g.t() @ x).float())
    db = bias_grad(g, torch.float32)
    assert torch.equal(db, g.float().sum(0))


def test_cpu_gemm_is_the_dequantized_fp32_product_checked_once_against_scaled_mm(monkeypatch):
    """On the CPU the GEMM is a dequantization and an fp32 matmul; torch._scaled_mm runs only on the first call of
    each variant, as the check, and the results are equal (the same arithmetic)."""
    from megadlms.fp8 import gemm
    monkeypatch.setattr(gemm, "_CPU_CHECKED", {})
    calls = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    a, b = torch.randn(64, 256), torch.randn(96, 256)
    qa, sa, _ = quantize_tensorwise(a, E5M2)
    qb, sb, _ = quantize_tensorwise(b, E4M3)
    for out_dtype in (torch.float32, torch.bfloat16):
        want = real(qa, qb.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)
        for _ in range(3):
            got = gemm.scaled_mm(qa, qb.t(), sa, sb, out_dtype)
            assert got.dtype == out_dtype and torch.equal(got, want)
    assert len(calls) == 2  # one check per out dtype
    assert all(gemm._CPU_CHECKED.values())


def test_cpu_gemm_that_disagrees_with_scaled_mm_falls_back_to_it(monkeypatch):
    from megadlms.fp8 import gemm
    monkeypatch.setattr(gemm, "_CPU_CHECKED", {})
    monkeypatch.setattr(gemm, "_dequantized_mm", lambda a, b, sa, sb, od: ((a.float() * sa) @ (b.float() * sb) + 1)
                        .to(od))
    qa, sa, _ = quantize_tensorwise(torch.randn(32, 64), E4M3)
    qb, sb, _ = quantize_tensorwise(torch.randn(16, 64), E4M3)
    with pytest.warns(RuntimeWarning, match="disagrees with torch._scaled_mm"):
        got = gemm.scaled_mm(qa, qb.t(), sa, sb, torch.float32)
    assert torch.equal(got, torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32))
    assert gemm._CPU_CHECKED == {(E4M3, E4M3, False, torch.float32): False}
