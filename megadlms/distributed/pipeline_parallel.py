"""Pipeline parallelism on torch.distributed.pipelining: the layers split into consecutive stages, one per rank of a
`pp` group, run by a 1F1B or GPipe schedule over the micro-batches of a step.

`PipelineStageModule` is one stage's share of a `TransformerLM`: the embedding on the first stage, a run of layers
(named by their global index, so checkpoints keep the one-model names), the final norm on the last stage, which
returns the final hidden states; the LM head and the loss run in the schedule's `loss_fn` on the last stage
(`megadlms.training.objectives.Objective.loss_from_hidden`). With tied embeddings the last stage holds the
embedding weight too and `sync_tied_gradients` sums its gradient with the first stage's.

A micro-batch's attention mask and positions are not pipeline activations: each stage reads them from the list
given to `run_schedule`, in micro-batch order (both schedules run every stage's forwards in that order).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config import ConfigError, TransformerConfig
from ..model import TransformerLM
from .config import PIPELINE_SCHEDULES

SCHEDULES = PIPELINE_SCHEDULES


def check_pipeline_parallel(cfg: TransformerConfig, pp_size: int) -> None:
    """Raise ConfigError (one line) where the layers do not split into `pp_size` equal stages."""
    if pp_size > 1 and cfg.num_layers % pp_size:
        fit = (cfg.num_layers // pp_size + 1) * pp_size
        raise ConfigError(f"--num-layers {cfg.num_layers} is not divisible by --pipeline-model-parallel-size "
                          f"{pp_size}; use a pipeline size that divides it, or {fit} layers")


def stage_layers(num_layers: int, pp_size: int, stage: int) -> range:
    """The global indices of the layers of `stage` (equal, consecutive runs)."""
    per = num_layers // pp_size
    return range(stage * per, (stage + 1) * per)


class PipelineStageModule(nn.Module):
    """One stage of a `TransformerLM`: first stage input_ids long [B, S] -> hidden [B, S, H]; a later stage
    hidden [B, S, H] -> hidden [B, S, H] (the last stage's after the final norm). Shares the model's modules."""

    def __init__(self, model: TransformerLM, stage: int, pp_size: int):
        super().__init__()
        cfg = model.config
        check_pipeline_parallel(cfg, pp_size)
        self.config, self.stage, self.pp_size = cfg, stage, pp_size
        self.is_first, self.is_last = stage == 0, stage == pp_size - 1
        tied = model.lm_head is None
        self.embed_tokens = model.embed_tokens if self.is_first or (self.is_last and tied) else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in stage_layers(cfg.num_layers, pp_size, stage)})
        self.norm = model.norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None
        self.rotary = model.rotary
        self.layer_context = model.layer_context
        self._mask_of = model._attention_mask  # a bound method: the model's mask preparation, not a submodule
        self._kwargs: list[dict[str, Any]] = []
        self._next = 0

    @property
    def output_weight(self) -> torch.Tensor:
        """The LM head's weight [V, H] (the last stage's; the embedding's when tied)."""
        assert self.is_last, "the LM head is on the last stage"
        if self.lm_head is not None:
            return self.lm_head.weight
        assert self.embed_tokens is not None
        return self.embed_tokens.weight

    def set_micro_batch_kwargs(self, kwargs: Sequence[dict[str, Any]]) -> None:
        """Each micro-batch's model keyword arguments (attention_mask, position_ids), read in order by forward."""
        self._kwargs, self._next = list(kwargs), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kwargs = self._kwargs[self._next] if self._kwargs else {}
        self._next += 1
        s = x.shape[1]
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
        return x


def build_schedule(stage_module: PipelineStageModule, group: dist.ProcessGroup, device: torch.device,
                   n_microbatches: int, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                   micro_batch: tuple[int, int], schedule: str = "1f1b", activation_dtype: torch.dtype = torch.float32,
                   output_dtype: torch.dtype = torch.float32, submodule: nn.Module | None = None) -> Any:
    """A torch.distributed.pipelining schedule of one stage per rank of `group`. loss_fn(hidden, index) is called
    on the last stage with the micro-batch's final hidden states and its index (long [1]) in the step.

    micro_batch: (B, S) of every micro-batch; the activations sent between stages are [B, S, H] in
    `activation_dtype` (the residual stream's), the last stage's output in `output_dtype` (the final norm's). Given
    up front, no forward runs to infer them (which would read a micro-batch's masks out of turn). submodule: what the
    stage runs, when not `stage_module` itself (its DDP wrapper)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    if schedule not in SCHEDULES:
        raise ConfigError(f"--pipeline-schedule {schedule!r} is not one of {list(SCHEDULES)}")
    pp_size = dist.get_world_size(group)
    if schedule == "1f1b" and n_microbatches < pp_size:
        raise ConfigError(f"the 1F1B schedule needs at least --pipeline-model-parallel-size {pp_size} micro-batches "
                          f"per step, got {n_microbatches}; raise --global-batch-size or use --pipeline-schedule gpipe")
    b, s = micro_batch
    hidden = stage_module.config.hidden_size
    inputs = (torch.zeros(b, s, dtype=torch.long, device=device) if stage_module.is_first
              else torch.empty(b, s, hidden, dtype=activation_dtype, device=device, requires_grad=True))
    outputs = torch.empty(b, s, hidden, dtype=output_dtype if stage_module.is_last else activation_dtype,
                          device=device, requires_grad=True)
    stage = PipelineStage(submodule or stage_module, stage_module.stage, pp_size, device, input_args=inputs,
                          output_args=outputs, group=group)
    cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    return cls(stage, n_microbatches, loss_fn=loss_fn)


def run_schedule(schedule: Any, stage_module: PipelineStageModule, inputs: torch.Tensor,
                 kwargs: Sequence[dict[str, Any]]) -> list[torch.Tensor]:
    """One step's forward and backward over the micro-batches: inputs long [M * B, S] (the first stage's; the
    others ignore it), kwargs the M micro-batches' model keyword arguments. Gradients are accumulated, scaled by
    1 / M (the mean over micro-batches). Returns the M micro-batch losses on the last stage, else []."""
    stage_module.set_micro_batch_kwargs(kwargs)
    losses: list[torch.Tensor] = []
    n = len(kwargs)
    target = torch.arange(n, device=inputs.device) if stage_module.is_last else None
    if stage_module.is_first:
        schedule.step(inputs, target=target, losses=losses)
    else:
        schedule.step(target=target, losses=losses)
    return losses


def sync_tied_gradients(stage_module: PipelineStageModule, group: dist.ProcessGroup) -> None:
    """Tied embeddings: sum the embedding weight's gradient of the first and the last stage (one weight, used at
    both ends), so that both copies take the same step. A no-op with untied weights or one stage. `group` holds
    exactly the first and the last stage's ranks."""
    if stage_module.config.untie_embeddings_and_output_weights or stage_module.pp_size == 1:
        return
    if not (stage_module.is_first or stage_module.is_last):
        return
    assert stage_module.embed_tokens is not None
    grad = stage_module.embed_tokens.weight.grad
    if grad is None:
        grad = torch.zeros_like(stage_module.embed_tokens.weight)
        stage_module.embed_tokens.weight.grad = grad
    dist.all_reduce(grad, group=group)
