"""The RL objectives: `Objective`s over RL records that the RL loop (`megadlms.training.rl_loop`) runs as
rollout -> score -> optimise (docs/rl.md).

- `PreferenceOptimisation` (`--rl vrpo`): LLaDA 1.5's VRPO on (prompt, chosen, rejected) pairs;
- `DiffuGRPO` (`--rl grpo`): d1's diffu-GRPO on prompts with verifiable rewards (rollouts from the fast sampler).

Both hold a frozen reference model: with LoRA the model itself with its adapters off, else a frozen copy of the
model taken when training starts (`fp8.frozen.frozen_copy`: its FP8 linears stored in FP8, 1 byte a weight; saved
with the checkpoints, so a resumed run keeps the first one). Every reference forward runs in eval mode, as the
rollouts do: none records FP8 amaxes. Their noise is
one seed per step drawn from the trainer's `MaskSampler` (checkpointed), from which every rollout, timestep and
mask of the step derives per record: a resumed run redraws exactly what the uninterrupted one drew.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from ..config import ConfigError, TransformerConfig
from ..data.tokenizer import Tokenizer
from ..diffusion.objective import BatchNoise, MaskSampler
from ..diffusion.sampler import position_ids_from_mask, prepare_prompts, trim_at_eos
from ..distributed.data_parallel import gathered_parameters
from ..fp8.frozen import frozen_copy, frozen_state_dict, load_frozen_state_dict
from ..lora import adapters_disabled, lora_modules
from ..rl import RL_KINDS
from ..rl.data import Record
from ..rl.grpo import completion_mask, group_advantages, grpo_loss, one_step_inputs, tidy_completions
from ..rl.vrpo import dpo_loss, elbo_estimates, elbo_noise, masked_rows, token_logps
from .config import RLConfig
from .documents import AttentionPlan
from .hooks import TrainingHook
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


B = TypeVar("B", bound=Batch)


class RLObjective(Objective[list[Record], StepSeed, B], TrainingHook):
    """What both RL objectives share: the reference model, the per-step seed, metrics over the log window. Its
    model, metrics and checkpointed state reach the loop as a training hook's (`megadlms.training.plugins`)."""

    bound = False

    def __init__(self, *args: Any, autocast: Callable[[], contextlib.AbstractContextManager], subs: bool = True,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._autocast = autocast
        if self.model_config.mask_token_id is None:
            raise ConfigError("RL trains a masked-diffusion model: pass --mask-token ID")
        self.mask_id: int = self.model_config.mask_token_id
        # the log-likelihoods are those of the distribution the model was trained as and is sampled from: under
        # SUBS (--diffusion-loss subs) [MASK] has probability 0, as the samplers never emit it
        self.subs_mask_id = self.mask_id if subs else None
        self._policy: nn.Module | None = None
        self._reference: nn.Module | None = None  # a frozen_copy (None with LoRA: the adapters are switched off)
        self._reference_state: dict[str, torch.Tensor] | None = None  # from a checkpoint, before the copy exists
        self._window: dict[str, list[float]] = {}
        self._step_micro = 0  # global index of this step's first micro-batch for this rank

    # -- the training hook's points
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
        if ref is None:
            return {"reference": None}
        return {"reference": {k: v.detach().clone() for k, v in frozen_state_dict(ref).items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._reference_state = state.get("reference")
        self._reference = None

    def validation_note(self) -> str:
        return "RL objective (no validation loss)"

    def draw_noise(self, sampler: MaskSampler, global_batch: int, micro_steps: int, *,
                   evaluation: bool = False) -> StepSeed:
        seed = int(torch.randint(0, 2**62, (1,), generator=sampler.generator, device=sampler.device))
        empty = torch.empty(0)
        return StepSeed(empty, empty, torch.zeros(micro_steps, dtype=torch.long), evaluation, seed=seed)

    def rollout(self, samples: Iterator[list[Record]], noise: StepSeed, count: int, device: torch.device) -> None:
        """The RL loop's first phase, before the step's micro-batches: sample completions and score them (nothing
        for objectives whose records carry their responses, VRPO's)."""

    # -- helpers
    def _record(self, name: str, value: float) -> None:
        self._window.setdefault(name, []).append(float(value))

    def _uses_lora(self) -> bool:
        return self._policy is not None and bool(lora_modules(self._policy))

    def reference(self) -> contextlib.AbstractContextManager[nn.Module]:
        """The frozen reference model for a `with` block, in eval mode (no gradients flow into it; its FP8 layers
        record no amaxes)."""
        policy = self._policy
        if policy is None:
            raise RuntimeError("the RL objective has no model: the trainer calls bind(model) first")
        if self._uses_lora():
            return _base_in_eval(policy)
        if self._reference is None:  # at the first step: the loaded (or resumed) weights are in place
            ref = frozen_copy(policy)
            if self._reference_state is not None:
                load_frozen_state_dict(ref, self._reference_state)
                self._reference_state = None
            self._reference = ref
        return contextlib.nullcontext(self._reference)


@contextlib.contextmanager
def _base_in_eval(model: nn.Module) -> Iterator[nn.Module]:
    """`model` with its adapters off and in eval mode inside the block (LoRA's reference model), then as it was."""
    was_training = model.training
    model.eval()
    try:
        with adapters_disabled(model):
            yield model
    finally:
        model.train(was_training)


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


class PreferenceOptimisation(RLObjective["PairBatch"]):
    """VRPO: per pair, n-sample ELBO estimates of the chosen and the rejected response under the policy and the
    reference, with the same timesteps and masks for both models (`megadlms.rl.vrpo`); the DPO loss averaged over
    the micro-batch's pairs."""

    name = "VRPO (DPO on ELBO estimates)"

    def __init__(self, *args: Any, samples: int, beta: float, eps: float, pad_id: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if samples < 1:
            raise ConfigError(f"--vrpo-samples {samples} must be at least 1 (LLaDA 1.5 uses 8)")
        self.samples, self.beta, self.eps, self.pad_id = samples, beta, eps, pad_id

    def micro_batches(self, samples: Iterator[list[Record]], noise: StepSeed, count: int,
                      device: torch.device) -> Iterator[PairBatch]:
        sh, n = self.sharding, self.samples
        for m in range(count):
            records = self._next(samples)
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
            yield PairBatch(inputs, targets, w, tokens=tokens, flops=tokens * self.token_flops * 4 / 3,
                            attention_mask=mask, samples=n)

    def loss(self, model: nn.Module, batch: PairBatch, output_weight: Callable[[], torch.Tensor]) -> torch.Tensor:
        kwargs = batch.model_kwargs()
        with torch.no_grad(), self.reference() as ref:
            ref_b = elbo_estimates(ref(batch.inputs, **kwargs), batch.targets, batch.weights, batch.samples,
                                   self.subs_mask_id)
        pol_b = elbo_estimates(model(batch.inputs, **kwargs), batch.targets, batch.weights, batch.samples,
                               self.subs_mask_id)
        pol, ref_ = pol_b.view(-1, 2), ref_b.view(-1, 2)  # [pairs, chosen / rejected]
        losses, margin = dpo_loss(pol[:, 0], ref_[:, 0], pol[:, 1], ref_[:, 1], self.beta)
        self._record("margin", margin.mean().item())
        self._record("accuracy", (margin > 0).float().mean().item())
        self._record("chosen_reward", (self.beta * (pol[:, 0] - ref_[:, 0])).mean().item())
        self._record("rejected_reward", (self.beta * (pol[:, 1] - ref_[:, 1])).mean().item())
        return losses.mean()


@dataclass
class Rollouts:
    """One micro-batch's rollouts (P prompts x G completions, rows grouped by prompt), kept for the mu updates."""

    sequences: torch.Tensor  # long [N, P + C]: left-padded prompt, completion (EOS after the first EOS)
    real: torch.Tensor  # bool [N, P + C]: False at the prompt's left padding
    completion: torch.Tensor  # bool [N, C]: tokens up to and including the first EOS
    advantages: torch.Tensor  # fp32 [N]
    old_logp: list[torch.Tensor]  # per inner update, fp32 [N, C] (empty with mu = 1: the policy's own, detached)
    ref_logp: list[torch.Tensor]  # per inner update, fp32 [N, C] (empty without a KL term)
    index: int  # global index of the micro-batch in the rollout step (its noise)
    seed: int  # the rollout step's seed

    def state_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def to(self, device: torch.device) -> Rollouts:
        """The rollouts on `device` (a checkpoint's come back on the CPU)."""
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device)

        return Rollouts(move(self.sequences), move(self.real), move(self.completion), move(self.advantages),
                        [move(t) for t in self.old_logp], [move(t) for t in self.ref_logp], self.index, self.seed)


@dataclass(kw_only=True)
class RolloutBatch(Batch):
    """diffu-GRPO micro-batch: the one-step inputs (`inputs`), the sampled sequences (`targets`) and the terms of
    the loss. weights: the completion mask over the whole row (the prompt's positions 0)."""

    prompt_length: int
    advantages: torch.Tensor  # fp32 [N]
    old_logp: torch.Tensor | None = None  # fp32 [N, C]; None: the policy's own (mu = 1)
    ref_logp: torch.Tensor | None = None  # fp32 [N, C]; None: no KL term


class DiffuGRPO(RLObjective["RolloutBatch"]):
    """diffu-GRPO (`megadlms.rl.grpo`): every mu steps, G completions per prompt from the fast sampler (eval mode, no
    gradients), rewards, group advantages and the old-policy / reference log-probabilities of each inner update's
    prompt mask; then mu optimizer steps on those rollouts."""

    name = "diffu-GRPO"

    def __init__(self, *args: Any, rl: RLConfig, eos_id: int | None, tokenizer: Tokenizer, **kwargs: Any):
        super().__init__(*args, **kwargs)
        from ..rl.rewards import RewardSet

        self.rl, self.eos_id, self.tokenizer = rl, eos_id, tokenizer
        self.group, self.mu = rl.grpo_group_size, rl.grpo_inner_updates
        self.rewards = RewardSet.parse(rl.rl_reward)
        self._inner = 0  # optimizer steps taken; rollouts are drawn when it is a multiple of mu
        self._rollouts: list[Rollouts] = []

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "inner": self._inner, "rollouts": [r.state_dict() for r in self._rollouts],
                "reward_failures": self.rewards.failures}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._inner = int(state.get("inner", 0))
        self._rollouts = [Rollouts(**r) for r in state.get("rollouts", [])]
        self.rewards.failures = int(state.get("reward_failures", 0))

    def rollout(self, samples: Iterator[list[Record]], noise: StepSeed, count: int, device: torch.device) -> None:
        """Every mu optimizer steps: this rank's `count` micro-batches of records rolled out and scored
        (`_rollout`), kept for the mu steps' micro-batches (`micro_batches`)."""
        if self._inner % self.mu == 0:
            self._rollouts = []
            for m in range(count):
                records = self._next(samples)
                index = m * self.sharding.dp_size + self.sharding.dp_rank  # the global micro-batch
                self._rollouts.append(self._rollout(records, noise.seed, index, device))
        self._rollouts = [r.to(device) for r in self._rollouts]

    def micro_batches(self, samples: Iterator[list[Record]], noise: StepSeed, count: int,
                      device: torch.device) -> Iterator[RolloutBatch]:
        """The optimizer step's micro-batches: inner update j of the rollouts `rollout` kept (the RL loop calls it
        first, each step)."""
        if not self._rollouts:
            raise RuntimeError("diffu-GRPO's micro-batches come from its rollouts: call rollout() first")
        j = self._inner % self.mu
        for roll in self._rollouts:
            inputs = self._one_step(roll, j)
            n, total = roll.sequences.shape
            p = total - roll.completion.shape[1]
            weights = torch.zeros(n, total, dtype=torch.float32, device=device)
            weights[:, p:] = roll.completion.float()
            tokens = n * total * self.sharding.dp_size
            yield RolloutBatch(inputs, roll.sequences, weights, tokens=tokens, flops=tokens * self.token_flops,
                               attention_mask=roll.real, position_ids=position_ids_from_mask(roll.real),
                               prompt_length=p, advantages=roll.advantages,
                               old_logp=roll.old_logp[j] if roll.old_logp else None,
                               ref_logp=roll.ref_logp[j] if roll.ref_logp else None)
        self._inner += 1

    def loss(self, model: nn.Module, batch: RolloutBatch, output_weight: Callable[[], torch.Tensor]
             ) -> torch.Tensor:
        p = batch.prompt_length
        logp = token_logps(model(batch.inputs, **batch.model_kwargs())[:, p:], batch.targets[:, p:], self.subs_mask_id)
        old = logp.detach() if batch.old_logp is None else batch.old_logp
        loss, stats = grpo_loss(logp, old, batch.ref_logp, batch.advantages, batch.weights[:, p:] > 0,
                                clip_eps=self.rl.grpo_clip_eps, kl_beta=self.rl.rl_kl_beta)
        for k, v in stats.items():
            self._record(k, v.item())
        return loss

    # -- rollouts
    def _one_step(self, roll: Rollouts, j: int) -> torch.Tensor:
        """The one-step input of inner update j (the same for the policy, the old policy and the reference)."""
        p = roll.sequences.shape[1] - roll.completion.shape[1]
        g = record_generator(roll.seed, roll.index, roll.sequences.device, salt=1 + j)
        return one_step_inputs(roll.sequences, roll.real[:, :p], self.rl.grpo_prompt_mask, g, self.mask_id)

    @torch.no_grad()
    def _logps(self, model: nn.Module, roll: Rollouts, j: int) -> torch.Tensor:
        p = roll.sequences.shape[1] - roll.completion.shape[1]
        with self._autocast():
            logits = model(self._one_step(roll, j), attention_mask=roll.real,
                           position_ids=position_ids_from_mask(roll.real))
        return token_logps(logits[:, p:], roll.sequences[:, p:], self.subs_mask_id)

    @torch.no_grad()
    def _rollout(self, records: list[Record], seed: int, index: int, device: torch.device) -> Rollouts:
        import time

        from ..diffusion.fast_sampler import fast_generate_tokens

        policy = self._policy
        assert policy is not None  # bound by the trainer
        rl, g_size = self.rl, self.group
        prompts = [r.prompt for r in records for _ in range(g_size)]
        ids, attn = prepare_prompts(prompts, pad_id=self.mask_id, device=device)
        real_prompt = attn if attn is not None else torch.ones_like(ids, dtype=torch.bool)
        gen = record_generator(seed, index, device)
        was_training = policy.training
        policy.eval()
        t0 = time.perf_counter()
        try:
            with self._autocast(), gathered_parameters(policy):  # ranks' sampler steps differ in number
                out, _ = fast_generate_tokens(policy, ids, attn, mask_id=self.mask_id, gen_length=rl.rl_gen_length,
                                              block_length=rl.rl_block_length, threshold=rl.rl_threshold,
                                              cache="dual", temperature=rl.rl_temperature, eos_id=self.eos_id,
                                              generator=gen)
        finally:
            policy.train(was_training)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        p = ids.shape[1]
        completions = tidy_completions(out[:, p:], self.eos_id)
        mask = completion_mask(completions, self.eos_id)
        texts = [self.tokenizer.decode(row) for row in trim_at_eos(completions, self.eos_id)]
        fields = [r.fields for r in records for _ in range(g_size)]
        failures = self.rewards.failures
        wheres = [r.where for r in records for _ in range(g_size)]
        rewards = torch.tensor(self.rewards(texts, fields, wheres), dtype=torch.float32, device=device)
        self._record("reward_mean", rewards.mean().item())
        self._record("reward_std", rewards.std().item() if rewards.numel() > 1 else 0.0)
        self._record("reward_failures", self.rewards.failures - failures)
        if len(self.rewards.terms) > 1:
            for name, value in self.rewards.last.items():
                self._record(f"reward/{name}", value)
        self._record("rollout_tokens_per_s", completions.numel() / max(seconds, 1e-9))
        self._record("rollout_s", seconds)  # the sampler's share of the step: against the step's time
        self._record("completion_length", mask.sum(1).float().mean().item())
        real = torch.cat([real_prompt, torch.ones_like(completions, dtype=torch.bool)], 1)
        roll = Rollouts(torch.cat([ids, completions], 1), real, mask, group_advantages(rewards, g_size), [], [],
                        index, seed)
        if self.mu > 1:
            roll.old_logp = [self._logps(policy, roll, j) for j in range(self.mu)]
        if rl.rl_kl_beta > 0:
            with self.reference() as ref:
                roll.ref_logp = [self._logps(ref, roll, j) for j in range(self.mu)]
        return roll


def build_rl_objective(rl: RLConfig, mode: str, model_config: TransformerConfig, attention: AttentionPlan,
                       sharding: Sharding, *, autocast: Callable[[], contextlib.AbstractContextManager],
                       tokenizer: Tokenizer | None, eps: float, diffusion_loss: str = "subs", **common: Any
                       ) -> PreferenceOptimisation | DiffuGRPO:
    """The objective of `--rl` from the run's RLConfig `rl`, for a masked-diffusion model (difflm-noshift);
    diffusion_loss: the model's (`--diffusion-loss`), so that the log-likelihoods are the trained ones."""
    # the mode and attention settings RL refuses are the run plan's (`run_plan`)
    pad = tokenizer.eod_id if tokenizer is not None and tokenizer.eod_id is not None else 0
    if rl.rl == "vrpo":
        return PreferenceOptimisation(model_config, attention, sharding, autocast=autocast, samples=rl.vrpo_samples,
                                      beta=rl.dpo_beta, eps=eps, pad_id=pad, subs=diffusion_loss == "subs", **common)
    if rl.rl == "grpo":
        if tokenizer is None:
            raise ConfigError("--rl grpo scores decoded completions: pass a tokenizer (--tokenizer-model)")
        return DiffuGRPO(model_config, attention, sharding, autocast=autocast, rl=rl, tokenizer=tokenizer,
                         eos_id=tokenizer.eod_id, subs=diffusion_loss == "subs", **common)
    raise ConfigError(f"--rl {rl.rl!r} is not one of {', '.join(RL_KINDS)}")
