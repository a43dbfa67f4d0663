import math

import pytest
import torch

from megadlms.diffusion.objective import (
    MaskSampler,
    ObjectiveConfig,
    chunked_weighted_cross_entropy,
    mask_tokens,
    prepare_batch,
    weighted_cross_entropy,
)

MASK = 7


def test_mask_rate_matches_p_and_every_row_has_a_mask():
    g = torch.Generator().manual_seed(0)
    B, L = 64, 2048
    tokens = torch.randint(10, 100, (B, L), generator=g)
    t = torch.rand(B, 1, generator=g)
    u = torch.rand(B, L, generator=g)
    noisy, w = mask_tokens(tokens, t, u, mask_token_id=MASK, eps=1e-3)
    masked = noisy == MASK
    p = (1 - 1e-3) * t + 1e-3
    rate = masked.float().mean(1, keepdim=True)
    assert (rate - p).abs().max() < 0.05  # binomial std at L=2048 is < 0.012
    assert masked.any(dim=1).all()
    assert torch.equal(noisy[~masked], tokens[~masked])
    torch.testing.assert_close(w, masked.float() / p)
    # tiny t: still one mask per row
    noisy, w = mask_tokens(tokens, torch.zeros(B, 1), u, mask_token_id=MASK, eps=1e-3)
    assert ((noisy == MASK).sum(1) >= 1).all()


def test_actual_pmask_uses_the_masked_fraction():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(10, 100, (4, 100), generator=g)
    noisy, w = mask_tokens(tokens, torch.rand(4, 1, generator=g), torch.rand(4, 100, generator=g),
                           mask_token_id=MASK, pmask="actual")
    masked = noisy == MASK
    frac = masked.float().mean(1, keepdim=True)
    torch.testing.assert_close(w, masked.float() / frac)
    # each row's weights sum to L: the unbiased 1/p weighting with the actual p
    torch.testing.assert_close(w.sum(1), torch.full((4,), 100.0))


def test_sampler_is_reproducible_and_checkpointable():
    a, b = MaskSampler(3), MaskSampler(3)
    n1 = a.draw(4, 16, 2, 0.5)
    state = a.state_dict()
    n2 = a.draw(4, 16, 2, 0.5)
    assert torch.equal(n1.u, b.draw(4, 16, 2, 0.5).u)
    c = MaskSampler(99)
    c.load_state_dict(state)
    n3 = c.draw(4, 16, 2, 0.5)
    assert torch.equal(n2.u, n3.u) and torch.equal(n2.t, n3.t) and torch.equal(n2.lengths, n3.lengths)


def test_varilen_lengths_follow_probability():
    noise = MaskSampler(0).draw(1, 64, 20000, 0.01)
    short = (noise.lengths < 64).float().mean().item()
    assert 0.006 < short < 0.014
    assert noise.lengths.min() >= 2


def test_uniform_predictor_loss_is_log_v_in_expectation():
    """Uniform logits: CE = log V per masked token; E[sum masked/p] = L, so the loss is log V."""
    V, B, L = 50, 256, 64
    sampler = MaskSampler(0)
    cfg = ObjectiveConfig(mask_token_id=MASK)
    sample = torch.randint(0, V, (B, L + 1))
    noise = sampler.draw(B, L, 1, 0.0)
    inputs, targets, weights = prepare_batch(sample, (noise.t, noise.u), L, cfg)
    loss = weighted_cross_entropy(torch.zeros(B, L, V), targets, weights)
    assert abs(loss.item() - math.log(V)) < 0.1 * math.log(V)


def test_ar_mode_shifts_labels():
    cfg = ObjectiveConfig(mode="vanilla")
    sample = torch.arange(10).view(1, 10)
    inputs, targets, weights = prepare_batch(sample, None, None, cfg)
    assert torch.equal(inputs, torch.arange(9).view(1, 9)) and torch.equal(targets, torch.arange(1, 10).view(1, 9))
    assert torch.equal(weights, torch.ones(1, 9))


def test_chunked_head_loss_equals_plain():
    torch.manual_seed(0)
    h = torch.randn(2, 13, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, 16, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 40, (2, 13))
    wt = torch.rand(2, 13, dtype=torch.float64)
    ref = weighted_cross_entropy(h @ w.T, y, wt)
    got = chunked_weighted_cross_entropy(h, w, y, wt, chunk_tokens=5)
    torch.testing.assert_close(got.double(), ref.double())
    gh, gw = torch.autograd.grad(ref, (h, w))
    ch, cw = torch.autograd.grad(got, (h, w))
    torch.testing.assert_close(ch, gh)
    torch.testing.assert_close(cw, gw)


@pytest.mark.parametrize("kw, msg", [(dict(mode="ar"), "model-running-mode"), (dict(pmask="x"), "difflm-pmask"),
                                     (dict(eps=0.0), "difflm-eps"), (dict(varilen_prob=2.0), "varilen")])
def test_objective_config_errors(kw, msg):
    with pytest.raises(ValueError, match=msg):
        ObjectiveConfig(**kw)
