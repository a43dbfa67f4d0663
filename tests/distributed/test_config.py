"""megadlms.distributed.config: ParallelConfig's strategy and its refusals."""

import pytest

from megadlms.config import ConfigError, TransformerConfig
from megadlms.distributed.config import ParallelConfig
from megadlms.training.config import RunConfig
from megadlms.training.run_plan import RunPlan


def test_strategy_and_refusals():
    assert ParallelConfig().sharding_strategy == "no_shard"
    assert ParallelConfig(use_distributed_optimizer=True).sharding_strategy == "optim"
    assert ParallelConfig(data_parallel_sharding_strategy="optim_grads_params",
                          use_distributed_optimizer=True).sharding_strategy == "optim_grads_params"
    with pytest.raises(ConfigError, match="--tensor-model-parallel-size 0 must be >= 1"):
        ParallelConfig(tensor_model_parallel_size=0)
    with pytest.raises(ConfigError, match="--data-parallel-sharding-strategy 'zero3' is not one of"):
        ParallelConfig(data_parallel_sharding_strategy="zero3")
    with pytest.raises(ConfigError, match="--distributed-backend 'mpi' is not one of \\['nccl', 'gloo'\\]"):
        ParallelConfig(distributed_backend="mpi")
    with pytest.raises(ConfigError, match="no_shard has none; add --use-distributed-optimizer"):
        RunPlan(RunConfig(parallel=ParallelConfig(overlap_param_gather=True)), TransformerConfig()).check()
