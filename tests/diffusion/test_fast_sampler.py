"""The fast sampler: equal to the reference where it is exact, threshold semantics, caches."""

import pytest
import torch

from megadlms.config import TransformerConfig
from megadlms.diffusion.fast_sampler import commit_step, fast_generate, fast_generate_tokens
from megadlms.diffusion.sampler import generate, generate_tokens
from megadlms.model import TransformerLM

VOCAB, MASK = 61, 60
PROMPT = torch.tensor([[3, 14, 15, 9, 26, 5], [2, 7, 18, 28, 18, 28]])


class NoMaskLM(TransformerLM):
    """A random model that, like a trained DLM, never predicts the mask token."""

    def logits(self, hidden):
        out = super().logits(hidden)
        out[..., MASK] = -1e4
        return out


def tiny_model(seed=0, layers=2, std=0.3):
    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=layers, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=64, vocab_size=VOCAB, seq_length=64, max_position_embeddings=64,
                            init_method_std=std, mask_token_id=MASK)
    return NoMaskLM(cfg).eval()


def count_forwards(model):
    calls = []
    model.register_forward_pre_hook(lambda m, a, k: calls.append(a[0].shape), with_kwargs=True)
    return calls


@pytest.mark.parametrize("kw", [
    dict(gen_length=16, block_length=4),
    dict(gen_length=12, block_length=12, cfg_scale=1.0),
    dict(gen_length=12, block_length=6, remasking="random"),  # random scores: argmax of a uniform draw each step
])
def test_threshold_one_without_cache_equals_reference(kw):
    model = tiny_model()
    torch.manual_seed(4)
    ref = generate_tokens(model, PROMPT, mask_id=MASK, steps=kw["gen_length"], **kw)
    torch.manual_seed(4)
    out, nfe = fast_generate_tokens(model, PROMPT, mask_id=MASK, threshold=1.0, cache=None, **kw)
    if kw.get("remasking") == "random":  # different draws (the fast path draws for the block only)
        assert nfe == kw["gen_length"] and not (out == MASK).any()
    else:
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        assert nfe == kw["gen_length"]


def test_fixed_schedule_without_cache_equals_reference():
    model = tiny_model(seed=1)
    kw = dict(gen_length=20, block_length=10, steps=6)
    ref = generate_tokens(model, PROMPT, mask_id=MASK, **kw)
    out, nfe = fast_generate_tokens(model, PROMPT, mask_id=MASK, threshold=None, cache=None, **kw)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert nfe == 6


@pytest.mark.parametrize("cache", ["dual", "prefix"])
@pytest.mark.parametrize("threshold", [0.3, None])
def test_caches_are_exact_for_a_one_layer_model(cache, threshold):
    model = tiny_model(layers=1, std=1.0)
    kw = dict(mask_id=MASK, gen_length=16, block_length=4, threshold=threshold, steps=8)
    ref, ref_nfe = fast_generate_tokens(model, PROMPT, cache=None, **kw)
    out, nfe = fast_generate_tokens(model, PROMPT, cache=cache, **kw)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert nfe == ref_nfe
    if threshold is not None:
        assert nfe < 16  # several tokens committed in some steps


def test_dual_cache_runs_block_sized_forwards():
    model = tiny_model()
    calls = count_forwards(model)
    out, nfe = fast_generate_tokens(model, PROMPT, mask_id=MASK, gen_length=16, block_length=4, threshold=1.0,
                                    cache="dual")
    assert nfe == 16 and len(calls) == 16
    # per block: one full forward [B, 22], then 3 forwards of the block only [B, 4]
    assert calls == [torch.Size([2, 22]), *[torch.Size([2, 4])] * 3] * 4
    calls.clear()
    fast_generate_tokens(model, PROMPT, mask_id=MASK, gen_length=16, block_length=4, threshold=1.0, cache="prefix")
    assert [c[1] for c in calls[:8]] == [22, 16, 16, 16, 22, 12, 12, 12]  # block + suffix after the prefix
    assert not (out == MASK).any()


def test_threshold_commits_every_confident_position_and_at_least_one():
    window = torch.full((2, 4), MASK)
    window[1, 0] = 7  # already decoded: never recommitted
    logits = torch.full((2, 4, VOCAB), -20.0)
    logits[0, :, 1] = torch.tensor([10.0, 0.0, 10.0, -30.0])  # p(token 1) ~ 1, 0.5, ~1, ~0
    logits[0, 1, 2] = 0.0
    logits[0, 3, MASK] = 10.0  # the mask token is the argmax here, but is never committed
    logits[1, 1:, 3] = 2.0  # row 1: p(token 3) = 0.62, 0.73, 0.82 -- none above 0.9
    logits[1, 1:, 4] = torch.tensor([1.5, 1.0, 0.5])
    committed = commit_step(window, logits, mask_id=MASK, threshold=0.9, count=None, temperature=0.0,
                            remasking="low_confidence", generator=None)
    assert committed.tolist() == [2, 1]
    assert window[0].tolist() == [1, MASK, 1, MASK]
    assert window[1].tolist() == [7, MASK, MASK, 3]  # its most confident masked position only


def test_threshold_zero_decodes_each_block_in_one_step():
    model = tiny_model()
    out, nfe = fast_generate_tokens(model, PROMPT, mask_id=MASK, gen_length=16, block_length=4, threshold=0.0,
                                    cache="dual")
    assert nfe == 4 and not (out == MASK).any()


@pytest.mark.parametrize("cache", ["dual", None])
def test_cuda_graph_path_gives_the_same_tokens(cache):
    model = tiny_model()
    prompts = [[5, 9, 2], [7, 1, 4, 4, 8]]
    kw = dict(mask_id=MASK, gen_length=12, block_length=4, threshold=0.2, cache=cache, cfg_scale=0.5)
    assert fast_generate(model, prompts, cuda_graph=True, **kw) == fast_generate(model, prompts, **kw)


@pytest.mark.parametrize("cache", ["dual", "prefix"])
def test_padded_batch_with_cache(cache):
    model = tiny_model(seed=2)
    prompts = [[5, 9, 2], [7, 1, 4, 4, 8, 3, 2]]
    kw = dict(mask_id=MASK, gen_length=12, block_length=4, threshold=0.5, cache=cache)
    a = fast_generate(model, prompts, pad_id=0, **kw)
    assert a == fast_generate(model, prompts, pad_id=44, **kw)
    assert a == [fast_generate(model, [p], **kw)[0] for p in prompts]


def test_agreement_with_reference_and_eos():
    model = tiny_model(seed=3)
    kw = dict(mask_id=MASK, gen_length=16, block_length=4)
    ref = generate(model, PROMPT, steps=16, **kw)
    fast = fast_generate(model, PROMPT, threshold=1.0, **kw)  # dual cache: approximate
    agree = sum(a == b for r, f in zip(ref, fast) for a, b in zip(r, f)) / 32
    assert 0.2 < agree <= 1.0
    eos = fast[0][1]
    cut = fast_generate(model, PROMPT, threshold=1.0, eos_id=eos, **kw)
    assert cut[0] == fast[0][:1] and eos not in cut[1]


def test_bad_arguments():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"threshold=1.5 must be in \[0, 1\]"):
        fast_generate(model, PROMPT, threshold=1.5, gen_length=8, block_length=4)
    with pytest.raises(ValueError, match=r"cache='full' is not one of"):
        fast_generate(model, PROMPT, cache="full", gen_length=8, block_length=4)
    with pytest.raises(ValueError, match="gen_length=10 is not divisible by block_length=4"):
        fast_generate(model, PROMPT, gen_length=10, block_length=4)
    with pytest.raises(ValueError, match=r"steps=6 cannot be spread evenly over .* 4 blocks"):
        fast_generate(model, PROMPT, gen_length=16, block_length=4, threshold=None, steps=6)


@pytest.mark.parametrize("padded", [False, True])
def test_graphs_and_cache_are_reused_across_calls(padded):
    """With cuda_graph=True a second call of the same shapes reuses the first call's cache and graphs (on the CPU
    the graph objects run eagerly on their buffers, the same data flow) and gives the tokens of a fresh call;
    other prompts, or weights moved to new storage, never meet an old graph."""
    from megadlms.diffusion import sampler as sampler_mod

    model = tiny_model()
    ids = PROMPT.clone()
    mask = torch.ones_like(ids, dtype=torch.bool)
    if padded:
        mask[1, :2] = False
    kw = dict(mask_id=MASK, gen_length=8, block_length=4, threshold=0.5, cache="dual")
    fresh, _ = fast_generate_tokens(model, ids, mask, **kw)
    first, _ = fast_generate_tokens(model, ids, mask, cuda_graph=True, **kw)
    kept = dict(sampler_mod._GRAPHS[model])
    other = ids.flip(1)
    fast_generate_tokens(model, other, mask, cuda_graph=True, **kw)  # same shapes, other tokens: same graphs
    again, _ = fast_generate_tokens(model, ids, mask, cuda_graph=True, **kw)
    assert torch.equal(first, fresh) and torch.equal(again, fresh)
    assert sampler_mod._GRAPHS[model] == kept and len(kept) == 1
    ref = generate_tokens(model, ids, mask, mask_id=MASK, gen_length=8, block_length=4, steps=8, cuda_graph=True)
    assert torch.equal(ref, generate_tokens(model, ids, mask, mask_id=MASK, gen_length=8, block_length=4, steps=8))
    assert len(sampler_mod._GRAPHS[model]) == 2  # the reference sampler's graph beside the fast sampler's
    for prm in model.parameters():
        prm.data = prm.data.clone()  # new storage: the old graphs would read the old weights
    fast_generate_tokens(model, ids, mask, cuda_graph=True, **kw)
    assert len(sampler_mod._GRAPHS[model]) == 3
    sampler_mod.release_graphs(model)
    assert model not in sampler_mod._GRAPHS
