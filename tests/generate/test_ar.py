"""Autoregressive decoding: the KV cache changes nothing, padding changes nothing, top-p semantics."""

import pytest
import torch

from megadlms.config import TransformerConfig
from megadlms.generate.ar import ar_generate, ar_generate_tokens, sample_next_token
from megadlms.model import TransformerLM


def causal_model(seed=0, std=0.3):
    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=64, vocab_size=53, seq_length=48, max_position_embeddings=48,
                            init_method_std=std, attn_mask_type="causal")
    return TransformerLM(cfg).eval()


PROMPTS = [[5, 9, 2], [7, 1, 4, 4, 8, 3, 2], [11]]


@pytest.mark.parametrize("temperature, top_p", [(0.0, 1.0), (1.0, 1.0), (0.8, 0.9)])
def test_cache_and_no_cache_give_the_same_tokens(temperature, top_p):
    model = causal_model()
    kw = dict(max_new_tokens=12, temperature=temperature, top_p=top_p)
    a = ar_generate(model, PROMPTS, generator=torch.Generator().manual_seed(3), **kw)
    b = ar_generate(model, PROMPTS, generator=torch.Generator().manual_seed(3), use_cache=False, **kw)
    assert a == b and all(len(r) == 12 for r in a)


def test_greedy_matches_a_plain_loop_and_padding_changes_nothing():
    model = causal_model(seed=1)
    out = ar_generate(model, PROMPTS, max_new_tokens=8)
    for prompt, got in zip(PROMPTS, out):
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(8):
                seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
        assert got == seq[len(prompt):]
    assert ar_generate(model, PROMPTS, max_new_tokens=8, pad_id=50) == out


def test_eos_stops_and_trims():
    model = causal_model(seed=2)
    full = ar_generate_tokens(model, torch.tensor([PROMPTS[1]]), max_new_tokens=10)[0, 7:].tolist()
    eos = full[3]
    cut = ar_generate(model, [PROMPTS[1]], max_new_tokens=10, eos_id=eos)
    assert cut[0] == full[:full.index(eos)]
    out = ar_generate_tokens(model, torch.tensor([PROMPTS[1]]), max_new_tokens=10, eos_id=eos)
    assert out.shape[1] == 7 + full.index(eos) + 1  # stopped right after the EOS


def test_sample_next_token_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_next_token(logits, temperature=1.0, top_p=0.7, generator=g) for _ in range(400)])
    assert set(draws.flatten().tolist()) == {0, 1}  # 0.5 + 0.3 reaches 0.7: tokens 2 and 3 are cut
    assert 0.5 < (draws == 0).float().mean() < 0.75  # renormalised: 0.5 / 0.8 = 0.625
    draws = torch.stack([sample_next_token(logits, temperature=1.0, top_p=0.4, generator=g) for _ in range(50)])
    assert set(draws.flatten().tolist()) == {0}
    assert sample_next_token(logits, temperature=0.0).tolist() == [0]


def test_bad_inputs():
    model = causal_model()
    with pytest.raises(ValueError, match=r"prompt length 7 \+ max_new_tokens 42 = 49 exceeds .*=48"):
        ar_generate(model, PROMPTS, max_new_tokens=42)
    with pytest.raises(ValueError, match="every prompt needs at least one token"):
        ar_generate(model, [[1, 2], []], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"top_p=0.0 must be in \(0, 1\]"):
        ar_generate(model, PROMPTS, top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens=0 must be a positive integer"):
        ar_generate(model, PROMPTS, max_new_tokens=0)
    dlm = TransformerLM(TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=53))
    with pytest.raises(ValueError, match="needs a causal model"):
        ar_generate(dlm, PROMPTS)
