"""megadlms.fp8.kernels.triton_cast: the one-pass cast + transpose + amax kernel, run by Triton's interpreter on the CPU
(in a subprocess, as the interpreter must be on before Triton is imported; skipped where Triton is not
installed). The kernel rounds to the FP8 grid in fp32 arithmetic itself, so arbitrary inputs (ties, subnormals,
-0.0, saturation) must give ATen's bits whatever the conversion instruction (or the interpreter's emulation of it)
does."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megadlms.fp8.kernels import triton_cast

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

SCRIPT = textwrap.dedent("""
    import torch
    from megadlms.fp8.kernels import triton_cast

    torch.manual_seed(0)
    for src, shape in ((torch.float32, (80, 144)), (torch.bfloat16, (80, 144)), (torch.bfloat16, (128, 192))):
        for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
            scale = torch.tensor(32.0)
            # partial tiles on both axes, or whole tiles only (the kernel without masks)
            x = ((torch.randn(*shape) * 3).to(fp8).float() / 32.0).to(src)
            assert triton_cast.available(x)
            amax = torch.tensor(0.01)
            q, t = triton_cast.checked_cast_transpose(x, scale, fp8, True, True, amax)
            ref = (x.float() * scale).clamp(-triton_cast.FP8_MAX[fp8], triton_cast.FP8_MAX[fp8]).to(fp8)
            assert torch.equal(q.view(torch.uint8), ref.view(torch.uint8)), (src, fp8)
            assert torch.equal(t.view(torch.uint8), ref.t().contiguous().view(torch.uint8)), (src, fp8)
            assert torch.equal(amax, x.abs().amax().float()), (src, fp8)
            assert triton_cast._state["checked"] and all(triton_cast._state["checked"].values())
            _, t_only = triton_cast.cast_transpose(x, scale, fp8, False, True)
            assert torch.equal(t_only.view(torch.uint8), t.view(torch.uint8))

    # row / column blocks of larger buffers (the concatenated weights of a fused projection)
    x = (torch.randn(32, 48) * 10).to(torch.float8_e4m3fn).float() / 16
    big_q = torch.zeros(64, 48, dtype=torch.float8_e4m3fn)
    big_t = torch.zeros(48, 64, dtype=torch.float8_e4m3fn)
    triton_cast.cast_transpose(x, torch.tensor(16.0), torch.float8_e4m3fn, True, True, None, big_q[32:],
                               big_t[:, 32:])
    ref = (x * 16).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(big_q[32:].view(torch.uint8), ref) and not big_q[:32].view(torch.uint8).any()
    assert torch.equal(big_t[:, 32:].view(torch.uint8), ref.t()) and not big_t[:, :32].view(torch.uint8).any()
    # column blocks (row stride > width) and a padded transpose (the gradient of a fused projection)
    gq = torch.zeros(48, 96, dtype=torch.float8_e5m2)
    gt = torch.zeros(96, 48, dtype=torch.float8_e5m2)
    g = (torch.randn(40, 48) * 4).to(torch.float8_e5m2).float().to(torch.bfloat16)
    amax = torch.zeros(())
    triton_cast.cast_transpose(g, torch.tensor(1.0), torch.float8_e5m2, True, True, amax, gq[:40, 48:],
                               gt[48:, :40])
    ref = g.float().to(torch.float8_e5m2).view(torch.uint8)
    assert torch.equal(gq[:40, 48:].view(torch.uint8), ref) and not gq[:40, :48].view(torch.uint8).any()
    assert not gq[40:].view(torch.uint8).any() and not gt[:, 40:].view(torch.uint8).any()
    assert torch.equal(gt[48:, :40].view(torch.uint8), ref.t()) and not gt[:48].view(torch.uint8).any()
    assert torch.equal(amax, g.abs().amax().float())

    # arbitrary values: random magnitudes over the whole range, exact FP8 midpoints (ties) and their fp32
    # neighbours, subnormals, signed zeros, values past the maximum (saturate)
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        fmax = triton_cast.FP8_MAX[fp8]
        grid = torch.arange(256, dtype=torch.uint8).view(fp8).float()
        grid = grid[torch.isfinite(grid)].unique()
        mids = (grid[1:] + grid[:-1]) / 2
        vals = torch.cat([mids, torch.nextafter(mids, torch.tensor(1e30)), torch.nextafter(mids, torch.tensor(-1e30)),
                          torch.randn(6000) * torch.exp2(torch.randint(-24, 18, (6000,)).float()),
                          torch.tensor([0.0, -0.0, 1e-30, -1e-30, 2 * fmax, -3 * fmax])])
        n = vals.numel() // 64 * 64
        for src in (torch.float32, torch.bfloat16):
            x = vals[:n].reshape(-1, 64).to(src)
            for scale in (torch.tensor(1.0), torch.tensor(0.7310585)):
                for mode in triton_cast.TRANSPOSE_MODES:  # every formulation of the transposed store
                    # rounded in fp32 arithmetic: exact whatever the interpreter's emulation of the conversion does
                    q, t = triton_cast.cast_transpose(x, scale, fp8, True, True, t_mode=mode, sw_round=True)
                    ref = (x.float() * scale).clamp(-fmax, fmax).to(fp8).view(torch.uint8)
                    assert torch.equal(q.view(torch.uint8), ref), (fp8, src, (q.view(torch.uint8) != ref).sum())
                    assert torch.equal(t.view(torch.uint8), ref.t()), (fp8, src, mode)
    # several amax outputs (the history slots of a fused group's members)
    x = torch.randn(70, 40)
    slots = [torch.tensor(0.0), torch.tensor(1e6), torch.tensor(-1.0)]
    triton_cast.cast_transpose(x, torch.tensor(1.0), torch.float8_e4m3fn, True, False, slots)
    assert slots[0] == x.abs().amax() and slots[1] == 1e6 and slots[2] == x.abs().amax()

    # the current-scale kernel: amax_to_scale and its reciprocal bit for bit, over the max of up to four amaxes,
    # with margins, zero / inf / NaN amaxes (scale 1.0) and amaxes so small that the scale overflows
    from megadlms.fp8.kernels.primitives import amax_to_scale
    amaxes = [3.3, 1.7e-3, 448.0, 1e-30, 1e-42, 0.0, float("inf"), float("nan"), 7.0e4, 0.1234567]
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        for margin in (0, 1, 3):
            for n in (1, 2, 4):
                for i in range(len(amaxes)):
                    vals = [torch.tensor(amaxes[(i + j) % len(amaxes)]) for j in range(n)]
                    scale, scale_inv = triton_cast.current_scale(vals, fp8, margin)
                    want = amax_to_scale(torch.stack(vals).amax(), triton_cast.FP8_MAX[fp8], margin)
                    assert torch.equal(scale, want) and torch.equal(scale_inv, want.reciprocal()), (vals, margin)
                    assert scale.data_ptr() % 16 == 0 and scale_inv.data_ptr() % 16 == 0
    assert triton_cast.checked_current_scale([torch.tensor(2.5)], torch.float8_e4m3fn) is not None
    assert triton_cast._state["scale_ok"] is True

    # the amax kernel: ATen's amax bit for bit, over partial and whole blocks, several blocks per program, signed
    # zeros, subnormals, inf and NaN (NaN wins, as in ATen)
    for src in (torch.float32, torch.bfloat16):
        for n in (1, 4095, 4096, 3 * 4096 + 17, 11 * 4096):
            x = (torch.randn(n) * torch.exp2(torch.randint(-30, 30, (n,)).float())).to(src)
            assert torch.equal(triton_cast.amax(x), x.abs().amax().float()), (src, n)
            # 3 programs (1 "SM" here), fewer than blocks: each strides over several
            assert torch.equal(triton_cast.amax(x, (1024, 4, 3)), x.abs().amax().float()), (src, n)
        x = torch.tensor([-0.0, 1e-40, -3.5, 2.0]).to(src)
        assert torch.equal(triton_cast.amax(x), torch.tensor(3.5))
        for special in (float("inf"), float("-inf"), float("nan")):
            x = torch.randn(9000).to(src)
            x[5000] = special
            got, want = triton_cast.amax(x), torch.linalg.vector_norm(x, float("inf")).float()
            assert torch.equal(got, want) or (got.isnan() and want.isnan()), (src, special, got)
        y = torch.randn(70, 40).to(src)
        assert torch.equal(triton_cast.checked_amax(y), y.abs().amax().float())
        assert triton_cast._state["amax_ok"][src] is True
    assert triton_cast.checked_amax(torch.randn(8, 6).t()) is None  # not contiguous: ATen's

    # fused.transpose_fp8 through the kernel (scale 1): every finite FP8 byte, -0.0 and subnormals included
    from megadlms.fp8.kernels.ops import transpose_fp8
    e5m2_nonfinite = set(range(0x7C, 0x80)) | set(range(0xFC, 0x100))
    for fp8, bad in ((torch.float8_e4m3fn, {0x7F, 0xFF}), (torch.float8_e5m2, e5m2_nonfinite)):
        finite = torch.tensor([b for b in range(256) if b not in bad], dtype=torch.uint8)
        q = finite[torch.randint(0, len(finite), (80, 144))].view(fp8)
        assert torch.equal(transpose_fp8(q).view(torch.uint8), q.t().contiguous().view(torch.uint8)), fp8
        assert triton_cast._state["checked"][(fp8, fp8, False, True, 0, False, False)], "the kernel made it"
    print("OK")
""")


def test_cast_transpose_amax_match_aten_in_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stdout + res.stderr


def test_the_production_formulation_is_checked_once_and_a_wrong_one_falls_back(monkeypatch):
    """Production runs one formulation of the kernel; its first call per variant is checked against ATen: amax
    outputs (several: a fused group's history slots) are raised exactly once, later calls run unchecked; a
    variant whose q^T or q is wrong is switched off with a warning and the amax outputs as they were."""
    import torch

    from megadlms.fp8.kernels import triton_cast

    calls, broken = [], {"t": False, "q": False}

    def kernel(x, scale, fp8_dtype, want_q, want_t, amax_out=None, q_out=None, t_out=None, t_mode=0,
               tile=None, sw_round=False):
        calls.append((t_mode, sw_round))
        ref = (x.float() * scale).clamp(-448, 448).to(fp8_dtype)
        for a in triton_cast._amax_list(amax_out):
            a.copy_(torch.maximum(a, x.abs().amax().float()))
        t = ref.t().contiguous()
        if broken["t"]:  # a miscompiled transposed store: a quarter of q^T zero
            t.view(torch.uint8)[: t.shape[0] // 4] = 0
        q = torch.zeros_like(ref) if broken["q"] else ref
        return (q if want_q else None), (t if want_t else None)

    monkeypatch.setattr(triton_cast, "cast_transpose", kernel)
    monkeypatch.setitem(triton_cast._state, "ok", True)
    monkeypatch.setitem(triton_cast._state, "checked", {})
    x = (torch.randn(64, 48) + 0.5).bfloat16()
    slots = [torch.tensor(0.25), torch.tensor(100.0)]
    q, t = triton_cast.checked_cast_transpose(x, torch.tensor(8.0), torch.float8_e4m3fn, True, True, slots)
    ref = (x.float() * 8).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(t.view(torch.uint8), ref.t().contiguous().view(torch.uint8))
    assert calls == [triton_cast.production_formulation()] == [(0, False)]
    assert list(triton_cast._state["checked"].values()) == [True]
    assert slots[0] == x.abs().amax() and slots[1] == 100.0
    triton_cast.checked_cast_transpose(x, torch.tensor(8.0), torch.float8_e4m3fn, True, True, slots)
    assert len(calls) == 2  # checked once: later calls run the kernel alone

    for part in ("t", "q"):
        broken.update({"t": part == "t", "q": part == "q"})
        amax = torch.tensor(0.5)
        with pytest.warns(RuntimeWarning, match="disagreed"):
            out = triton_cast.checked_cast_transpose(x.float(), torch.tensor(8.0), torch.float8_e5m2, True, True,
                                                     amax)
        assert out is None and amax == 0.5
        n = len(calls)
        assert triton_cast.checked_cast_transpose(x.float(), torch.tensor(8.0), torch.float8_e5m2, True, True,
                                                  amax) is None
        assert len(calls) == n  # off for this variant: the caller's torch path runs
        monkeypatch.setitem(triton_cast._state, "checked", {})


def test_elements_a_kernel_leaves_unwritten_fail_the_first_call_check(monkeypatch):
    """The outputs are filled with a marker before the checked call, so a kernel that skips some stores fails
    even when the buffer already holds the right bytes (a reused allocation from an earlier call)."""
    import torch

    from megadlms.fp8.kernels import triton_cast

    def kernel(x, scale, fp8_dtype, want_q, want_t, amax_out=None, q_out=None, t_out=None, t_mode=0,
               tile=None, sw_round=False):
        ref = (x.float() * scale).clamp(-448, 448).to(fp8_dtype)
        q_out.copy_(ref)
        rows = t_out.shape[0] * 3 // 4  # skips a quarter of q^T
        t_out[:rows].copy_(ref.t()[:rows])
        return q_out, t_out

    monkeypatch.setattr(triton_cast, "cast_transpose", kernel)
    monkeypatch.setitem(triton_cast._state, "ok", True)
    monkeypatch.setitem(triton_cast._state, "checked", {})
    x = torch.randn(64, 48).bfloat16()
    ref = (x.float() * 8).to(torch.float8_e4m3fn)
    q_out = ref.clone()
    t_out = ref.t().contiguous()  # already the right bytes
    with pytest.warns(RuntimeWarning, match="q\\^T"):
        out = triton_cast.checked_cast_transpose(x, torch.tensor(8.0), torch.float8_e4m3fn, True, True, None, q_out,
                                                 t_out)
    assert out is None and list(triton_cast._state["checked"].values()) == [False]


def test_the_kernels_compile_with_torchs_ptxas_unless_the_user_chose_one(monkeypatch, tmp_path):
    """Triton's bundled Hopper ptxas miscompiles the transposed FP8 stores: `use_torch_ptxas` (opt-in; the commands
    call it) points Triton at torch's own ptxas, as torch.compile does; a TRITON_PTXAS_PATH the user set stays."""
    from megadlms import triton_setup

    ours = tmp_path / "ptxas"
    ours.write_text("#!/bin/sh\n")
    ours.chmod(0o755)
    monkeypatch.setattr(triton_setup, "_torch_dir", lambda: str(tmp_path / "torch"))
    assert triton_setup.torch_ptxas() is None  # no bin/ptxas beside this torch
    (tmp_path / "torch" / "bin").mkdir(parents=True)
    (tmp_path / "torch" / "bin" / "ptxas").write_bytes(ours.read_bytes())
    (tmp_path / "torch" / "bin" / "ptxas").chmod(0o755)
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    triton_setup.use_torch_ptxas()
    assert os.environ["TRITON_PTXAS_PATH"] == str(tmp_path / "torch" / "bin" / "ptxas")
    monkeypatch.setenv("TRITON_PTXAS_PATH", str(ours))
    triton_setup.use_torch_ptxas()
    assert os.environ["TRITON_PTXAS_PATH"] == str(ours)


def test_the_first_call_reference_cast_is_built_in_row_blocks(monkeypatch):
    """The ATen reference of the cast kernel's first-call check is cast a few rows at a time (bounded fp32
    temporaries): the same codes and amax as the whole-tensor cast, for bf16 and fp32 sources, a NaN kept."""
    monkeypatch.setattr(triton_cast, "CHECK_ROWS", 7)
    torch.manual_seed(0)
    for dtype, fp8 in ((torch.bfloat16, torch.float8_e4m3fn), (torch.float32, torch.float8_e5m2)):
        x = (torch.randn(40, 24) * 30).to(dtype)
        scale = torch.tensor(3.0)
        ref, amax = triton_cast._aten_cast(x, scale, fp8)
        fmax = torch.finfo(fp8).max
        assert torch.equal(ref.view(torch.uint8), (x.float() * scale).clamp(-fmax, fmax).to(fp8).view(torch.uint8))
        assert torch.equal(amax, x.abs().amax().float())
        x[39, 0] = float("nan")
        assert triton_cast._aten_cast(x, scale, fp8)[1].isnan()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_amax_and_cast_equal_the_references(dtype):
    """On the CPU `amax_of` is abs + amax and the cast ATen's own: the bits of the inf-norm and of the grid
    rounding the compiled kernels use, NaN included."""
    from megadlms.fp8.kernels import ops as kernels
    from megadlms.fp8.kernels.primitives import round_to_fp8_grid
    torch.manual_seed(0)
    x = (torch.randn(48, 80) * 30).to(dtype)
    assert torch.equal(kernels.amax_of(x), torch.linalg.vector_norm(x, float("inf")).float())
    x[3, 5] = float("nan")
    assert kernels.amax_of(x).isnan()
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        y = (torch.randn(64, 64) * 2.0 ** torch.randint(-12, 9, (64, 64))).clamp(-448, 448)
        assert torch.equal(kernels._to_fp8(y, fp8).view(torch.uint8),
                           round_to_fp8_grid(y, fp8).to(fp8).view(torch.uint8))


ROWWISE_SCRIPT = textwrap.dedent("""
    import torch
    from megadlms.fp8.kernels import triton_cast
    from megadlms.fp8.kernels.primitives import quantize_rowwise
    from megadlms.fp8.quantizer import make_quantizer
    from megadlms.fp8.recipe import Float8RowwiseScaling
    from megadlms.fp8.tensor import Scaling

    torch.manual_seed(0)
    # rows spanning six decades (per-row scales differ), a zero row (scale 1), partial tiles or whole ones
    for src, shape, margin in ((torch.float32, (80, 144), 0), (torch.bfloat16, (128, 256), 0),
                               (torch.bfloat16, (48, 200), 1)):
        x = (torch.randn(*shape) * torch.logspace(-3, 3, shape[0])[:, None]).to(src)
        x[3] = 0
        for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
            for want_q, want_t in ((True, True), (True, False), (False, True)):
                q, t, rsi, csi = triton_cast.checked_rowwise_cast(x, fp8, want_q, want_t, margin)
                if want_q:
                    ref, ref_si = quantize_rowwise(x, fp8, 1, margin)
                    assert torch.equal(q.view(torch.uint8), ref.view(torch.uint8)), (src, fp8, "q")
                    assert torch.equal(rsi, ref_si) and rsi.shape == (shape[0], 1)
                    assert rsi[3, 0] == 1.0
                else:
                    assert q is None and rsi is None
                if want_t:
                    ref, ref_si = quantize_rowwise(x, fp8, 0, margin)
                    assert torch.equal(t.view(torch.uint8), ref.t().contiguous().view(torch.uint8)), (src, fp8, "t")
                    assert torch.equal(csi, ref_si.reshape(-1, 1))
                else:
                    assert t is None and csi is None
    assert len(triton_cast._state["rowwise_ok"]) == 18 and all(triton_cast._state["rowwise_ok"].values())

    # the rowwise quantizer takes both copies from the kernels: the torch path's bits and scales
    quant = make_quantizer(Float8RowwiseScaling(), torch.float8_e4m3fn, None, 0)
    x = torch.randn(64, 96, dtype=torch.bfloat16) * 5
    got = quant.quantize(x, rows=True, cols=True)
    want_rows, want_cols = quant._rows(x), quant._cols(x)
    for g, w in ((got.rows, want_rows), (got.cols, want_cols)):
        assert torch.equal(g.data.view(torch.uint8), w.data.view(torch.uint8)) and torch.equal(g.scale_inv, w.scale_inv)
        assert g.scaling is Scaling.ROW and g.transposed == w.transposed
    assert torch.equal(quant.cols_of(got.rows, lambda: x).data.view(torch.uint8), want_cols.data.view(torch.uint8))

    # a rowwise Float8Linear (odd shapes: padded operands) gives the same output and gradients with the kernels
    # as with the torch casts
    from megadlms.fp8 import Float8Linear, fp8_autocast

    def run(kernels):
        triton_cast._state["ok"] = kernels
        torch.manual_seed(1)
        layer = Float8Linear(40, 24, recipe=Float8RowwiseScaling())
        x = torch.randn(3, 7, 40, requires_grad=True)
        with fp8_autocast(fp8_recipe=layer.recipe):
            y = layer(x)
        y.backward(torch.randn_like(y))
        return y, x.grad, layer.weight.grad

    calls, kernel = [], triton_cast.rowwise_cast
    triton_cast.rowwise_cast = lambda x, *a: calls.append(tuple(x.shape)) or kernel(x, *a)
    with_kernels = run(True)
    # padded to multiples of 16, both copies of each in one call: the input, the weight (its transpose for dx made
    # with its rows and kept in the step's cache), the gradient
    assert sorted(calls) == [(32, 32), (32, 48), (32, 48)], calls
    without = run(False)
    assert all(torch.equal(a, b) for a, b in zip(with_kernels, without))
    print("OK")
""")


def test_rowwise_cast_matches_the_torch_cast_in_interpreter():
    """The rowwise recipe's casts in two reads of x (row and column maxima, then q per row and q^T per column of x):
    the bits and scales of `quantize_rowwise`, for every output choice, both formats, a margin and partial tiles."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-c", ROWWISE_SCRIPT], env=env, cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stdout + res.stderr


@pytest.mark.parametrize("margin", [0, 2])
def test_the_rowwise_first_call_reference_is_built_in_row_blocks(monkeypatch, margin):
    """The first call's reference of the rowwise kernels, built a few rows at a time (fp32 temporaries of that height,
    not the whole tensor's), has quantize_rowwise's bits and scales; the columns' scales span every block."""
    from megadlms.fp8.kernels.primitives import quantize_rowwise

    monkeypatch.setattr(triton_cast, "CHECK_ROWS", 16)
    x = (torch.randn(72, 48) * torch.logspace(-2, 2, 72)[:, None]).to(torch.bfloat16)
    q, t, row_si, col_si = triton_cast._rowwise_reference(x, torch.float8_e4m3fn, True, True, margin)
    ref_q, ref_row = quantize_rowwise(x, torch.float8_e4m3fn, 1, margin)
    ref_c, ref_col = quantize_rowwise(x, torch.float8_e4m3fn, 0, margin)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(row_si, ref_row)
    assert torch.equal(t.view(torch.uint8), ref_c.t().contiguous().view(torch.uint8))
    assert torch.equal(col_si, ref_col.reshape(-1, 1))
