"""`ParallelConfig`: how a run is spread over ranks (fields named after the Megatron-LM flags' dests)."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import check_at_least, check_choice

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
BACKENDS = ("nccl", "gloo")
PIPELINE_SCHEDULES = ("1f1b", "gpipe")
CP_COMM_TYPES = ("all_gather", "p2p")  # Megatron's names (its a2a is not implemented)


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    context_parallel_size: int = 1  # each sequence's positions split over this many ranks
    cp_comm_type: str = "all_gather"  # how attention exchanges K/V: all_gather | p2p (ring attention)
    pipeline_model_parallel_size: int = 1  # the layers split into this many consecutive stages
    expert_model_parallel_size: int = 1  # each MoE block's experts split over this many ranks (all-to-all)
    pipeline_schedule: str = "1f1b"  # 1f1b | gpipe (torch.distributed.pipelining)
    num_layers_per_virtual_pipeline_stage: int | None = None  # several stages per rank: interleaved 1F1B
    sequence_parallel: bool = False  # with TP: norms on seq_length / tp positions per rank
    data_parallel_sharding_strategy: str = "no_shard"  # DDP | FSDP2 ZeRO-1 / -2 / -3 (`data_parallel`)
    use_distributed_optimizer: bool = False  # Megatron's spelling of no_shard -> optim
    overlap_grad_reduce: bool = False  # accepted: DDP and FSDP2 always overlap the gradient reduction
    overlap_param_gather: bool = False  # FSDP2: prefetch the next layer's parameters
    tp_only_amax_red: bool = False  # reduce FP8 amaxes over the TP group only
    distributed_backend: str | None = None  # None: nccl on GPUs, gloo on CPU

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
