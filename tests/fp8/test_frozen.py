"""FrozenFP8Linear: the FP8 GEMMs of a frozen weight equal the same products computed from the dequantized
operands, only the input gets a gradient, and the weight is stored in one byte per element."""

import pytest
import torch
from torch import nn

from megadlms.fp8.frozen import FrozenFP8Linear
from megadlms.fp8.kernels.primitives import quantize_tensorwise
from megadlms.fp8.recipe import E4M3, E5M2


def _ref(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    q, si, _ = quantize_tensorwise(t, dtype)
    return q.float() * si


@pytest.mark.parametrize("bias", [False, True])
def test_forward_and_input_gradient_are_fp8_products(bias):
    torch.manual_seed(0)
    lin = nn.Linear(48, 32, bias=bias)
    frozen = FrozenFP8Linear.from_linear(lin, grad_dtype=E5M2)
    assert frozen.weight_fp8.dtype == E4M3 and frozen.weight_fp8.shape == (32, 48)
    assert list(frozen.parameters()) == [] and frozen.state_dict() == {}  # nothing trainable, nothing persistent
    w = _ref(lin.weight.detach(), E4M3)
    torch.testing.assert_close(frozen.dequantized_weight(), w, rtol=0, atol=0)
    x = torch.randn(3, 7, 48, requires_grad=True)  # 21 tokens: padded inside
    y = frozen(x)
    expect = _ref(x.detach().reshape(-1, 48), E4M3) @ w.t() + (lin.bias.detach() if bias else 0)
    torch.testing.assert_close(y.reshape(-1, 32), expect, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    torch.testing.assert_close(x.grad.reshape(-1, 48), _ref(g.reshape(-1, 32), E5M2) @ w, rtol=1e-5, atol=1e-5)
    # and close to the high-precision linear (FP8's relative error)
    ref = lin(x.detach())
    assert (y - ref).norm() / ref.norm() < 0.08


def test_keeps_fp8_dtypes_when_the_model_is_cast_and_bf16_under_autocast():
    frozen = FrozenFP8Linear.from_linear(nn.Linear(32, 16, bias=False))
    frozen.to(torch.bfloat16)
    assert frozen.weight_fp8.dtype == E4M3 and frozen.weight_scale_inv.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert frozen(torch.randn(4, 32)).dtype == torch.bfloat16


def test_rejects_a_wrong_input_width():
    frozen = FrozenFP8Linear.from_linear(nn.Linear(32, 16))
    with pytest.raises(ValueError, match=r"expects input \[\.\.\., 32\]"):
        frozen(torch.randn(2, 16))
