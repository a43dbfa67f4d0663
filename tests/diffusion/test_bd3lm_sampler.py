"""Block-diffusion sampling: the KV cache gives the tokens of recomputing the prefix, forwards per block, EOS
stop, prompts of any length, `megadlms generate --sampler bd3lm`."""

import argparse
import sys
import types

import pytest
import torch

from megadlms.config import ConfigError, TransformerConfig
from megadlms.diffusion.bd3lm_sampler import bd3lm_generate, bd3lm_generate_tokens
from megadlms.diffusion.sampler import prepare_prompts
from megadlms.model import TransformerLM

EOD, MASK, PAD = 256, 257, 258
BLOCK = 4


def tiny(block_size=BLOCK):
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=64, vocab_size=260, seq_length=64, init_method_std=0.3,
                            mask_token_id=MASK, block_size=block_size)
    return TransformerLM(cfg).eval(), cfg


# lengths 1..6 against block 4: partial blocks, a whole block, a whole block plus a tail. (No empty prompt here:
# an all-mask block with no context has near-tied confidences, which float rounding of either path may order.)
PROMPTS = [[5], [10, 11, 12], [20, 21, 22, 23], [30, 31, 32, 33, 34, 35]]


@pytest.mark.parametrize("decoding", [dict(steps=BLOCK), dict(steps=2), dict(threshold=0.05)])
def test_cache_gives_the_tokens_of_recomputing_the_prefix(decoding):
    model, _ = tiny()
    ids, attn = prepare_prompts(PROMPTS, pad_id=PAD, device="cpu")
    runs = {c: bd3lm_generate_tokens(model, ids, attn, mask_id=MASK, max_new_tokens=10, use_cache=c, **decoding)
            for c in (True, False)}
    (x, start, nfe), (x_ref, start_ref, nfe_ref) = runs[True], runs[False]
    assert torch.equal(x, x_ref) and torch.equal(start, start_ref)
    assert start.tolist() == [5, 7, 4, 6]  # whole-block left pads: each row's tail ends on the same block
    assert not bool((x[torch.arange(x.shape[1])[None] >= start[:, None]] == MASK).any())
    if "steps" in decoding:  # a block costs its steps; with the cache, one more forward for the prompt's blocks
        blocks = -(-(10 + 3) // BLOCK)
        assert nfe_ref == blocks * decoding["steps"] and nfe == nfe_ref + 1
    for row, prompt, s in zip(x.tolist(), PROMPTS, start.tolist()):
        assert row[s - len(prompt):s] == prompt


def test_a_single_prompt_matches_its_row_in_a_batch_and_eos_stops_early():
    model, _ = tiny()
    batch = bd3lm_generate(model, PROMPTS, max_new_tokens=12)
    alone = bd3lm_generate(model, [PROMPTS[3]], max_new_tokens=12)
    assert alone[0] == batch[3] and all(len(r) == 12 for r in batch)
    # an EOS at the row's 2nd new token: the output is cut there and no later block is decoded
    eos = batch[3][1]
    ids, attn = prepare_prompts([PROMPTS[3]], pad_id=PAD, device="cpu")
    x, start, nfe = bd3lm_generate_tokens(model, ids, attn, mask_id=MASK, max_new_tokens=12, eos_id=eos)
    assert bd3lm_generate(model, [PROMPTS[3]], max_new_tokens=12, eos_id=eos) == [batch[3][:batch[3].index(eos)]]
    # the prompt's whole block, then the first block: its 2 open slots take 2 steps (a block stops when full)
    assert nfe == 1 + 2 and bool((x[0, 8:] == MASK).all())


def test_temperature_sampling_is_reproducible_with_a_generator():
    model, _ = tiny()
    draws = [bd3lm_generate(model, PROMPTS[1:3], max_new_tokens=8, temperature=1.0, threshold=0.5,
                            generator=torch.Generator().manual_seed(s)) for s in (1, 1, 2)]
    assert draws[0] == draws[1] and draws[0] != draws[2]


def test_bad_arguments():
    model, cfg = tiny()
    with pytest.raises(ConfigError, match="steps=5 per block must be in"):
        bd3lm_generate(model, PROMPTS, steps=5)
    with pytest.raises(ConfigError, match="not both"):
        bd3lm_generate(model, PROMPTS, steps=2, threshold=0.5)
    with pytest.raises(ConfigError, match="more than the model's max_position_embeddings=64"):
        bd3lm_generate(model, PROMPTS, max_new_tokens=60)
    plain = TransformerLM(cfg.replace(block_size=None)).eval()
    with pytest.raises(ConfigError, match="the model has no block_size"):
        bd3lm_generate(plain, PROMPTS)


class ByteTokenizer:
    vocab_size, eod_id, mask_id, pad_id = 259, EOD, MASK, PAD

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode(errors="replace")


def test_generate_cli_defaults_to_the_bd3lm_sampler(tmp_path, capsys, monkeypatch):
    from megadlms.cli import generate as cli
    from megadlms.training.checkpoint import save_model_checkpoint

    monkeypatch.setitem(sys.modules, "megadlms.data", types.SimpleNamespace(load_tokenizer=lambda p: ByteTokenizer()))
    model, cfg = tiny()
    save_model_checkpoint(tmp_path / "ckpt", model, cfg)
    prompts = ["Hi", "The cat"]
    argv = ["--load", str(tmp_path / "ckpt"), "--prompt", prompts[0], "--prompt", prompts[1], "--max-new-tokens",
            "9", "--block-steps", "2", "--ignore-eos", "--no-progress"]
    assert cli.run(cli.add_arguments(argparse.ArgumentParser()).parse_args(argv)) == 0
    out, err = capsys.readouterr()
    expect = bd3lm_generate(model, [list(p.encode()) for p in prompts], max_new_tokens=9, steps=2, pad_id=PAD)
    assert out == "".join(f">>> {p}\n{ByteTokenizer().decode(e)}\n\n" for p, e in zip(prompts, expect))
    assert "[bd3lm] 18 tokens in" in err


def test_nucleus_keeps_the_smallest_set_that_reaches_top_p():
    from megadlms.diffusion.sampler import nucleus_logits

    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    kept = nucleus_logits(logits, 0.7).isfinite().tolist()
    assert kept == [True, True, False, False]  # 0.5 < 0.7 <= 0.5 + 0.3
    assert nucleus_logits(logits, 0.7, forbid=0).isfinite().tolist() == [False, True, True, False]  # 0.6 + 0.3
    assert nucleus_logits(logits, 1.0).isfinite().all()


def test_paper_sampling_draws_from_the_nucleus_one_token_a_step():
    """The paper's sampler (random order, one token a step, temperature 1, nucleus): reproducible with a
    generator; a nucleus of one token makes the draw the argmax, i.e. greedy decoding in the same order."""
    model, _ = tiny()
    kw = dict(mask_id=MASK, max_new_tokens=8, eos_id=None, steps=BLOCK)
    draw = [bd3lm_generate(model, PROMPTS, temperature=1.0, top_p=0.9, remasking="random",
                           generator=torch.Generator().manual_seed(0), **kw) for _ in range(2)]
    assert draw[0] == draw[1] and all(len(r) == 8 for r in draw[0])
    greedy = bd3lm_generate(model, PROMPTS, temperature=0.0, **kw)
    nucleus_of_one = bd3lm_generate(model, PROMPTS, temperature=1.0, top_p=1e-6,
                                    generator=torch.Generator().manual_seed(0), **kw)
    assert nucleus_of_one == greedy
    with pytest.raises(ConfigError, match="top_p=0 must be in"):
        bd3lm_generate(model, PROMPTS, top_p=0, **kw)
