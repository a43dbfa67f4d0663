"""What an objective adds to the loop beside its batches and losses, attached once by `objective_plugins`:

- validation plug-ins (`ValidationPlugin`): they see each validation batch's loader samples and adopt what the
  validation showed (BD3-LM's clip search, `Bd3lmClipSearch`);
- training hooks (`megadlms.training.hooks.TrainingHook`) of objectives with state of their own (RL's reference
  model and rollouts, its metrics).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..diffusion import bd3lm
from ..diffusion.clip_search import ClipSearch, block_means, lowest_variance
from ..diffusion.objective import MaskSampler, token_losses
from .hooks import TrainingHook
from .objectives import BlockDiffusion, Objective


class ValidationPlugin(TrainingHook):
    """Work during validation beside the loss; its state is checkpointed with the objective's."""

    def observe(self, model: nn.Module, samples: list[torch.Tensor], batch: int,
                output_weight: Callable[[], torch.Tensor]) -> None:
        """Validation batch `batch`: this rank's loader samples (one per micro-step, on the device), under the
        caller's autocast and no_grad."""

    def finish(self) -> dict[str, float]:
        """After the validation batches: adopt what they showed; returns the metrics to log beside the loss."""
        return {}


class Bd3lmClipSearch(ValidationPlugin):
    """--bd3lm-clip-search: each candidate interval's per-block training losses on the validation batches, and
    the interval of lowest summed batch variance adopted for training (written into the objective's config).
    seed: seeds the noise it draws (the same at every validation)."""

    def __init__(self, objective: BlockDiffusion, seed: int):
        self.objective, self.seed = objective, seed
        self.search = ClipSearch([(c.clip_min, c.clip_max) for c in objective.candidates])

    def state_dict(self) -> dict[str, Any]:
        """The interval it adopted (training uses it until the next validation)."""
        config = self.objective.config
        return {"bd3lm_clip": [config.clip_min, config.clip_max]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "bd3lm_clip" in state:
            config = self.objective.config
            config.clip_min, config.clip_max = (float(v) for v in state["bd3lm_clip"])

    def observe(self, model: nn.Module, samples: list[torch.Tensor], batch: int,
                output_weight: Callable[[], torch.Tensor]) -> None:
        """Noise drawn for the global batch under the training rules of each candidate, from a generator seeded by
        (seed, batch), the same for every candidate (common random numbers: the candidates differ by their
        interval, not by their draws)."""
        search, obj = self.search, self.objective
        if not search.wants(batch):
            return
        sh, n, block = obj.sharding, obj.config.seq_length, obj.config.block_size
        device = samples[0].device
        kwargs = bd3lm.forward_kwargs(obj.config, device, obj.flex)
        global_batch = sh.micro_batch_size * sh.dp_size * len(samples)
        for c, cand in enumerate(obj.candidates):
            noise = bd3lm.draw_noise(MaskSampler(self.seed * 1_000_003 + batch, device=device), global_batch,
                                     len(samples), cand)
            for m, sample in enumerate(samples):
                rows = sh.rows(m)
                inputs, targets, weights = bd3lm.prepare_batch(sample.to(device), (noise.t[rows], noise.u[rows]),
                                                               cand)
                hidden = model(inputs, output_hidden=True, **kwargs)[:, :n]
                losses = token_losses(hidden, output_weight(), targets, weights, mask_id=obj.subs_mask_id,
                                      chunk_tokens=obj.loss_chunk_tokens or 8192)
                search.observe(batch, c, block_means(losses, block))

    def finish(self) -> dict[str, float]:
        """The same interval on every rank (the moments are summed over the data-parallel ranks first); the
        metrics: the adopted interval, its variance and every candidate's."""
        search, obj = self.search, self.objective
        stats = search.stacked()
        if stats is None:
            return {}
        if obj.sharding.dp_size > 1:
            dist.all_reduce(stats, group=obj.sharding.dp_group)
        best, total = lowest_variance(stats)
        search.reset()
        config = obj.config
        config.clip_min, config.clip_max = search.candidates[best]
        out = {"bd3lm_clip_min": config.clip_min, "bd3lm_clip_max": config.clip_max,
               "bd3lm_clip_variance": float(total[best])}
        for (lo, hi), v in zip(search.candidates, total.tolist()):
            out[f"bd3lm_clip_variance/{lo:g}-{hi:g}"] = v
        return out


def objective_plugins(objective: Objective, model: nn.Module, *, seed: int
                      ) -> tuple[list[TrainingHook], list[ValidationPlugin]]:
    """The hooks and validation plug-ins of the run's objective, decided once. model: the unwrapped model being
    trained (an objective that is itself a hook, RL's, holds it for its reference and rollouts); seed: the
    validation plug-ins' noise seed."""
    hooks: list[TrainingHook] = []
    plugins: list[ValidationPlugin] = []
    if isinstance(objective, TrainingHook):  # RL: the reference model, rollouts and metrics of its own
        objective.bind(model)
        hooks.append(objective)
    if isinstance(objective, BlockDiffusion) and objective.candidates:
        plugins.append(Bd3lmClipSearch(objective, seed))
    return hooks, plugins
