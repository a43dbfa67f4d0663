"""The reference sampler against an independent transcription of LLaDA's generate()."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megadlms.config import ConfigError, TransformerConfig
from megadlms.diffusion.sampler import (
    check_sampling_args,
    generate,
    generate_tokens,
    get_num_transfer_tokens,
    prepare_prompts,
    trim_at_eos,
)
from megadlms.model import TransformerLM

VOCAB, MASK = 61, 60


class NoMaskLM(TransformerLM):
    """A random model that, like a trained DLM, never predicts the mask token."""

    def logits(self, hidden):
        out = super().logits(hidden)
        out[..., MASK] = -1e4
        return out


def tiny_model(seed=0, cls=NoMaskLM, **kw):
    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=64, vocab_size=VOCAB, seq_length=64, max_position_embeddings=64,
                            init_method_std=0.3, mask_token_id=MASK, **kw)
    return cls(cfg).eval()


class Recorder:
    """Records the input ids of every forward (the sampler's state at each step)."""

    def __init__(self, model):
        self.inputs = []
        model.register_forward_pre_hook(lambda m, args, kwargs: self.inputs.append(args[0].clone()), with_kwargs=True)


# ---- an independent transcription of LLaDA's generate.py (github.com/ML-GSAI/LLaDA) ----

def llada_add_gumbel_noise(logits, temperature):
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    noise = torch.rand_like(logits, dtype=torch.float64)
    gumbel_noise = (- torch.log(noise)) ** temperature
    return logits.exp() / gumbel_noise


def llada_get_num_transfer_tokens(mask_index, steps):
    mask_num = mask_index.sum(dim=1, keepdim=True)
    base = mask_num // steps
    remainder = mask_num % steps
    num_transfer_tokens = torch.zeros(mask_num.size(0), steps, device=mask_index.device, dtype=torch.int64) + base
    for i in range(mask_num.size(0)):
        num_transfer_tokens[i, :remainder[i]] += 1
    return num_transfer_tokens


@torch.no_grad()
def llada_generate(model, prompt, steps=128, gen_length=128, block_length=128, temperature=0.,
                   cfg_scale=0., remasking='low_confidence', mask_id=126336):
    x = torch.full((prompt.shape[0], prompt.shape[1] + gen_length), mask_id, dtype=torch.long)
    x[:, :prompt.shape[1]] = prompt.clone()
    prompt_index = (x != mask_id)
    assert gen_length % block_length == 0
    num_blocks = gen_length // block_length
    assert steps % num_blocks == 0
    steps = steps // num_blocks
    for num_block in range(num_blocks):
        block_mask_index = (x[:, prompt.shape[1] + num_block * block_length:
                              prompt.shape[1] + (num_block + 1) * block_length] == mask_id)
        num_transfer_tokens = llada_get_num_transfer_tokens(block_mask_index, steps)
        for i in range(steps):
            mask_index = (x == mask_id)
            if cfg_scale > 0.:
                un_x = x.clone()
                un_x[prompt_index] = mask_id
                x_ = torch.cat([x, un_x], dim=0)
                logits = model(x_)
                logits, un_logits = torch.chunk(logits, 2, dim=0)
                logits = un_logits + (cfg_scale + 1) * (logits - un_logits)
            else:
                logits = model(x)
            logits_with_noise = llada_add_gumbel_noise(logits, temperature=temperature)
            x0 = torch.argmax(logits_with_noise, dim=-1)
            if remasking == 'low_confidence':
                p = F.softmax(logits.to(torch.float64), dim=-1)
                x0_p = torch.squeeze(torch.gather(p, dim=-1, index=torch.unsqueeze(x0, -1)), -1)
            elif remasking == 'random':
                x0_p = torch.rand((x0.shape[0], x0.shape[1]), device=x0.device)
            else:
                raise NotImplementedError(remasking)
            x0_p[:, prompt.shape[1] + (num_block + 1) * block_length:] = -np.inf
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, -np.inf)
            transfer_index = torch.zeros_like(x0, dtype=torch.bool, device=x0.device)
            for j in range(confidence.shape[0]):
                _, select_index = torch.topk(confidence[j], k=num_transfer_tokens[j, i])
                transfer_index[j, select_index] = True
            x[transfer_index] = x0[transfer_index]
    return x


def run_both(model, prompt, seed=0, use_generator=False, **kw):
    """(ours, LLaDA's) final tokens and per-forward inputs, from the same seed."""
    rec = Recorder(model)
    torch.manual_seed(seed)
    ref = llada_generate(model, prompt, mask_id=MASK, **kw)
    ref_inputs, rec.inputs = rec.inputs, []
    gen = torch.Generator().manual_seed(seed) if use_generator else None
    torch.manual_seed(seed)
    ours = generate_tokens(model, prompt, mask_id=MASK, generator=gen, **kw)
    return ours, ref, rec.inputs, ref_inputs


PROMPT = torch.tensor([[3, 14, 15, 9, 26, 5], [2, 7, 18, 28, 18, 28]])


@pytest.mark.parametrize("kw", [
    dict(gen_length=20, block_length=10, steps=6, temperature=0.0),  # 10 tokens over 3 steps: [4, 3, 3]
    dict(gen_length=16, block_length=16, steps=16, temperature=0.0),
    dict(gen_length=16, block_length=4, steps=8, temperature=0.8),
    dict(gen_length=12, block_length=6, steps=6, temperature=0.5, remasking="random"),
    dict(gen_length=12, block_length=4, steps=12, temperature=0.0, remasking="random"),
    dict(gen_length=12, block_length=6, steps=6, temperature=0.0, cfg_scale=1.5),
    dict(gen_length=12, block_length=6, steps=6, temperature=0.7, cfg_scale=0.5),
])
def test_matches_llada_step_by_step(kw):
    model = tiny_model()
    ours, ref, our_inputs, ref_inputs = run_both(model, PROMPT, seed=11, **kw)
    assert len(our_inputs) == len(ref_inputs) == kw["steps"]
    for a, b in zip(our_inputs, ref_inputs):  # the state fed to every forward is the same
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    assert not (ours == MASK).any()
    assert (ours[:, :PROMPT.shape[1]] == PROMPT).all()


def test_same_tokens_with_explicit_generator():
    model = tiny_model()
    kw = dict(gen_length=12, block_length=6, steps=6, temperature=0.9, remasking="random")
    ours, ref, _, _ = run_both(model, PROMPT, seed=5, use_generator=True, **kw)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    torch.manual_seed(5)
    other = generate_tokens(model, PROMPT, mask_id=MASK, generator=torch.Generator().manual_seed(6), **kw)
    assert not torch.equal(other, ours)  # the generator is really the source of randomness


def test_masked_prompt_positions_are_filled_like_llada():
    """LLaDA commits any masked position left of the block end, including masks inside the prompt."""
    model = tiny_model(seed=3, cls=TransformerLM)  # a plain model: x0 may even be the mask token
    prompt = PROMPT.clone()
    prompt[:, 2] = MASK
    ours, ref, our_inputs, ref_inputs = run_both(model, prompt, gen_length=12, block_length=4, steps=6)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(our_inputs, ref_inputs))
    assert (ours[:, 2] != prompt[:, 2]).any()


def test_schedule_and_commits_per_step():
    assert get_num_transfer_tokens(torch.ones(2, 10, dtype=torch.bool), 3).tolist() == [[4, 3, 3]] * 2
    m = torch.tensor([[1] * 7 + [0] * 3, [1] * 2 + [0] * 8], dtype=torch.bool)
    assert get_num_transfer_tokens(m, 4).tolist() == [[2, 2, 2, 1], [1, 1, 0, 0]]
    assert (llada_get_num_transfer_tokens(m, 4) == get_num_transfer_tokens(m, 4)).all()
    model = tiny_model()
    rec = Recorder(model)
    out = generate_tokens(model, PROMPT, mask_id=MASK, gen_length=20, block_length=10, steps=6)
    states = rec.inputs[1:] + [out]
    masked = [int((s == MASK).sum()) for s in rec.inputs[:1] + states]
    committed = [(a - b) // PROMPT.shape[0] for a, b in zip(masked, masked[1:])]
    assert committed == [4, 3, 3, 4, 3, 3]
    # commits stay in their block: after the first 3 steps the second block is untouched
    assert (states[2][:, PROMPT.shape[1] + 10:] == MASK).all() and not (states[2][:, 6:16] == MASK).any()


def test_padded_batch_pads_never_attended_and_positions_restart():
    model = tiny_model(seed=1)
    prompts = [[5, 9, 2], [7, 1, 4, 4, 8, 3, 2]]
    kw = dict(mask_id=MASK, gen_length=12, block_length=6, steps=6)
    a = generate(model, prompts, pad_id=0, **kw)
    b = generate(model, prompts, pad_id=33, **kw)
    assert a == b  # pad values change nothing
    alone = [generate(model, [p], **kw)[0] for p in prompts]
    assert a == alone  # a left-padded row decodes as if it were alone (positions start at 0)
    # with cfg too
    assert (generate(model, prompts, pad_id=0, cfg_scale=1.0, **kw)
            == generate(model, prompts, pad_id=17, cfg_scale=1.0, **kw))
    ids, attn = prepare_prompts(prompts, pad_id=0, device="cpu")
    assert ids.tolist() == [[0, 0, 0, 0, 5, 9, 2], [7, 1, 4, 4, 8, 3, 2]]
    assert attn.sum(1).tolist() == [3, 7]


def test_eos_trim_and_early_stop():
    kw = dict(mask_id=MASK, gen_length=24, block_length=6, steps=12)
    for seed in range(20):  # a model whose rows share a token in their first block: call it EOS
        model = tiny_model(seed=seed)
        full = generate(model, PROMPT, **kw)
        common = set(full[0][:6]) & set(full[1][:6])
        if common:
            break
    assert common
    eos = sorted(common)[0]
    rec = Recorder(model)
    trimmed = generate(model, PROMPT, eos_id=eos, **kw)
    assert trimmed == trim_at_eos(torch.tensor(full), eos)
    assert all(eos not in t for t in trimmed) and min(len(t) for t in trimmed) < 6
    assert len(rec.inputs) == 3  # stopped after the first block (3 steps) instead of 12


def test_cuda_graph_path_gives_the_same_tokens():
    model = tiny_model()
    kw = dict(mask_id=MASK, gen_length=12, block_length=6, steps=6, cfg_scale=0.5)
    prompts = [[5, 9, 2], [7, 1, 4, 4, 8]]
    assert generate(model, prompts, cuda_graph=True, **kw) == generate(model, prompts, **kw)


def test_progress_callback_counts_steps():
    model = tiny_model()
    seen = []
    generate(model, PROMPT, mask_id=MASK, gen_length=8, block_length=4, steps=4, progress=seen.append)
    assert seen == [1, 1, 1, 1]


def test_mask_id_defaults_to_config():
    model = tiny_model()
    assert generate(model, PROMPT, gen_length=8, steps=4) == generate(model, PROMPT, mask_id=MASK, gen_length=8,
                                                                      steps=4)


@pytest.mark.parametrize("kw, match", [
    (dict(gen_length=100, block_length=32), r"gen_length=100 is not divisible by block_length=32.*e\.g\. 20 or 25"),
    (dict(gen_length=64, block_length=8, steps=100), r"steps=100 .* 8 blocks; use a multiple of 8 \(e\.g\. 96"),
    (dict(gen_length=16, steps=32), r"steps=32 exceeds gen_length=16"),
    (dict(gen_length=8, temperature=-1.0), r"temperature=-1.0 must be >= 0"),
    (dict(gen_length=8, remasking="topk"), r"remasking='topk' is not one of"),
    (dict(gen_length=8, cfg_scale=-0.5), r"cfg_scale=-0.5 must be >= 0"),
])
def test_bad_sampling_args(kw, match):
    with pytest.raises(ValueError, match=match):
        generate(tiny_model(), PROMPT, mask_id=MASK, **kw)


def test_bad_model_inputs():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"6 \+ generation length 60 = 66 exceeds the model's "
                                         r"max_position_embeddings=64; shorten the prompt to at most 4 tokens "
                                         r"or lower the generation length to at most 58$"):
        generate(model, PROMPT, mask_id=MASK, gen_length=60, block_length=60, steps=60)
    with pytest.raises(ValueError, match=r"= 70 exceeds the model's max_position_embeddings=64; lower the generation "
                                         r"length to at most 58$"):  # no prompt fits beside 64 tokens
        generate(model, PROMPT, mask_id=MASK, gen_length=64, block_length=64, steps=64)
    with pytest.raises(ValueError, match=r"mask_id=61 is outside the vocabulary \[0, 61\)"):
        generate(model, PROMPT, mask_id=61, gen_length=8)
    with pytest.raises(ValueError, match=r"prompt token ids \[99\] are outside the model's vocabulary"):
        generate(model, [[1, 99]], mask_id=MASK, gen_length=8)
    model.config.mask_token_id = None
    with pytest.raises(ValueError, match="mask_id is not given"):
        generate(model, PROMPT, gen_length=8)
    check_sampling_args(gen_length=8, block_length=4, steps=None, temperature=0.0, remasking="random", cfg_scale=0.0)


def test_window_noise_is_seeded_and_differs_from_llada_stream():
    model = tiny_model()
    kw = dict(mask_id=MASK, gen_length=12, block_length=6, steps=6, temperature=1.0)
    a, b, exact = (generate_tokens(model, PROMPT, generator=torch.Generator().manual_seed(0), exact_noise=e, **kw)
                   for e in (False, False, True))
    assert torch.equal(a, b) and not torch.equal(a, exact) and not (a == MASK).any()


class _ShiftOracle(torch.nn.Module):
    """A difflm-shift 'model' whose hidden state at position i names token (i + 1) * 3 % 31 + 1: decoding it
    right yields exactly that sequence."""

    def __init__(self):
        super().__init__()
        from types import SimpleNamespace

        self.config = SimpleNamespace(diffusion_shift=True, mask_token_id=0, vocab_size=32)
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    def forward(self, ids, attention_mask=None, position_ids=None, kv_cache=None, output_hidden=False):
        pos = torch.arange(ids.shape[1]) if position_ids is None else position_ids
        pos = pos.expand(ids.shape) if pos.dim() == 1 else pos
        return torch.nn.functional.one_hot((pos + 1) * 3 % 31 + 1, 32).float()

    def logits(self, hidden):
        return hidden * 10.0


def test_shift_models_decode_the_next_position():
    from megadlms.diffusion.fast_sampler import fast_generate_tokens
    from megadlms.diffusion.sampler import generate_tokens

    model = _ShiftOracle()
    prompt = torch.tensor([[5, 6, 7]])
    want = [(j * 3) % 31 + 1 for j in range(3, 11)]
    out = generate_tokens(model, prompt, mask_id=0, gen_length=8, block_length=4, steps=8)
    assert out[0, 3:].tolist() == want
    fast, _ = fast_generate_tokens(model, prompt, mask_id=0, gen_length=8, block_length=4, cache=None)
    assert fast[0, 3:].tolist() == want
    with pytest.raises(ConfigError, match="prompt"):
        generate_tokens(model, prompt[:, :0], mask_id=0, gen_length=8)
