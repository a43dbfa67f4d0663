"""Blockwise FP8 (1x128 tiles, 128x128 blocks) against a NumPy / ml_dtypes construction from the definition, and
the three GEMMs of a linear layer against dequantise-then-matmul."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from megadlms.fp8.formats import blockwise as bw
from megadlms.fp8.hardware import FP8UnsupportedError
from megadlms.fp8.tensor import Scaling

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ML = {E4M3: ml_dtypes.float8_e4m3fn, E5M2: ml_dtypes.float8_e5m2}
FMAX = {E4M3: 448.0, E5M2: 57344.0}
CUDA = torch.cuda.is_available()


def outliers(rows: int, cols: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Gaussian values with a few large channels and a zero row (amax 0 -> scale 1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x[:, 7] *= 300.0
    x[3] = 0.0
    x[5, 130:] *= 1e-3
    return x.to(dtype)


def ref_scale(amax: np.ndarray, fp8_dtype: torch.dtype, pow2: bool) -> np.ndarray:
    with np.errstate(divide="ignore"):
        s = np.float32(FMAX[fp8_dtype]) / amax.astype(np.float32)
    if pow2:
        mant, exp = np.frexp(s)  # s = mant * 2**exp, mant in [0.5, 1): the power of two below is 2**(exp - 1)
        s = np.ldexp(np.float32(1.0), exp - 1).astype(np.float32)
    return np.where(amax > 0, s, np.float32(1.0)).astype(np.float32)


def ref_tiles(x: np.ndarray, fp8_dtype: torch.dtype, pow2: bool) -> tuple[np.ndarray, np.ndarray]:
    """1x128 tiles of x [R, C] (padded to multiples of 128): (fp8 bytes [R', C'], scale_inv [R', C'/128])."""
    r, c = x.shape
    xp = np.zeros((-(-r // 128) * 128, -(-c // 128) * 128), np.float32)
    xp[:r, :c] = x
    tiles = xp.reshape(xp.shape[0], -1, 128)
    scale = ref_scale(np.abs(tiles).max(axis=2), fp8_dtype, pow2)
    fmax = np.float32(FMAX[fp8_dtype])
    q = np.clip(tiles * scale[:, :, None], -fmax, fmax).astype(ML[fp8_dtype]).reshape(xp.shape)
    return q.view(np.uint8), np.float32(1.0) / scale


def ref_blocks(w: np.ndarray, fp8_dtype: torch.dtype, pow2: bool) -> tuple[np.ndarray, np.ndarray]:
    r, c = w.shape
    wp = np.zeros((-(-r // 128) * 128, -(-c // 128) * 128), np.float32)
    wp[:r, :c] = w
    blocks = wp.reshape(wp.shape[0] // 128, 128, wp.shape[1] // 128, 128)
    scale = ref_scale(np.abs(blocks).max(axis=(1, 3)), fp8_dtype, pow2)
    fmax = np.float32(FMAX[fp8_dtype])
    q = np.clip(blocks * scale[:, None, :, None], -fmax, fmax).astype(ML[fp8_dtype]).reshape(wp.shape)
    return q.view(np.uint8), np.float32(1.0) / scale


def as_bytes(q: torch.Tensor) -> np.ndarray:
    return q.view(torch.uint8).numpy()


@pytest.mark.parametrize("dtype,fp8_dtype,pow2", [(torch.float32, E4M3, False), (torch.bfloat16, E4M3, True),
                                                   (torch.float32, E5M2, False), (torch.float32, E5M2, True)])
def test_tiles_and_transposed_tiles_match_the_definition_bitwise(dtype, fp8_dtype, pow2):
    x = outliers(200, 300, seed=0, dtype=dtype)
    tiles, t_tiles = bw.quantize_tiles(x, fp8_dtype, pow2=pow2, transpose=True)
    xf = x.float().numpy()
    for got, ref_in in ((tiles, xf), (t_tiles, xf.T)):
        q, s = ref_tiles(ref_in, fp8_dtype, pow2)
        assert np.array_equal(as_bytes(got.data), q)
        assert np.array_equal(got.scale_inv.numpy(), s)
        assert got.scale_inv.stride() == (1, got.data.shape[0])  # column-major, as the GEMM takes it
    if pow2:  # powers of two: dequantising is exact
        assert np.all(np.frexp(tiles.scale_inv.numpy())[0] == 0.5)


@pytest.mark.parametrize("pow2", [False, True])
def test_weight_blocks_and_their_transpose_match_the_definition_bitwise(pow2):
    w = outliers(200, 300, seed=1)
    blocks, t_blocks = bw.quantize_blocks(w, E4M3, pow2=pow2, transpose=True)
    q, s = ref_blocks(w.numpy(), E4M3, pow2)
    assert np.array_equal(as_bytes(blocks.data), q)
    assert blocks.scale_inv.shape == (2, 4) and blocks.scale_inv.is_contiguous()  # [N/128, L4(K/128)]
    assert np.array_equal(blocks.scale_inv[:, :3].numpy(), s) and torch.all(blocks.scale_inv[:, 3:] == 1.0)
    assert np.array_equal(as_bytes(t_blocks.data), q.T)
    assert np.array_equal(t_blocks.scale_inv[:, :2].numpy(), s.T)


def test_saturation_and_zero_blocks():
    x = torch.zeros(128, 256)
    x[0, :128] = torch.linspace(-1e6, 1e6, 128)
    tiles, _ = bw.quantize_tiles(x)
    assert tiles.data.float().abs().max().item() == 448.0
    assert tiles.scale_inv[1, 0].item() == 1.0 and tiles.scale_inv[0, 1].item() == 1.0  # all-zero tiles


def dequant64(q: torch.Tensor, s: torch.Tensor, block: bool) -> np.ndarray:
    """Dequantise in float64 from the definition (independent of the module's own dequantise)."""
    qv = q.float().numpy().astype(np.float64)
    sv = s.numpy().astype(np.float64)
    if block:
        sv = sv[:, : -(-q.shape[1] // 128)]
        full = np.kron(sv, np.ones((128, 128)))
    else:
        full = np.kron(sv, np.ones((1, 128)))
    return qv * full[: q.shape[0], : q.shape[1]]


def test_fprop_dgrad_wgrad_equal_dequantise_then_matmul():
    m, k, n = 256, 384, 128
    x, w, dy = outliers(m, k, 2), outliers(n, k, 3) * 0.02, outliers(m, n, 4) * 1e-4
    xq, xtq = bw.quantize_tiles(x, transpose=True)
    wq, wtq = bw.quantize_blocks(w, transpose=True)
    gq, gtq = bw.quantize_tiles(dy, transpose=True)
    cases = {  # name: (a, b, b has blocks, the unquantised operands of a @ b^T)
        "fprop": (xq, wq, True, x, w),
        "dgrad": (gq, wtq, True, dy, w.t()),
        "wgrad": (gtq, xtq, False, dy.t(), x.t()),
    }
    for name, (a, b, blocks, ea, eb) in cases.items():
        assert (b.scaling is Scaling.BLOCK) == blocks and a.scaling is Scaling.TILE
        got = bw.blockwise_gemm(a.data, a.scale_inv, b.data, b.scale_inv, torch.float32, blocks).double().numpy()
        want = dequant64(a.data, a.scale_inv, False) @ dequant64(b.data, b.scale_inv, blocks).T
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max(), err_msg=name)
        # the right operands in the right layout: within E4M3's rounding (2**-4 per operand) of the unquantised
        # product, elementwise against sum |a| |b| (a misplaced scale is off by about that sum itself)
        exact = (ea.double() @ eb.double().t()).numpy()
        bound = (ea.double().abs() @ eb.double().abs().t()).numpy()
        assert got.shape == exact.shape and np.all(np.abs(got - exact) <= 0.13 * bound), name


def test_gemm_rejects_layouts_the_gpu_kernel_rejects():
    xq, _ = bw.quantize_tiles(outliers(128, 256, 5))
    wq, _ = bw.quantize_blocks(outliers(128, 256, 6))
    with pytest.raises(ValueError, match="column-major"):
        bw.blockwise_gemm(xq.data, xq.scale_inv.contiguous(), wq.data, wq.scale_inv, torch.float32, True)
    with pytest.raises(ValueError, match="128x128 block buffer"):
        bw.blockwise_gemm(xq.data, xq.scale_inv, wq.data, wq.scale_inv[:, :2], torch.float32, True)
    with pytest.raises(ValueError, match="b_scale must be 1x128 tiles"):  # block scales stated as tiles
        bw.blockwise_gemm(xq.data, xq.scale_inv, wq.data, wq.scale_inv, torch.float32, False)
    g, _ = bw.quantize_tiles(outliers(128, 256, 7), E5M2)  # the SM90 kernels take E4M3 only
    with pytest.raises(ValueError, match="E4M3 operands only.*--fp8-format e4m3"):
        bw.blockwise_gemm(g.data, g.scale_inv, wq.data, wq.scale_inv, torch.float32, True)


def test_gemm_support_errors_name_what_is_needed(monkeypatch):
    check = bw.check_blockwise_gemm_support.__wrapped__
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA B200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (10, 0))
    with pytest.raises(FP8UnsupportedError, match=r"Hopper \(compute capability 9.0\) only.*mxfp8"):
        check(0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))
    monkeypatch.setattr(torch.version, "cuda", "12.6")
    with pytest.raises(FP8UnsupportedError, match="CUDA >= 12.9"):
        check(0)


INTERPRETED = textwrap.dedent("""
    import torch
    from megadlms.fp8.formats import blockwise as bw

    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 384, generator=g) * 0.02
    w[3, 5], w[130, 1], w[:128, 128:256] = 7.0, -3e-9, 0.0  # an outlier, a subnormal-bound value, a zero block
    for dtype, fp8, pow2 in ((torch.float32, torch.float8_e4m3fn, False), (torch.bfloat16, torch.float8_e4m3fn, True),
                             (torch.bfloat16, torch.float8_e5m2, False)):
        wp = w.to(dtype)
        for kernel, reference in ((bw._blocks_triton, bw._blocks_reference),
                                  (bw._tiles_triton, bw._tiles_pair_reference)):
            for got, want in zip(kernel(wp, fp8, pow2, True), reference(wp, fp8, pow2, True)):
                assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)), (kernel, dtype, fp8)
                assert torch.equal(got.scale_inv, want.scale_inv), (kernel, dtype, fp8, pow2)
    print("bitwise")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_triton_tile_and_block_casts_match_the_reference_in_the_interpreter():
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "bitwise" in out.stdout, out.stderr[-2000:]


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_triton_block_cast_matches_the_reference_on_cuda():
    w = outliers(300, 520, seed=8).cuda() * 0.02
    for fp8_dtype, pow2 in ((E4M3, False), (E4M3, True)):
        bw._verdicts.clear()
        got = bw.quantize_blocks(w, fp8_dtype, pow2=pow2, transpose=True)
        assert all(bw._verdicts.values())  # the Triton kernel ran and agreed with the reference on its first call
        want = bw._blocks_reference(bw._pad_to_blocks(w), fp8_dtype, pow2, True)
        for g, r in zip(got, want):
            assert torch.equal(g.data.view(torch.uint8), r.data.view(torch.uint8))
            assert torch.equal(g.scale_inv, r.scale_inv)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_triton_tile_cast_matches_the_reference_on_cuda():
    x = outliers(300, 520, seed=9, dtype=torch.bfloat16).cuda()
    for fp8_dtype, pow2 in ((E4M3, False), (E5M2, True)):
        bw._verdicts.clear()
        got = bw.quantize_tiles(x, fp8_dtype, pow2=pow2, transpose=True)
        assert all(bw._verdicts.values())  # the Triton kernel ran and agreed with the reference on its first call
        xp = bw._pad_to_blocks(x)
        want = (bw._tiles_reference(xp, fp8_dtype, pow2), bw._tiles_reference(xp.t(), fp8_dtype, pow2))
        for g, w in zip(got, want):
            assert torch.equal(g.data.view(torch.uint8), w.data.view(torch.uint8))
            assert torch.equal(g.scale_inv, w.scale_inv) and g.scale_inv.stride() == w.scale_inv.stride()


@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU")
def test_cuda_gemm_matches_the_cpu_emulation():
    m, k, n = 256, 512, 384
    x, w, dy = outliers(m, k, 2).cuda(), outliers(n, k, 3).cuda() * 0.02, outliers(m, n, 4).cuda() * 1e-4
    xq, xtq = bw.quantize_tiles(x, transpose=True)
    wq, wtq = bw.quantize_blocks(w, transpose=True)
    gq, gtq = bw.quantize_tiles(dy, transpose=True)
    for a, b in ((xq, wq), (gq, wtq), (gtq, xtq)):
        blocks = b.scaling is Scaling.BLOCK
        got = bw.blockwise_gemm(a.data, a.scale_inv, b.data, b.scale_inv, torch.float32, blocks).cpu()
        cpu = [t.cpu() for t in (a.data, a.scale_inv, b.data, b.scale_inv)]  # .cpu() keeps the strides
        want = bw.blockwise_gemm(*cpu, torch.float32, blocks)
        torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-3 * want.abs().max().item())
