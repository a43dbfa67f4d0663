"""Parallelism flags (Megatron-LM names)."""

from __future__ import annotations

import argparse

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def add_distributed_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism (launch with torchrun)")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--data-parallel-sharding-strategy", choices=SHARDING_STRATEGIES, default="no_shard",
                   help="no_shard: DDP; optim: DDP + sharded optimizer; optim_grads / optim_grads_params: FSDP2 "
                        "without / with resharding after forward")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard the optimizer state across data-parallel ranks (same as strategy optim)")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--tp-only-amax-red", action="store_true", help="reduce FP8 amaxes over the TP group only")
    g.add_argument("--async-save", action="store_true", help="write checkpoints in the background")
    g.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None,
                   help="default: nccl on GPUs, gloo on CPU")
