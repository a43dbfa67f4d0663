"""megadlms.copy_kernels: the row-strided converting copy against torch's, run by Triton's interpreter on the CPU
(in a subprocess: the interpreter must be on before Triton is imported; skipped where Triton is not installed),
and the row views it takes."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megadlms.copy_kernels import copy_rows, rows_view

SCRIPT = textwrap.dedent("""
    import torch
    from megadlms import copy_kernels as ck
    from megadlms import swiglu_kernels as sk
    from megadlms.grouped_gemm import _stack, _unstack

    torch.manual_seed(0)
    assert ck.available(torch.zeros(1))
    # fp32 -> BF16 into the halves of a stack, and back (the expert weights' casts); ragged rows (3 x 2500). The
    # values are BF16's: the interpreter's conversion truncates where the GPU's rounds to nearest even
    wg = (torch.randn(3, 50, 50) * 100).to(torch.bfloat16).float()
    wu = torch.randn(3, 50, 50).to(torch.bfloat16).float()
    w = _stack(wg, wu, torch.bfloat16)
    assert torch.equal(w, torch.cat([wg, wu], 1).to(torch.bfloat16))
    dg, du = _unstack(w, (torch.float32, torch.float32))
    assert torch.equal(dg, wg.to(torch.bfloat16).float()) and torch.equal(du, wu.to(torch.bfloat16).float())
    # same dtype, both sides strided
    src, dst = torch.randn(7, 300), torch.zeros(7, 700)
    ck.copy_rows(src[:, 50:250], dst[:, 100:300])
    assert torch.equal(dst[:, 100:300], src[:, 50:250]) and dst[:, :100].abs().max() == 0
    assert dst[:, 300:].abs().max() == 0
    # the SwiGLU backward of the halves of one product: the gradients are the halves of one new tensor
    y = torch.randn(9, 64, dtype=torch.bfloat16)
    gate, up = y.chunk(2, dim=-1)
    dh = torch.randn(9, 32, dtype=torch.bfloat16)
    d_gate, d_up = sk.swiglu_backward(dh, gate, up, joint=True)
    assert sk.adjacent_halves(d_gate, d_up) and d_gate.data_ptr() != gate.data_ptr()
    separate = sk.swiglu_backward(dh, gate, up)  # as the other callers take them: a tensor each
    assert separate[0].is_contiguous() and separate[1].is_contiguous()
    assert torch.equal(separate[0], d_gate) and torch.equal(separate[1], d_up)
    print("copy kernels ok")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_copy_matches_torch_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
           "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "copy kernels ok" in r.stdout


def test_rows_view():
    t = torch.zeros(4, 6, 10)
    assert rows_view(t) == (24, 10)
    assert rows_view(torch.zeros(3, 20)[:, :10]) == (3, 20)
    assert rows_view(torch.zeros(1, 5)) == (1, 5)
    assert rows_view(t.transpose(0, 1)) is None  # leading dims that do not collapse
    assert rows_view(t.transpose(1, 2)) is None  # last stride not 1


def test_copy_rows_without_the_kernel_is_copy(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    src = torch.randn(3, 8)
    dst = torch.empty(3, 8, dtype=torch.bfloat16)
    assert torch.equal(copy_rows(src, dst), src.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"src \(3, 8\) and dst \(3, 4\) differ in shape"):
        copy_rows(src, torch.empty(3, 4))
