"""Pipeline parallelism on torch.distributed.pipelining: the layers split into consecutive stages over the ranks of
a `pp` group, run by a 1F1B, GPipe or interleaved 1F1B schedule over the micro-batches of a step.

`PipelineStageModule` is one stage's share of a `TransformerLM`: the embedding on the first stage, a run of layers
(named by their global index, so checkpoints keep the one-model names), the final norm on the last stage, which
returns the final hidden states; the LM head and the loss run in the schedule's `loss_fn` on the last stage
(`megadlms.training.objectives.Objective.loss_from_hidden`). With tied embeddings the last stage holds the
embedding weight too and `sync_tied_gradients` sums its gradient with the first stage's.

Virtual stages (Megatron's --num-layers-per-virtual-pipeline-stage): with V stages per rank the model is cut into
pp x V stages and rank r holds stages r, r + pp, ..., r + (V - 1) pp (the looped layout torch's interleaved
schedule expects), so the pipeline fills V times faster. `RankStages` holds one rank's stages under the model's
parameter names, for the optimizer, the FP8 updates and the checkpoints.

A micro-batch's attention mask and positions are not pipeline activations: each stage reads them from the list
given to `run_schedule`, in micro-batch order (every schedule runs each stage's forwards in that order).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..config import ConfigError, TransformerConfig
from ..model import TransformerLM
from .config import PIPELINE_SCHEDULES

SCHEDULES = PIPELINE_SCHEDULES


def check_pipeline_parallel(cfg: TransformerConfig, pp_size: int, virtual_stages: int = 1) -> None:
    """Raise ConfigError (one line) where the layers do not split into `pp_size` x `virtual_stages` equal stages."""
    stages = pp_size * virtual_stages
    if stages > 1 and cfg.num_layers % stages:
        fit = (cfg.num_layers // stages + 1) * stages
        if virtual_stages == 1:
            raise ConfigError(f"--num-layers {cfg.num_layers} is not divisible by --pipeline-model-parallel-size "
                              f"{pp_size}; use a pipeline size that divides it, or {fit} layers")
        raise ConfigError(f"--num-layers {cfg.num_layers} is not divisible by --pipeline-model-parallel-size "
                          f"{pp_size} x {virtual_stages} virtual stages = {stages}; use {fit} layers or fewer "
                          "virtual stages (--num-layers-per-virtual-pipeline-stage)")


def virtual_stages(num_layers: int, pp_size: int, layers_per_virtual_stage: int | None) -> int:
    """Stages per rank: num_layers / (pp x --num-layers-per-virtual-pipeline-stage), 1 without the flag. Raises
    ConfigError (one line) where the layers do not split so."""
    if not layers_per_virtual_stage:
        return 1
    per_rank, rest = divmod(num_layers, pp_size)
    if rest or per_rank % layers_per_virtual_stage:
        raise ConfigError(f"--num-layers-per-virtual-pipeline-stage {layers_per_virtual_stage} does not divide the "
                          f"--num-layers {num_layers} / --pipeline-model-parallel-size {pp_size} layers of each rank; "
                          "pick a divisor of num_layers / pp")
    return per_rank // layers_per_virtual_stage


def stage_layers(num_layers: int, num_stages: int, stage: int) -> range:
    """The global indices of the layers of `stage` (equal, consecutive runs)."""
    per = num_layers // num_stages
    return range(stage * per, (stage + 1) * per)


def rank_stages(pp_rank: int, pp_size: int, virtual: int = 1) -> list[int]:
    """The stages pp rank `pp_rank` holds: pp_rank + v x pp_size for v < virtual (the looped layout)."""
    return [pp_rank + v * pp_size for v in range(virtual)]


class PipelineStageModule(nn.Module):
    """One stage of a `TransformerLM`: first stage input_ids long [B, S] -> hidden [B, S, H]; a later stage
    hidden [B, S, H] -> hidden [B, S, H] (the last stage's after the final norm). Shares the model's modules.
    stage: its index among num_stages (pp x virtual stages)."""

    def __init__(self, model: TransformerLM, stage: int, num_stages: int, sequence: Any = None):
        super().__init__()
        cfg = model.config
        if cfg.num_layers % num_stages:
            raise ConfigError(f"--num-layers {cfg.num_layers} does not split into {num_stages} pipeline stages")
        self.config, self.stage, self.num_stages = cfg, stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        tied = model.lm_head is None
        self.embed_tokens = model.embed_tokens if self.is_first or (self.is_last and tied) else None
        self.layers = nn.ModuleDict({str(i): model.layers[i]
                                     for i in stage_layers(cfg.num_layers, num_stages, stage)})
        self.norm = model.norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None
        self.rotary = model.rotary
        self.layer_context = model.layer_context
        self._mask_of = model._attention_mask  # a bound method: the model's mask preparation, not a submodule
        self._kwargs: list[dict[str, Any]] = []
        self._next = 0
        # tensor parallelism's sequence-length source (`tensor_parallel.SequenceLength`), which its norms read:
        # with sequence parallelism a stage's input is a shard [B, S / tp, H], so the length comes from here
        self.sequence = sequence
        self._length: int | None = None

    @property
    def output_weight(self) -> torch.Tensor:
        """The LM head's weight [V, H] (the last stage's; the embedding's when tied)."""
        assert self.is_last, "the LM head is on the last stage"
        if self.lm_head is not None:
            return self.lm_head.weight
        assert self.embed_tokens is not None
        return self.embed_tokens.weight

    @property
    def tied_weight(self) -> torch.Tensor | None:
        """The embedding weight this stage shares with the other end of the pipeline (tied embeddings, first or
        last of several stages), else None."""
        if self.config.untie_embeddings_and_output_weights or self.num_stages == 1 or self.embed_tokens is None:
            return None
        return self.embed_tokens.weight

    def set_micro_batch_kwargs(self, kwargs: Sequence[dict[str, Any]], length: int | None = None) -> None:
        """Each micro-batch's model keyword arguments (attention_mask, position_ids), read in order by forward, and
        their sequence length S (when a stage's input may be a sequence shard)."""
        self._kwargs, self._next, self._length = list(kwargs), 0, length

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kwargs = self._kwargs[self._next] if self._kwargs else {}
        self._next += 1
        s = self._length or x.shape[1]
        if self.sequence is not None:
            self.sequence.value = s
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(s, device=x.device)
        rope = self.rotary(positions)
        mask = self._mask_of(kwargs.get("attention_mask"), s, None)
        if self.is_first:
            assert self.embed_tokens is not None
            x = self.embed_tokens(x)
        residual = None
        with self.layer_context():
            for layer in self.layers.values():
                x, residual = layer(x, rope, mask, None, residual)
        x = x if residual is None else residual + x
        if self.is_last:
            assert self.norm is not None
            x = self.norm(x)
            if isinstance(x, DTensor):  # tensor parallel: the final norm's replicated output, as a plain tensor
                x = x.to_local()
        return x


class RankStages(nn.Module):
    """One rank's stages of a `TransformerLM`, under the model's parameter names (embed_tokens, layers.<i>, norm,
    lm_head): what the optimizer steps, the FP8 updates visit and checkpoints save. Not called itself: the schedule
    runs `runners`, each stage module or its data-parallel wrapper (DDP; FSDP2 shards the stage modules in place)."""

    def __init__(self, stages: Sequence[PipelineStageModule]):
        super().__init__()
        self.config = stages[0].config
        embeds = [s.embed_tokens for s in stages if s.embed_tokens is not None]
        self.embed_tokens = embeds[0] if embeds else None
        self.layers = nn.ModuleDict({k: v for s in stages for k, v in s.layers.items()})
        last = [s for s in stages if s.is_last]
        self.norm = last[0].norm if last else None
        self.lm_head = last[0].lm_head if last else None
        self.stages: list[PipelineStageModule] = list(stages)  # a plain list: their modules are registered above
        self.runners: list[nn.Module] = list(stages)
        self.sequence_shards = 1  # sequence parallelism: the activations between stages are [B, S / tp, H]
        # the dtype of the activations between stages when it is not the residual stream's fp32: FSDP2's compute
        # dtype (its mixed precision casts the parameters, so the stages compute and send in it)
        self.activation_dtype: torch.dtype | None = None

    def train(self, mode: bool = True) -> RankStages:
        super().train(mode)
        for r in self.runners:
            r.train(mode)
        return self

    def forward(self, *args: Any) -> Any:
        raise RuntimeError("RankStages is run by its pipeline schedule (megadlms.training.pipeline_step)")


def count_stage_parameters(model: RankStages, group: dist.ProcessGroup) -> int:
    """The whole model's parameter count from every pipeline rank's stages (collective over `group`): each
    parameter once, a sharded one (FSDP2, TP) whole, the tied embedding's last-stage copy left out."""
    copy = next((s.tied_weight for s in model.stages if s.is_last and s.tied_weight is not None), None)
    device = next(model.parameters()).device  # NCCL reduces GPU tensors only
    n = torch.tensor(sum(p.numel() for p in model.parameters() if p is not copy), dtype=torch.float64, device=device)
    dist.all_reduce(n, group=group)
    return int(n.item())


def check_micro_batches(n_microbatches: int, pp_size: int, virtual: int, schedule: str, *,
                        samples_per_micro_batch: int | None = None) -> None:
    """Refuse a step whose micro-batch count the schedule cannot run: 1F1B needs at least `pp_size`, the
    interleaved 1F1B (`virtual` > 1 stages per rank) a multiple of it. samples_per_micro_batch (micro-batch x
    data-parallel size): given, the error names the --global-batch-size that fits."""
    interleaved = virtual > 1
    if not (interleaved and n_microbatches % pp_size) and not (schedule == "1f1b" and n_microbatches < pp_size):
        return
    need = -(-n_microbatches // pp_size) * pp_size  # the next multiple of pp_size (pp_size itself below it)
    fix = ("raise --global-batch-size" if samples_per_micro_batch is None
           else f"pass --global-batch-size {need * samples_per_micro_batch} ({need} micro-batches of "
                f"{samples_per_micro_batch} samples: --micro-batch-size x data-parallel size)")
    if interleaved:
        raise ConfigError(f"the interleaved 1F1B schedule needs the micro-batches per step ({n_microbatches}) to be a "
                          f"multiple of --pipeline-model-parallel-size {pp_size}; {fix}")
    raise ConfigError(f"the 1F1B schedule needs at least --pipeline-model-parallel-size {pp_size} micro-batches "
                      f"per step, got {n_microbatches}; {fix}, or use --pipeline-schedule gpipe")


def build_schedule(stage_modules: Sequence[PipelineStageModule], group: dist.ProcessGroup, device: torch.device,
                   n_microbatches: int, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                   micro_batch: tuple[int, int], schedule: str = "1f1b", activation_dtype: torch.dtype = torch.float32,
                   output_dtype: torch.dtype = torch.float32, submodules: Sequence[nn.Module] | None = None,
                   sequence_shards: int = 1) -> Any:
    """A torch.distributed.pipelining schedule of this rank's stages (`rank_stages`' order) over `group`.
    loss_fn(hidden, index) is called on the last stage with the micro-batch's final hidden states and its index
    (long [1]) in the step. Several stages per rank run the interleaved 1F1B schedule.

    micro_batch: (B, S) of every micro-batch; the activations sent between stages are [B, S, H] in
    `activation_dtype` (the residual stream's), the last stage's output in `output_dtype` (the final norm's). Given
    up front, no forward runs to infer them (which would read a micro-batch's masks out of turn). submodules: what
    the stages run, when not the stage modules themselves (their DDP wrappers). sequence_shards: sequence
    parallelism's tp, whose ranks send [B, S / tp, H] between stages (the last stage's output stays [B, S, H])."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    if schedule not in SCHEDULES:
        raise ConfigError(f"--pipeline-schedule {schedule!r} is not one of {list(SCHEDULES)}")
    pp_size = dist.get_world_size(group)
    virtual = len(stage_modules)
    if virtual > 1 and schedule != "1f1b":
        raise ConfigError(f"--pipeline-schedule {schedule} runs one stage per rank, and --num-layers-per-virtual-"
                          f"pipeline-stage gives {virtual}; use --pipeline-schedule 1f1b or drop the flag")
    check_micro_batches(n_microbatches, pp_size, virtual, schedule)
    b, s = micro_batch
    shard = s // sequence_shards
    stages: list[Any] = []
    for module, run in zip(stage_modules, submodules or stage_modules):
        hidden = module.config.hidden_size
        inputs = (torch.zeros(b, s, dtype=torch.long, device=device) if module.is_first
                  else torch.empty(b, shard, hidden, dtype=activation_dtype, device=device, requires_grad=True))
        outputs = (torch.empty(b, s, hidden, dtype=output_dtype, device=device, requires_grad=True) if module.is_last
                   else torch.empty(b, shard, hidden, dtype=activation_dtype, device=device, requires_grad=True))
        stages.append(PipelineStage(run, module.stage, module.num_stages, device, input_args=inputs,
                                    output_args=outputs, group=group))
    if virtual > 1:
        return ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=loss_fn)
    cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    return cls(stages[0], n_microbatches, loss_fn=loss_fn)


def run_schedule(schedule: Any, stage_modules: Sequence[PipelineStageModule], inputs: torch.Tensor,
                 kwargs: Sequence[dict[str, Any]], train: bool = True) -> list[torch.Tensor]:
    """One step over the micro-batches: forward and backward (train), else forward only. inputs long [M * B, S]
    (the first stage's; the others ignore it), kwargs the M micro-batches' model keyword arguments. Gradients are
    accumulated, scaled by 1 / M (the mean over micro-batches). Returns the M micro-batch losses on the rank of the
    last stage, else []."""
    for module in stage_modules:
        module.set_micro_batch_kwargs(kwargs, inputs.shape[1])
    losses: list[torch.Tensor] = []
    last = any(m.is_last for m in stage_modules)
    target = torch.arange(len(kwargs), device=inputs.device) if last else None
    args = (inputs,) if any(m.is_first for m in stage_modules) else ()
    (schedule.step if train else schedule.eval)(*args, target=target, losses=losses)
    return losses


def sync_tied_gradients(stage_modules: Sequence[PipelineStageModule], group: dist.ProcessGroup) -> None:
    """Tied embeddings: sum the embedding weight's gradient of the first and the last stage (one weight, used at
    both ends), so that both copies take the same step. A no-op with untied weights, one stage, or on a rank
    holding neither end. `group` holds exactly the ranks of the first and the last stage. A sharded gradient
    (FSDP2, tensor parallelism) is summed shard by shard: both ends shard the weight alike over the same ranks."""
    tied = [m.tied_weight for m in stage_modules if m.tied_weight is not None]
    if not tied:
        return
    weight = tied[0]
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    grad = weight.grad
    if isinstance(grad, DTensor) and isinstance(weight, DTensor) and grad.placements != weight.placements:
        # tensor parallelism: the embedding's backward may leave a replicated gradient; both ends are made to
        # hold the weight's layout, so that their shards add up
        grad = weight.grad = grad.redistribute(placements=weight.placements)
    local = grad.to_local() if isinstance(grad, DTensor) else grad
    dist.all_reduce(local, group=group)
