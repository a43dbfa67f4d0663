"""A training step's micro-batches through a pipeline of stages (--pipeline-model-parallel-size): the schedule of
`megadlms.distributed.pipeline_parallel` with the objective's loss on the last stage, the losses shared with every
stage, the tied embedding's two copies synchronised and the gradient norm taken over all stages."""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from ..distributed.pipeline_parallel import PipelineStageModule, build_schedule, run_schedule, sync_tied_gradients
from .objectives import Batch, Objective


class PipelineRunner:
    """One stage's side of the step. group: the pipeline's ranks (stage i on rank i of the group)."""

    def __init__(self, model: nn.Module, objective: Objective, group: dist.ProcessGroup,
                 device: torch.device, micro_batches: int, schedule: str, output_dtype: torch.dtype):
        """model: this rank's PipelineStageModule, or its DDP wrapper (data parallelism between pipelines)."""
        self.model = model
        self.stage = cast(PipelineStageModule, getattr(model, "module", model))
        self.objective, self.group, self.device = objective, group, device
        self.micro_batches, self.schedule_name, self.output_dtype = micro_batches, schedule, output_dtype
        self._batches: list[Batch] = []
        self._schedule: Any = None
        self._tied_group = self._first_and_last(group)

    @staticmethod
    def _first_and_last(group: dist.ProcessGroup) -> dist.ProcessGroup:
        """The group of this pipeline's first and last stage (the tied embedding's two copies). Every rank makes
        every pipeline's pair, in the same order, as new_group requires."""
        ranks = dist.get_process_group_ranks(group)
        if len(ranks) <= 2:
            return group
        pipelines: list[list[int]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(pipelines, ranks)
        mine = group
        for pair in sorted({(p[0], p[-1]) for p in pipelines}):
            g = dist.new_group(list(pair))
            if pair == (ranks[0], ranks[-1]):
                mine = g
        return mine

    def _loss_fn(self, hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return self.objective.loss_from_hidden(hidden, self._batches[int(index)], lambda: self.stage.output_weight)

    def _run(self, batches: list[Batch], train: bool) -> torch.Tensor:
        """The sum of the micro-batches' losses (fp32 scalar), on every stage."""
        self._batches = batches
        if self._schedule is None:
            self._schedule = build_schedule(self.stage, self.group, self.device, self.micro_batches, self._loss_fn,
                                            micro_batch=tuple(batches[0].inputs.shape),  # type: ignore[arg-type]
                                            schedule=self.schedule_name, output_dtype=self.output_dtype,
                                            submodule=self.model)
        inputs = torch.cat([b.inputs for b in batches])
        kwargs = [b.model_kwargs() for b in batches]
        if train:
            losses = run_schedule(self._schedule, self.stage, inputs, kwargs)
        else:
            self.stage.set_micro_batch_kwargs(kwargs)
            losses = []
            target = torch.arange(len(batches), device=self.device) if self.stage.is_last else None
            args = (inputs,) if self.stage.is_first else ()
            self._schedule.eval(*args, target=target, losses=losses)
        total = torch.zeros((), device=self.device)
        for x in losses:
            total += x.detach().float()
        dist.all_reduce(total, group=self.group)  # only the last stage's is non-zero
        self._batches = []
        return total

    def train(self, batches: list[Batch]) -> torch.Tensor:
        """Forward and backward of the step's micro-batches (gradients accumulated, divided by their number);
        returns the sum of their losses on every stage."""
        total = self._run(batches, train=True)
        sync_tied_gradients(self.stage, self._tied_group)
        return total

    def evaluate(self, batches: list[Batch]) -> torch.Tensor:
        return self._run(batches, train=False)

    def clip_grads(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """The L2 norm of the whole model's gradients (the tied embedding counted once), the gradients clipped to
        `max_norm` (min(1, max_norm / (norm + 1e-6)), as `optim.clip_grad_norm`)."""
        stage = self.stage
        tied_copy = (stage.is_last and not stage.is_first and stage.embed_tokens is not None
                     and not stage.config.untie_embeddings_and_output_weights)
        params = [p for p in stage.parameters() if p.grad is not None]
        counted = [p for p in params if not (tied_copy and p is stage.embed_tokens.weight)]  # type: ignore[union-attr]
        sq = torch.zeros((), device=self.device)
        for p in counted:
            sq += p.grad.detach().float().square().sum()  # type: ignore[union-attr]
        dist.all_reduce(sq, group=self.group)
        norm = sq.sqrt()
        optimizer.grad_scale = None  # type: ignore[attr-defined]  # read by torch's fused Adam kernels
        if not math.isinf(max_norm):
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for p in params:
                p.grad.detach().mul_(coef)  # type: ignore[union-attr]
        return norm

