"""Pipeline parallelism on 2 processes (torch.distributed.pipelining, 1F1B and GPipe): a step's micro-batch losses
and every gradient equal the whole model's running the micro-batches in turn; a PP=2 training run (with validation)
gives one process's curve and its checkpoint resumes on one process; bad sizes are refused in one line."""

from __future__ import annotations

import json

import pytest

from megadlms.build import build_model
from megadlms.config import TransformerConfig
from megadlms.distributed.config import ParallelConfig
from megadlms.distributed.init import init_parallel
from megadlms.distributed.pipeline_parallel import (
    PipelineStageModule,
    RankStages,
    check_micro_batches,
    check_pipeline_parallel,
    rank_stages,
    stage_layers,
    virtual_stages,
)

from .launch import TINY, launch, train_iterations, train_losses
from .pp_worker import CASES

RTOL = 1e-5  # fp32: only the order of floating-point sums differs


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp") / "results.json"
    launch(2, [str(out)], script="tests/distributed/pp_worker.py", rerun_after_native_crash=True)
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_matches_the_whole_model(results, case):
    r = results[case]
    assert r["loss"] < RTOL, r
    assert r["grads"] < RTOL, r
    tied = 1 if "untied" not in case and "bd3lm" not in case else 0
    assert sum(r["params_per_stage"]) == r["params"] + tied  # every parameter on one stage; a tied embedding on two


def test_stages_hold_their_layers_under_global_names():
    model = build_model(TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=2, vocab_size=64))
    last = PipelineStageModule(model, stage=1, num_stages=2)
    names = {n for n, _ in last.named_parameters()}
    assert "layers.2.self_attn.q_proj.weight" in names and "layers.1.mlp.up_proj.weight" not in names
    assert {"norm.weight", "embed_tokens.weight"} <= names  # the final norm, and the tied head's weight
    assert list(stage_layers(8, 4, 3)) == [6, 7]


def test_virtual_stages_interleave_the_layers_over_the_ranks():
    model = build_model(TransformerConfig(num_layers=8, hidden_size=32, num_attention_heads=2, vocab_size=64))
    assert virtual_stages(8, 2, 2) == 2 and virtual_stages(8, 2, None) == 1
    assert rank_stages(1, 2, 2) == [1, 3]  # rank 1 of 2, stages 1 and 3 of 4
    second = RankStages([PipelineStageModule(model, i, 4) for i in rank_stages(1, 2, 2)])
    layers = sorted({int(n.split(".")[1]) for n, _ in second.named_parameters() if n.startswith("layers.")})
    assert layers == [2, 3, 6, 7]
    assert {n.split(".")[0] for n, _ in second.named_parameters()} == {"layers", "norm", "embed_tokens"}
    first = RankStages([PipelineStageModule(model, i, 4) for i in rank_stages(0, 2, 2)])
    assert first.norm is None and first.embed_tokens is model.embed_tokens
    whole = sum(p.numel() for p in model.parameters())
    own = sum(p.numel() for p in first.parameters()) + sum(p.numel() for p in second.parameters())
    assert own == whole + model.embed_tokens.weight.numel()  # the tied embedding on both ends


def test_bad_virtual_stages_are_refused():
    with pytest.raises(ValueError, match="--num-layers-per-virtual-pipeline-stage 3 does not divide the --num-layers 8 "
                                         "/ --pipeline-model-parallel-size 2 layers of each rank"):
        virtual_stages(8, 2, 3)
    from megadlms.training.config import RunConfig
    from megadlms.training.run_plan import RunPlan

    def plan(**parallel) -> RunPlan:
        return RunPlan(RunConfig(parallel=ParallelConfig(**parallel)), TransformerConfig(num_layers=8), world_size=2)

    with pytest.raises(ValueError, match="--num-layers-per-virtual-pipeline-stage 2 interleaves the stages of a "
                                         "pipeline; add --pipeline-model-parallel-size 2"):
        plan(num_layers_per_virtual_pipeline_stage=2).check()
    with pytest.raises(ValueError, match="not --pipeline-schedule gpipe; use 1f1b"):
        plan(pipeline_model_parallel_size=2, pipeline_schedule="gpipe", num_layers_per_virtual_pipeline_stage=1).check()
    with pytest.raises(ValueError, match="--num-layers 6 is not divisible by --pipeline-model-parallel-size 2 x 2 "
                                         "virtual stages = 4; use 8 layers"):
        check_pipeline_parallel(TransformerConfig(num_layers=6), 2, 2)


def test_micro_batches_the_schedule_cannot_run_name_the_global_batch_that_fits():
    check_micro_batches(4, 2, 2, "1f1b", samples_per_micro_batch=16)  # a multiple of pp: runs
    check_micro_batches(1, 2, 1, "gpipe", samples_per_micro_batch=16)  # GPipe takes any count
    with pytest.raises(ValueError, match=r"interleaved 1F1B schedule needs the micro-batches per step \(3\) to be a "
                                         r"multiple of --pipeline-model-parallel-size 2; pass --global-batch-size 64 "
                                         r"\(4 micro-batches of 16 samples"):
        check_micro_batches(3, 2, 2, "1f1b", samples_per_micro_batch=16)
    with pytest.raises(ValueError, match=r"needs at least --pipeline-model-parallel-size 4 micro-batches per step, "
                                         r"got 1; pass --global-batch-size 32 \(4 micro-batches of 8 .* or use "
                                         r"--pipeline-schedule gpipe"):
        check_micro_batches(1, 4, 1, "1f1b", samples_per_micro_batch=8)
    with pytest.raises(ValueError, match="got 1; raise --global-batch-size, or use"):
        check_micro_batches(1, 2, 1, "1f1b")


def test_layers_not_divisible_by_stages_are_refused():
    with pytest.raises(ValueError, match="--num-layers 6 is not divisible by --pipeline-model-parallel-size 4; "
                                         "use a pipeline size that divides it, or 8 layers"):
        check_pipeline_parallel(TransformerConfig(num_layers=6), 4)


COMMON = TINY + ["--train-iters", "4", "--eval-iters", "1", "--eval-interval", "2"]


def eval_losses(save) -> list[float]:
    lines = (save / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["split"] == "valid"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The one-process reference run and the PP=2 run (1F1B over 4 micro-batches of 1), launched once."""
    root = tmp_path_factory.mktemp("pp_runs")
    launch(1, COMMON + ["--micro-batch-size", "2", "--save", str(root / "one")])
    out = launch(2, COMMON + ["--micro-batch-size", "1", "--save", str(root / "pp2"), "--pipeline-model-parallel-size",
                              "2", "--save-interval", "2"], rerun_after_native_crash=True,
                 clean_before_rerun=[root / "pp2"])
    return root, out


def test_training_matches_one_process(runs):
    root, out = runs
    assert "pipeline parallel: 2 stages of 1 layer" in out
    reference = train_losses(root / "one")
    assert len(reference) == 4
    assert train_losses(root / "pp2") == pytest.approx(reference, rel=RTOL)
    assert eval_losses(root / "pp2") == pytest.approx(eval_losses(root / "one"), rel=RTOL)


def test_resume_from_pp2_on_one_process(runs):
    root, _ = runs
    resumed = root / "resumed"
    launch(1, TINY + ["--train-iters", "4", "--micro-batch-size", "2", "--save", str(resumed), "--load",
                      str(root / "pp2"), "--ckpt-step", "2"])
    assert train_iterations(resumed) == [3, 4]
    assert train_losses(resumed) == pytest.approx(train_losses(root / "one")[2:], rel=RTOL)


def test_pipeline_with_context_parallel_matches_one_process(runs, tmp_path):
    """4 ranks: 2 stages x 2 context-parallel ranks each, whose attention passes K/V around the ring
    (--cp-comm-type p2p), DDP over the cp pairs."""
    root, _ = runs
    save = tmp_path / "pp2_cp2"
    out = launch(4, COMMON + ["--micro-batch-size", "1", "--save", str(save), "--pipeline-model-parallel-size", "2",
                              "--context-parallel-size", "2", "--cp-comm-type", "p2p"], rerun_after_native_crash=True,
                 clean_before_rerun=[save])
    assert "world 4 (pp 2 x dp 1 x cp 2 x tp 1)" in out
    assert "2 context parallel, ring attention, K/V passed by p2p" in out
    assert train_losses(save) == pytest.approx(train_losses(root / "one"), rel=RTOL)
    assert eval_losses(save) == pytest.approx(eval_losses(root / "one"), rel=RTOL)


def test_pipeline_with_tensor_parallel_matches_one_process(runs, tmp_path):
    """4 ranks: 2 stages x 2 tensor-parallel ranks each (the tied embedding vocabulary-sharded on both ends), with
    sequence parallelism: the stages send sequence shards [B, S / 2, H]."""
    root, _ = runs
    save = tmp_path / "pp2_tp2"
    out = launch(4, COMMON + ["--micro-batch-size", "1", "--save", str(save), "--pipeline-model-parallel-size", "2",
                              "--tensor-model-parallel-size", "2", "--sequence-parallel"],
                 rerun_after_native_crash=True, clean_before_rerun=[save])
    assert "pipeline parallel: 2 stages of 1 layer | tensor parallel over 2 ranks + sequence parallel" in out
    assert train_losses(save) == pytest.approx(train_losses(root / "one"), rel=RTOL)
    assert eval_losses(save) == pytest.approx(eval_losses(root / "one"), rel=RTOL)


def test_pipeline_needs_that_many_processes(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size 2 needs 2 processes"):
        init_parallel("cpu", pp_size=2)


# FP8 (delayed scaling: amaxes reduced over the ranks holding the same stages), 4 layers; validation at the end only
# (an FP8 evaluation's forward records amaxes that steer the next steps' scales, by a rounding that differs with
# the evaluation's split over ranks)
FP8 = TINY + ["--fp8-format", "hybrid", "--fp8-amax-history-len", "2", "--num-layers", "4", "--micro-batch-size", "1",
              "--train-iters", "4", "--eval-iters", "1", "--eval-interval", "0"]


@pytest.fixture(scope="module")
def composed(tmp_path_factory):
    """One FP8 process, and 4 ranks: 2 pipelines of 2 ranks x 2 virtual stages (interleaved 1F1B), each stage
    sharded by FSDP2 (ZeRO-3) over the 2 pipelines, FP8 linears."""
    root = tmp_path_factory.mktemp("pp_composed")
    one = launch(1, FP8 + ["--save", str(root / "one")])
    run = root / "pp2_fsdp2"
    out = launch(4, FP8 + ["--save", str(run), "--save-interval", "2", "--pipeline-model-parallel-size", "2",
                           "--num-layers-per-virtual-pipeline-stage", "1", "--data-parallel-sharding-strategy",
                           "optim_grads_params"], rerun_after_native_crash=True, clean_before_rerun=[run])
    return root, one, out


def test_interleaved_fsdp2_fp8_pipeline_matches_one_process(composed):
    root, one, out = composed
    assert ("pipeline parallel: 2 ranks x 2 virtual stages (interleaved 1F1B) of 1 layer | data parallel: FSDP2 "
            "ZeRO-3") in out
    assert "world 4 (pp 2 x dp 2 x cp 1 x tp 1)" in out
    params = one[one.index("model tiny: "):].split(" parameters")[0]
    assert params + " parameters, 4 layers" in out  # the whole model's count, not one stage's
    reference = train_losses(root / "one")
    assert len(reference) == 4
    # rtol above fp32's: a sum order that differs can flip an FP8 rounding
    assert train_losses(root / "pp2_fsdp2") == pytest.approx(reference, rel=1e-4)
    # FP8 evaluation: the micro-batches' casts, split over 2 data-parallel ranks, round apart by about 1e-4
    assert eval_losses(root / "pp2_fsdp2") == pytest.approx(eval_losses(root / "one"), rel=2e-4)


def test_resume_from_sharded_pipeline_on_one_process(composed):
    root, _, _ = composed
    resumed = root / "resumed"
    launch(1, FP8 + ["--save", str(resumed), "--load", str(root / "pp2_fsdp2"), "--ckpt-step", "2",
                     "--eval-iters", "0"])
    assert train_iterations(resumed) == [3, 4]
    assert train_losses(resumed) == pytest.approx(train_losses(root / "one")[2:], rel=1e-4)
