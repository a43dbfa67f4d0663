"""Dream's sampler against an independent restatement of Dream's `diffusion_generate`, and against the tokens Dream's
own code produced on the recorded tiny Dream model.

The recorded tokens (tests/interop/data/dream_generate_reference.json) come from Dream's generation_utils.py and
modeling_dream.py as kept in ZHZisZZ/dllm (`dllm/pipelines/dream/models/`, commit ca176752) under transformers
4.46.3, run on tests/interop/data/dream/ with the global RNG seeded per case:

    python tools/make_dlm_reference.py --dream-code DIR_WITH_modeling_dream.py_AND_generation_utils.py --generate
"""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megadlms.config import ConfigError, TransformerConfig
from megadlms.diffusion import dream_generate, dream_generate_tokens
from megadlms.interop import load_hf_model
from megadlms.model import TransformerLM

DATA = Path(__file__).parents[1] / "interop" / "data"
VOCAB, MASK, PAD = 61, 60, 1


class NoMaskLM(TransformerLM):
    """A random model that, like a trained DLM, never predicts the mask token."""

    def logits(self, hidden):
        out = super().logits(hidden)
        out[..., MASK] = -1e4
        return out


def tiny_model(shift: bool, seed: int = 0, cls: type[TransformerLM] = TransformerLM) -> TransformerLM:
    """A random model; this one does propose the mask token at times, so rows end up with unequal masked
    counts (the mean-count rule and the re-masking of committed tokens are then exercised)."""
    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=64, vocab_size=VOCAB, seq_length=64, max_position_embeddings=64,
                            init_method_std=0.3, mask_token_id=MASK, diffusion_shift=shift)
    return cls(cfg).eval()


# ---- a restatement of Dream's published decoding (diffusion_generate / _sample / sample_tokens), run on the
# ---- full logits every step with the global RNG, as Dream's code does

def ref_sample_tokens(logits, temperature, top_p, top_k, margin=False, neg_entropy=False):
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        srt, order = torch.sort(logits, descending=True)
        remove = torch.cumsum(F.softmax(srt, dim=-1), dim=-1) > top_p
        remove[..., 1:] = remove[..., :-1].clone()
        remove[..., 0] = False
        logits = logits.masked_fill(torch.zeros_like(logits, dtype=torch.bool).scatter(-1, order, remove),
                                    torch.finfo(logits.dtype).min)
    if top_k is not None:
        logits = logits.masked_fill(logits < torch.topk(logits, min(top_k, logits.size(-1)))[0][..., -1, None],
                                    torch.finfo(logits.dtype).min)
    probs = torch.softmax(logits, dim=-1)
    if temperature > 0:
        x0 = torch.distributions.Categorical(probs=probs).sample()
        conf = torch.gather(probs, -1, x0[:, None])[:, 0]
    else:
        conf, x0 = probs.max(dim=-1)
    if margin:
        s = torch.sort(probs, dim=-1, descending=True)[0]
        conf = s[:, 0] - s[:, 1]
    if neg_entropy:
        conf = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
    return conf, x0


def ref_dream(model, ids, attn, *, gen_length, steps, alg, alg_temp=None, temperature=0.0, top_p=None, top_k=None,
              eps=1e-3, shift=True):
    b, p = ids.shape
    x = F.pad(ids, (0, gen_length), value=MASK)
    mask = pos = None
    if attn is not None:
        mask = F.pad(attn, (0, gen_length), value=1).bool()
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    timesteps = torch.linspace(1, eps, steps + 1)
    for i in range(steps):
        mask_index = x == MASK
        logits = model(x, attention_mask=mask, position_ids=pos)
        if shift:
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        mask_logits = logits[mask_index]
        t, s = timesteps[i], timesteps[i + 1]
        if alg == "origin":
            p_transfer = 1 - s / t if i < steps - 1 else 1
            x0 = torch.zeros_like(x[mask_index]) + MASK
            transfer = torch.rand(*x0.shape) < p_transfer
            if transfer.any():
                _, x0[transfer] = ref_sample_tokens(mask_logits[transfer], temperature, top_p, top_k)
            x[mask_index] = x0.clone()
            continue
        conf, x0 = ref_sample_tokens(mask_logits, temperature, top_p, top_k, margin=alg == "topk_margin",
                                     neg_entropy=alg == "entropy")
        num_mask = mask_index.sum() / mask_index.shape[0]
        n = int(num_mask * (1 - s / t)) if i < steps - 1 else int(num_mask)
        full = torch.full_like(x, -torch.inf, dtype=logits.dtype)
        full[mask_index] = conf
        if n > 0:
            if alg_temp is None or alg_temp == 0:
                _, transfer_index = torch.topk(full, n)
            else:
                transfer_index = torch.multinomial(F.softmax(full / alg_temp, dim=-1), num_samples=n)
            x_ = torch.zeros_like(x) + MASK
            x_[mask_index] = x0.clone()
            r = torch.arange(b)[:, None].expand_as(transfer_index)
            x[r, transfer_index] = x_[r, transfer_index]
    return x


CASES = [
    dict(alg="origin", steps=6),
    dict(alg="origin", steps=5, temperature=0.8, top_p=0.9),
    dict(alg="maskgit_plus", steps=10),
    dict(alg="maskgit_plus", steps=4, temperature=0.7, alg_temp=0.5),
    dict(alg="topk_margin", steps=3),
    dict(alg="topk_margin", steps=7, alg_temp=0.2, top_k=5, temperature=1.0),
    dict(alg="entropy", steps=10),
    dict(alg="entropy", steps=6, temperature=0.5, alg_temp=1.0),
    # steps = gen_length (Dream's default): step 0 reveals int(10 * 0.999 / 10) = 0 positions, yet draws
    dict(alg="maskgit_plus", steps=10, temperature=0.7, top_p=0.95),
    dict(alg="topk_margin", steps=10, temperature=0.7, top_p=0.95),
    dict(alg="entropy", steps=10, temperature=0.7, top_p=0.95),
]


@pytest.mark.parametrize("cls", [TransformerLM, NoMaskLM])
@pytest.mark.parametrize("shift", [True, False])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_matches_the_restated_algorithm(case, padded, shift, cls):
    model = tiny_model(shift, cls=cls)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, 50, (3, 5), generator=g)
    attn = None
    if padded:
        ids[1, :2] = PAD
        ids[2, :1] = PAD
        attn = torch.ones_like(ids, dtype=torch.bool)
        attn[1, :2] = False
        attn[2, :1] = False
    torch.manual_seed(7)
    want = ref_dream(model, ids.clone(), attn, gen_length=10, shift=shift, **case)
    got = dream_generate_tokens(model, ids, attn, mask_id=MASK, gen_length=10,
                                generator=torch.Generator().manual_seed(7), **case)
    assert torch.equal(got, want)
    assert not (got[:, 5:] == MASK).all(1).any()  # something was decoded


def _reference_cases():
    return json.loads((DATA / "dream_generate_reference.json").read_text())["cases"]


@pytest.fixture(scope="module")
def dream_model():
    model, cfg = load_hf_model(DATA / "dream")
    assert cfg.diffusion_shift
    return model.eval()


@pytest.mark.parametrize("case", _reference_cases(), ids=lambda c: c["name"])
def test_matches_dreams_own_code(case, dream_model):
    """The tokens Dream's diffusion_generate produced on the recorded tiny Dream model, seed for seed."""
    ids = torch.tensor(case["input_ids"])
    attn = None if case["attention_mask"] is None else torch.tensor(case["attention_mask"]).bool()
    want = torch.tensor(case["sequences"])
    got = dream_generate_tokens(dream_model, ids, attn, mask_id=dream_model.config.mask_token_id,
                                gen_length=want.shape[1] - ids.shape[1],
                                generator=torch.Generator().manual_seed(case["seed"]), **case["kwargs"])
    if attn is not None:  # pads: Dream leaves them as they were
        got = torch.where(F.pad(attn, (0, got.shape[1] - ids.shape[1]), value=True), got, want)
    assert torch.equal(got, want)


def test_the_timestep_schedule_reveals_everything_by_the_last_step():
    """The count per step is int(masked * (1 - s/t)) from linspace(1, eps, steps + 1); the last step takes the rest."""
    model = tiny_model(True, cls=NoMaskLM)
    seen = []
    model.register_forward_pre_hook(lambda m, args, kw: seen.append(int((args[0] == MASK).sum())), with_kwargs=True)
    out = dream_generate_tokens(model, torch.tensor([[3, 4, 5]]), mask_id=MASK, gen_length=20, steps=4,
                                alg="maskgit_plus")
    ts = torch.linspace(1, 1e-3, 5)
    left, want = 20, []
    for i in range(4):
        want.append(left)
        left -= left if i == 3 else int(torch.tensor(left, dtype=torch.float32) * (1 - ts[i + 1] / ts[i]))
    assert seen == want
    assert not (out == MASK).any()


def test_dream_generate_defaults_and_trims_at_eos():
    model = tiny_model(True)
    full = dream_generate_tokens(model, torch.tensor([[3, 4, 5]]), mask_id=MASK, gen_length=8, alg="entropy")
    new = full[0, 3:].tolist()
    eos = new[3]
    out = dream_generate(model, [[3, 4, 5]], gen_length=8, alg="entropy", eos_id=eos)
    assert out == [new[:new.index(eos)]]


@pytest.mark.parametrize("kwargs, match", [
    (dict(alg="greedy"), "decoding orders"),
    (dict(alg="origin", alg_temp=0.5), "alg_temp has no effect"),
    (dict(alg="entropy", steps=0), "steps=0"),
    (dict(alg="entropy", top_p=0.0), "top_p=0.0"),
    (dict(alg="entropy", top_k=0), "top_k=0"),
    (dict(alg="entropy", eps=1.0), "eps=1.0"),
    (dict(alg="entropy", temperature=-1.0), "temperature=-1.0"),
    (dict(alg="entropy", alg_temp=math.nan), "alg_temp=nan"),
])
def test_bad_arguments_name_the_value(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        dream_generate_tokens(tiny_model(True), torch.tensor([[3, 4]]), mask_id=MASK, gen_length=4, **kwargs)


def test_a_shifted_model_needs_a_prompt():
    with pytest.raises(ConfigError, match="at least one token"):
        dream_generate_tokens(tiny_model(True), torch.zeros(1, 0, dtype=torch.long), mask_id=MASK, gen_length=4)
