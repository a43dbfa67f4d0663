import pytest
import torch

from megadlms.grouped_gemm import backend, gmm, gmm_wgrad, grouped_linear

# group sizes with an empty expert and sizes that are not multiples of 16
SIZES = [5, 0, 17, 10]


def _offs(sizes):
    return torch.tensor(sizes).cumsum(0).to(torch.int32)


def _dense(x, w, sizes):
    """The reference: one matmul per row group."""
    return torch.cat([xs @ w[e].t() for e, xs in enumerate(x.split(sizes))])


def test_cpu_backend_is_probed():
    # torch >= 2.9 ships a CPU _grouped_mm; older builds fall back to the loop
    expected = "grouped_mm" if hasattr(torch, "_grouped_mm") else "loop"
    assert backend(torch.device("cpu"), torch.float32) == expected


@pytest.mark.parametrize("impl", ["loop", "grouped_mm"])
def test_gmm_and_wgrad_match_per_group_matmuls(impl):
    if impl == "grouped_mm" and backend(torch.device("cpu"), torch.float32) != "grouped_mm":
        pytest.skip("this torch has no CPU _grouped_mm")
    torch.manual_seed(0)
    x, w, g = torch.randn(32, 16), torch.randn(4, 24, 16), torch.randn(32, 24)
    offs = _offs(SIZES)
    torch.testing.assert_close(gmm(x, w.transpose(-2, -1), offs, impl), _dense(x, w, SIZES))
    dw = gmm_wgrad(g.t(), x, offs, impl)
    for e, (gs, xs) in enumerate(zip(g.split(SIZES), x.split(SIZES))):
        torch.testing.assert_close(dw[e], gs.t() @ xs)
    assert dw[1].abs().max() == 0  # the expert without rows


@pytest.mark.parametrize("impl", ["loop", "grouped_mm"])
def test_grouped_linear_gradients(impl):
    if impl == "grouped_mm" and backend(torch.device("cpu"), torch.float32) != "grouped_mm":
        pytest.skip("this torch has no CPU _grouped_mm")
    torch.manual_seed(0)
    x = torch.randn(32, 16, requires_grad=True)
    w = torch.randn(4, 24, 16, requires_grad=True)
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    g = torch.randn(32, 24)
    y = grouped_linear(x, w, _offs(SIZES), impl)
    y.backward(g)
    _dense(xr, wr, SIZES).backward(g)
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(w.grad, wr.grad)


def test_grouped_linear_under_autocast_runs_in_bf16():
    x, w = torch.randn(32, 16), torch.randn(4, 8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = grouped_linear(x, w, _offs(SIZES))
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), _dense(x, w, SIZES), atol=0.1, rtol=0.05)
