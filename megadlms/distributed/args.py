"""Parallelism flags (Megatron-LM names); their dests are the fields of `ParallelConfig`."""

from __future__ import annotations

import argparse

from .config import BACKENDS, CP_COMM_TYPES, PIPELINE_SCHEDULES, SHARDING_STRATEGIES


def add_distributed_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism (launch with torchrun)")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="split each layer's heads and FFN over this many ranks (DTensor tensor parallelism); "
                        "must divide num_attention_heads, num_query_groups and ffn_hidden_size")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="split each sequence's positions over this many ranks (attention all-gathers K/V); "
                        "--seq-length must be divisible by 2 x this size")
    g.add_argument("--cp-comm-type", choices=CP_COMM_TYPES, default="all_gather",
                   help="context parallelism's K/V exchange: all_gather (each layer gathers the whole sequence's "
                        "K/V) or p2p (ring attention: K/V blocks passed around the cp ranks, partial results merged "
                        "by their log-sum-exp; fp32 block products, no fused kernel)")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="split the layers into this many consecutive stages, one per rank (torch.distributed."
                        "pipelining); must divide --num-layers; composes with DDP, FSDP2, CP and TP")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="with --pipeline-model-parallel-size: cut each rank's layers into stages of this many and "
                        "run the interleaved 1F1B schedule (rank r holds stages r, r + pp, ...); micro-batches per "
                        "step must be a multiple of the pipeline size")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="split each MoE block's experts over this many ranks (tokens sent to their experts by "
                        "all-to-all); must divide --num-moe-experts and the world size; with data parallelism only")
    g.add_argument("--pipeline-schedule", choices=PIPELINE_SCHEDULES, default="1f1b",
                   help="1f1b: one forward, one backward in turn (micro-batches >= stages); gpipe: all forwards first")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="with tensor parallelism, run norms on seq_length / tp positions per rank")
    g.add_argument("--data-parallel-sharding-strategy", choices=SHARDING_STRATEGIES, default="no_shard",
                   help="no_shard: DDP; optim: ZeRO-1 (sharded optimizer state); optim_grads: ZeRO-2 (+ sharded "
                        "gradients); optim_grads_params: ZeRO-3 (+ sharded parameters). The sharded ones use FSDP2")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard the optimizer state across data-parallel ranks (turns no_shard into optim)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="accepted for Megatron command lines: DDP (bucketed all-reduce) and FSDP2 (per-layer "
                        "reduce-scatter) always overlap the gradient reduction with backward")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="FSDP2: prefetch the next layer's parameters (all-gather issued before the current "
                        "layer runs, forward and backward); needs a sharded strategy")
    g.add_argument("--tp-only-amax-red", action="store_true",
                   help="reduce FP8 amaxes over the TP group only (default: over data x tensor parallel ranks)")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints in the background; each one is committed (renamed into place, "
                        "latest pointer updated) at the next save or at the end of training")
    g.add_argument("--distributed-backend", choices=BACKENDS, default=None,
                   help="default: nccl on GPUs, gloo on CPU")
