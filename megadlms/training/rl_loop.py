"""RL's step (`--rl`, docs/rl.md): rollout -> score -> optimise. diffu-GRPO samples G completions per prompt
from the fast sampler and scores them (rewards, group advantages, the old-policy and reference log-probabilities)
every mu steps; VRPO's records carry their responses, so it has nothing to roll out. The step then optimises the
objective's loss on its micro-batches through the trainer's step runner; the model, optimizer, schedule, hooks,
checkpoints and logging are the trainer's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..diffusion.objective import MaskSampler
from ..rl.data import Record
from .objectives import Objective
from .rl_objectives import PairBatch, RLObjective, RolloutBatch


class RLStep:
    """Makes an RL step's micro-batches from the loader's records; the trainer chooses it once, for `--rl` runs.
    sampler: the trainer's checkpointed generator (one seed per step); global_batch, micro_steps: the step's."""

    def __init__(self, objective: Objective, sampler: MaskSampler, global_batch: int, micro_steps: int,
                 device: torch.device):
        if not isinstance(objective, RLObjective):
            raise TypeError(f"RL's step runs an RL objective, not {type(objective).__name__}")
        self.objective: RLObjective[Any] = objective
        self.sampler, self.device = sampler, device
        self.global_batch, self.micro_steps = global_batch, micro_steps

    def __call__(self, records: Iterator[list[Record]], iteration: int) -> Iterator[PairBatch | RolloutBatch]:
        obj = self.objective
        noise = obj.draw_noise(self.sampler, self.global_batch, self.micro_steps)  # the step's seed
        obj.rollout(records, noise, self.micro_steps, self.device)  # rollout and score, when due
        return obj.micro_batches(records, noise, self.micro_steps, self.device)  # what the step optimises
