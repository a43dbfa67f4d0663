"""BD3-LM's clip-interval search: the candidate grid, the per-block losses, the batch variance and the choice
against hand-computed values; in training, the adopted interval against the definition, logged, checkpointed."""

import pytest
import torch
import torch.nn.functional as F

from megadlms.config import ConfigError
from megadlms.diffusion import bd3lm
from megadlms.diffusion.clip_search import ClipSearch, block_means, clip_grid, lowest_variance, moments, variance
from megadlms.diffusion.objective import MaskSampler, subs_logits, token_losses


def test_grid_is_the_linear_schedule_then_each_widths_intervals():
    # widths 0.5 and 0.9 with starts 0.25 apart: 0, 0.25, 0.5 for 0.5 (0.5 <= 1 - 0.5); only 0 for 0.9
    assert clip_grid((0.5, 0.9), 0.25, 1e-3) == [(1e-3, 1.0), (1e-3, 0.5), (0.25, 0.75), (0.5, 1.0), (1e-3, 0.9)]
    grid = clip_grid((0.5, 0.6, 0.7, 0.8, 0.9), 0.05, 1e-3)  # the paper's: 1 + 11 + 9 + 7 + 5 + 3
    assert len(grid) == 36 and grid[:3] == [(1e-3, 1.0), (1e-3, 0.5), (0.05, 0.55)]
    assert grid[11] == (0.5, 1.0) and grid[-1] == (0.1, 1.0) and (0.35, 0.95) in grid
    # with --bd3lm-resample, blocks of 1 reach the fractions 0 and 1 only: intervals strictly inside are dropped
    cfg = bd3lm.Bd3lmConfig(1, 8, clip_search=True, resample=True, search_widths=(0.5,), search_delta=0.25)
    assert [(c.clip_min, c.clip_max) for c in cfg.search_candidates()] == [(1e-3, 1.0), (1e-3, 0.5), (0.5, 1.0)]
    assert all(c.resample and not c.clip_search for c in cfg.search_candidates())


def test_block_means_variance_and_choice_by_hand():
    losses = torch.tensor([[2.0, 0.0, 4.0, 4.0], [0.0, 0.0, 6.0, 0.0]])
    per_block = block_means(losses, 2)  # each block's sum over its 2 tokens / 2
    assert per_block.tolist() == [[1.0, 4.0], [0.0, 3.0]]
    # mean 2; squared deviations 1, 4, 4, 1 -> unbiased variance 10 / 3
    assert moments(per_block).tolist() == [4.0, 8.0, 26.0]
    assert float(variance(moments(per_block))) == pytest.approx(10 / 3)
    assert float(variance(moments(per_block))) == pytest.approx(float(per_block.var()))
    # two batches x three candidates: the sums of the batch variances are 10/3 + 0, 0 + 2, 2 + 0 -> candidate 1,
    # and on a tie (1 and 2) the first
    flat, spread = moments(torch.tensor([5.0, 5.0])), moments(torch.tensor([1.0, 3.0]))  # variances 0 and 2
    stats = torch.stack([torch.stack([moments(per_block), flat, spread]), torch.stack([flat, spread, flat])])
    best, total = lowest_variance(stats)
    assert best == 1 and total.tolist() == pytest.approx([10 / 3, 2.0, 2.0])
    assert variance(moments(torch.tensor([7.0]))).item() == 0.0  # one value: no spread


def test_micro_batches_add_up_to_the_batch_variance():
    search = ClipSearch([(1e-3, 1.0), (0.3, 0.8)], max_batches=1)
    values = torch.arange(12.0).view(4, 3) ** 1.5
    search.observe(0, 1, values[:2])  # two micro-batches (or ranks) of one validation batch
    search.observe(0, 1, values[2:])
    search.observe(0, 0, torch.zeros(4, 3))
    stats = search.stacked()
    assert stats is not None and stats.shape == (1, 2, 3)
    torch.testing.assert_close(variance(stats[0, 1]), values.double().var())
    assert lowest_variance(stats)[0] == 0 and search.wants(0) and not search.wants(1)
    search.reset()
    assert search.stacked() is None


def test_token_losses_are_the_weighted_subs_cross_entropy():
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 6, 8, generator=g), torch.randn(11, 8, generator=g)
    targets = torch.randint(0, 10, (2, 6), generator=g)
    weights = torch.tensor([[0.0, 2.0, 0.0, 1.5, 0.0, 4.0], [1.0, 0.0, 0.0, 0.0, 3.0, 0.0]])
    got = token_losses(hidden, weight, targets, weights, mask_id=10, chunk_tokens=2)
    ce = F.cross_entropy(subs_logits(hidden @ weight.t(), 10).transpose(1, 2), targets, reduction="none")
    torch.testing.assert_close(got, ce * weights)


def test_bad_search_settings_name_the_flag():
    with pytest.raises(ConfigError, match="--bd3lm-clip-search-widths"):
        bd3lm.Bd3lmConfig(4, 16, clip_search=True, search_widths=(0.5, 1.2))
    with pytest.raises(ConfigError, match="--bd3lm-clip-search-delta 0"):
        bd3lm.Bd3lmConfig(4, 16, clip_search=True, search_delta=0.0)


# --------------------------------------------------------------------------- in training

SMALL = ["--model-path", "tiny", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--ffn-hidden-size", "64", "--seq-length", "16", "--device", "cpu", "--no-compile",
         "--num-workers", "0", "--log-interval", "1", "--no-progress", "--lr", "3e-3", "--lr-warmup-iters", "2",
         "--no-generate-sample", "--model-running-mode", "bd3lm", "--block-size", "4", "--micro-batch-size", "4",
         "--bd3lm-clip-search", "--eval-interval", "2"]


def _setup(argv):
    from megadlms.training.args import parse_train_args
    from megadlms.training.trainer import setup

    return setup(parse_train_args(SMALL + argv))


@torch.no_grad()
def test_validation_adopts_the_interval_of_lowest_variance_from_the_definition():
    """One validation batch of 4 windows: each candidate's variance is the unbiased variance over windows x blocks
    of sum_block(1{masked} / t x CE) / B, with the candidate's training noise; the lowest is adopted."""
    trainer = _setup(["--eval-iters", "1", "--train-iters", "2"])
    trainer.evaluate()
    found = trainer.validation_metrics
    obj, model = trainer.objective, trainer.base_model
    assert (found["bd3lm_clip_min"], found["bd3lm_clip_max"]) == (obj.config.clip_min, obj.config.clip_max)
    assert (obj.config.clip_min, obj.config.clip_max) != (1e-3, 1.0)  # here the search moves away from the default
    t = obj.draw_noise(MaskSampler(0), 64, 1).t  # training draws from the adopted interval
    assert obj.config.clip_min <= float(t.min()) and float(t.max()) <= obj.config.clip_max
    loader = trainer.loaders.valid
    loader.load_state_dict({"consumed_samples": 0})
    sample = next(iter(loader))
    variances = {}
    for cand in obj.candidates:
        noise = bd3lm.draw_noise(MaskSampler((1234 + 5) * 1_000_003), 4, 1, cand)
        inputs, targets, weights = bd3lm.prepare_batch(sample, (noise.t, noise.u), cand)
        logits = model(inputs, **bd3lm.forward_kwargs(cand, torch.device("cpu"), flex=False))[:, :16].float()
        ce = F.cross_entropy(subs_logits(logits, cand.mask_token_id).transpose(1, 2), targets, reduction="none")
        per_block = (torch.where(weights > 0, ce, 0.0) * weights).view(4, 4, 4).sum(-1) / 4
        variances[(cand.clip_min, cand.clip_max)] = float(per_block.double().var())
        assert found[f"bd3lm_clip_variance/{cand.clip_min:g}-{cand.clip_max:g}"] == pytest.approx(
            variances[(cand.clip_min, cand.clip_max)], rel=1e-4)
    assert min(variances, key=variances.get) == (obj.config.clip_min, obj.config.clip_max)
    assert found["bd3lm_clip_variance"] == pytest.approx(min(variances.values()), rel=1e-4)
    assert obj.validation_note().endswith(f"training t ~ U[{obj.config.clip_min:g}, {obj.config.clip_max:g}] "
                                          "(clip search, 36 intervals)")


def test_the_adopted_interval_trains_and_resumes_exactly(tmp_path):
    common = ["--eval-iters", "1", "--global-batch-size", "8", "--train-iters", "6"]
    straight = _setup(common + ["--save", str(tmp_path / "a")]).run()
    _setup(common + ["--save", str(tmp_path / "b"), "--save-interval", "3", "--exit-interval", "3"]).run()
    resumed = _setup(common + ["--save", str(tmp_path / "b"), "--load", str(tmp_path / "b")])
    adopted = (resumed.objective.config.clip_min, resumed.objective.config.clip_max)
    assert adopted != (1e-3, 1.0)  # the checkpoint's interval, not the flags' default
    evals = [m for m in straight.history if "eval_loss" in m]
    assert [m["iteration"] for m in evals] == [0, 2, 4, 6]
    assert adopted == (evals[1]["bd3lm_clip_min"], evals[1]["bd3lm_clip_max"])  # adopted at iteration 2
    losses = [m["loss"] for m in resumed.run().history if "loss" in m and "eval_loss" not in m]
    assert losses == [m["loss"] for m in straight.history if "loss" in m and "eval_loss" not in m][3:]  # bitwise


def test_search_needs_validation():
    with pytest.raises(ConfigError, match="--bd3lm-clip-search chooses the interval during validation"):
        _setup(["--eval-iters", "0", "--train-iters", "2"])
