"""How one step's micro-batches run through the model, chosen once when the trainer is built: `PlainRunner` (the
whole model on this rank, gradients accumulated micro-batch by micro-batch) or, with pipeline parallelism,
`megadlms.training.pipeline_step.PipelineRunner` (a schedule over the stages). The loop calls the same three
methods on either and never asks which it has."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from .objectives import Batch
from .optim import clip_grad_norm


@dataclass
class StepTotals:
    """What a step's (or a validation batch's) micro-batches add up to."""

    loss_sum: torch.Tensor  # fp32 scalar: the sum of the micro-batches' losses
    micro_batches: int
    tokens: int = 0  # summed over the data-parallel ranks (throughput)
    flops: float = 0.0


class StepRunner(ABC):
    """Forward (and backward) of a step's micro-batches, and the gradient norm and clip of the step."""

    @abstractmethod
    def train(self, batches: Iterable[Batch], micro_steps: int) -> StepTotals:
        """Forward and backward of the step's `micro_steps` micro-batches, gradients accumulated as the mean."""

    @abstractmethod
    def evaluate(self, batches: Iterable[Batch], totals: StepTotals) -> None:
        """The micro-batches' losses added to `totals` (one running sum over the validation), no gradients (the
        caller's no_grad)."""

    @abstractmethod
    def clip_grads(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """The L2 norm of the whole model's gradients (fp32 scalar on the device), the gradients clipped to
        `max_norm` for the next optimizer step (min(1, max_norm / (norm + 1e-6)); inf only measures)."""


class PlainRunner(StepRunner):
    """The whole model on this rank (data, tensor, context or expert parallel: the collectives are the model's).

    loss: a micro-batch's loss under the run's autocast; grad_sync(last): whether this micro-batch reduces
    gradients (`megadlms.distributed.data_parallel.grad_sync_context`); eager_unless_length: with compiled
    tensor-parallel layers, the one sequence length they run compiled at (a varilen micro-batch runs eagerly, since
    DTensor graphs with dynamic shapes recompile for every length or fail to compile); None: always as built."""

    def __init__(self, model: nn.Module, loss: Callable[[Batch], torch.Tensor],
                 grad_sync: Callable[[bool], contextlib.AbstractContextManager], device: torch.device,
                 eager_unless_length: int | None = None):
        self.model, self.loss, self.grad_sync, self.device = model, loss, grad_sync, device
        self.eager_unless_length = eager_unless_length

    def _stance(self, length: int) -> contextlib.AbstractContextManager:
        if self.eager_unless_length is not None and length != self.eager_unless_length:
            return torch.compiler.set_stance("force_eager")
        return contextlib.nullcontext()

    def train(self, batches: Iterable[Batch], micro_steps: int) -> StepTotals:
        out = StepTotals(torch.zeros((), device=self.device), 0)
        for m, batch in enumerate(batches):
            with self.grad_sync(m == micro_steps - 1), self._stance(batch.inputs.shape[1]):
                loss = self.loss(batch)
                (loss / micro_steps).backward()
            out.loss_sum += loss.detach()
            out.micro_batches += 1
            out.tokens += batch.tokens
            out.flops += batch.flops
        return out

    def evaluate(self, batches: Iterable[Batch], totals: StepTotals) -> None:
        for batch in batches:
            totals.loss_sum += self.loss(batch)
            totals.micro_batches += 1

    def clip_grads(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = clip_grad_norm(optimizer, params, max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
