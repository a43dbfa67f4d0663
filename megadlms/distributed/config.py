"""`ParallelConfig`: how a run is spread over ranks (fields named after the Megatron-LM flags' dests)."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError, check_at_least, check_choice
from ..fp8.recipe import param_gather_problem

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
BACKENDS = ("nccl", "gloo")
PIPELINE_SCHEDULES = ("1f1b", "gpipe")


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    context_parallel_size: int = 1  # each sequence's positions split over this many ranks
    pipeline_model_parallel_size: int = 1  # the layers split into this many consecutive stages
    expert_model_parallel_size: int = 1  # each MoE block's experts split over this many ranks (all-to-all)
    pipeline_schedule: str = "1f1b"  # 1f1b | gpipe (torch.distributed.pipelining)
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
        ep = self.expert_model_parallel_size
        if ep > 1:
            for flag, size in (("--tensor-model-parallel-size", self.tensor_model_parallel_size),
                               ("--context-parallel-size", self.context_parallel_size),
                               ("--pipeline-model-parallel-size", self.pipeline_model_parallel_size)):
                if size > 1:
                    raise ConfigError(f"--expert-model-parallel-size {ep} takes data parallelism alone for now, not "
                                      f"{flag} {size}; drop one of them")
        check_choice(self, "pipeline_schedule", PIPELINE_SCHEDULES)
        pp = self.pipeline_model_parallel_size
        if pp > 1 and (self.tensor_model_parallel_size > 1 or self.context_parallel_size > 1
                       or self.sharding_strategy != "no_shard"):
            raise ConfigError(f"--pipeline-model-parallel-size {pp} takes DDP alone for now: drop "
                              "--tensor-model-parallel-size, --context-parallel-size and the sharded data-parallel "
                              "strategies")
        check_choice(self, "data_parallel_sharding_strategy", SHARDING_STRATEGIES)
        if self.distributed_backend is not None:
            check_choice(self, "distributed_backend", BACKENDS)
        if self.overlap_param_gather and self.sharding_strategy == "no_shard":
            raise ConfigError("--overlap-param-gather overlaps the all-gather of sharded parameters, and "
                              "--data-parallel-sharding-strategy no_shard has none; add --use-distributed-optimizer "
                              "or pick optim, optim_grads or optim_grads_params")

    @property
    def sharding_strategy(self) -> str:
        """The strategy to apply: --use-distributed-optimizer turns no_shard into optim (Megatron)."""
        if self.use_distributed_optimizer and self.data_parallel_sharding_strategy == "no_shard":
            return "optim"
        return self.data_parallel_sharding_strategy


def check_fp8_param_gather(fp8: bool, fp8_recipe: str, parallel: ParallelConfig) -> None:
    """Raise ConfigError (one line) where --fp8-param-gather has nothing to gather in FP8 or could not be exact
    whatever the world size (`parallelize.apply_fp8_param_gather` checks the rest: ranks and shapes)."""
    if not fp8:
        raise ConfigError("--fp8-param-gather gathers the weights of FP8 layers; add --fp8-format e4m3 (or hybrid) "
                          "or drop --fp8-param-gather")
    problem = param_gather_problem(fp8_recipe)
    if problem:
        raise ConfigError(problem)
    if parallel.sharding_strategy == "no_shard":
        raise ConfigError("--fp8-param-gather casts the weight shards FSDP2 all-gathers, and --data-parallel-"
                          "sharding-strategy no_shard shards none; add --use-distributed-optimizer or pick optim, "
                          "optim_grads or optim_grads_params")
    if parallel.tensor_model_parallel_size > 1:
        raise ConfigError(f"--fp8-param-gather takes FSDP2 alone, not with --tensor-model-parallel-size "
                          f"{parallel.tensor_model_parallel_size}; drop one of them")
