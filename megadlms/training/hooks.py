"""What a feature adds to the training loop, behind one interface the loop calls without naming the feature.

A `TrainingHook` is attached once, when the trainer is built, by the feature that needs it (FP8, MoE, CUDA graphs
here; an objective with state of its own, such as RL's reference model, or a validation plug-in elsewhere). The
loop calls every hook at the same points, in the order they were attached:

    begin_step(logged)  ->  micro-batches, backward, clip, optimizer step  ->  after_optimizer_step()
    with evaluation(): validation batches
    metrics()           at each log line
    state_dict()        with each checkpoint (rank state), load_state_dict() on resume
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..moe import moe_metrics, moe_step

if TYPE_CHECKING:
    import torch.distributed as dist

    from .cuda_graphs import LayerGraphs


class TrainingHook:
    """A no-op at every point; a feature overrides the points it acts at."""

    def bind(self, model: nn.Module) -> None:
        """The model being trained (unwrapped), for a hook made before it was built."""

    def begin_step(self, logged: bool) -> None:
        """Before the step's first forward; logged: the step ends a log window (its metrics are read after it)."""

    def after_optimizer_step(self) -> None:
        """After the optimizer step and zero_grad (also after a step the divergence guard skipped)."""

    def evaluation(self) -> contextlib.AbstractContextManager:
        """Entered around the validation batches."""
        return contextlib.nullcontext()

    def metrics(self) -> dict[str, float]:
        """The hook's metrics over the log window (then reset), for the log line and the sinks."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the hook for an exact resume (each hook its own keys)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Hooks:
    """The run's hooks, called in the order attached."""

    def __init__(self) -> None:
        self.hooks: list[TrainingHook] = []

    def attach(self, hook: TrainingHook) -> None:
        self.hooks.append(hook)

    def begin_step(self, logged: bool) -> None:
        for h in self.hooks:
            h.begin_step(logged)

    def after_optimizer_step(self) -> None:
        for h in self.hooks:
            h.after_optimizer_step()

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for h in self.hooks:
                stack.enter_context(h.evaluation())
            yield

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for h in self.hooks:
            out.update(h.metrics())
        return out

    def state_dict(self) -> dict[str, Any]:
        """Every hook's state in one dict (each hook its own keys)."""
        out: dict[str, Any] = {}
        for h in self.hooks:
            out.update(h.state_dict())
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for h in self.hooks:
            h.load_state_dict(state)


class Fp8Hook(TrainingHook):
    """FP8 training's per-step work: the delayed-scaling amax histories and scales advanced after each optimizer
    step; the weight caches off for training where each step has one micro-batch (a cached weight would outlive its
    backward) and back on for validation (every batch sees the same weights); with --fp8-stats, the telemetry
    recorded on the device in the steps that end a log window."""

    def __init__(self, model: nn.Module, *, amax_group: dist.ProcessGroup | None, stats: bool, micro_steps: int,
                 optimizer: torch.optim.Optimizer | None = None):
        from ..fp8 import set_fp8_weight_caching
        from .triton_adamw import StreamingAdamW

        self.model, self.amax_group, self.stats = model, amax_group, stats
        self._collecting = False
        if isinstance(optimizer, StreamingAdamW):
            # current scaling: each weight's amax comes out of the optimizer's update, not a pass before its cast
            # (a checkpoint's load refreshes them: Float8Linear.load_state_dict)
            from ..fp8 import attach_weight_amaxes

            optimizer.publish_amaxes(attach_weight_amaxes(model))
        # no later micro-batch of the step reads a cached FP8 weight: each layer's lives from its forward to its
        # backward (which also makes its transpose), not through the optimizer step until the next forward
        self.uncached = set_fp8_weight_caching(model, False) if micro_steps == 1 else []

    def begin_step(self, logged: bool) -> None:
        if self.stats and logged:
            from ..fp8 import enable_fp8_stats

            enable_fp8_stats(self.model, True)
            self._collecting = True

    def after_optimizer_step(self) -> None:
        from ..fp8 import enable_fp8_stats, fp8_step

        if self._collecting:
            enable_fp8_stats(self.model, False)
            self._collecting = False
        fp8_step(self.model, self.amax_group)

    def evaluation(self) -> contextlib.AbstractContextManager:
        if not self.uncached:
            return contextlib.nullcontext()
        from ..fp8 import fp8_weight_caching

        return fp8_weight_caching(self.model, self.uncached)

    def metrics(self) -> dict[str, float]:
        if not self.stats:
            return {}
        from ..fp8 import fp8_stats

        return {f"fp8/{k}": v for k, v in fp8_stats(self.model).items()}


class MoeHook(TrainingHook):
    """An MoE model's expert biases and routing counters, once per optimizer step; tokens per expert per layer and
    the auxiliary loss at each log line (`megadlms.moe`)."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None):
        self.model, self.group = model, group

    def after_optimizer_step(self) -> None:
        moe_step(self.model, self.group)

    def metrics(self) -> dict[str, float]:
        return moe_metrics(self.model)


class ArmLayerGraphs(TrainingHook):
    """CUDA graphs of the layers are captured once a step has run: compiled code and FP8 delayed scales exist."""

    def __init__(self, graphs: LayerGraphs):
        self.graphs = graphs

    def after_optimizer_step(self) -> None:
        self.graphs.arm()
