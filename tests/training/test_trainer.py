"""End-to-end training on CPU: falling loss, exact resume, accumulation, AR mode, CLI."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megadlms.config import ConfigError
from megadlms.training import checkpoint as ckpt
from megadlms.training.args import parse_train_args
from megadlms.training.trainer import setup, train

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--model-path", "tiny",  # flags of its own run, not over the demo configuration
         "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--ffn-hidden-size", "128", "--seq-length", "32", "--device", "cpu", "--no-compile", "--num-workers", "0",
         "--eval-iters", "0", "--log-interval", "1", "--no-progress", "--lr", "3e-3", "--lr-warmup-iters", "2",
         "--difflm-varilen-prob", "0.2", "--no-generate-sample"]


def run(argv):
    return train(parse_train_args(argv))


def losses(state):
    return [m["loss"] for m in state.history if "loss" in m and "eval_loss" not in m]


def test_loss_falls_on_the_bundled_corpus(tmp_path):
    # the validation loss uses the same batches and masks every time, so before/after are comparable
    args = parse_train_args(SMALL + ["--micro-batch-size", "16", "--train-iters", "60", "--lr-decay-style",
                                     "constant", "--eval-iters", "4", "--eval-interval", "1000",
                                     "--save", str(tmp_path / "ck")])
    trainer = setup(args)
    before = trainer.evaluate()
    state = trainer.run()
    after = trainer.evaluate()
    assert len(losses(state)) == 60
    assert after < 0.8 * before, (before, after)
    # metrics.jsonl beside the checkpoints: one line per log interval and the final validation
    lines = [json.loads(x) for x in (tmp_path / "ck" / "metrics.jsonl").read_text().splitlines()]
    train_rec = [r for r in lines if r["split"] == "train"][-1]
    assert train_rec["iteration"] == 60
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "memory_gib"} <= set(train_rec)
    valid = [r for r in lines if r["split"] == "valid"]
    assert valid[0]["iteration"] == 0 and valid[0]["loss"] == pytest.approx(before, rel=1e-6)  # the curve's start
    assert valid[-1]["loss"] < before


def test_trains_from_python_dataclasses_as_from_flags():
    """The library API: a RunConfig built in Python, no argparse, trains exactly as the same flags do."""
    from megadlms.data.args import DataSourceConfig
    from megadlms.training import DiffusionConfig, ModelConfig, RunConfig, TrainConfig

    config = RunConfig(
        model=ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                          ffn_hidden_size=128, seq_length=32),
        objective=DiffusionConfig(difflm_varilen_prob=0.2),
        train=TrainConfig(train_iters=3, micro_batch_size=2, lr=3e-3, lr_warmup_iters=2, device="cpu",
                          compile=False, eval_iters=0, log_interval=1, no_progress=True),
        data=DataSourceConfig(num_workers=0))
    ours = losses(train(config))
    assert len(ours) == 3 and all(0 < x < 20 for x in ours)
    assert ours == losses(run(SMALL + ["--micro-batch-size", "2", "--train-iters", "3"]))


def _weights(path):
    model, _, _ = ckpt.load_model_from_checkpoint(path)
    return model.state_dict()


def test_exact_resume_is_bitwise(tmp_path):
    common = SMALL + ["--micro-batch-size", "4", "--global-batch-size", "8"]
    straight = run(common + ["--train-iters", "8", "--save", str(tmp_path / "a")])
    run(common + ["--train-iters", "8", "--save", str(tmp_path / "b"), "--save-interval", "4", "--exit-interval", "4"])
    assert (tmp_path / "b" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    resumed = run(common + ["--train-iters", "8", "--save", str(tmp_path / "b"), "--load", str(tmp_path / "b")])
    assert losses(resumed) == losses(straight)[4:]  # bitwise equal floats
    wa, wb = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_gradient_accumulation_matches_a_large_micro_batch(tmp_path):
    common = SMALL + ["--train-iters", "4", "--difflm-varilen-prob", "0"]
    big = losses(run(common + ["--micro-batch-size", "8"]))
    acc = losses(run(common + ["--micro-batch-size", "2", "--global-batch-size", "8"]))
    torch.testing.assert_close(torch.tensor(acc), torch.tensor(big), rtol=1e-5, atol=1e-6)


def test_autoregressive_mode_trains(tmp_path):
    state = run(SMALL + ["--model-running-mode", "vanilla", "--micro-batch-size", "8", "--train-iters", "30",
                         "--lr-decay-style", "constant"])
    ls = losses(state)
    assert sum(ls[-5:]) / 5 < 0.8 * sum(ls[:5]) / 5


def test_finetune_loads_weights_only(tmp_path):
    run(SMALL + ["--micro-batch-size", "4", "--train-iters", "3", "--save", str(tmp_path / "a")])
    state = run(SMALL + ["--micro-batch-size", "4", "--train-iters", "2", "--load", str(tmp_path / "a"),
                         "--finetune"])
    assert state.iteration == 2  # counted from zero


def test_fp8_runs_load_checkpoints_saved_without_fp8_state(tmp_path, caplog):
    """Finetuning or resuming with FP8 (and FP8 attention) from a BF16 checkpoint: the FP8 amax histories and scales
    start fresh with a warning; a tensor of the model itself missing from the checkpoint is still an error."""
    run(SMALL + ["--micro-batch-size", "4", "--train-iters", "2", "--save", str(tmp_path / "bf16")])
    fp8 = ["--fp8-format", "hybrid", "--fp8-dot-product-attention"]
    with caplog.at_level("WARNING", logger="megadlms"):
        state = run(SMALL + fp8 + ["--micro-batch-size", "4", "--train-iters", "2", "--load", str(tmp_path / "bf16"),
                                   "--finetune"])
    assert state.iteration == 2 and "no FP8 state" in caplog.text
    state = run(SMALL + fp8 + ["--micro-batch-size", "4", "--train-iters", "3", "--load", str(tmp_path / "bf16")])
    assert state.iteration == 3  # resumed at 2
    with pytest.raises(ckpt.CheckpointError, match="another architecture"):
        run(SMALL + fp8 + ["--untie-embeddings-and-output-weights", "--micro-batch-size", "4", "--train-iters", "2",
                           "--load", str(tmp_path / "bf16"), "--finetune"])


def test_yaml_config_and_unknown_key(tmp_path):
    good = tmp_path / "run.yaml"
    good.write_text("train-iters: 7\nmicro_batch_size: 3\n")
    args = parse_train_args(["--config", str(good), "--train-iters", "9"])
    assert args.train.train_iters == 9 and args.train.micro_batch_size == 3
    bad = tmp_path / "bad.yaml"
    bad.write_text("train-itres: 7\n")
    with pytest.raises(ConfigError, match="train-itres"):
        parse_train_args(["--config", str(bad)])


def test_fp8_hybrid_synonym():
    assert parse_train_args(["--fp8-hybrid"]).fp8.fp8_format == "hybrid"
    assert parse_train_args(["--fp8-format", "e4m3"]).fp8.fp8_format == "e4m3"


def test_fp8_telemetry_is_logged_only_when_asked_for():
    """`--fp8-stats` puts the FP8 casts' amax / underflow / saturation in the log every --log-interval; off by
    default (its steps run without the CUDA graphs)."""
    fp8 = SMALL + ["--fp8-format", "hybrid", "--micro-batch-size", "4", "--train-iters", "2"]
    plain = run(fp8).history
    assert plain and not any(k.startswith("fp8/") for m in plain for k in m)
    logged = [m for m in run(fp8 + ["--fp8-stats"]).history if "loss" in m]
    assert len(logged) == 2
    keys = {f"fp8/{r}_{k}" for r in ("input", "weight", "grad") for k in ("amax", "underflow", "saturation")}
    for m in logged:
        assert keys <= set(m)
        assert m["fp8/input_amax"] > 0 and m["fp8/grad_amax"] > 0


def test_cli_help_and_train_smoke(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "pretrain_difflm.py"), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--fp8-format" in out.stdout and "--data-path" in out.stdout
    ours = subprocess.run([sys.executable, "-m", "megadlms", "train", "--help"], capture_output=True, text=True)
    # exactly the same flags
    strip = lambda s: s.split("options:", 1)[1]
    assert strip(ours.stdout) == strip(out.stdout)
    run_ = subprocess.run([sys.executable, "-m", "megadlms", "train", *SMALL, "--micro-batch-size", "2",
                           "--train-iters", "2", "--save", str(tmp_path / "s"), "--generate-sample"],
                          capture_output=True, text=True)
    assert run_.returncode == 0, run_.stderr[-2000:]
    assert "iter      2/2" in run_.stdout and "MFU n/a" in run_.stdout
    assert "sample> Once upon a time" in run_.stdout  # the demo's closing sample


def test_fp8_weights_uncached_in_training_and_cast_once_per_evaluation():
    """At one micro-batch per step the FP8 weight cache is off (nothing reuses it; each layer's FP8 weight is freed
    after its backward); an evaluation turns it on for its batches (same weights: one cast per layer) and drops
    what it cached on the way out."""
    from megadlms.fp8 import fp8_modules
    from megadlms.fp8.fusions.fused_mlp import fused_projections

    trainer = setup(parse_train_args(SMALL + ["--train-iters", "2", "--fp8-format", "hybrid", "--eval-iters", "3",
                                              "--difflm-varilen-prob", "0"]))
    mods = list(fp8_modules(trainer.model))
    assert mods and not any(m.cache_weight for m in mods)
    trainer._train_iter = iter(trainer.loaders.train)
    trainer.train_step()
    before = [m.num_weight_casts for m in mods]
    assert trainer.evaluate() is not None
    assert [m.num_weight_casts - b for m, b in zip(mods, before)] == [1] * len(mods)  # 3 batches, one cast
    assert not any(m.cache_weight or m.weight_cache is not None for m in mods)
    assert all(g.weight_cache is None for g in fused_projections(trainer.model))
    trainer.train_step()
    assert [m.num_weight_casts - b for m, b in zip(mods, before)] == [2] * len(mods)  # training casts afresh


def test_blockwise_and_mxfp8_track_bf16_and_blockwise_resumes_exactly(tmp_path):
    """CPU emulation of the finer-scaled recipes: the losses stay close to those of the unquantized run on
    the same data and seed (within 0.5%), and a blockwise run (no delayed state) resumes bitwise from its checkpoint."""
    common = SMALL + ["--micro-batch-size", "4", "--train-iters", "8", "--difflm-varilen-prob", "0"]
    base = losses(run(common))
    blockwise = ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"]
    straight = losses(run(common + blockwise + ["--save", str(tmp_path / "a")]))
    mx = losses(run(common + ["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"]))
    for ours in (straight, mx):
        assert len(ours) == 8 and ours != base
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(base), rtol=0.005, atol=0)  # measured: <0.1%
    run(common + blockwise + ["--save", str(tmp_path / "b"), "--save-interval", "4", "--exit-interval", "4"])
    resumed = run(common + blockwise + ["--save", str(tmp_path / "b"), "--load", str(tmp_path / "b")])
    assert losses(resumed) == straight[4:]
    assert not any("fp8_amax_history" in k for k in _weights(tmp_path / "b"))  # no delayed-scaling state


def test_running_mode_defaults_to_the_one_the_model_records(tmp_path):
    """A shifted model (Dream's prediction of token i + 1) or a block-diffusion checkpoint keeps its mode without
    --model-running-mode; a flag that contradicts the shift is refused in one line."""
    base = SMALL + ["--micro-batch-size", "2", "--train-iters", "2"]
    for mode, extra in (("difflm-shift", []), ("bd3lm", ["--block-size", "4"])):
        run(base + ["--model-running-mode", mode, *extra, "--save", str(tmp_path / mode)])
        trainer = setup(parse_train_args(base + ["--load", str(tmp_path / mode), "--use-checkpoint-args",
                                                 "--finetune"]))
        assert (trainer.model_config.diffusion_shift, trainer.model_config.block_size) == (
            (True, None) if mode == "difflm-shift" else (False, 4))
        assert trainer.objective.name == ("masked diffusion (shifted)" if mode == "difflm-shift"
                                          else "block diffusion")
    with pytest.raises(ConfigError, match="drop the flag or use difflm-shift"):
        setup(parse_train_args(base + ["--load", str(tmp_path / "difflm-shift"), "--use-checkpoint-args",
                                       "--finetune", "--model-running-mode", "difflm-noshift"]))
    assert setup(parse_train_args(base)).objective.name == "masked diffusion"  # nothing recorded: the default


@pytest.mark.parametrize("mode,extra", [
    ("difflm-noshift", []), ("difflm-shift", []), ("bd3lm", ["--block-size", "4"]),
    ("bd3lm", ["--block-size", "4", "--bf16"]), ("difflm-noshift", ["--fp8-format", "hybrid"]),
    ("bd3lm", ["--block-size", "4", "--fp8-format", "hybrid", "--diffusion-loss", "full-vocab"]),
])
def test_the_training_loss_is_subs_by_default_in_both_head_paths(mode, extra):
    """The objective's loss, plain logits and fused chunked head alike, equals the definition computed from the
    model's logits: sum of w * (logsumexp over the vocabulary without [MASK] - logit of the target) / (B * L)."""
    trainer = setup(parse_train_args(SMALL + ["--train-iters", "2", "--model-running-mode", mode,
                                              "--difflm-varilen-prob", "0"] + extra))
    obj, mask = trainer.objective, trainer.model_config.mask_token_id
    noise = obj.draw_noise(trainer.sampler, trainer.global_batch, 1)
    batch = next(obj.micro_batches(iter(trainer.loaders.train), noise, 1, trainer.device))
    n = batch.targets.shape[1]
    with torch.no_grad(), trainer._autocast():
        hidden = trainer.model(batch.inputs, output_hidden=True, **batch.model_kwargs())[:, :n]
        logits = torch.nn.functional.linear(hidden, trainer._output_weight()).float()
        plain = obj.loss(trainer.model, batch, trainer._output_weight)
        obj.loss_chunk_tokens = 7
        batch.weighted_rows = None
        fused = obj.loss(trainer.model, batch, trainer._output_weight)
    keep = torch.arange(logits.shape[-1]) != mask
    full_vocab = "full-vocab" in extra
    lse = torch.logsumexp(logits if full_vocab else logits[..., keep], dim=-1)
    ce = lse - logits.gather(-1, batch.targets[..., None]).squeeze(-1)
    expect = (ce * batch.weights).sum() / batch.targets.numel()
    torch.testing.assert_close(plain, expect, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused, expect, rtol=2e-2 if "--bf16" in extra else 1e-5, atol=1e-6)
    subs_gap = torch.logsumexp(logits, -1) - torch.logsumexp(logits[..., keep], -1)  # > 0: [MASK]'s share
    assert (subs_gap[batch.weights > 0] > 0).all()


def test_use_checkpoint_args_keeps_the_runs_seq_length_and_the_checkpoints_tokenizer(tmp_path):
    """--use-checkpoint-args: the architecture is the checkpoint's, the window length the run's; a model flag that
    contradicts the checkpoint is refused; a run that loads a checkpoint tokenizes with the tokenizer saved there."""
    run(SMALL + ["--micro-batch-size", "2", "--train-iters", "2", "--save", str(tmp_path / "a")])
    load = ["--load", str(tmp_path / "a"), "--use-checkpoint-args", "--finetune", "--train-iters", "2",
            "--micro-batch-size", "2", "--device", "cpu", "--no-compile", "--num-workers", "0", "--eval-iters", "0"]
    trainer = setup(parse_train_args(load + ["--seq-length", "16"]))
    assert trainer.model_config.seq_length == 16 and trainer.model_config.hidden_size == 64
    assert str(trainer.tokenizer.source_dir) == str(ckpt.find_checkpoint(tmp_path / "a") / "tokenizer")
    with pytest.raises(ConfigError, match="--hidden-size 128 \\(the checkpoint has 64\\)"):
        setup(parse_train_args(load + ["--hidden-size", "128"]))
