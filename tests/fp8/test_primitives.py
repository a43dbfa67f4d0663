"""megadlms.fp8.kernels.primitives: casts against ml_dtypes, scale arithmetic, the scaled-GEMM operand rules."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from megadlms.fp8.gemm import scaled_mm
from megadlms.fp8.kernels.primitives import (
    E4M3,
    E5M2,
    amax_to_scale,
    dequantize,
    pad_2d,
    quant_stats,
    quantize,
    quantize_rowwise,
    quantize_tensorwise,
    round_to_fp8_grid,
)

from .helpers import FMAX, ML, ref_quantize, ref_scale

DTYPES = [E4M3, E5M2]


def _all_codes_and_midpoints(dtype: torch.dtype) -> np.ndarray:
    """Every finite value of the format, the midpoints between neighbours (ties) and points near them."""
    vals = np.arange(256, dtype=np.uint8).view(ML[dtype]).astype(np.float64)
    vals = np.unique(vals[np.isfinite(vals)])
    mids = (vals[1:] + vals[:-1]) / 2
    near = np.concatenate([mids * (1 + 1e-3), mids * (1 - 1e-3)])
    return np.concatenate([vals, mids, near]).astype(np.float32)


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy()


@pytest.mark.parametrize("dtype", DTYPES)
def test_cast_matches_ml_dtypes_normal_subnormal_and_ties(dtype):
    x = _all_codes_and_midpoints(dtype)
    tiny = float(ml_dtypes.finfo(ML[dtype]).smallest_subnormal)
    x = np.concatenate([x, np.random.default_rng(0).normal(0, 4, 4000).astype(np.float32),
                        np.array([tiny / 2, tiny * 0.49, tiny * 0.51, -tiny * 1.5], np.float32)])
    ours = quantize(torch.from_numpy(x), torch.tensor(1.0), dtype)
    ref = x.astype(ML[dtype])
    np.testing.assert_array_equal(_bits(ours), ref.view(np.uint8))
    # subnormals really are exercised: some outputs are nonzero and below the smallest normal
    smallest_normal = float(ml_dtypes.finfo(ML[dtype]).smallest_normal)
    out = ours.float().abs()
    assert ((out > 0) & (out < smallest_normal)).sum() > 4


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_to_fp8_grid_gives_the_cast_bits_and_exact_values(dtype):
    """The fp32-arithmetic rounding used inside generated / Triton kernels: the same bits as the ATen cast and as
    ml_dtypes (ties to even, subnormals, signed zeros), and values the cast then represents exactly."""
    fmax = float(ml_dtypes.finfo(ML[dtype]).max)
    rng = np.random.default_rng(1)
    x = np.concatenate([_all_codes_and_midpoints(dtype), -_all_codes_and_midpoints(dtype),
                        (rng.normal(0, 1, 20000) * np.exp2(rng.integers(-30, 17, 20000))).astype(np.float32),
                        np.array([0.0, -0.0, 1e-38, -1e-38, 1e-45, -1e-45], np.float32)])
    y = torch.from_numpy(x).clamp(-fmax, fmax)
    r = round_to_fp8_grid(y, dtype)
    np.testing.assert_array_equal(_bits(r.to(dtype)), _bits(y.to(dtype)))
    np.testing.assert_array_equal(_bits(r.to(dtype)), y.numpy().astype(ML[dtype]).view(np.uint8))
    assert torch.equal(r, r.to(dtype).float())  # on the grid: exactly representable
    assert torch.equal(torch.signbit(r), torch.signbit(y))  # -0.0 and negatives rounding to zero keep the sign


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_saturates_and_handles_non_finite(dtype):
    fmax = FMAX[dtype]
    x = np.array([fmax * 1.01, -fmax * 3, 1e30, -1e30, np.inf, -np.inf, np.nan, fmax, 0.0, -0.0], np.float32)
    ours = quantize(torch.from_numpy(x), torch.tensor(1.0), dtype).float().numpy()
    ref = ref_quantize(x, np.float32(1.0), dtype)
    np.testing.assert_array_equal(ours[:6], [fmax, -fmax, fmax, -fmax, fmax, -fmax])
    np.testing.assert_array_equal(ours[:6], ref[:6])
    assert np.isnan(ours[6]) and np.isnan(ref[6])
    np.testing.assert_array_equal(ours[7:], [fmax, 0.0, 0.0])
    assert np.signbit(ours[9])  # -0 keeps its sign


@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_roundtrip_relative_error_within_half_ulp(dtype):
    x = torch.randn(64, 96, dtype=torch.float64).float() * 3
    q, scale_inv, amax = quantize_tensorwise(x, dtype)
    assert amax.item() == x.abs().max().item()
    assert torch.allclose(scale_inv, amax / FMAX[dtype])
    back = dequantize(q, scale_inv)
    normal = x.abs() * (1 / scale_inv) >= float(ml_dtypes.finfo(ML[dtype]).smallest_normal)
    mant = {E4M3: 3, E5M2: 2}[dtype]
    err = ((back - x).abs() / x.abs())[normal]
    assert err.max().item() <= 2.0 ** -(mant + 1) * (1 + 1e-6)
    # bit-exact against the independent reference with the same scale
    ref = ref_quantize(x.numpy(), (1 / scale_inv).numpy(), dtype)
    np.testing.assert_array_equal(q.double().numpy(), ref)


def test_amax_to_scale_margin_and_fallback():
    amax = torch.tensor([2.0, 0.0, float("inf"), float("nan"), 1e-40, 448.0])
    s = amax_to_scale(amax, 448.0, margin=0, fallback=torch.full((6,), 7.0))
    assert s.tolist() == [224.0, 7.0, 7.0, 7.0, 7.0, 1.0]
    s2 = amax_to_scale(amax[:1], 448.0, margin=2)
    assert s2.item() == 56.0
    np.testing.assert_array_equal(amax_to_scale(torch.tensor([3.0, 0.5]), 57344.0, 1).numpy(),
                                  ref_scale(np.array([3.0, 0.5]), E5M2, 1))
    assert amax_to_scale(torch.tensor(0.0), 448.0).item() == 1.0


def test_rowwise_and_columnwise_scales():
    x = torch.tensor([[1.0, -4.0], [0.5, 0.25], [0.0, 0.0]]).repeat(1, 8)  # [3, 16]
    q, si = quantize_rowwise(x, E4M3, dim=1)
    assert si.shape == (3, 1) and si.is_contiguous()
    assert torch.allclose(si.squeeze(1), torch.tensor([4.0 / 448, 0.5 / 448, 1.0]))
    q0, si0 = quantize_rowwise(x, E4M3, dim=0)
    assert si0.shape == (1, 16)
    assert torch.allclose(si0[0, :2], torch.tensor([1.0 / 448, 4.0 / 448]))
    assert torch.equal(dequantize(q, si)[2], torch.zeros(16))  # an all-zero row stays zero
    # N-D, one scale per row of the last dim (the FP8 SwiGLU input store): the 2-D rows' cast, reshaped
    q3, si3 = quantize_rowwise(x.reshape(1, 3, 16), E4M3)
    assert si3.shape == (1, 3, 1) and torch.equal(si3.reshape(3, 1), si)
    assert torch.equal(q3.reshape(3, 16).view(torch.uint8), q.view(torch.uint8))


def test_quant_stats_counts():
    x = torch.tensor([1000.0, 1e-9, -1e-9, 0.0, 3.0, 1040.0, -2000.0])
    scale = torch.tensor(448.0 / 1000.0)
    q = quantize(x, scale, E4M3)
    stats = quant_stats(x, q, scale, E4M3).tolist()
    # amax; two tiny values flushed; 1040 -> 465.9 and -2000 are out of range (1000 -> 448 is not)
    assert stats == [2000.0, 2.0, 2.0, 7.0]
    assert quant_stats(x, q, scale, E4M3, valid_numel=4).tolist()[3] == 4.0


def test_pad_2d():
    x = torch.randn(5, 7)
    p = pad_2d(x, 16, 16)
    assert p.shape == (16, 16) and torch.equal(p[:5, :7], x) and p[5:].abs().sum() == 0 and p[:, 7:].abs().sum() == 0
    assert pad_2d(x, 5, 7) is x


def test_scaled_mm_equals_dequantized_matmul_and_checks_operands():
    a = torch.randn(32, 48)
    b = torch.randn(16, 48)
    aq, asi, _ = quantize_tensorwise(a, E4M3)
    bq, bsi, _ = quantize_tensorwise(b, E4M3)
    out = scaled_mm(aq, bq.t(), asi, bsi, torch.float32)
    ref = (aq.double() * asi.double()) @ (bq.double() * bsi.double()).t()
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="column-major"):
        scaled_mm(aq, bq.t().contiguous(), asi, bsi, torch.float32)
    with pytest.raises(ValueError, match="row-major"):
        scaled_mm(aq.t().contiguous().t(), bq.t(), asi, bsi, torch.float32)
    with pytest.raises(ValueError, match="multiples of 16"):
        scaled_mm(aq[:30], bq.t(), asi, bsi, torch.float32)
    gq, gsi, _ = quantize_tensorwise(a, E5M2)
    hq, hsi, _ = quantize_tensorwise(b, E5M2)
    with pytest.raises(ValueError, match="E5M2 x E5M2"):
        scaled_mm(gq, hq.t(), gsi, hsi, torch.float32)
    # E5M2 x E4M3 is allowed
    assert scaled_mm(gq, bq.t(), gsi, bsi, torch.float32).shape == (32, 16)
