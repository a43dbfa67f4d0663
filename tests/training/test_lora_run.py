"""LoRA training runs on CPU: only the adapters train and are saved, the resume is exact, the base is checked,
and an FP8 base tracks the unquantized base."""

import pytest
import torch

from megadlms.config import ConfigError
from megadlms.training import checkpoint as ckpt
from megadlms.training.args import parse_train_args
from megadlms.training.lora_run import base_checksum, load_lora_model
from megadlms.training.run_plan import plan_run
from megadlms.training.trainer import setup, train

SMALL = ["--model-path", "tiny", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--num-query-groups", "2",
         "--ffn-hidden-size", "128", "--seq-length", "32", "--device", "cpu", "--no-compile", "--num-workers", "0",
         "--eval-iters", "0", "--log-interval", "1", "--no-progress", "--lr", "3e-3", "--micro-batch-size", "4",
         "--difflm-varilen-prob", "0", "--no-generate-sample"]


def losses(state):
    return [m["loss"] for m in state.history if "loss" in m and "eval_loss" not in m]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A base model: a few steps of pre-training."""
    path = tmp_path_factory.mktemp("base") / "base"
    train(parse_train_args(SMALL + ["--train-iters", "3", "--save", str(path)]))
    return path


def lora(base_dir, *extra):
    return SMALL + ["--load", str(base_dir), "--use-checkpoint-args", "--lora-rank", "4", "--lora-alpha", "8",
                    *extra]


def test_only_adapters_train_and_resume_is_exact(base, tmp_path):
    trainer = setup(parse_train_args(lora(base, "--train-iters", "2")))
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert len(trainer.optimizer.state) == len(trained)  # no optimizer state for the base
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    trainer.run()
    for n, p in trainer.model.named_parameters():
        assert p.grad is None
        if not p.requires_grad:
            assert torch.equal(p, before[n]), n  # the base does not move

    straight = losses(train(parse_train_args(lora(base, "--train-iters", "6", "--save", str(tmp_path / "a")))))
    run = lora(base, "--train-iters", "6", "--save", str(tmp_path / "b"))
    train(parse_train_args(run + ["--exit-interval", "3"]))
    saved = ckpt.find_checkpoint(tmp_path / "b")
    keys = set(ckpt.SafeFileSystemReader(str(saved)).read_metadata().state_dict_metadata)
    model_keys = {k for k in keys if k.startswith("model.")}
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)  # adapters only
    meta = ckpt.read_meta(saved)
    assert meta["config"]["extra"]["lora_base"] == {"path": str(ckpt.find_checkpoint(base).resolve()),
                                                    "checksum": base_checksum(ckpt.find_checkpoint(base))}
    assert meta["config"]["extra"]["lora"]["rank"] == 4
    resumed = train(parse_train_args(lora(tmp_path / "b", "--train-iters", "6", "--save", str(tmp_path / "b"))))
    assert losses(resumed) == straight[3:]


def test_resuming_onto_another_base_is_a_one_line_error(base, tmp_path):
    run = lora(base, "--train-iters", "1", "--save", str(tmp_path / "a"))
    train(parse_train_args(run))
    other = tmp_path / "other"
    train(parse_train_args(SMALL + ["--train-iters", "1", "--seed", "7", "--save", str(other)]))
    with pytest.raises(ConfigError, match=r"checksum .* pass --lora-base-path") as e:
        setup(parse_train_args(lora(tmp_path / "a", "--train-iters", "2", "--lora-base-path", str(other))))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="drop --finetune"):
        setup(parse_train_args(lora(tmp_path / "a", "--train-iters", "2", "--finetune")))
    model, cfg, config, meta = load_lora_model(tmp_path / "a")  # the recorded base checks out
    assert config.rank == 4 and "lora" not in cfg.extra and meta["base"] == str(ckpt.find_checkpoint(base))


def test_fp8_base_tracks_the_unquantized_base(base):
    """The FP8 base's losses stay within the FP8 tolerance of the tests of the FP8 recipes (0.5%) of the same LoRA
    run on the high-precision base."""
    ref = losses(train(parse_train_args(lora(base, "--train-iters", "6"))))
    fp8 = losses(train(parse_train_args(lora(base, "--train-iters", "6", "--lora-base", "fp8"))))
    assert len(fp8) == 6 and fp8 != ref
    torch.testing.assert_close(torch.tensor(fp8), torch.tensor(ref), rtol=0.005, atol=0)


def test_lora_flags_need_a_base_and_refuse_base_training_flags():
    with pytest.raises(ConfigError, match="pass --load BASE"):
        plan_run(parse_train_args(SMALL + ["--lora-rank", "4"]))
    with pytest.raises(ConfigError, match="drop --no-fp8-wgrad"):
        plan_run(parse_train_args(SMALL + ["--lora-rank", "4", "--load", "x", "--fp8-format", "hybrid",
                                           "--no-fp8-wgrad"]))
    with pytest.raises(ConfigError, match="--lora-targets: unknown target 'qkv'"):
        plan_run(parse_train_args(SMALL + ["--lora-rank", "4", "--load", "x", "--lora-targets", "qkv"]))
    with pytest.raises(ConfigError, match="--lora-rank -1 must be an integer >= 1"):
        plan_run(parse_train_args(SMALL + ["--lora-rank", "-1", "--load", "x"]))
    with pytest.raises(ConfigError, match="add --lora-rank R"):
        plan_run(parse_train_args(SMALL + ["--lora-targets", "q"]))


@pytest.mark.parametrize("flags, match", [
    (["--fp8-format", "hybrid", "--fp8-param-gather", "--data-parallel-sharding-strategy", "optim_grads_params"],
     "--lora-rank 4 freezes the base, so --fp8-param-gather has no trained FP8 weights to gather; drop"),
    (["--tensor-model-parallel-size", "2"], "--lora-rank 4 with --tensor-model-parallel-size 2: .* drop tensor"),
    (["--pipeline-model-parallel-size", "2", "--difflm-varilen-prob", "0", "--pipeline-schedule", "gpipe"],
     "--lora-rank 4 with --pipeline-model-parallel-size 2: .* drop pipeline"),
    (["--lora-rank", "0"], "--lora-rank 0 must be an integer >= 1"),
    (["--lora-alpha", "-1"], "--lora-alpha -1.0 must be > 0"),
    (["--lora-dropout", "1"], "--lora-dropout 1.0 must be in"),
    (["--lora-targets", "q,,v"], "--lora-targets: unknown target ''"),
])
def test_lora_with_flags_that_train_the_base_or_bad_values_is_one_line(flags, match, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # the plan of a run over two ranks: FSDP2 has shards to gather
    with pytest.raises(ConfigError, match=match) as e:
        plan_run(parse_train_args(SMALL + ["--lora-rank", "4", "--load", "x", *flags]))
    assert "\n" not in str(e.value)


def test_fsdp2_and_ddp_train_the_adapters_as_one_process(tmp_path):
    """LoRA under FSDP2 (two gloo ranks, parameters sharded, the frozen base included) and under DDP (two gloo
    ranks, the adapters' gradients all-reduced): the losses of one process."""
    from tests.distributed.launch import TINY, launch, train_losses

    flags = TINY + ["--micro-batch-size", "2", "--lr-warmup-iters", "1"]
    launch(1, flags + ["--train-iters", "2", "--save", str(tmp_path / "base")])
    lora = flags + ["--load", str(tmp_path / "base"), "--use-checkpoint-args", "--lora-rank", "4", "--train-iters", "3"]
    launch(1, lora + ["--save", str(tmp_path / "one")])
    for strategy in ("optim_grads_params", "no_shard"):
        launch(2, lora + ["--save", str(tmp_path / strategy), "--data-parallel-sharding-strategy", strategy,
                          "--distributed-backend", "gloo"])
    one = train_losses(tmp_path / "one")
    assert len(one) == 3
    assert train_losses(tmp_path / "optim_grads_params") == pytest.approx(one, rel=1e-5)
    assert train_losses(tmp_path / "no_shard") == pytest.approx(one, rel=1e-5)


@pytest.mark.parametrize("mode", [
    (),
    ("--model-running-mode", "difflm-shift", "--attention-anneal-iters", "2"),  # AR-to-DLM adaptation
    ("--model-running-mode", "bd3lm", "--block-size", "8"),
], ids=["masked", "shift-anneal", "bd3lm"])
def test_lora_runs_with_each_objective_and_activation_recompute(base, mode):
    """With each objective the LoRA model starts as its base (the first loss is the full fine-tune's, bit for bit),
    only the adapters move, and activation recompute changes no loss."""
    full = losses(train(parse_train_args(SMALL + ["--load", str(base), "--use-checkpoint-args", "--finetune",
                                                  "--train-iters", "1", *mode])))
    trainer = setup(parse_train_args(lora(base, "--train-iters", "3", *mode)))
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    got = losses(trainer.run())
    assert len(got) == 3 and got[0] == full[0]
    for n, p in trainer.model.named_parameters():
        if p.requires_grad:
            assert ".lora_" in n and (".lora_A." in n or p.abs().sum() > 0), n  # B left its zero start
        else:
            assert torch.equal(p, frozen[n]), n
    recomputed = losses(train(parse_train_args(lora(base, "--train-iters", "3", "--recompute-granularity", "full",
                                                    *mode))))
    assert recomputed == got


def test_ddp_buckets_hold_the_adapters_alone(tmp_path):
    """DistributedDataParallel over a LoRA model (a one-rank gloo group) registers the adapters only: nothing of
    the frozen base is all-reduced."""
    import torch.distributed as dist

    from megadlms.build import construct_model
    from megadlms.distributed.data_parallel import apply_ddp
    from megadlms.lora import LoraConfig, adapter_state_dict, apply_lora
    from megadlms.presets import preset_config

    if dist.is_initialized():
        pytest.skip("a process group exists in this process already")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        cfg = preset_config("tiny", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=128, seq_length=16)
        model = apply_lora(construct_model(cfg), LoraConfig(rank=4, base="keep"))
        adapters = adapter_state_dict(model)
        data = apply_ddp(model, None, torch.device("cpu"))._get_ddp_logging_data()
        assert data["num_parameter_tensors"] == len(adapters) == 2 * 7 * 2
        assert data["total_parameter_size_bytes"] == sum(t.numel() * 4 for t in adapters.values())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("lora_base", ["bf16", "fp8"])
def test_lora_layers_replay_from_cuda_graphs_as_they_run_eagerly(base, monkeypatch, lora_base):
    """The layers of a LoRA model (adapters trained, the base frozen in BF16 or FP8) replayed from CUDA graphs, as
    the trainer runs them on one GPU by default (emulated here): every step after the first replays, with the eager
    run's losses and adapters."""
    argv = lora(base, "--train-iters", "4", "--lora-base", lora_base)
    eager = setup(parse_train_args(argv))
    eager.run()
    monkeypatch.setenv("MEGADLMS_EMULATE_CUDA_GRAPHS", "1")
    graphed = setup(parse_train_args(argv + ["--cuda-graphs", "on"]))
    graphed.run()
    assert graphed.layer_graphs.num_replays == 3
    assert losses(graphed.state) == pytest.approx(losses(eager.state), rel=1e-5)
    for (name, p), q in zip(eager.model.named_parameters(), graphed.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
