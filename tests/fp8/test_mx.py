"""MXFP8 against the OCP MX v1.0 definition (NumPy / ml_dtypes, bitwise for data and E8M0 scales), the swizzled
scale layout against its index formula, and the three GEMMs of a linear layer against dequantise-then-matmul."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from megadlms.fp8.formats import mx
from megadlms.fp8.hardware import FP8UnsupportedError

CUDA = torch.cuda.is_available()


def mx_input(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Values spanning many binades, blocks whose amax sits exactly on and just past the 1.75 * 2**e boundary
    (where ceil and floor rounding part), an all-zero block and a tiny block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-20, 20, (rows, 1), generator=g).float())
    x[0, :32] = torch.linspace(-1, 1, 32) * 448.0  # amax = 448: k = 0 either way
    x[1, :32] = torch.linspace(-1, 1, 32) * 1.75 * 2.0 ** 5  # amax = 1.75 * 2**5: ceil and floor agree
    x[2, :32] = torch.linspace(-1, 1, 32) * 1.8 * 2.0 ** 5  # past 1.75: ceil takes one more power of two
    x[3, 32:64] = 0.0
    x[4, :32] *= 1e-30
    return x


def ref_mx(x: np.ndarray, rounding: str) -> tuple[np.ndarray, np.ndarray]:
    """OCP MX v1.0 from its definition in float64: (E4M3 bytes [R, C'], E8M0 bytes [R, C'/32])."""
    r, c = x.shape
    xp = np.zeros((r, -(-c // 32) * 32), np.float64)
    xp[:, :c] = x
    blocks = xp.reshape(r, -1, 32)
    amax = np.abs(blocks).max(axis=2)
    with np.errstate(divide="ignore"):
        if rounding == "ceil":  # the smallest power of two X with amax / X <= 448
            k = np.ceil(np.log2(amax / 448.0))
        else:  # the spec: floor(log2(amax)) - emax, emax(E4M3) = 8
            k = np.floor(np.log2(amax)) - 8
    k = np.clip(np.nan_to_num(k, neginf=-127), -127, 127)
    q = np.clip(blocks / 2.0 ** k[:, :, None], -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)
    scale = (2.0 ** k).astype(ml_dtypes.float8_e8m0fnu)
    return q.reshape(r, -1).view(np.uint8), scale.view(np.uint8)


@pytest.mark.parametrize("rounding", ["ceil", "floor"])
def test_data_and_scales_match_the_ocp_definition_bitwise(rounding):
    x = mx_input(64, 200, seed=0)
    q, s = mx.quantize_mx(x, rounding)
    rq, rs = ref_mx(x.numpy(), rounding)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu and s.shape == (64, 7)
    assert np.array_equal(q.view(torch.uint8).numpy(), rq)
    assert np.array_equal(s.view(torch.uint8).numpy(), rs)


def test_ceil_never_saturates_where_floor_does():
    x = mx_input(64, 256, seed=1)
    for rounding, saturated in (("ceil", False), ("floor", True)):
        q, s = mx.quantize_mx(x, rounding)
        err = (mx.dequantize_mx(q, s) - x).abs() / x.abs().clamp(min=1e-30)
        big = x.abs() > 2.0 ** (s.view(torch.uint8).float().repeat_interleave(32, 1) - 127) * 464  # past 448 + ulp/2
        assert big.any().item() is saturated
        # the upper eighth of each block's range is E4M3-normal: rounding alone stays within 2**-4 relative
        top = x.abs() >= x.abs().view(64, -1, 32).amax(2).repeat_interleave(32, 1) / 8
        assert (err[top & (x != 0)] <= 2.0 ** -4).all().item() is not saturated
    assert mx.quantize_mx(x, "ceil")[1].view(torch.uint8)[2, 0] == mx.quantize_mx(x, "floor")[1].view(
        torch.uint8)[2, 0] + 1


def test_bad_rounding_is_one_clear_error():
    with pytest.raises(ValueError, match="'ceil'.*'floor'"):
        mx.quantize_mx(torch.ones(2, 32), "nearest")


def test_swizzled_scales_follow_the_index_formula():
    r, kb = 200, 9
    s = torch.randint(0, 255, (r, kb), dtype=torch.uint8)
    got = mx.swizzle_scales(s.view(torch.float8_e8m0fnu)).view(torch.uint8)
    rp, kp = 256, 12
    assert got.numel() == rp * kp
    want = torch.zeros(rp * kp, dtype=torch.uint8)
    for row in range(r):
        for col in range(kb):
            tile = (row // 128) * (kp // 4) + col // 4
            within = (row % 32) * 16 + ((row % 128) // 32) * 4 + col % 4
            want[tile * 512 + within] = s[row, col]
    assert torch.equal(got, want)


def test_fprop_dgrad_wgrad_equal_dequantise_then_matmul():
    m, k, n = 64, 96, 48
    g = torch.Generator().manual_seed(2)
    x, w, dy = (torch.randn(*shape, generator=g) for shape in ((m, k), (n, k), (m, n)))
    cases = {"fprop": (x, w), "dgrad": (dy, w.t()), "wgrad": (dy.t(), x.t())}  # a @ b^T, each along its own K
    for name, (a, b) in cases.items():
        (aq, as_), (bq, bs) = mx.quantize_mx(a), mx.quantize_mx(b)
        got = mx.mx_gemm(aq, as_, bq, bs, torch.float32).double().numpy()
        ra, rsa = ref_mx(a.numpy(), "ceil")
        rb, rsb = ref_mx(b.numpy(), "ceil")
        deq = [q.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * np.repeat(
            sc.view(ml_dtypes.float8_e8m0fnu).astype(np.float64), 32, axis=1) for q, sc in ((ra, rsa), (rb, rsb))]
        want = deq[0] @ deq[1].T
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max(), err_msg=name)
        exact = (a.double() @ b.double().t()).numpy()
        assert np.abs(got - exact).max() / np.abs(exact).max() < 0.05, name


def test_hopper_gets_an_error_naming_the_recipes_that_run_there(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H200")
    with pytest.raises(FP8UnsupportedError,
                       match=r"Blackwell.*H200 \(9.0\).*delayed, tensorwise, rowwise or blockwise"):
        mx.check_mx_gemm_support.__wrapped__(0)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_gemm_runs_on_blackwell_and_says_why_not_elsewhere():
    x, w = torch.randn(128, 256, device="cuda"), torch.randn(256, 256, device="cuda")
    (xq, xs), (wq, ws) = mx.quantize_mx(x), mx.quantize_mx(w)
    if torch.cuda.get_device_capability()[0] != 10:
        with pytest.raises(FP8UnsupportedError, match="compute capability 10.x"):
            mx.mx_gemm(xq, xs, wq, ws, torch.bfloat16)
        return
    got = mx.mx_gemm(xq, xs, wq, ws, torch.float32).cpu()
    want = mx.mx_gemm(xq.cpu(), xs.cpu(), wq.cpu(), ws.cpu(), torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())
