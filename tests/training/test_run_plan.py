"""megadlms.training.run_plan: the rules of what combines with what, checked before anything is built."""

from __future__ import annotations

from pathlib import Path

import pytest

from megadlms.config import ConfigError, TransformerConfig
from megadlms.distributed.config import ParallelConfig
from megadlms.training.args import parse_train_args
from megadlms.training.config import RunConfig, TrainConfig
from megadlms.training.run_plan import RULES, RunPlan, plan_run, rules_table

OWN = ["--model-path", "tiny", "--device", "cpu"]  # a run of the user's own: no demo configuration (it saves)
DOC = Path(__file__).resolve().parents[2] / "docs" / "run_plan.md"


@pytest.mark.parametrize("flags, message", [
    (["--fp8-recipe", "tensorwise"], "^--fp8-recipe tensorwise: FP8 is off; add --fp8-format hybrid .or e4m3., or "
                                     "drop it$"),
    (["--sft-pad", "ignore"], "^--sft-pad ignore: only read with --sft .packed chat data., which is off; add --sft or "
                              "drop it$"),
    (["--truncate"], "^--truncate: only read with --sft"),
    (["--rl-kl-beta", "0.1"], "^--rl-kl-beta 0.1: not read by a run without --rl .*; drop it or pick the --rl kind it "
                              "belongs to$"),
    (["--rl", "grpo", "--rl-data", "x.jsonl", "--dpo-beta", "0.2"], "^--dpo-beta 0.2: not read by --rl grpo"),
    (["--rl", "vrpo", "--rl-data", "x.jsonl", "--rl-reward", "format"], "^--rl-reward format: not read by --rl vrpo"),
    (["--save-interval", "10"], "^--save-interval 10: this run saves no checkpoint; add --save DIR or drop it$"),
    (["--async-save"], "^--async-save: this run saves no checkpoint"),
    (["--ckpt-keep-last", "2"], "^--ckpt-keep-last 2: this run saves no checkpoint"),
    (["--global-batch-size", "6", "--micro-batch-size", "4"], "^--global-batch-size 6 is not divisible by "
                                                              "--micro-batch-size 4 x data-parallel size 1; pass a "
                                                              "multiple of their product$"),
])
def test_flags_that_would_change_nothing_are_refused_in_one_line(flags, message):
    config = parse_train_args(OWN + flags)
    with pytest.raises(ConfigError, match=message) as e:
        plan_run(config)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("flags", [
    ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    ["--sft", "--sft-pad", "ignore", "--truncate"],
    ["--rl", "grpo", "--rl-data", "x.jsonl", "--rl-kl-beta", "0.1"],
    ["--rl", "vrpo", "--rl-data", "x.jsonl", "--dpo-beta", "0.2"],
    ["--save", "ck", "--save-interval", "10", "--async-save", "--ckpt-keep-last", "2"],
    ["--fp8-recipe", "delayed", "--sft-pad", "eos", "--rl-kl-beta", "0.04"],  # the defaults: nothing set
])
def test_the_same_flags_with_their_feature_are_accepted(flags):
    plan = plan_run(parse_train_args(OWN + flags))
    assert plan.clashes() == []


def test_every_clash_is_reported_at_once_one_line_each():
    config = parse_train_args(OWN + ["--truncate", "--save-interval", "5", "--pipeline-model-parallel-size", "2",
                                     "--rl", "vrpo", "--rl-data", "x.jsonl"])
    with pytest.raises(ConfigError) as e:
        plan_run(config)
    lines = str(e.value).splitlines()
    assert lines[0] == "5 settings do not go together:"
    starts = ["--truncate: only read with --sft", "--save-interval 5: this run saves no checkpoint",
              "--rl vrpo samples rollouts from the whole model", "--pipeline-model-parallel-size 2 runs micro-batches",
              "the 1F1B schedule needs at least --pipeline-model-parallel-size 2 micro-batches per step, got 1"]
    assert [x.strip()[:len(start)] for x, start in zip(lines[1:], starts)] == starts and len(lines) == 6


def test_a_pipeline_schedule_without_enough_micro_batches_is_refused_before_the_build(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    flags = OWN + ["--pipeline-model-parallel-size", "2", "--difflm-varilen-prob", "0", "--micro-batch-size", "2"]
    with pytest.raises(ConfigError, match=r"^the 1F1B schedule needs at least --pipeline-model-parallel-size 2 "
                                          r"micro-batches per step, got 1; pass --global-batch-size 4 \(2 "
                                          r"micro-batches of 2 samples.*, or use --pipeline-schedule gpipe$"):
        plan_run(parse_train_args(flags))
    assert plan_run(parse_train_args(flags + ["--global-batch-size", "4"])).accumulation == 2
    assert plan_run(parse_train_args(flags + ["--pipeline-schedule", "gpipe"])).clashes() == []


def test_the_plan_in_one_line(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    config = parse_train_args(OWN + ["--fp8-format", "hybrid", "--tensor-model-parallel-size", "2",
                                     "--micro-batch-size", "2", "--global-batch-size", "8", "--no-compile"])
    plan = plan_run(config)
    assert (plan.dp, plan.global_batch, plan.accumulation) == (2, 8, 2)
    assert plan.describe() == ("pre-training (difflm-noshift) | FP8 hybrid/delayed | world 4 (pp 1 x dp 2 x cp 1 x "
                               "tp 2, ep 1) | global batch 8 (micro 2 x accum 2 x dp 2) | no LoRA | eager, no CUDA "
                               "graphs")


def test_the_check_runs_before_any_process_group_model_or_loader(monkeypatch):
    """A clash that used to surface only after the model and the loaders were built is reported by `setup` before
    it initialises the process groups."""
    from megadlms.training import trainer

    def built(*args, **kwargs):
        raise AssertionError("init_parallel ran before the plan's check")

    monkeypatch.setattr(trainer, "init_parallel", built)
    config = parse_train_args(OWN + ["--model-running-mode", "bd3lm", "--block-size", "4", "--seq-length", "16",
                                     "--bd3lm-clip-search", "--eval-iters", "0"])
    with pytest.raises(ConfigError, match="^--bd3lm-clip-search chooses the interval during validation"):
        trainer.setup(config)


def _plan(world_size: int = 1, device_type: str = "cuda", **sections) -> RunPlan:
    return RunPlan(RunConfig(**sections), TransformerConfig(), world_size=world_size, device_type=device_type)


def test_cuda_graphs_follow_the_blockers():
    assert _plan().layer_graphs() and _plan().graph_blockers() == []
    assert not _plan(device_type="cpu").layer_graphs()
    assert not _plan(world_size=2).layer_graphs()  # auto: a single process only
    assert _plan(world_size=2, train=TrainConfig(cuda_graphs="on")).layer_graphs()  # on: also under DDP
    sharded = _plan(world_size=2, parallel=ParallelConfig(use_distributed_optimizer=True),
                    train=TrainConfig(cuda_graphs="on"))
    assert sharded.graph_blockers() == ["sharded data parallelism (optim) gathers weights per use"]
    with pytest.raises(ConfigError, match=r"^--cuda-graphs on is not possible here: sharded data parallelism "
                                          r"\(optim\) gathers weights per use; use --cuda-graphs auto or off$"):
        sharded.check()
    tp = _plan(world_size=2, parallel=ParallelConfig(tensor_model_parallel_size=2))
    assert tp.graph_blockers() == ["tensor parallelism (DTensor parameters)"] and not tp.layer_graphs()


def test_every_rule_names_a_feature_and_a_fix():
    for rule in RULES:
        assert rule.feature.startswith("--") or rule.feature[0].isupper(), rule.feature
        assert rule.clash and rule.fix and "|" not in rule.feature + rule.clash + rule.fix


def test_the_docs_table_is_generated_from_the_rules():
    text = DOC.read_text()
    assert rules_table() in text, ("docs/run_plan.md is out of date: paste the output of "
                                   "`python -m megadlms.training.run_plan` between its table markers")
