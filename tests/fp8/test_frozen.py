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


def test_frozen_copy_stores_the_fp8_layers_in_fp8_and_computes_as_the_fresh_model():
    from megadlms.build import build_model
    from megadlms.config import TransformerConfig
    from megadlms.fp8 import Float8Linear
    from megadlms.fp8.frozen import frozen_copy

    torch.manual_seed(0)
    model = build_model(TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                          ffn_hidden_size=128, vocab_size=40, seq_length=16, fp8=True))
    copy = frozen_copy(model)
    attn = copy.layers[0].self_attn
    assert model.layers[0].self_attn.qkv_fusion is not None and attn.qkv_fusion is None  # members one by one
    assert not any(isinstance(m, Float8Linear) for m in copy.modules())
    # q/k/v share the fused group's weight scale: the largest amax of the three
    w = model.layers[0].self_attn
    amax = max(m.weight.abs().max() for m in (w.q_proj, w.k_proj, w.v_proj))
    assert all(m.weight_scale_inv.item() == pytest.approx(amax.item() / 448, rel=1e-6)
               for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert not copy.training and not any(p.requires_grad for p in copy.parameters())
    ids = torch.randint(0, 40, (2, 16))
    with torch.no_grad():
        assert torch.equal(copy(ids), model(ids))
