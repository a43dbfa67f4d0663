"""`ParallelConfig`: how a run is spread over ranks; each field is also its command-line flag (Megatron-LM names;
`megadlms.settings`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import check_at_least, check_choice
from ..settings import setting

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
BACKENDS = ("nccl", "gloo")
PIPELINE_SCHEDULES = ("1f1b", "gpipe")
CP_COMM_TYPES = ("all_gather", "p2p")  # Megatron's names (its a2a is not implemented)


PARALLEL_GROUP = "parallelism (launch with torchrun)"


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = setting(
        1, "split each layer's heads and FFN over this many ranks (DTensor tensor parallelism); must divide "
           "num_attention_heads, num_query_groups and ffn_hidden_size")
    context_parallel_size: int = setting(
        1, "split each sequence's positions over this many ranks (attention all-gathers K/V); --seq-length must be "
           "divisible by 2 x this size")
    cp_comm_type: str = setting(
        "all_gather", "context parallelism's K/V exchange: all_gather (the whole sequence's K/V per layer) or p2p "
                      "(ring attention; docs/distributed.md)", choices=CP_COMM_TYPES)
    pipeline_model_parallel_size: int = setting(
        1, "split the layers into this many consecutive stages, one per rank (torch.distributed.pipelining); must "
           "divide --num-layers; composes with DDP, FSDP2, CP and TP")
    num_layers_per_virtual_pipeline_stage: int | None = setting(
        None, "with --pipeline-model-parallel-size: cut each rank's layers into stages of this many and run the "
              "interleaved 1F1B schedule (rank r holds stages r, r + pp, ...); micro-batches per step must be a "
              "multiple of the pipeline size")
    expert_model_parallel_size: int = setting(
        1, "split each MoE block's experts over this many ranks (tokens sent to their experts by all-to-all); must "
           "divide --num-moe-experts and the world size; with data parallelism only")
    pipeline_schedule: str = setting("1f1b", "1f1b: one forward, one backward in turn (micro-batches >= stages); "
                                             "gpipe: all forwards first", choices=PIPELINE_SCHEDULES)
    sequence_parallel: bool = setting(False, "with tensor parallelism, run norms on seq_length / tp positions per rank")
    data_parallel_sharding_strategy: str = setting(
        "no_shard", "no_shard: DDP; optim: ZeRO-1 (sharded optimizer state); optim_grads: ZeRO-2 (+ sharded "
                    "gradients); optim_grads_params: ZeRO-3 (+ sharded parameters). The sharded ones use FSDP2",
        choices=SHARDING_STRATEGIES)
    use_distributed_optimizer: bool = setting(False, "shard the optimizer state across data-parallel ranks (turns "
                                                     "no_shard into optim)")
    overlap_grad_reduce: bool = setting(False, "accepted for Megatron command lines: DDP (bucketed all-reduce) and "
                                               "FSDP2 (per-layer reduce-scatter) always overlap the gradient reduction "
                                               "with backward")
    overlap_param_gather: bool = setting(False, "FSDP2: prefetch the next layer's parameters (all-gather issued "
                                                "before the current layer runs, forward and backward); needs a "
                                                "sharded strategy")
    tp_only_amax_red: bool = setting(False, "reduce FP8 amaxes over the TP group only (default: over data x tensor "
                                            "parallel ranks)")
    distributed_backend: str | None = setting(None, "default: nccl on GPUs, gloo on CPU", choices=BACKENDS)

    def __post_init__(self) -> None:
        check_at_least(self, {"tensor_model_parallel_size": 1, "context_parallel_size": 1,
                              "pipeline_model_parallel_size": 1, "expert_model_parallel_size": 1})
        check_choice(self, "pipeline_schedule", PIPELINE_SCHEDULES)
        check_choice(self, "cp_comm_type", CP_COMM_TYPES)
        check_at_least(self, {"num_layers_per_virtual_pipeline_stage": 1})
        check_choice(self, "data_parallel_sharding_strategy", SHARDING_STRATEGIES)
        if self.distributed_backend is not None:
            check_choice(self, "distributed_backend", BACKENDS)

    @property
    def sharding_strategy(self) -> str:
        """The strategy to apply: --use-distributed-optimizer turns no_shard into optim (Megatron)."""
        if self.use_distributed_optimizer and self.data_parallel_sharding_strategy == "no_shard":
            return "optim"
        return self.data_parallel_sharding_strategy
