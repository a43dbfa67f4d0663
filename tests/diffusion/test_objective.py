import math

import pytest
import torch
import torch.nn.functional as F

from megadlms.attention_masks import build_attention_mask, document_mask_mod, segment_positions
from megadlms.diffusion.objective import (
    MaskSampler,
    ObjectiveConfig,
    chunked_weighted_cross_entropy,
    mask_tokens,
    prepare_batch,
    prepare_sft_batch,
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


@pytest.mark.parametrize("mask_id", [None, MASK])
def test_chunked_head_loss_equals_plain(mask_id):
    torch.manual_seed(0)
    h = torch.randn(2, 13, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, 16, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 40, (2, 13))
    y[y == MASK] = 0  # a target is never [MASK]
    wt = torch.rand(2, 13, dtype=torch.float64)
    wt[0, :4] = 0.0  # unscored positions: the chunked path skips them
    ref = weighted_cross_entropy(h @ w.T, y, wt, mask_id=mask_id)
    got = chunked_weighted_cross_entropy(h, w, y, wt, chunk_tokens=5, mask_id=mask_id)
    torch.testing.assert_close(got.double(), ref.double())
    gh, gw = torch.autograd.grad(ref, (h, w))
    ch, cw = torch.autograd.grad(got, (h, w))
    torch.testing.assert_close(ch, gh)
    torch.testing.assert_close(cw, gw)
    with torch.no_grad():  # the forward-only path (validation)
        torch.testing.assert_close(chunked_weighted_cross_entropy(h, w, y, wt, 5, mask_id=mask_id).double(), ref)
    if mask_id is not None:  # SUBS: the [MASK] logit is a constant -inf, its head row gets no gradient
        assert torch.equal(cw[MASK], torch.zeros(16, dtype=torch.float64))


def test_subs_loss_is_the_cross_entropy_without_the_mask_token():
    """Hand values: logits (1, 2, 0, 5) with [MASK] = 3, target 1, weight 2, one of two positions scored.
    SUBS: -log(e^2 / (e^1 + e^2 + e^0)); full vocabulary: -log(e^2 / (e^1 + e^2 + e^0 + e^5))."""
    logits = torch.tensor([[[1.0, 2.0, 0.0, 5.0], [0.0, 0.0, 0.0, 9.0]]])
    targets, weights = torch.tensor([[1, 3]]), torch.tensor([[2.0, 0.0]])  # the unscored target is [MASK] itself
    subs = 2.0 * -math.log(math.exp(2) / (math.exp(1) + math.exp(2) + 1.0)) / 2
    full = 2.0 * -math.log(math.exp(2) / (math.exp(1) + math.exp(2) + 1.0 + math.exp(5))) / 2
    assert weighted_cross_entropy(logits, targets, weights, mask_id=3).item() == pytest.approx(subs, rel=1e-6)
    assert weighted_cross_entropy(logits, targets, weights).item() == pytest.approx(full, rel=1e-6)
    fused = chunked_weighted_cross_entropy(logits, torch.eye(4), targets, weights, 1, mask_id=3)  # head = identity
    assert fused.item() == pytest.approx(subs, rel=1e-6)
    bf16 = weighted_cross_entropy(logits.bfloat16(), targets, weights, mask_id=3)  # bf16 logits, fp32 loss
    assert bf16.dtype == torch.float32 and bf16.item() == pytest.approx(subs, rel=1e-6)


def test_the_loss_is_subs_by_default_for_every_diffusion_mode():
    for mode in ("difflm-noshift", "difflm-shift", "bd3lm"):
        assert ObjectiveConfig(mode=mode, mask_token_id=MASK).subs_mask_id == MASK
        assert ObjectiveConfig(mode=mode, mask_token_id=MASK, loss="full-vocab").subs_mask_id is None
    assert ObjectiveConfig(mode="vanilla", mask_token_id=MASK).subs_mask_id is None  # AR: the whole vocabulary


@pytest.mark.parametrize("kw, msg", [(dict(mode="ar"), "model-running-mode"), (dict(pmask="x"), "difflm-pmask"),
                                     (dict(eps=0.0), "difflm-eps"), (dict(varilen_prob=2.0), "varilen"),
                                     (dict(loss="llada"), "--diffusion-loss 'llada' is not one of"),
                                     (dict(mode="difflm-shift", ignore_bos=True), "never masks the first token")])
def test_objective_config_errors(kw, msg):
    with pytest.raises(ValueError, match=msg):
        ObjectiveConfig(**kw)


# --------------------------------------------------------------------------- supervised fine-tuning



def _window(convs, length, pad_eos=False, eod=0):
    """Pack [(tokens, loss_mask)] into one [3, length+1] window (megadlms.data.sft's layout)."""
    w = torch.zeros(3, length + 1, dtype=torch.long)
    w[0] = eod
    pos = 0
    for s, (tok, lm) in enumerate(convs, 1):
        n = len(tok)
        w[0, pos:pos + n], w[1, pos:pos + n], w[2, pos:pos + n] = torch.tensor(tok), torch.tensor(lm), s
        pos += n
    if pad_eos:
        w[1, pos:length], w[2, pos:length] = 1, len(convs)
    return w


@pytest.mark.parametrize("mode", ["difflm-noshift", "difflm-shift", "vanilla"])
def test_sft_prompt_tokens_never_masked_nor_weighted(mode):
    g = torch.Generator().manual_seed(0)
    convs = [([3 + i for i in range(9)], [0] * 5 + [1] * 4), ([20 + i for i in range(6)], [0, 0, 1, 1, 1, 1])]
    sample = torch.stack([_window(convs, 16), _window(convs[::-1], 16)])
    t = torch.full((2, 16), 0.999)  # p ~ 1: every maskable token is masked
    u = torch.rand(2, 16, generator=g)
    b = prepare_sft_batch(sample, (t, u), ObjectiveConfig(mode=mode, mask_token_id=99))
    tokens, lm = sample[:, 0, :16], sample[:, 1, :16].bool()
    assert torch.equal(b.inputs[~lm], tokens[~lm])  # prompts and pads as they are
    if mode != "vanilla":
        assert torch.equal(b.inputs[lm], torch.full_like(tokens[lm], 99))
    target_is_response = sample[:, 1, 1:].bool() if mode != "difflm-noshift" else lm
    assert (b.weights[~target_is_response] == 0).all() and (b.weights[target_is_response] > 0).all()
    assert int(b.conversations) == 4


def test_sft_loss_equals_llada_formula():
    # LLaDA GUIDELINES.md, transcribed: one conversation per row padded with EOS; the pads count as answer
    torch.manual_seed(0)
    eps, mask_id, vocab, length = 1e-3, 31, 32, 12
    rows = [([5, 6, 7, 8, 9, 10, 11], 3), ([12, 13, 14, 15, 16], 2)]  # (tokens, prompt length)
    input_ids = torch.zeros(2, length, dtype=torch.long)
    prompt_index = torch.zeros(2, length, dtype=torch.bool)
    for r, (tok, plen) in enumerate(rows):
        input_ids[r, :len(tok)] = torch.tensor(tok)
        prompt_index[r, :plen] = True
    t, u = torch.rand(2, 1), torch.rand(2, length)
    logits = torch.randn(2, length, vocab)
    p_mask = ((1 - eps) * t + eps).expand(2, length)
    noisy = torch.where(u < p_mask, mask_id, input_ids)
    noisy[prompt_index] = input_ids[prompt_index]
    answer_lengths = (~prompt_index).long().sum(-1, keepdim=True).repeat(1, length)
    masked = noisy == mask_id
    token_loss = F.cross_entropy(logits[masked], input_ids[masked], reduction="none") / p_mask[masked]
    llada = torch.sum(token_loss / answer_lengths[masked]) / input_ids.shape[0]

    sample = torch.stack([_window([(tok, [0] * plen + [1] * (len(tok) - plen))], length, pad_eos=True)
                          for tok, plen in rows])
    b = prepare_sft_batch(sample, (t.expand(2, length), u), ObjectiveConfig(mask_token_id=mask_id, eps=eps))
    assert torch.equal(b.inputs, noisy)
    ours = weighted_cross_entropy(logits, b.targets, b.weights, b.conversations)
    torch.testing.assert_close(ours, llada, rtol=1e-6, atol=0)


@pytest.mark.parametrize("mode", ["difflm-noshift", "difflm-shift", "vanilla"])
def test_packing_changes_no_token_loss(mode):
    from megadlms.config import TransformerConfig
    from megadlms.model import TransformerLM

    torch.manual_seed(0)
    length, vocab = 16, 40
    model = TransformerLM(TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=vocab,
                                            seq_length=length, attn_mask_type="causal" if mode == "vanilla"
                                            else "bidirectional")).eval()
    cfg = ObjectiveConfig(mode=mode, mask_token_id=39, eps=0.3)
    a = ([1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 1, 1, 1, 1])
    b = ([8, 9, 10, 11, 12, 13], [0, 0, 1, 1, 1, 1])
    g = torch.Generator().manual_seed(1)
    ta, tb = 0.5, 0.8
    ua, ub = torch.rand(7, generator=g), torch.rand(6, generator=g)

    def token_losses(convs, t_vals, u_vals):
        sample = _window(convs, length)[None]
        t = torch.zeros(1, length)
        u = torch.ones(1, length)
        pos = 0
        for (tok, _), tv, uv in zip(convs, t_vals, u_vals):
            t[0, pos], u[0, pos:pos + len(tok)] = tv, uv
            pos += len(tok)
        batch = prepare_sft_batch(sample, (t, u), cfg)
        seg = batch.segment_ids
        mask = build_attention_mask(document_mask_mod(seg, causal=mode == "vanilla"), 1, length, length, "cpu")
        with torch.no_grad():
            logits = model(batch.inputs, attention_mask=mask, position_ids=segment_positions(seg))
        ce = F.cross_entropy(logits[0], batch.targets[0], reduction="none")
        return ce * batch.weights[0], batch.conversations

    packed, n = token_losses([a, b], [ta, tb], [ua, ub])
    alone_a, _ = token_losses([a], [ta], [ua])
    alone_b, _ = token_losses([b], [tb], [ub])
    assert int(n) == 2 and packed.sum() > 0
    torch.testing.assert_close(packed[:7], alone_a[:7], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[7:13], alone_b[:6], atol=1e-5, rtol=1e-5)


def test_shifted_diffusion_predicts_the_next_token():
    g = torch.Generator().manual_seed(0)
    sample = torch.randint(10, 100, (3, 9), generator=g)
    t, u = torch.full((3, 1), 0.6), torch.rand(3, 8, generator=g)
    noisy, targets, weights = prepare_batch(sample, (t, u), None, ObjectiveConfig(mode="difflm-shift",
                                                                                  mask_token_id=MASK))
    assert torch.equal(targets, sample[:, 1:]) and (noisy[:, 0] == sample[:, 0]).all()  # position 0 never masked
    masked = noisy == MASK
    # the weight of a masked token sits on the position before it; the last position predicts nothing masked
    assert torch.equal(weights[:, :-1] > 0, masked[:, 1:]) and (weights[:, -1] == 0).all()


def test_mask_tokens_without_a_mask_id_names_the_field_and_the_fix():
    from megadlms import build_model, preset_config
    from megadlms.errors import MegaDLMsError

    cfg = preset_config("tiny").replace(vocab_size=64, seq_length=16)
    assert cfg.mask_token_id is None  # the README snippet's path: a preset that records no [MASK] id
    tokens = torch.randint(0, 64, (2, 16))
    with pytest.raises(MegaDLMsError, match=r"mask_token_id is None .*cfg\.replace\(mask_token_id=") as e:
        mask_tokens(tokens, torch.rand(2, 1), torch.rand(2, 16), mask_token_id=cfg.mask_token_id)
    assert "\n" not in str(e.value)
    cfg = cfg.replace(mask_token_id=3)  # the fix the message gives
    noisy, _ = mask_tokens(tokens, torch.ones(2, 1), torch.rand(2, 16), mask_token_id=cfg.mask_token_id)
    assert build_model(cfg)(noisy).shape == (2, 16, 64)
    assert (noisy == 3).all()
