"""A training step's micro-batches through a pipeline of stages (--pipeline-model-parallel-size): the schedule of
`megadlms.distributed.pipeline_parallel` with the objective's loss on the last stage, the losses shared with every
stage, the tied embedding's two copies synchronised and the gradient norm taken over all stages."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..distributed.pipeline_parallel import RankStages, build_schedule, run_schedule, sync_tied_gradients
from .objectives import Batch, Objective
from .step_runner import StepRunner, StepTotals


class PipelineRunner(StepRunner):
    """One rank's side of the step. group: the pipeline's ranks (stage i on rank i mod pp of the group); autocast:
    the run's, around the schedule."""

    def __init__(self, model: RankStages, objective: Objective, group: dist.ProcessGroup,
                 device: torch.device, micro_batches: int, schedule: str, output_dtype: torch.dtype,
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
        self.model, self.stages = model, model.stages
        self.objective, self.group, self.device = objective, group, device
        self.micro_batches, self.schedule_name, self.output_dtype = micro_batches, schedule, output_dtype
        self.autocast = autocast
        self._batches: list[Batch] = []
        self._schedule: Any = None
        self._tied_group = self._first_and_last(group)
        self._last = next((s for s in self.stages if s.is_last), None)

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
        assert self._last is not None  # the schedule calls it on the last stage's rank only
        last = self._last

        def weight() -> torch.Tensor:  # tensor parallel: vocabulary-sharded, gathered (every TP rank has all logits)
            w = last.output_weight
            return w.full_tensor() if isinstance(w, DTensor) else w

        return self.objective.loss_from_hidden(hidden, self._batches[int(index)], weight)

    def _run(self, batches: list[Batch], train: bool) -> torch.Tensor:
        """The sum of the micro-batches' losses (fp32 scalar), on every stage."""
        self._batches = batches
        if self._schedule is None:
            self._schedule = build_schedule(self.stages, self.group, self.device, self.micro_batches, self._loss_fn,
                                            micro_batch=tuple(batches[0].inputs.shape),  # type: ignore[arg-type]
                                            schedule=self.schedule_name,
                                            activation_dtype=self.model.activation_dtype or torch.float32,
                                            output_dtype=self.model.activation_dtype or self.output_dtype,
                                            submodules=self.model.runners,
                                            sequence_shards=self.model.sequence_shards)
        inputs = torch.cat([b.inputs for b in batches])
        losses = run_schedule(self._schedule, self.stages, inputs, [b.model_kwargs() for b in batches], train=train)
        total = torch.zeros((), device=self.device)
        for x in losses:
            total += x.detach().float()
        dist.all_reduce(total, group=self.group)  # only the last stage's is non-zero
        self._batches = []
        return total

    def train(self, batches: Iterable[Batch], micro_steps: int) -> StepTotals:
        """Forward and backward of the step's micro-batches (gradients accumulated, divided by their number); the
        sum of their losses on every stage."""
        staged = list(batches)
        out = StepTotals(torch.zeros((), device=self.device), len(staged), sum(b.tokens for b in staged),
                         sum(b.flops for b in staged))
        with self.autocast():
            out.loss_sum += self._run(staged, train=True)
        sync_tied_gradients(self.stages, self._tied_group)
        return out

    def evaluate(self, batches: Iterable[Batch], totals: StepTotals) -> None:
        staged = list(batches)
        with self.autocast():
            totals.loss_sum += self._run(staged, train=False)
        totals.micro_batches += len(staged)

    def clip_grads(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """The L2 norm of the whole model's gradients (the tied embedding counted once; sharded gradients, FSDP2's
        or tensor parallelism's, whole), the gradients clipped to `max_norm` (min(1, max_norm / (norm + 1e-6)), as
        `optim.clip_grad_norm`)."""
        tied_copy = next((s.tied_weight for s in self.stages if s.is_last and s.tied_weight is not None), None)
        params = [p for p in self.model.parameters() if p.grad is not None]
        grads = [p.grad for p in params if p.grad is not None and p is not tied_copy]
        norm = nn.utils.get_total_norm(grads, foreach=True) if grads else torch.zeros((), device=self.device)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm  # this rank's stages
        sq = norm.float().square()
        dist.all_reduce(sq, group=self.group)  # over the stages
        norm = sq.sqrt()
        optimizer.grad_scale = None  # type: ignore[attr-defined]  # read by torch's fused Adam kernels
        if not math.isinf(max_norm):
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for p in params:  # each rank scales its shard of a sharded gradient
                g = p.grad.detach()  # type: ignore[union-attr]
                (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)
        return norm
