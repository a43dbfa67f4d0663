"""megadlms.interop.verify: the batch, the agreement measure and its pass/fail decision."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megadlms.config import TransformerConfig
from megadlms.interop import DEFAULT_TOLERANCE, VerifyResult, compare_models, load_hf_model, verification_batch
from megadlms.interop.verify import verify_against_folder

from .helpers import load_transformers


def _cfg(**kw) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=50, seq_length=32,
                             max_position_embeddings=40, **kw)


def test_batch_bidirectional_masks_with_the_mask_id():
    b = verification_batch(_cfg(mask_token_id=7), batch_size=2, seq_len=64, seed=3)
    assert b.input_ids.shape == (2, 40)  # capped at max_position_embeddings
    assert b.attention_mask[0].all() and b.attention_mask[1].sum() == 30  # row 1 right-padded by a quarter
    assert (b.labels != 7).all()  # clean tokens never equal [MASK]
    assert torch.equal(b.input_ids[b.loss_mask], torch.full((int(b.loss_mask.sum()),), 7))
    assert torch.equal(b.input_ids[~b.loss_mask], b.labels[~b.loss_mask])
    assert not (b.loss_mask & ~b.attention_mask).any() and b.loss_mask[:, 0].all()
    assert 0.3 < b.loss_mask[0].float().mean() < 0.7
    again = verification_batch(_cfg(mask_token_id=7), batch_size=2, seq_len=64, seed=3)
    assert torch.equal(again.input_ids, b.input_ids)  # seeded


def test_batch_causal_is_next_token():
    b = verification_batch(_cfg(attn_mask_type="causal"), seq_len=12, vocab_limit=20)
    assert int(b.input_ids.max()) < 20
    assert torch.equal(b.labels[:, :-1], b.input_ids[:, 1:])
    assert not b.loss_mask[:, -1].any() and b.loss_mask[0, :-1].all()
    assert b.loss_mask[1].sum() == 12 - 3 - 1  # pads and the last real token have no target


def test_result_limits():
    r = VerifyResult(max_abs_diff=5e-4, mean_abs_diff=1e-5, max_abs_logit=10.0, loss_ours=2.0, loss_hf=2.0001,
                     tolerance=1e-4, attn_mask_type="causal")
    assert r.logit_limit == pytest.approx(1e-3) and r.loss_limit == pytest.approx(2.0001e-4)
    assert r.passed and "PASSED" in r.summary()
    assert not VerifyResult(2e-4, 0, 0.5, 1.0, 1.0, 1e-4, "causal").passed  # limit floors at tol * 1
    assert not VerifyResult(0, 0, 1.0, 1.0, 1.01, 1e-4, "causal").passed  # loss beyond tol
    assert DEFAULT_TOLERANCE == 1e-4


@pytest.mark.parametrize("family,attn", [("qwen3", "bidirectional"), ("llama", "causal")])
def test_compare_models_passes_and_catches_a_perturbation(hf_dirs, family, attn):
    ours, cfg = load_hf_model(hf_dirs[family], attn_mask_type=attn, mask_token_id=1)
    result = verify_against_folder(ours, cfg, hf_dirs[family], vocab_limit=90)
    assert result.passed and result.max_abs_diff < 1e-5 and result.attn_mask_type == attn
    hf = load_transformers(hf_dirs[family], causal=attn == "causal")
    batch = verification_batch(cfg, vocab_limit=90)
    with torch.no_grad():  # the reported loss is the loss of transformers' logits on the batch
        logits = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long()).logits
    expect = F.cross_entropy(logits[batch.loss_mask], batch.labels[batch.loss_mask]).item()
    assert result.loss_hf == pytest.approx(expect, rel=1e-6)
    with torch.no_grad():
        hf.model.layers[1].mlp.down_proj.weight[3, 5] += 0.05
    bad = compare_models(ours, hf, batch, attn_mask_type=attn)
    assert not bad.passed and bad.max_abs_diff > 1e-3 and "FAILED" in bad.summary()
    # the wrong attention type is caught as well
    other = load_transformers(hf_dirs[family], causal=attn != "causal")
    assert not compare_models(ours, other, batch).passed
