"""megadlms.fp8.kernels.triton_grouped_cast and expert_quantizer: the one-pass grouped casts of the MoE experts, run
by Triton's interpreter on the CPU (in a subprocess: the interpreter must be on before Triton is imported), equal
bit for bit to the torch casts, which equal the fp32 definition of each scaling."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megadlms.fp8.expert_quantizer import ExpertQuantizer
from megadlms.fp8.kernels import triton_grouped_cast as k
from megadlms.fp8.kernels.primitives import amax_to_scale
from megadlms.fp8.recipe import E4M3, FP8_MAX, Float8CurrentScaling, Float8RowwiseScaling
from megadlms.fp8.tensor import Scaling

SCRIPT = textwrap.dedent("""
    import torch
    from megadlms.fp8 import expert_quantizer
    from megadlms.fp8.grouped import fp8_grouped_linear
    from megadlms.fp8.kernels import triton_cast, triton_grouped_cast as k
    from megadlms.fp8.recipe import Float8CurrentScaling, Float8RowwiseScaling

    E4 = torch.float8_e4m3fn
    def same(a, b):
        return a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dtype == E4 else a,
                                                  b.view(torch.uint8) if b.dtype == E4 else b)

    torch.manual_seed(0)
    assert triton_cast.enabled(torch.device("cpu"))
    # groups: an expert without rows, rows past offs[-1] (the last expert's), partial tiles on both axes
    offs = torch.tensor([16, 16, 48, 96], dtype=torch.int32)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(100, 80) * 3).to(dtype)
        x[20:30] *= 300  # saturating values in expert 2 for a margin-free scale of another's... and its own scale
        x[40] = 0  # a row of zeros: scale 1
        x[50, 7] = 1e-12  # underflows
        for margin in (0, 1):
            a = k.expert_amax(x, offs)
            assert same(a, k.torch_expert_amax(x, offs)), (dtype, margin)
            for amax in (None, a):
                for tile in (None, (16, 128, 1)):  # rows in column blocks, or whole rows in one tile
                    q, si = k.row_cast(x, E4, margin, offs, amax, tile)
                    ref = k.torch_row_cast(x, E4, margin, offs, amax)
                    assert all(map(same, (q, si), ref)), (dtype, margin, amax, tile)
                t, si = k.col_cast(x, offs, E4, margin, amax)
                assert all(map(same, (t, si), k.torch_col_cast(x, offs, E4, margin, amax))), (dtype, margin, amax)
        w = torch.randn(3, 48, 80).to(dtype)
        wo = torch.tensor([48, 96, 144], dtype=torch.int32)
        for amax in (None, k.expert_amax(w.reshape(-1, 80), wo)):
            # row blocks; each expert's 48 rows whole in one tile of columns (80 in one, or blocks of 8)
            for tile in (None, (0, 0, 1), (0, 8, 1)):
                t, si = k.col_cast(w.reshape(-1, 80), wo, E4, 0, amax, per_expert_out=True, tile=tile)
                assert t.shape == (3, 80, 48)
                assert all(map(same, (t, si), k.torch_col_cast(w.reshape(-1, 80), wo, E4, 0, amax, True))), tile
        t, si = k.col_cast(x, offs, E4, 0, None, tile=(0, 16, 1))  # jagged groups: never whole, row blocks
        assert all(map(same, (t, si), k.torch_col_cast(x, offs, E4, 0, None)))
    # the grouped linear through the kernels equals the torch casts' (forward and both gradients)
    sizes = [16, 0, 32, 48]
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    for recipe in (Float8RowwiseScaling(), Float8CurrentScaling()):
        outs = []
        for on in (True, False):
            triton_cast._state["ok"] = on
            x = torch.randn(96, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
            w = torch.randn(4, 48, 32, generator=torch.Generator().manual_seed(2), requires_grad=True)
            y = fp8_grouped_linear(x, w, offs, recipe)
            y.backward(torch.randn(96, 48, generator=torch.Generator().manual_seed(3)))
            outs.append((y, x.grad, w.grad))
        assert all(torch.equal(a, b) for a, b in zip(*outs)), recipe
    triton_cast._state["ok"] = True
    assert expert_quantizer._CHECKED and all(expert_quantizer._CHECKED.values()), expert_quantizer._CHECKED
    print("OK")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_grouped_casts_match_torch_in_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stdout + res.stderr


def _scaled(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """The fp32 definition: x cast with scale fp8_max / amax, as the FP8 values times scale_inv."""
    scale = amax_to_scale(amax, FP8_MAX[E4M3])
    return (x * scale).clamp(-448, 448).to(E4M3).float() * scale.reciprocal()


def test_torch_casts_are_the_fp32_definition_of_each_scaling():
    torch.manual_seed(0)
    offs = torch.tensor([16, 16, 48, 80], dtype=torch.int32)
    groups = [(0, 16), (16, 16), (16, 48), (48, 80)]
    x = torch.randn(80, 32)
    x[20:30] *= 40
    q, si = k.torch_row_cast(x, E4M3)  # per row
    torch.testing.assert_close(q.float() * si[:, None], _scaled(x, x.abs().amax(1, keepdim=True)), rtol=0, atol=0)
    t, si = k.torch_col_cast(x, offs, E4M3)  # per (expert, column)
    assert t.shape == (32, 80) and si.shape == (4, 32)
    for e, (s, end) in enumerate(groups):
        xs = x[s:end]
        if end > s:
            ref = _scaled(xs, xs.abs().amax(0, keepdim=True))
            torch.testing.assert_close(t[:, s:end].t().float() * si[e], ref, rtol=0, atol=0)
        else:
            assert (si[e] == 1).all()  # no rows: scale 1
    amax = k.torch_expert_amax(x, offs)
    assert amax.tolist() == [x[s:end].abs().max().item() if end > s else 0.0 for s, end in groups]
    q, si = k.torch_row_cast(x, E4M3, 0, offs, amax)  # per expert
    torch.testing.assert_close(q[16:48].float() * si[16:48, None], _scaled(x[16:48], amax[2]), rtol=0, atol=0)


@pytest.mark.parametrize("recipe,scaling", [(Float8RowwiseScaling(), Scaling.ROW),
                                            (Float8CurrentScaling(), Scaling.EXPERT)])
def test_quantizer_states_scaling_and_grouped_layouts(recipe, scaling):
    quant = ExpertQuantizer(recipe)
    offs = torch.tensor([16, 32], dtype=torch.int32)
    rows, cols = quant.quantize(torch.randn(32, 48), offs, rows=True, cols=True)
    assert rows.scaling is cols.scaling is scaling and rows.offs is offs and cols.offs is offs
    assert (rows.data.shape, rows.scale_inv.shape, rows.transposed) == ((32, 48), (32,), False)
    assert (cols.data.shape, cols.scale_inv.shape, cols.transposed) == ((48, 32), (2, 48), True)
    w_rows, w_cols = quant.quantize_weight(torch.randn(2, 64, 48), rows=True, cols=True)
    assert (w_rows.data.shape, w_rows.scale_inv.shape) == ((2, 64, 48), (2, 64))
    assert (w_cols.data.shape, w_cols.scale_inv.shape, w_cols.transposed) == ((2, 48, 64), (2, 48), True)
    if scaling is Scaling.EXPERT:  # one value per expert, written out per row / column
        assert (rows.scale_inv[:16] == rows.scale_inv[0]).all()
        assert (w_cols.scale_inv[1] == w_cols.scale_inv[1, 0]).all()


def _script(name: str, args: list[str], capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run benchmarks/<name>'s main() in this process (no interpreter start-up) and return what it printed."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / name
    monkeypatch.syspath_prepend(str(path.parent))  # its sibling modules, as when run as a script
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", [str(path), *args])
    try:
        module.main()
    except SystemExit as e:
        assert e.code == 0, capsys.readouterr().out
    return capsys.readouterr().out


def test_grouped_check_script_passes_on_the_cpu(capsys, monkeypatch):
    out = _script("fp8_grouped_check.py", ["--smoke"], capsys, monkeypatch)
    lines = [line for line in out.splitlines() if line.startswith(("gemm ", "layer "))]
    assert len(lines) == 24 and all(line.endswith(" ok") for line in lines), out
    assert out.strip().endswith("0 failed")


def test_grouped_cast_bandwidth_script_prints_every_cast(capsys, monkeypatch):
    out = _script("fp8_grouped_cast.py", ["--smoke"], capsys, monkeypatch)
    rows = [line.split("|") for line in out.splitlines() if line.count("|") == 5 and "ms" not in line]
    rows = [r for r in rows if not r[0].startswith("-")]
    assert len(rows) == 10 and all(float(r[2]) > 0 and float(r[4].replace(",", "")) > 0 for r in rows), out
    assert "of copy (goal >= 70%)" in out


def test_a_kernel_that_disagrees_with_torch_falls_back_with_a_warning(monkeypatch):
    from megadlms.fp8 import expert_quantizer

    monkeypatch.setattr(expert_quantizer, "_CHECKED", {})
    monkeypatch.setattr(expert_quantizer.triton_cast, "enabled", lambda device: True)
    calls = []

    def wrong_row_cast(x, *args):
        calls.append(1)
        q, si = k.torch_row_cast(x, *args)
        return q, si * 2  # wrong scales

    monkeypatch.setattr(expert_quantizer.kernels, "row_cast", wrong_row_cast)
    quant = ExpertQuantizer(Float8RowwiseScaling())
    x, offs = torch.randn(32, 48), torch.tensor([16, 32], dtype=torch.int32)
    with pytest.warns(RuntimeWarning, match="row_cast disagreed with the torch cast"):
        rows, _ = quant.quantize(x, offs)
    ref_q, ref_si = k.torch_row_cast(x, E4M3)
    assert torch.equal(rows.scale_inv, ref_si) and torch.equal(rows.data.view(torch.uint8), ref_q.view(torch.uint8))
    rows, _ = quant.quantize(x, offs)  # decided once: the torch cast from now on, the kernel not called again
    assert len(calls) == 1 and torch.equal(rows.scale_inv, ref_si)


def test_torch_casts_in_row_chunks_equal_the_whole(monkeypatch):
    torch.manual_seed(0)
    x, offs = torch.randn(80, 32).to(torch.bfloat16), torch.tensor([16, 16, 48, 80], dtype=torch.int32)
    x[20:30] *= 40
    whole = [k.torch_row_cast(x, E4M3), k.torch_col_cast(x, offs, E4M3), (k.torch_expert_amax(x, offs),)]
    monkeypatch.setattr(k, "REFERENCE_ROWS", 24)  # chunks that cut through expert groups
    chunked = [k.torch_row_cast(x, E4M3), k.torch_col_cast(x, offs, E4M3), (k.torch_expert_amax(x, offs),)]
    for a, b in zip(whole, chunked):
        for ta, tb in zip(a, b):
            assert torch.equal(ta.view(torch.uint8) if ta.dtype == E4M3 else ta,
                               tb.view(torch.uint8) if tb.dtype == E4M3 else tb)
