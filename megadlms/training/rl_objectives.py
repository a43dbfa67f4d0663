"""The RL objectives behind the trainer's `Objective` interface (docs/rl.md).

- `PreferenceOptimisation` (`--rl vrpo`): LLaDA 1.5's VRPO on (prompt, chosen, rejected) pairs;
- `DiffuGRPO` (`--rl grpo`): d1's diffu-GRPO on prompts with verifiable rewards (rollouts from the fast sampler).

Both hold a frozen reference model: with LoRA the model itself with its adapters off, else a copy of the model
taken when training starts (saved with the checkpoints, so a resumed run keeps the first one). Their noise is
one seed per step drawn from the trainer's `MaskSampler` (checkpointed), from which every rollout, timestep and
mask of the step derives per record: a resumed run redraws exactly what the uninterrupted one drew.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from ..config import ConfigError, TransformerConfig
from ..diffusion.objective import BatchNoise, MaskSampler
from ..lora import adapters_disabled, lora_modules
from ..rl import RL_KINDS
from ..rl.data import Record
from ..rl.vrpo import dpo_loss, elbo_estimates, elbo_noise, masked_rows
from .documents import AttentionPlan
from .objectives import Batch, Objective, Sharding


@dataclass
class StepSeed(BatchNoise):
    """An RL step's noise: one seed, from which each record's randomness derives (`record_generator`)."""

    seed: int = 0


def record_generator(seed: int, index: int, device: torch.device, salt: int = 0) -> torch.Generator:
    """The generator of global record `index` in the step of `seed` (independent of how records fall on ranks)."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + index * 7919 + salt) % (2**63 - 1))
    return g


class RLObjective(Objective):
    """What both RL objectives share: the reference model, the per-step seed, metrics over the log window."""

    bound = False

    def __init__(self, *args: Any, autocast: Callable[[], contextlib.AbstractContextManager], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._autocast = autocast
        if self.model_config.mask_token_id is None:
            raise ConfigError("RL trains a masked-diffusion model: pass --mask-token ID")
        self.mask_id: int = self.model_config.mask_token_id
        self._policy: nn.Module | None = None
        self._reference: nn.Module | None = None  # a frozen copy (None with LoRA: the adapters are switched off)
        self._reference_state: dict[str, torch.Tensor] | None = None  # from a checkpoint, before the copy exists
        self._window: dict[str, list[float]] = {}
        self._step_micro = 0  # global index of this step's first micro-batch for this rank

    # -- the trainer's hooks
    def bind(self, model: nn.Module) -> None:
        """The policy (the unwrapped TransformerLM), after the trainer built it."""
        self._policy = model

    def metrics(self) -> dict[str, float]:
        """Means over the log window (this rank's), then a fresh window."""
        out = {f"rl/{k}": sum(v) / len(v) for k, v in self._window.items() if v}
        self._window = {}
        return out

    def state_dict(self) -> dict[str, Any]:
        ref = self._reference
        return {"reference": None if ref is None else {k: v.detach().clone() for k, v in ref.state_dict().items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._reference_state = state.get("reference")
        self._reference = None

    def flops_per_token(self) -> float:
        return self.model_config.flops_per_token(self.model_config.seq_length)

    def validation_note(self) -> str:
        return "RL objective (no validation loss)"

    def draw_noise(self, sampler: MaskSampler, global_batch: int, micro_steps: int, *,
                   evaluation: bool = False) -> BatchNoise:
        seed = int(torch.randint(0, 2**62, (1,), generator=sampler.generator, device=sampler.device))
        empty = torch.empty(0)
        return StepSeed(empty, empty, torch.zeros(micro_steps, dtype=torch.long), evaluation, seed=seed)

    # -- helpers
    def _record(self, name: str, value: float) -> None:
        self._window.setdefault(name, []).append(float(value))

    def _uses_lora(self) -> bool:
        return self._policy is not None and bool(lora_modules(self._policy))

    def reference(self) -> contextlib.AbstractContextManager[nn.Module]:
        """The frozen reference model for a `with` block (no gradients flow into it)."""
        policy = self._policy
        if policy is None:
            raise RuntimeError("the RL objective has no model: the trainer calls bind(model) first")
        if self._uses_lora():
            return adapters_disabled(policy)
        if self._reference is None:  # at the first step: the loaded (or resumed) weights are in place
            ref = copy.deepcopy(policy)
            if self._reference_state is not None:
                ref.load_state_dict(self._reference_state)
                self._reference_state = None
            for p in ref.parameters():
                p.requires_grad_(False)
            self._reference = ref.eval()
        return contextlib.nullcontext(self._reference)


@dataclass
class PairBatch(Batch):
    """VRPO micro-batch: rows [pair, chosen / rejected, sample] flattened; inputs and weights as in `masked_rows`."""

    samples: int = 1  # n, rows per ELBO estimate


def pad_rows(rows: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token rows to the longest: (ids long [R, S], real bool [R, S])."""
    width = max(r.shape[-1] for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=rows[0].device)
    real = torch.zeros(len(rows), width, dtype=torch.bool, device=rows[0].device)
    for i, r in enumerate(rows):
        ids[i, :r.shape[-1]] = r
        real[i, :r.shape[-1]] = True
    return ids, real


class PreferenceOptimisation(RLObjective):
    """VRPO: per pair, n-sample ELBO estimates of the chosen and the rejected response under the policy and the
    reference, with the same timesteps and masks for both models (`megadlms.rl.vrpo`); the DPO loss averaged over
    the micro-batch's pairs."""

    name = "VRPO (DPO on ELBO estimates)"

    def __init__(self, *args: Any, samples: int, beta: float, eps: float, pad_id: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if samples < 1:
            raise ConfigError(f"--vrpo-samples {samples} must be at least 1 (LLaDA 1.5 uses 8)")
        self.samples, self.beta, self.eps, self.pad_id = samples, beta, eps, pad_id

    def micro_batches(self, samples: Iterator[Any], noise: BatchNoise, count: int,
                      device: torch.device) -> Iterator[Batch]:
        assert isinstance(noise, StepSeed)
        sh, n = self.sharding, self.samples
        for m in range(count):
            records = cast("list[Record]", self._next(samples))
            first = sh.rows(m).start
            seqs: list[torch.Tensor] = []
            weights: list[torch.Tensor] = []
            clean: list[torch.Tensor] = []
            for j, rec in enumerate(records):
                g = record_generator(noise.seed, first + j, device)
                for response in (rec.chosen, rec.rejected):
                    seq = torch.tensor(rec.prompt + response, dtype=torch.long, device=device)
                    p, masked = elbo_noise(n, len(response), g, eps=self.eps)
                    x, w = masked_rows(seq, len(rec.prompt), p, masked, mask_id=self.mask_id)
                    seqs.extend(x)
                    weights.extend(w)
                    clean.extend([seq] * n)
            inputs, real = pad_rows(seqs, self.pad_id)
            targets, _ = pad_rows(clean, self.pad_id)
            w = torch.zeros(inputs.shape, dtype=torch.float32, device=device)
            for i, row in enumerate(weights):
                w[i, :row.shape[0]] = row
            tokens = int(real.sum()) * sh.dp_size
            mask = None if bool(real.all()) else real
            # the reference's forward costs a third of the policy's forward + backward
            yield PairBatch(inputs, targets, w, tokens=tokens, flops=tokens * self.flops_per_token() * 4 / 3,
                            attention_mask=mask, samples=n)

    def loss(self, model: nn.Module, batch: Batch, output_weight: Callable[[], torch.Tensor]) -> torch.Tensor:
        assert isinstance(batch, PairBatch)
        kwargs = batch.model_kwargs()
        with torch.no_grad(), self.reference() as ref:
            ref_b = elbo_estimates(ref(batch.inputs, **kwargs), batch.targets, batch.weights, batch.samples)
        pol_b = elbo_estimates(model(batch.inputs, **kwargs), batch.targets, batch.weights, batch.samples)
        pol, ref_ = pol_b.view(-1, 2), ref_b.view(-1, 2)  # [pairs, chosen / rejected]
        losses, margin = dpo_loss(pol[:, 0], ref_[:, 0], pol[:, 1], ref_[:, 1], self.beta)
        self._record("margin", margin.mean().item())
        self._record("accuracy", (margin > 0).float().mean().item())
        self._record("chosen_reward", (self.beta * (pol[:, 0] - ref_[:, 0])).mean().item())
        self._record("rejected_reward", (self.beta * (pol[:, 1] - ref_[:, 1])).mean().item())
        return losses.mean()


def build_rl_objective(rl: Any, mode: str, model_config: TransformerConfig, attention: AttentionPlan,
                       sharding: Sharding, *, autocast: Callable[[], contextlib.AbstractContextManager],
                       tokenizer: Any, eps: float, **common: Any) -> RLObjective:
    """The objective of `--rl` from the run's RLConfig `rl`, for a masked-diffusion model (difflm-noshift)."""
    if mode != "difflm-noshift":
        raise ConfigError(f"--rl {rl.rl} trains a masked-diffusion model whose position i predicts token i "
                          f"(difflm-noshift); this run's mode is {mode}: use --model-running-mode difflm-noshift")
    if attention.needs_masks() or attention.reset_position_ids:
        raise ConfigError(f"--rl {rl.rl} scores one record per row: drop --reset-attention-mask, "
                          "--reset-position-ids and --attention-anneal-iters")
    pad = tokenizer.eod_id if tokenizer is not None and tokenizer.eod_id is not None else 0
    if rl.rl == "vrpo":
        return PreferenceOptimisation(model_config, attention, sharding, autocast=autocast, samples=rl.vrpo_samples,
                                      beta=rl.dpo_beta, eps=eps, pad_id=pad, **common)
    raise ConfigError(f"--rl {rl.rl!r} is not one of {', '.join(RL_KINDS)}")
