"""benchmarks/moe_block.py's bookkeeping: what its kernel breakdown counts as device work, and backward passes
that write fresh gradients (as a training step does) rather than accumulate into the previous call's."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import moe_block
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return moe_block


def _event(name: str, device: str = "CUDA", annotation: bool = False) -> SimpleNamespace:
    return SimpleNamespace(name=name, device_type=SimpleNamespace(name=device), is_user_annotation=annotation)


def test_device_time_counts_kernels_not_the_phase_spans():
    bench = _bench()
    assert bench._device_work(_event("moe_gather_rows_kernel"))
    assert bench._device_work(_event("Memset (Device)"))
    assert not bench._device_work(_event("moe/experts", annotation=True))  # a record_function's span on the GPU
    assert not bench._device_work(_event("moe/router"))  # the same, from a torch that does not flag annotations
    assert not bench._device_work(_event("aten::mm", device="CPU"))


def test_backward_fresh_writes_the_gradients_of_one_backward():
    bench = _bench()
    w = torch.randn(3, 4, requires_grad=True)
    x = torch.randn(5, 3, requires_grad=True)
    y = x @ w
    g = torch.randn(5, 4)
    for _ in range(3):
        bench.backward_fresh(y, g, [x, w], retain_graph=True)
    torch.testing.assert_close(w.grad, x.detach().t() @ g)
    torch.testing.assert_close(x.grad, g @ w.detach().t())
