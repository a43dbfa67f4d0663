"""Block diffusion: the mask against the paper's definition, the vectorised loss against the block-by-block
definition, its AR (B = 1) and masked-diffusion (B = L) limits, the noise, the config checks."""

import math

import pytest
import torch

from megadlms.config import ConfigError, TransformerConfig
from megadlms.diffusion import bd3lm
from megadlms.diffusion.kv_cache import BlockCache
from megadlms.diffusion.objective import MaskSampler, mask_tokens, weighted_cross_entropy
from megadlms.model import TransformerLM

MASK = 3
V = 48


def paper_mask(n: int, b: int) -> torch.Tensor:
    """M = [[M_BD, M_OBC], [0, M_BC]] entry by entry (Arriola et al., sec. 3.3), block index = position // b."""
    m = torch.zeros(2 * n, 2 * n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            m[i, j] = i // b == j // b  # M_BD: block-diagonal, within the noised sequence
            m[i, n + j] = j // b < i // b  # M_OBC: offset block-causal, noised block -> earlier clean blocks
            m[n + i, n + j] = j // b <= i // b  # M_BC: block-causal among clean blocks
    return m


@pytest.mark.parametrize("n,b", [(8, 1), (8, 2), (12, 3), (16, 4), (16, 16)])
def test_mask_is_the_papers_definition(n, b):
    dense = bd3lm.dense_block_diffusion_mask(n, b)
    assert dense.shape == (1, 1, 2 * n, 2 * n)
    assert torch.equal(dense[0, 0], paper_mask(n, b))
    assert int(dense.sum()) == n * bd3lm.allowed_pairs_per_token(n, b)


def test_flex_block_mask_skips_the_empty_tiles():
    # 2L = 512 in 128-tiles (4 x 4): a tile is computed iff the dense mask has an allowed score in it
    n, b = 256, 16
    block_mask = bd3lm.flex_block_diffusion_mask(n, b, "cpu")
    tiles = block_mask.to_dense()[0, 0].bool()
    dense = bd3lm.dense_block_diffusion_mask(n, b)[0, 0]
    assert torch.equal(tiles, dense.view(4, 128, 4, 128).any(dim=3).any(dim=1))
    assert int(tiles.sum()) == 8  # of 16: x_0 -> x_t never, x_t -> x_t only on the diagonal, both triangles


@torch.no_grad()
def test_the_model_runs_the_block_mask_through_flex_attention():
    # the forward only: FlexAttention has no CPU backward (torch 2.13), which is why training on the CPU takes the
    # dense mask; on the GPU the same BlockMask runs inside the compiled layers
    n, b = 16, 4
    model = tiny(n=n, b=b)
    cfg = bd3lm.Bd3lmConfig(block_size=b, seq_length=n, mask_token_id=MASK)
    tokens, t, u = noise(2, n, n // b)
    inputs, _, _ = bd3lm.prepare_batch(torch.cat([tokens, tokens[:, :1]], dim=1), (t, u), cfg)
    dense = model(inputs, **bd3lm.forward_kwargs(cfg, torch.device("cpu"), flex=False))
    flex = model(inputs, **bd3lm.forward_kwargs(cfg, torch.device("cpu"), flex=True))
    torch.testing.assert_close(flex, dense, rtol=1e-4, atol=1e-5)


def tiny(causal=False, n=16, b=4):
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=64, vocab_size=V, seq_length=n, mask_token_id=MASK,
                            attn_mask_type="causal" if causal else "bidirectional", block_size=None if causal else b)
    return TransformerLM(cfg).eval()


def noise(rows, n, blocks, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, V, (rows, n), generator=g)
    t = 0.05 + 0.9 * torch.rand(rows, blocks, generator=g)
    u = torch.rand(rows, n, generator=g)
    return tokens, t, u


def vectorised_loss(model, tokens, t, u, b, loss="full-vocab"):
    n = tokens.shape[1]
    cfg = bd3lm.Bd3lmConfig(block_size=b, seq_length=n, mask_token_id=MASK, loss=loss)
    sample = torch.cat([tokens, tokens[:, :1]], dim=1)  # the loader's [B, L+1]
    inputs, targets, weights = bd3lm.prepare_batch(sample, (t, u), cfg)
    hidden = model(inputs, output_hidden=True, **bd3lm.forward_kwargs(cfg, tokens.device, flex=False))[:, :n]
    return weighted_cross_entropy(model.logits(hidden), targets, weights, mask_id=cfg.subs_mask_id), weights


@torch.no_grad()
def test_vectorised_loss_equals_the_block_by_block_definition():
    n, b = 16, 4
    model = tiny(n=n, b=b)
    tokens, t, u = noise(3, n, n // b)
    loss, weights = vectorised_loss(model, tokens, t, u, b)
    noisy, _ = bd3lm.mask_blocks(tokens, t, u, block_size=b, mask_token_id=MASK)
    # the definition: block j is denoised from its noised tokens, attending to the cached clean blocks < j
    cache, total = BlockCache(n + b), 0.0
    for j in range(n // b):
        sl, pos = slice(j * b, (j + 1) * b), torch.arange(j * b, (j + 1) * b)
        cache.keep = 0
        logits = model(noisy[:, sl], position_ids=pos, kv_cache=cache)
        total += weighted_cross_entropy(logits, tokens[:, sl], weights[:, sl]) * b / n
        cache.keep = b  # then clean block j joins the cache (attending to itself and the blocks before it)
        model(tokens[:, sl], position_ids=pos, kv_cache=cache)
    assert len(cache) == n
    torch.testing.assert_close(loss, torch.as_tensor(total), rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_block_size_one_is_the_autoregressive_loss():
    # B = 1: a noised token sees only the clean tokens before it and itself, so its CE is the AR CE of
    # p(x_i | x_<i) read at a [MASK] query placed at position i (a causal pass over x_<i, [MASK]). The loss is
    # that AR CE weighted by 1{masked}/t_i, whose expectation over t ~ U and the masks is 1: every token masked
    # (t = 1) is the AR loss exactly; any noise gives the same CEs with these weights.
    n = 8
    model = tiny(n=n, b=1)
    tokens, t, u = noise(2, n, n)
    ar = tiny(causal=True, n=n)
    ar.load_state_dict(model.state_dict())
    ar_ce = torch.stack([torch.nn.functional.cross_entropy(
        ar(torch.cat([tokens[:, :i], torch.full((2, 1), MASK)], dim=1))[:, -1], tokens[:, i], reduction="none")
        for i in range(n)], dim=1)
    loss, weights = vectorised_loss(model, tokens, t, u, 1)
    torch.testing.assert_close(loss, (ar_ce * weights).sum() / tokens.numel(), rtol=1e-5, atol=1e-6)
    every, ones = vectorised_loss(model, tokens, torch.ones(2, n), u, 1)
    assert torch.equal(ones, torch.ones(2, n))
    torch.testing.assert_close(every, ar_ce.mean(), rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_block_size_l_is_the_masked_diffusion_loss():
    # B = L: one noised block attending only to itself; no clean block is before it. With the masked-diffusion
    # level p = (1 - eps) t + eps as BD3-LM's t and the same uniforms, the masks and the 1/p weights are the
    # masked-diffusion objective's (where its at-least-one-mask rule does not fire: a row with a masked token)
    n = 16
    model = tiny(n=n, b=n)
    tokens, t, u = noise(3, n, 1)
    eps = 1e-3
    noisy, w = mask_tokens(tokens, t, u, mask_token_id=MASK, eps=eps)
    p = (1 - eps) * t + eps
    assert ((u < p).sum(1) > 0).all()
    mdlm = weighted_cross_entropy(model(noisy), tokens, w)
    loss, weights = vectorised_loss(model, tokens, p, u, n)
    torch.testing.assert_close(weights, w)
    torch.testing.assert_close(loss, mdlm, rtol=1e-5, atol=1e-6)


def test_noise_is_clipped_per_block_and_deterministic():
    cfg = bd3lm.Bd3lmConfig(block_size=4, seq_length=32, clip_min=0.3, clip_max=0.8, antithetic=False)
    a = bd3lm.draw_noise(MaskSampler(5), 64, 2, cfg)
    b = bd3lm.draw_noise(MaskSampler(5), 64, 2, cfg)
    assert a.t.shape == (64, 8) and a.u.shape == (64, 32) and a.lengths.tolist() == [32, 32]
    assert torch.equal(a.t, b.t) and torch.equal(a.u, b.u)
    assert 0.3 <= float(a.t.min()) and float(a.t.max()) <= 0.8 and float(a.t.max() - a.t.min()) > 0.4
    ev = bd3lm.draw_noise(MaskSampler(5), 64, 1, cfg, evaluation=True)
    assert float(ev.t.min()) < 0.3 and float(ev.t.max()) > 0.8  # evaluation: the whole linear schedule
    seq = bd3lm.draw_noise(MaskSampler(5), 64, 1, bd3lm.Bd3lmConfig(4, 32, noise_per="sequence", antithetic=False))
    assert seq.t.shape == (64, 1)
    g = torch.Generator().manual_seed(5)  # independent draws: t = min + (max - min) r, r ~ U(0, 1)
    torch.testing.assert_close(a.t, 0.3 + 0.5 * torch.rand(64, 8, generator=g))
    tokens = torch.randint(4, V, (64, 32))
    noisy, w = bd3lm.mask_blocks(tokens, a.t, a.u, block_size=4, mask_token_id=MASK)
    t_tok = a.t.repeat_interleave(4, dim=1)
    assert torch.equal(noisy == MASK, a.u < t_tok)
    torch.testing.assert_close(w, (a.u < t_tok).float() / t_tok)


@pytest.mark.parametrize("per,blocks", [("block", 4), ("sequence", 1)])
@pytest.mark.parametrize("evaluation", [False, True])
def test_antithetic_noise_stratifies_t_over_the_global_batch_and_blocks(per, blocks, evaluation):
    """The k-th of n = G x blocks levels (row-major) is lo + (hi - lo)(r_k + k) / n with r_k the generator's k-th
    uniform draw: one level in each of the n equal parts of [lo, hi]."""
    cfg = bd3lm.Bd3lmConfig(block_size=4, seq_length=16, clip_min=0.3, clip_max=0.8, noise_per=per)
    assert cfg.antithetic  # the default
    noise = bd3lm.draw_noise(MaskSampler(7), 6, 2, cfg, evaluation=evaluation)
    lo, hi = (1e-3, 1.0) if evaluation else (0.3, 0.8)
    n = 6 * blocks
    g = torch.Generator().manual_seed(7)
    r = torch.rand(6, blocks, generator=g)
    k = torch.arange(n, dtype=torch.float32).view(6, blocks)
    torch.testing.assert_close(noise.t, lo + (hi - lo) * (r + k) / n)
    strata = ((noise.t.flatten() - lo) / (hi - lo) * n).floor().long()
    assert torch.equal(strata, torch.arange(n))  # one level per stratum
    torch.testing.assert_close(noise.u, torch.rand(6, 16, generator=g))  # then u, as before


def test_antithetic_noise_is_split_invariant_and_resumes_from_the_generator():
    """Drawn per global batch from the checkpointed generator: the rows a rank slices do not depend on the split,
    and a sampler restored from a state continues with the same strata and draws."""
    cfg = bd3lm.Bd3lmConfig(block_size=4, seq_length=16)
    sampler = MaskSampler(3)
    bd3lm.draw_noise(sampler, 8, 1, cfg)
    state = sampler.state_dict()
    after = bd3lm.draw_noise(sampler, 8, 1, cfg)
    restored = MaskSampler(99)
    restored.load_state_dict(state)
    again = bd3lm.draw_noise(restored, 8, 1, cfg)
    assert torch.equal(after.t, again.t) and torch.equal(after.u, again.u)
    from megadlms.training.objectives import Sharding

    # 2 ranks x 2 micro-steps of 2 rows, or 1 rank x 1 micro-step of 8: each sample gets the same t
    rows = [after.t[Sharding(2, r, 2).rows(m)] for m in range(2) for r in range(2)]
    assert torch.equal(torch.cat([rows[0], rows[1], rows[2], rows[3]]), after.t[Sharding(8).rows(0)])


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_size=5, seq_length=32), "--block-size 5 does not divide --seq-length 32"),
    (dict(block_size=0, seq_length=32), "--block-size 0 must be a positive integer"),
    (dict(block_size=4, seq_length=32, clip_min=0.9, clip_max=0.5), "--bd3lm-clip-min 0.9"),
    (dict(block_size=4, seq_length=32, noise_per="token"), "--bd3lm-noise-per 'token'"),
])
def test_config_errors_name_the_flag(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        bd3lm.Bd3lmConfig(**kwargs)


@torch.no_grad()
def test_nelbo_is_deterministic_and_matches_the_training_loss():
    n, b = 16, 4
    model = tiny(n=n, b=b)
    tokens = torch.randint(4, V, (2, n), generator=torch.Generator().manual_seed(3))
    a = bd3lm.nelbo(model, tokens, block_size=b, mask_token_id=MASK, generator=torch.Generator().manual_seed(1))
    again = bd3lm.nelbo(model, tokens, block_size=b, mask_token_id=MASK, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, again) and a.shape == (2,)
    g = torch.Generator().manual_seed(1)
    t = 1e-3 + (1 - 1e-3) * torch.rand(2, n // b, generator=g)
    u = torch.rand(2, n, generator=g)
    loss, _ = vectorised_loss(model, tokens, t, u, b, loss="subs")  # the default: SUBS, as trained
    torch.testing.assert_close(a.mean().float(), loss, rtol=1e-5, atol=1e-6)
    full = bd3lm.nelbo(model, tokens, block_size=b, mask_token_id=MASK, generator=torch.Generator().manual_seed(1),
                       loss="full-vocab")
    loss_full, _ = vectorised_loss(model, tokens, t, u, b, loss="full-vocab")
    torch.testing.assert_close(full.mean().float(), loss_full, rtol=1e-5, atol=1e-6)
    assert (full > a).all()  # [MASK] in the softmax only loosens the bound


# --------------------------------------------------------------------------- the training mode

SMALL = ["--model-path", "tiny",  # flags of its own run, not over the demo configuration
         "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--ffn-hidden-size", "64", "--seq-length", "16", "--device", "cpu", "--no-compile", "--num-workers", "0",
         "--eval-iters", "0", "--log-interval", "1", "--no-progress", "--lr", "3e-3", "--lr-warmup-iters", "2",
         "--no-generate-sample", "--model-running-mode", "bd3lm", "--block-size", "4", "--micro-batch-size", "4"]


def _train(argv):
    from megadlms.training.args import parse_train_args
    from megadlms.training.trainer import train

    return train(parse_train_args(argv))


def _losses(state):
    return [m["loss"] for m in state.history if "loss" in m and "eval_loss" not in m]


def test_training_resumes_exactly_and_records_the_block_size(tmp_path):
    from megadlms.training import checkpoint as ckpt

    common = SMALL + ["--global-batch-size", "8", "--bd3lm-clip-min", "0.3", "--bd3lm-clip-max", "0.8",
                      "--train-iters", "6"]
    straight = _train(common + ["--save", str(tmp_path / "a")])
    _train(common + ["--save", str(tmp_path / "b"), "--save-interval", "3", "--exit-interval", "3"])
    resumed = _train(common + ["--save", str(tmp_path / "b"), "--load", str(tmp_path / "b")])
    assert _losses(resumed) == _losses(straight)[3:]  # bitwise
    (wa, cfg, _), (wb, _, _) = (ckpt.load_model_from_checkpoint(tmp_path / d) for d in "ab")
    assert cfg.block_size == 4 and cfg.attn_mask_type == "bidirectional"
    for k, v in wa.state_dict().items():
        assert torch.equal(v, wb.state_dict()[k]), k


def test_validation_reports_the_nelbo_with_the_same_noise_every_time():
    from megadlms.training.args import parse_train_args
    from megadlms.training.trainer import setup

    trainer = setup(parse_train_args(SMALL + ["--eval-iters", "2", "--train-iters", "4"]))
    first, second = trainer.evaluate(), trainer.evaluate()
    log_vocab = math.log(trainer.model_config.vocab_size)  # a masked token's CE at init; E[1{masked} / t] = 1
    assert first == second and 0.7 * log_vocab < first < 1.5 * log_vocab


@pytest.mark.parametrize("extra,match", [
    (["--block-size", "5"], "--block-size 5 does not divide --seq-length 16"),
    (["--model-running-mode", "difflm-noshift"], "--block-size 4 is only used with --model-running-mode bd3lm"),
    (["--bd3lm-clip-search-widths", "0.5"], "--bd3lm-clip-search-widths: the candidates of --bd3lm-clip-search"),
])
def test_bad_flags_are_one_line_errors(extra, match):
    from megadlms.training.args import parse_train_args
    from megadlms.training.trainer import setup

    with pytest.raises(ConfigError, match=match):
        setup(parse_train_args(SMALL + extra + ["--train-iters", "4"]))


def test_activation_recompute_and_fp8_linears_train_the_same_objective():
    base = SMALL + ["--train-iters", "2", "--lr-warmup-iters", "1"]
    plain = _losses(_train(base))
    assert _losses(_train(base + ["--recompute-granularity", "full"])) == plain  # bitwise
    fp8 = _losses(_train(base + ["--fp8-format", "hybrid", "--recompute-granularity", "full"]))
    torch.testing.assert_close(torch.tensor(fp8), torch.tensor(plain), rtol=0.03, atol=0.0)


def test_layers_replay_from_cuda_graphs_under_the_block_diffusion_mask(monkeypatch):
    """The block-diffusion mask is a static input of the captured layers (emulated graphs on the CPU)."""
    from megadlms.training.args import parse_train_args
    from megadlms.training.trainer import setup

    argv = SMALL + ["--train-iters", "4", "--lr-warmup-iters", "1"]
    eager = _losses(_train(argv))
    monkeypatch.setenv("MEGADLMS_EMULATE_CUDA_GRAPHS", "1")
    trainer = setup(parse_train_args(argv + ["--cuda-graphs", "on"]))
    graphed = _losses(trainer.run())
    assert trainer.layer_graphs.num_replays == 3  # every step after the first (the capture's)
    assert graphed == pytest.approx(eager, rel=1e-5)


@torch.no_grad()
def test_ignore_bos_never_masks_the_first_token_and_the_nelbo_leaves_it_out():
    n, b = 16, 4
    model = tiny(n=n, b=b)
    tokens = torch.randint(4, V, (2, n), generator=torch.Generator().manual_seed(3))
    t, u = torch.full((2, n // b), 0.5), torch.rand(2, n, generator=torch.Generator().manual_seed(4))
    u[:, 0] = 0.0  # would be masked at any t
    cfg = bd3lm.Bd3lmConfig(block_size=b, seq_length=n, mask_token_id=MASK, ignore_bos=True)
    sample = torch.cat([tokens, tokens[:, :1]], dim=1)
    inputs, _, weights = bd3lm.prepare_batch(sample, (t, u), cfg)
    assert (inputs[:, 0] == tokens[:, 0]).all() and (weights[:, 0] == 0).all()
    rest = u[:, 1:] < 0.5  # every other token as without the option: masked where u < t, weight 1/t
    assert torch.equal(inputs[:, 1:n] == MASK, rest) and torch.equal(weights[:, 1:], rest.float() / 0.5)
    # nelbo: the same noise with token 0 never masked, summed and divided by the other n - 1 tokens
    got = bd3lm.nelbo(model, tokens, block_size=b, mask_token_id=MASK, generator=torch.Generator().manual_seed(1),
                      ignore_bos=True)
    g = torch.Generator().manual_seed(1)
    t = 1e-3 + (1 - 1e-3) * torch.rand(2, n // b, generator=g)
    u = torch.rand(2, n, generator=g)
    u[:, 0] = 2.0
    loss, _ = vectorised_loss(model, tokens, t, u, b, loss="subs")  # / (2 n) tokens
    torch.testing.assert_close(got.mean().float(), loss * n / (n - 1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode,extra", [("bd3lm", ["--block-size", "4"]), ("difflm-noshift", [])])
def test_ignore_bos_validation_divides_by_the_other_tokens(mode, extra):
    from megadlms.training.args import parse_train_args
    from megadlms.training.trainer import setup

    base = SMALL[:-6] + ["--micro-batch-size", "4"]  # without the mode and the block size
    trainer = setup(parse_train_args(base + ["--model-running-mode", mode, "--train-iters", "4", "--ignore-bos",
                                             "--difflm-varilen-prob", "0"] + extra))
    obj, mask = trainer.objective, trainer.model_config.mask_token_id
    assert obj.validation_note() == "SUBS, first token excluded"
    for evaluation, denominator in ((False, None), (True, 4 * 15)):
        noise = obj.draw_noise(MaskSampler(0), 4, 1, evaluation=evaluation)
        noise.u[:, 0] = 0.0  # token 0 would be masked
        batch = next(obj.micro_batches(iter(trainer.loaders.train), noise, 1, trainer.device))
        assert (batch.inputs[:, 0] != mask).all() and (batch.weights[:, 0] == 0).all()
        assert (None if batch.denominator is None else float(batch.denominator)) == denominator
    plain = setup(parse_train_args(base + ["--model-running-mode", mode, "--train-iters", "4"] + extra))
    assert plain.objective.validation_note() == "SUBS, first token included"


def test_resample_redraws_only_the_blocks_outside_the_clip():
    """Blocks of 4, clip [0.3, 0.8]: a block keeps its first draw when 2 or 3 of its 4 tokens are masked (0.5,
    0.75); otherwise it takes the next fresh draw of the generator, until every block is inside."""
    cfg = bd3lm.Bd3lmConfig(block_size=4, seq_length=16, clip_min=0.3, clip_max=0.8, resample=True, antithetic=False)
    noise = bd3lm.draw_noise(MaskSampler(11), 8, 1, cfg)
    frac = (noise.u < noise.t.repeat_interleave(4, dim=1)).float().view(8, 4, 4).mean(-1)
    assert ((frac >= 0.3) & (frac <= 0.8)).all()
    g = torch.Generator().manual_seed(11)  # replay the definition
    t = 0.3 + 0.5 * torch.rand(8, 4, generator=g)
    u = torch.rand(8, 16, generator=g)
    while True:
        f = (u < t.repeat_interleave(4, dim=1)).float().view(8, 4, 4).mean(-1)
        bad = (f < 0.3) | (f > 0.8)
        if not bad.any():
            break
        u = torch.where(bad.repeat_interleave(4, dim=1), torch.rand(8, 16, generator=g), u)
    assert torch.equal(noise.t, t) and torch.equal(noise.u, u)
    ev = bd3lm.draw_noise(MaskSampler(11), 8, 1, cfg, evaluation=True)  # evaluation: the plain schedule
    g = torch.Generator().manual_seed(11)
    torch.rand(8, 4, generator=g)
    assert torch.equal(ev.u, torch.rand(8, 16, generator=g))
    # a bound left at the linear schedule's end (1e-3 or 1) is not enforced, as in the reference
    assert bd3lm.Bd3lmConfig(4, 16, clip_min=1e-3, clip_max=0.5, resample=True).resample_bounds == (0.0, 0.5)
    assert bd3lm.Bd3lmConfig(4, 16, clip_min=0.3, clip_max=1.0, resample=True).resample_bounds == (0.3, 1.0)
    with pytest.raises(ConfigError, match="no masked fraction k/4"):
        bd3lm.Bd3lmConfig(4, 16, clip_min=0.3, clip_max=0.45, resample=True)


def test_training_weight_is_one_when_the_clip_starts_above_one_half():
    tokens = torch.randint(4, V, (2, 8))
    sample = torch.cat([tokens, tokens[:, :1]], dim=1)
    t, u = torch.full((2, 2), 0.7), torch.rand(2, 8, generator=torch.Generator().manual_seed(0))
    masked = (u < 0.7).float()
    high = bd3lm.Bd3lmConfig(4, 8, mask_token_id=MASK, clip_min=0.6, clip_max=0.9)
    assert torch.equal(bd3lm.prepare_batch(sample, (t, u), high)[2], masked)  # weight 1
    torch.testing.assert_close(bd3lm.prepare_batch(sample, (t, u), high, evaluation=True)[2], masked / 0.7)
    low = bd3lm.Bd3lmConfig(4, 8, mask_token_id=MASK, clip_min=0.5, clip_max=0.9)  # 0.5 is not above one half
    torch.testing.assert_close(bd3lm.prepare_batch(sample, (t, u), low)[2], masked / 0.7)


def test_mask_blocks_without_a_mask_id_names_the_field_and_the_fix():
    with pytest.raises(ConfigError, match=r"^mask_blocks needs a \[MASK\] id but mask_token_id is None .*"
                                          r"cfg\.replace\(mask_token_id="):
        bd3lm.mask_blocks(torch.zeros(1, 8, dtype=torch.long), torch.rand(1, 2), torch.rand(1, 8), block_size=4,
                          mask_token_id=None)
