"""Block-diffusion sampling: the KV cache gives the tokens of recomputing the prefix, forwards per block, EOS
stop, prompts of any length, the reference's stopping rules (entropy floor, second EOS), the sliding window against
recomputing the window, `megadlms generate --sampler bd3lm`."""

import argparse
import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megadlms.config import ConfigError, TransformerConfig
from megadlms.diffusion.bd3lm_sampler import bd3lm_generate, bd3lm_generate_tokens, second_eos_end, unigram_entropy
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
    with pytest.raises(ConfigError, match=r"steps=5 per block \(--block-steps\) must be in"):
        bd3lm_generate(model, PROMPTS, steps=5)
    with pytest.raises(ConfigError, match="not both"):
        bd3lm_generate(model, PROMPTS, steps=2, threshold=0.5)
    with pytest.raises(ConfigError, match="context_window=128 is more than the model's max_position_embeddings=64"):
        bd3lm_generate(model, PROMPTS, context_window=128)
    with pytest.raises(ConfigError, match=r"context_window=6 must be a multiple of the block size 4 \(at least one "
                                          r"block\), e\.g\. 4 or 8$"):
        bd3lm_generate(model, PROMPTS, context_window=6)
    with pytest.raises(ConfigError, match="var_length stops at the second EOS: give eos_id"):
        bd3lm_generate(model, PROMPTS, var_length=True)
    with pytest.raises(ConfigError, match="entropy_floor=0.0 must be > 0"):
        bd3lm_generate(model, PROMPTS, entropy_floor=0.0, eos_id=EOD)
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
    # the stopping rules and the window pass through; --var-length needs the EOS
    window = argv + ["--context-window", "8", "--entropy-floor", "0.5", "--entropy-window", "6"]
    assert cli.run(cli.add_arguments(argparse.ArgumentParser()).parse_args(window)) == 0
    expect = bd3lm_generate(model, [list(p.encode()) for p in prompts], max_new_tokens=9, steps=2, pad_id=PAD,
                            context_window=8, entropy_floor=0.5, entropy_window=6)
    assert capsys.readouterr().out == "".join(f">>> {p}\n{ByteTokenizer().decode(e)}\n\n"
                                              for p, e in zip(prompts, expect))
    assert cli.run(cli.add_arguments(argparse.ArgumentParser()).parse_args(argv + ["--var-length"])) == 2
    assert "--var-length stops at the second EOS: drop --ignore-eos" in capsys.readouterr().err
    assert cli.run(cli.add_arguments(argparse.ArgumentParser()).parse_args(argv + ["--entropy-window", "6"])) == 2
    assert ("--entropy-window 6 is the window of --entropy-floor, which is off; add --entropy-floor H"
            in capsys.readouterr().err)
    assert cli.run(cli.add_arguments(argparse.ArgumentParser()).parse_args(argv + ["--gen-length", "8"])) == 2
    assert ("--gen-length applies to other samplers, not the bd3lm sampler; its length flags are --max-new-tokens"
            in capsys.readouterr().err)
    reference = argv[:-4] + ["--sampler", "reference", "--gen-length", "8", "--block-length", "8", "--no-progress"]
    assert cli.run(cli.add_arguments(argparse.ArgumentParser()).parse_args(reference + ["--var-length"])) == 2
    assert "--var-length applies to the bd3lm sampler, not the reference sampler" in capsys.readouterr().err


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


# --------------------------------------------------------------------------- stopping rules and the sliding window


class Scripted(nn.Module):
    """A stand-in model that predicts token `script(position)` at every position, whatever it is shown."""

    def __init__(self, script, max_pos=1024):
        super().__init__()
        self.script = script
        self.anchor = nn.Parameter(torch.zeros(1))  # for the sampler's device lookup
        self.config = types.SimpleNamespace(block_size=BLOCK, max_position_embeddings=max_pos, mask_token_id=MASK,
                                            vocab_size=260)

    def forward(self, ids, attention_mask=None, position_ids=None, kv_cache=None, output_hidden=False):
        return position_ids.expand(ids.shape)

    def logits(self, positions):
        return 10.0 * F.one_hot(positions.clone().apply_(self.script), 260).float()


def test_unigram_entropy_and_second_eos_by_hand():
    rows = torch.tensor([[1, 1, 2, 2], [5, 5, 5, 5], [1, 2, 3, 4], [7, 7, 7, 8]])
    expect = [math.log(2), 0.0, math.log(4), -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))]
    torch.testing.assert_close(unigram_entropy(rows), torch.tensor(expect, dtype=torch.float64))
    x = torch.tensor([[EOD, 3, EOD, 4, EOD], [3, EOD, 4, 4, 4], [EOD, EOD, 3, EOD, 3]])
    real = torch.tensor([[True] * 5, [True] * 5, [False, True, True, True, True]])  # row 2's first column: a pad
    assert second_eos_end(x, real, EOD).tolist() == [3, -1, 4]


def test_entropy_floor_stops_a_degenerate_row_and_cuts_its_window():
    """Prompt [10], then token 10 + p % k at position p. After the third block the text has 12 tokens, more than
    the window of 8: its last 8 (positions 4..11) hold k values equally often, entropy ln k. ln 2 < 1: the row stops
    and positions 4.. are cut (the output is positions 1..3); ln 4 > 1: it goes on to max_new_tokens."""
    kw = dict(max_new_tokens=30, eos_id=EOD, steps=BLOCK, entropy_floor=1.0, entropy_window=8)
    two = Scripted(lambda p: 10 + p % 2)
    assert bd3lm_generate(two, [[10]], **kw) == [[11, 10, 11]]
    ids, attn = prepare_prompts([[10]], pad_id=PAD, device="cpu")
    x, start, nfe = bd3lm_generate_tokens(two, ids, attn, mask_id=MASK, **kw)
    assert nfe == 3 + 4 + 4 and bool((x[0, 4:] == MASK).all())  # stopped after the third block
    assert bd3lm_generate(two, [[10]], **{**kw, "entropy_floor": None}) == [[10 + p % 2 for p in range(1, 31)]]
    four = Scripted(lambda p: 10 + p % 4)
    assert bd3lm_generate(four, [[10]], **kw) == [[10 + p % 4 for p in range(1, 31)]]


def test_var_length_stops_at_the_second_eos_of_the_text_and_keeps_it():
    """EOS at positions 5 and 9, token 20 elsewhere. A prompt opening with EOS (BOS = EOS, the paper's samples):
    the second EOS is the one at 5, kept; without var_length the output stops before the first generated EOS.
    A prompt without EOS runs on to the EOS at 9."""
    model = Scripted(lambda p: EOD if p in (5, 9) else 20)
    prompts = [[EOD, 10], [10, 11]]
    got = bd3lm_generate(model, prompts, max_new_tokens=20, eos_id=EOD, steps=BLOCK, var_length=True)
    assert got == [[20, 20, 20, EOD], [20, 20, 20, EOD, 20, 20, 20, EOD]]
    assert bd3lm_generate(model, prompts, max_new_tokens=20, eos_id=EOD, steps=BLOCK) == [[20, 20, 20]] * 2
    ids, attn = prepare_prompts(prompts, pad_id=PAD, device="cpu")
    _, _, nfe = bd3lm_generate_tokens(model, ids, attn, mask_id=MASK, max_new_tokens=20, eos_id=EOD, steps=BLOCK,
                                      var_length=True)
    assert nfe == 2 + 4 + 4  # the blocks up to column 11, which holds row 1's second EOS


@torch.no_grad()
def window_recompute(model, prompt, new, window):
    """The definition: greedy decoding one token a step (the most confident masked position, the argmax token with
    [MASK] excluded, confidence from the full softmax), each block decoded from a forward over the window
    [max(0, c + B - W), c + B) alone, at positions 0.., under the block-causal mask."""
    seq = list(prompt) + [MASK] * new
    for c in range(len(prompt), len(seq), BLOCK):
        s = max(0, c + BLOCK - window)
        while MASK in seq[c:c + BLOCK]:
            idx = torch.arange(c + BLOCK - s)
            mask = (idx[None, :] // BLOCK <= idx[:, None] // BLOCK)[None, None]
            hidden = model(torch.tensor([seq[s:c + BLOCK]]), attention_mask=mask, position_ids=idx,
                           output_hidden=True)
            logits = model.logits(hidden[:, -BLOCK:])[0].double()
            conf = F.softmax(logits, dim=-1)
            logits[:, MASK] = -math.inf
            x0 = logits.argmax(-1)
            score = conf.gather(1, x0[:, None]).squeeze(1)
            score[torch.tensor([t != MASK for t in seq[c:c + BLOCK]])] = -math.inf
            i = int(score.argmax())
            seq[c + i] = int(x0[i])
    return seq[len(prompt):]


@pytest.mark.parametrize("window", [8, 16])
def test_sliding_window_equals_recomputing_the_window(window):
    """Past the model's 64 positions: 4 + 72 tokens with windows of 8 and 16 tokens; with and without the cache,
    the tokens of the definition above. The default window (the model's 64 positions) also generates past them."""
    model, _ = tiny()
    prompt = PROMPTS[2]  # one whole block
    expect = window_recompute(model, prompt, 72, window)
    for cache in (True, False):
        got = bd3lm_generate(model, [prompt], max_new_tokens=72, steps=BLOCK, context_window=window, use_cache=cache)
        assert got == [expect]
    assert bd3lm_generate(model, [prompt], max_new_tokens=72, steps=BLOCK) == [window_recompute(model, prompt, 72, 64)]


def test_sliding_window_with_padded_prompts_matches_without_the_cache():
    model, _ = tiny()
    ids, attn = prepare_prompts(PROMPTS, pad_id=PAD, device="cpu")
    runs = [bd3lm_generate_tokens(model, ids, attn, mask_id=MASK, max_new_tokens=40, steps=2, context_window=12,
                                  use_cache=c) for c in (True, False)]
    assert torch.equal(runs[0][0], runs[1][0])
    # a block costs its steps either way (with the cache, the window's recompute is the block's first step), plus
    # the prompt's whole block cached once
    assert runs[1][2] == 11 * 2 and runs[0][2] == runs[1][2] + 1
