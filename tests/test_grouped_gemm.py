import pytest
import torch

from megadlms.grouped_gemm import _joined, backend, gmm, gmm_wgrad, grouped_gate_up, grouped_linear

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


@pytest.mark.parametrize("impl", ["loop", "grouped_mm"])
def test_grouped_gate_up_is_the_two_projections(impl):
    """gate and up as one product against the stacked weights: the outputs and every gradient of two
    `grouped_linear`s (whose dgrads autograd sums), also where only one half is used."""
    if impl == "grouped_mm" and backend(torch.device("cpu"), torch.float32) != "grouped_mm":
        pytest.skip("this torch has no CPU _grouped_mm")
    torch.manual_seed(0)
    offs = _offs(SIZES)
    x = torch.randn(32, 16)
    wg, wu = torch.randn(4, 24, 16), torch.randn(4, 24, 16)
    dg, du = torch.randn(32, 24), torch.randn(32, 24)
    for use_up in (True, False):
        leaves = [t.clone().requires_grad_() for t in (x, wg, wu)]
        refs = [t.clone().requires_grad_() for t in (x, wg, wu)]
        gate, up = grouped_gate_up(*leaves, offs, impl)
        rgate, rup = grouped_linear(refs[0], refs[1], offs, impl), grouped_linear(refs[0], refs[2], offs, impl)
        torch.testing.assert_close(gate, rgate, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(up, rup, rtol=1e-5, atol=1e-5)
        ((gate * dg).sum() + (up * du).sum() * use_up).backward()
        ((rgate * dg).sum() + (rup * du).sum() * use_up).backward()
        for got, want in zip(leaves, refs):
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-5)
        assert leaves[1].grad.is_contiguous() and leaves[2].grad.is_contiguous()


def test_gradients_in_the_weights_dtype():
    """fp32 weights under BF16 autocast: BF16 outputs, fp32 weight gradients equal to the BF16 products' (the
    weights' casts in and out are exact on the way back), from both `grouped_gate_up` and `grouped_linear`."""
    torch.manual_seed(0)
    offs = _offs(SIZES)
    x = torch.randn(32, 16, requires_grad=True)
    wg, wu, wd = (torch.randn(4, 8, 16, requires_grad=True) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gate, up = grouped_gate_up(x, wg, wu, offs)
        down = grouped_linear(x, wd, offs)
    assert gate.dtype == up.dtype == down.dtype == torch.bfloat16
    torch.testing.assert_close(up.float(), _dense(x, wu, SIZES), atol=0.1, rtol=0.05)
    g = torch.randn(32, 8).to(torch.bfloat16)
    ((gate.float() + up.float() + down.float()) * g.float()).sum().backward()
    assert wg.grad.dtype == wu.grad.dtype == wd.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    xb = x.detach().to(torch.bfloat16)
    for w in (wg, wu, wd):
        assert torch.equal(w.grad, gmm_wgrad(g.t(), xb, offs).float())


def test_joined_takes_adjacent_halves_whole():
    both = torch.randn(5, 8)
    joined = _joined(both[:, :4], both[:, 4:], both[:, :4])
    assert joined.data_ptr() == both.data_ptr() and torch.equal(joined, both)  # no copy
    a, b = torch.randn(5, 4), torch.randn(5, 4)
    torch.testing.assert_close(_joined(a, b, a), torch.cat([a, b], 1))
    torch.testing.assert_close(_joined(None, b, b), torch.cat([torch.zeros(5, 4), b], 1))
