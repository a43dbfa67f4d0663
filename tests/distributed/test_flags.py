"""Parallelism flags: Megatron's spellings map onto the sharding strategies; impossible combinations are refused."""

from __future__ import annotations

import pytest

from megadlms.distributed.config import ParallelConfig
from megadlms.distributed.data_parallel import grad_sync_context
from megadlms.training.args import parse_train_args


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
        args("--overlap-param-gather")
    assert args("--overlap-param-gather", "--use-distributed-optimizer").sharding_strategy == "optim"


def test_one_data_parallel_rank_needs_no_sync_control():
    class Model:  # would fail if the context touched it
        pass

    with grad_sync_context(Model(), "none", last=False):
        pass
