"""The fast paths compute the same function as the plain ones (checked on the CPU).

- the fused, masked-rows-only LM head + loss == plain logits + weighted cross-entropy, value and
  gradients, for any chunking, weights with zeros, no weight at all, and under autocast;
- the one-pass FP8 cast (amax, scale, q and q^T) == `quantize` and a transpose, bit for bit.
"""

import pytest
import torch
import torch.nn.functional as F

from megadlms import TransformerConfig, build_model
from megadlms.diffusion.objective import _ce_loss_and_grad, chunked_weighted_cross_entropy, weighted_cross_entropy


def _case(seed, t=23, h=16, vocab=50, dtype=torch.float64, zero_share=0.5):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, t, h, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, h, generator=g, dtype=dtype, requires_grad=True)
    y = torch.randint(0, vocab, (2, t), generator=g)
    w = torch.rand(2, t, generator=g) * 3
    w = torch.where(torch.rand(2, t, generator=g) < zero_share, torch.zeros_like(w), w)
    return hidden, weight, y, w


@pytest.mark.parametrize("chunk", [1, 5, 8, 1000])
@pytest.mark.parametrize("zero_share", [0.0, 0.5, 0.95])
def test_fused_head_loss_equals_plain(chunk, zero_share):
    hidden, weight, y, w = _case(chunk, zero_share=zero_share)
    ref = weighted_cross_entropy(hidden @ weight.T, y, w)
    got = chunked_weighted_cross_entropy(hidden, weight, y, w, chunk_tokens=chunk)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref.float(), rtol=1e-6, atol=1e-6)
    gh, gw = torch.autograd.grad(ref, (hidden, weight))
    ch, cw = torch.autograd.grad(got, (hidden, weight))
    assert ch.dtype == hidden.dtype and cw.dtype == weight.dtype
    torch.testing.assert_close(ch, gh, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(cw, gw, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("zero_share", [0.0, 0.5, 1.0])
def test_fused_head_loss_with_a_known_row_count_is_the_same(zero_share):
    """num_rows (the weighted-token count the trainer copies to the host before the forward) selects the same rows
    without the device sync: bitwise the same loss and gradients."""
    hidden, weight, y, w = _case(3, zero_share=zero_share)
    ref = chunked_weighted_cross_entropy(hidden, weight, y, w, chunk_tokens=5)
    got = chunked_weighted_cross_entropy(hidden, weight, y, w, chunk_tokens=5, num_rows=int(torch.count_nonzero(w)))
    assert torch.equal(got, ref)
    for a, b in zip(torch.autograd.grad(got, (hidden, weight)), torch.autograd.grad(ref, (hidden, weight))):
        assert torch.equal(a, b)


def test_fused_head_loss_upstream_gradient_scales():
    hidden, weight, y, w = _case(7, dtype=torch.float32)
    ref = 3.5 * weighted_cross_entropy(hidden @ weight.T, y, w)
    got = 3.5 * chunked_weighted_cross_entropy(hidden, weight, y, w, chunk_tokens=4)
    for a, b in zip(torch.autograd.grad(got, (hidden, weight)), torch.autograd.grad(ref, (hidden, weight))):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_fused_head_loss_without_weights_and_without_grad():
    hidden, weight, y, _ = _case(1)
    zero = torch.zeros(2, hidden.shape[1])
    got = chunked_weighted_cross_entropy(hidden, weight, y, zero, chunk_tokens=4)
    assert got.item() == 0.0
    gh, gw = torch.autograd.grad(got, (hidden, weight))
    assert not gh.any() and not gw.any()
    hidden, weight, y, w = _case(2)
    with torch.no_grad():
        got = chunked_weighted_cross_entropy(hidden, weight, y, w, chunk_tokens=4)
        ref = weighted_cross_entropy(hidden @ weight.T, y, w)
    torch.testing.assert_close(got, ref.float(), rtol=1e-6, atol=1e-6)


def test_fused_head_loss_under_autocast_matches_plain_autocast():
    hidden, weight, y, w = _case(4, t=40, h=32, vocab=300, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = weighted_cross_entropy(F.linear(hidden, weight), y, w)
        got = chunked_weighted_cross_entropy(hidden, weight, y, w, chunk_tokens=16)
    torch.testing.assert_close(got, ref, rtol=2e-3, atol=2e-3)
    gh, gw = torch.autograd.grad(ref, (hidden, weight))
    ch, cw = torch.autograd.grad(got, (hidden, weight))
    assert ch.dtype == torch.float32 and cw.dtype == torch.float32
    assert (ch - gh).norm() / gh.norm() < 1e-2 and (cw - gw).norm() / gw.norm() < 1e-2


def test_ce_core_gradient_is_autograd_gradient():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(7, 31, generator=g, dtype=torch.float32, requires_grad=True)
    y = torch.randint(0, 31, (7,), generator=g)
    w = torch.rand(7, generator=g)
    loss, grad = _ce_loss_and_grad(logits.detach(), y, w)
    ref = (F.cross_entropy(logits, y, reduction="none") * w).sum()
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(grad, torch.autograd.grad(ref, logits)[0], rtol=1e-5, atol=1e-7)


def test_model_loss_through_the_fused_head_equals_plain():
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=64, vocab_size=101, seq_length=16, qk_layernorm=True)
    model = build_model(cfg).double()
    x = torch.randint(0, 101, (2, 16))
    w = (torch.rand(2, 16) < 0.5).double() * 2.0
    ref = weighted_cross_entropy(model(x), x, w)
    got = chunked_weighted_cross_entropy(model(x, output_hidden=True), model.output_weight, x, w, chunk_tokens=7)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    params = list(model.parameters())
    for a, b in zip(torch.autograd.grad(got, params), torch.autograd.grad(ref, params)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_one_pass_fp8_cast_equals_quantize(src_dtype, fp8_dtype):
    from megadlms.fp8.kernels.ops import cast_fp8, transpose_fp8
    from megadlms.fp8.kernels.primitives import FP8_MAX, amax_to_scale, quantize

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(48, 32, generator=g) * 5).to(src_dtype)
    amax = x.float().abs().amax()
    # current scaling, recording into a history slot
    hist = torch.zeros(2, 3)
    hist[0, 2] = amax * 2  # the slot keeps the larger value
    q, t, si, a = cast_fp8(x, None, hist[0, 1], fp8_dtype, margin=1, want_q=True, want_t=True)
    scale = amax_to_scale(amax, FP8_MAX[fp8_dtype], 1)
    ref = quantize(x, scale, fp8_dtype)
    assert torch.equal(q.view(torch.uint8), ref.view(torch.uint8))
    assert t.is_contiguous() and torch.equal(t.view(torch.uint8), ref.t().contiguous().view(torch.uint8))
    assert torch.equal(si, scale.reciprocal()) and torch.equal(a, amax) and hist[0, 1] == amax
    # a given (delayed) scale: only q^T asked for, the slot takes the max
    slot = hist[0, 2]
    q, t, si, _ = cast_fp8(x, torch.tensor(3.0), slot, fp8_dtype, want_q=False, want_t=True)
    assert q is None and torch.equal(t.view(torch.uint8),
                                     quantize(x, torch.tensor(3.0), fp8_dtype).t().contiguous().view(torch.uint8))
    assert torch.equal(si, torch.tensor(3.0).reciprocal()) and slot == amax * 2
    assert torch.equal(transpose_fp8(ref).view(torch.uint8), ref.t().contiguous().view(torch.uint8))
