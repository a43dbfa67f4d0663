"""Parallelism flags: Megatron's spellings map onto the sharding strategies; impossible combinations are refused."""

from __future__ import annotations

import pytest

from megadlms.distributed.config import ParallelConfig
from megadlms.distributed.data_parallel import grad_sync_context
from megadlms.training.args import parse_train_args
from megadlms.training.run_plan import plan_run


def args(*flags: str) -> ParallelConfig:
    return parse_train_args(["--device", "cpu", *flags]).parallel


@pytest.mark.parametrize("flags, strategy", [
    ((), "no_shard"),
    (("--use-distributed-optimizer",), "optim"),
    (("--data-parallel-sharding-strategy", "optim_grads"), "optim_grads"),
    (("--data-parallel-sharding-strategy", "optim_grads_params", "--use-distributed-optimizer"), "optim_grads_params"),
])
def test_strategy_from_flags(flags, strategy):
    assert args(*flags).sharding_strategy == strategy


def test_param_gather_overlap_needs_sharded_parameters():
    with pytest.raises(ValueError, match="no_shard has none; add --use-distributed-optimizer"):
        plan_run(parse_train_args(["--device", "cpu", "--overlap-param-gather"]))
    assert args("--overlap-param-gather", "--use-distributed-optimizer").sharding_strategy == "optim"


def test_one_data_parallel_rank_needs_no_sync_control():
    class Model:  # would fail if the context touched it
        pass

    with grad_sync_context(Model(), "none", last=False):
        pass


@pytest.mark.parametrize("flags, message", [
    (("--num-layers-per-virtual-pipeline-stage", "1"),
     "--num-layers-per-virtual-pipeline-stage 1 interleaves the stages of a pipeline; add "
     "--pipeline-model-parallel-size 2 or more"),
    (("--pipeline-model-parallel-size", "2", "--rl", "grpo", "--rl-data", "x.jsonl"),
     "--rl grpo samples rollouts from the whole model, which --pipeline-model-parallel-size 2 splits over ranks"),
    (("--pipeline-model-parallel-size", "2", "--lora-rank", "8", "--load", "base"),
     "--lora-rank 8 with --pipeline-model-parallel-size 2: LoRA runs with data parallelism only"),
])
def test_pipeline_combinations_not_supported_are_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        plan_run(parse_train_args(["--device", "cpu", *flags]))


def test_parallel_plan_refusals():
    from megadlms.config import TransformerConfig
    from megadlms.distributed.init import ParallelContext, build_mesh
    from megadlms.distributed.parallelize import check_parallel_plan
    from megadlms.training.config import RunConfig
    from megadlms.training.run_plan import RunPlan

    moe = TransformerConfig(num_layers=4, num_moe_experts=4)
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size 2 with an MoE model"):
        RunPlan(RunConfig(parallel=ParallelConfig(pipeline_model_parallel_size=2)), moe, world_size=2).check()
    with pytest.raises(ValueError, match="--seq-length 30 is not divisible by 2 x --context-parallel-size 2 = 4"):
        check_parallel_plan(TransformerConfig(seq_length=30), ParallelContext(world_size=2, cp_size=2),
                            ParallelConfig())
    with pytest.raises(ValueError, match="--num-layers-per-virtual-pipeline-stage 2 does not divide the --num-layers 6 "
                                         "/ --pipeline-model-parallel-size 2 layers of each rank"):
        check_parallel_plan(TransformerConfig(num_layers=6), ParallelContext(world_size=2, pp_size=2),
                            ParallelConfig(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=2))
    with pytest.raises(ValueError, match="--num-layers 7 is not divisible by --pipeline-model-parallel-size 2"):
        check_parallel_plan(TransformerConfig(num_layers=7), ParallelContext(world_size=2, pp_size=2),
                            ParallelConfig(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1))
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size 2 x --tensor-model-parallel-size 2 over 2 "
                                         "data-parallel ranks: DDP takes no tensor-parallel parameters"):
        RunPlan(RunConfig(parallel=ParallelConfig(pipeline_model_parallel_size=2, tensor_model_parallel_size=2)),
                TransformerConfig(num_layers=4), world_size=8).check()
    with pytest.raises(ValueError, match="--sequence-parallel with --pipeline-model-parallel-size 2: the stages send "
                                         "equal sequence shards, and the 30 positions per context-parallel rank do "
                                         "not split over --tensor-model-parallel-size 4"):
        check_parallel_plan(TransformerConfig(num_layers=4, seq_length=30),
                            ParallelContext(world_size=8, pp_size=2, tp_size=4), ParallelConfig(sequence_parallel=True))
    with pytest.raises(ValueError, match="world size 6 is not divisible by --pipeline-model-parallel-size 2 x "
                                         "--context-parallel-size 2 = 4; launch a multiple of 4 processes"):
        build_mesh("cpu", 6, pp_size=2, cp_size=2)
