"""Likelihood estimators against direct references: LLaDA's Monte-Carlo estimator, exact AR log-likelihood."""

import math

import pytest
import torch
import torch.nn.functional as F

from megadlms.config import ConfigError, TransformerConfig
from megadlms.eval import likelihood as lk
from megadlms.model import TransformerLM

MASK = 257


def tiny(causal=False):
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=64, vocab_size=260, seq_length=64, init_method_std=0.3,
                            mask_token_id=MASK, attn_mask_type="causal" if causal else "bidirectional")
    return TransformerLM(cfg).eval()


PAIRS = [([5, 9, 11, 3], [20, 21, 22, 23, 24]), ([7], [30, 31]), ([40, 41, 42, 43, 44, 45], [50])]


def llada_log_likelihood(model, prefix, target, *, mask_id, mc_num, batch, cfg=0.0):
    """LLaDA's get_log_likelihood (eval_llada.py) written out: the global RNG, `batch` draws per loop."""
    seq = torch.tensor(prefix + target)[None].repeat(batch, 1)
    is_prompt = torch.arange(seq.shape[1]) < len(prefix)
    length = len(target)
    losses = []
    for _ in range(mc_num // batch):
        k = torch.randint(1, length + 1, ())
        x = torch.round(torch.linspace(float(k), k + (batch - 1) * (length / batch), steps=batch)).long()
        x = ((x - 1) % length) + 1
        masked = torch.arange(length).repeat(batch, 1) < x[:, None]
        for i in range(batch):
            masked[i] = masked[i][torch.randperm(length)]
        masked = torch.cat([torch.zeros(batch, len(prefix), dtype=torch.bool), masked], dim=1)
        noisy = torch.where(masked, mask_id, seq)
        p_mask = (x / length)[:, None].repeat(1, seq.shape[1])
        inp = noisy
        if cfg > 0:
            un = noisy.clone()
            un[is_prompt[None].repeat(batch, 1)] = mask_id
            inp = torch.cat([noisy, un])
        logits = model(inp)
        if cfg > 0:
            cond, uncond = torch.chunk(logits, 2, dim=0)
            logits = uncond + (cfg + 1) * (cond - uncond)
        at = noisy == mask_id
        loss = F.cross_entropy(logits[at], seq[at], reduction="none") / p_mask[at]
        losses.append((loss.sum() / batch).item())
    return -sum(losses) / len(losses)


@pytest.mark.parametrize("cfg", [0.0, 1.5])
def test_mc_estimator_equals_llada_given_the_same_draws(cfg):
    model = tiny()
    mc_num = 8
    ours = lk.mc_loglikelihood(model, PAIRS, mask_id=MASK, mc_num=mc_num, seed=7, cfg=cfg, batch_size=5)
    for (prefix, target), got in zip(PAIRS, ours):
        gen_seed = lk.request_generator(7, prefix, target).initial_seed()
        torch.manual_seed(gen_seed)  # the global RNG now draws what the request's generator drew
        ref = llada_log_likelihood(model, prefix, target, mask_id=MASK, mc_num=mc_num, batch=mc_num, cfg=cfg)
        assert got == pytest.approx(ref, rel=1e-5, abs=1e-5)


def test_mc_draws_are_stratified_and_seeded():
    g = torch.Generator().manual_seed(3)
    masked, counts = lk.stratified_masks(10, 5, g)
    assert masked.sum(1).tolist() == counts.tolist()
    steps = sorted(counts.tolist())
    assert [b - a for a, b in zip(steps, steps[1:])] == [2, 2, 2, 2]  # L / num apart, wrapped into 1..L
    model = tiny()
    a = lk.mc_loglikelihood(model, PAIRS, mask_id=MASK, mc_num=4, seed=1, batch_size=3)
    b = lk.mc_loglikelihood(model, PAIRS[::-1], mask_id=MASK, mc_num=4, seed=1, batch_size=7)[::-1]
    c = lk.mc_loglikelihood(model, PAIRS, mask_id=MASK, mc_num=4, seed=2, batch_size=3)
    assert a == pytest.approx(b, rel=1e-5)  # independent of batching and order
    assert a != pytest.approx(c, rel=1e-6)


def test_single_token_target_mc_is_exact_conditional():
    model = tiny()
    prefix, target = PAIRS[2]
    got = lk.mc_loglikelihood(model, [(prefix, target)], mask_id=MASK, mc_num=1)[0]
    logp = torch.log_softmax(model(torch.tensor([prefix + [MASK]]))[0, -1], -1)[target[0]].item()
    assert got == pytest.approx(logp, rel=1e-5)


def test_ar_path_is_exact_log_likelihood():
    model = tiny(causal=True)
    got = lk.ar_loglikelihood(model, PAIRS, batch_size=2)
    for (prefix, target), (lp, greedy) in zip(PAIRS, got):
        seq = torch.tensor(prefix + target)
        total, all_argmax = 0.0, True
        for i in range(len(prefix), len(seq)):  # one forward per token: the chain rule
            logits = model(seq[None, :i])[0, -1]
            total += torch.log_softmax(logits, -1)[seq[i]].item()
            all_argmax &= int(logits.argmax()) == int(seq[i])
        assert lp == pytest.approx(total, rel=1e-5) and greedy == all_argmax


def test_elbo_grid_is_deterministic_and_bounds_ar_free_quantities():
    model = tiny()
    a = lk.elbo_nll(model, PAIRS, mask_id=MASK, seed=0, batch_size=4)
    b = lk.elbo_nll(model, PAIRS, mask_id=MASK, seed=0, batch_size=30)
    assert a.shape == (3, 10) and torch.allclose(a, b, rtol=1e-6)
    # ratio 1.0 masks the whole target: its entry is the sum of CE with everything masked
    prefix, target = PAIRS[0]
    logits = model(torch.tensor([prefix + [MASK] * len(target)]))[0, len(prefix):]
    assert a[0, -1].item() == pytest.approx(F.cross_entropy(logits, torch.tensor(target), reduction="sum").item(),
                                            rel=1e-5)
    assert all(math.isfinite(v) for v in a.flatten().tolist())


def test_greedy_checks():
    model = tiny()
    prefix = [5, 9, 11]
    # the model's own greedy decode of 3 tokens is, by construction, greedy
    x = torch.tensor([prefix + [MASK] * 3])
    for _ in range(3):
        logits = model(x)[0]
        x0 = logits.argmax(-1)
        conf = torch.softmax(logits, -1).gather(-1, x0[:, None]).squeeze(-1)
        conf[x[0] != MASK] = -1
        i = int(conf.argmax())
        x[0, i] = x0[i]
    decoded = x[0, 3:].tolist()
    other = [(decoded[0] + 1) % 256] + decoded[1:]
    assert lk.greedy_decodes_target(model, [(prefix, decoded), (prefix, other), ([7], [1, 2])], mask_id=MASK,
                                    batch_size=2) == [True, False, False]
    single = model(torch.tensor([prefix + [MASK]]))[0, -1].argmax().item()
    assert lk.tokens_are_argmax(model, [(prefix, [single]), (prefix, [(single + 1) % 256])], mask_id=MASK) == [
        True, False]


def test_bad_inputs_are_one_line_errors():
    model = tiny()
    with pytest.raises(ConfigError, match="mc_num=0 must be a positive integer"):
        lk.mc_loglikelihood(model, PAIRS, mask_id=MASK, mc_num=0)
    with pytest.raises(ConfigError, match="exceeds the model's max_position_embeddings=64"):
        lk.mc_loglikelihood(model, [([1] * 60, [2] * 10)], mask_id=MASK, mc_num=1)
    with pytest.raises(ConfigError, match="empty continuation"):
        lk.elbo_nll(model, [([1], [])], mask_id=MASK)
    with pytest.raises(ConfigError, match="must be in"):
        lk.elbo_nll(model, PAIRS, mask_id=MASK, ratios=[0.0, 0.5])


class _Shifted(torch.nn.Module):
    """A difflm-shift view of a model: position i gives the logits that score token i + 1 (Dream's alignment)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.config = TransformerConfig(**{**inner.config.to_dict(), "diffusion_shift": True})

    def forward(self, ids, attention_mask=None):
        logits = self.inner(ids, attention_mask=attention_mask)
        return torch.cat([logits[:, 1:], logits[:, -1:]], dim=1)


def test_shifted_models_are_scored_at_the_position_before_each_token():
    model = tiny()
    shifted = _Shifted(model)
    torch.testing.assert_close(lk.elbo_nll(shifted, PAIRS, mask_id=MASK, seed=0),
                               lk.elbo_nll(model, PAIRS, mask_id=MASK, seed=0))
    assert lk.tokens_are_argmax(shifted, PAIRS, mask_id=MASK) == lk.tokens_are_argmax(model, PAIRS, mask_id=MASK)
    assert (lk.greedy_decodes_target(shifted, PAIRS, mask_id=MASK)
            == lk.greedy_decodes_target(model, PAIRS, mask_id=MASK))
    with pytest.raises(ConfigError, match="prompt"):
        lk.elbo_nll(shifted, [([], [20, 21])], mask_id=MASK)
