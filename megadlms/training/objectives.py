"""The training objectives behind one interface: what the trainer's step, its validation and the tests call.

An objective draws the noise of a global batch, turns this rank's loader samples into typed micro-batches
(`Batch`: inputs, targets, weights, attention mask, positions, loss normaliser, token and FLOP counts) and
computes the loss of a micro-batch. The trainer never asks which objective it runs:

- `Pretraining`: masked diffusion (LLaDA / MDLM, `difflm-noshift`), shifted masked diffusion (Dream,
  `difflm-shift`) and autoregressive (`vanilla`) on token windows, with optional document masks and annealing;
- `BlockDiffusion`: BD3-LM, one forward over x_t (+) x_0 under the block-diffusion mask;
- `SupervisedFineTuning`: packed chat windows (LLaDA's SFT for the diffusion modes, the mean over
  conversations of the response NLL for `vanilla`), the loss divided by the global batch's conversations;
- VRPO and diffu-GRPO (`rl_objectives`): records instead of token windows, a frozen reference model.

The pure functions (masking, the batch transforms, the losses) stay in `megadlms.diffusion`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..config import TransformerConfig
from ..diffusion import bd3lm
from ..diffusion.objective import (
    BatchNoise,
    MaskSampler,
    ObjectiveConfig,
    chunked_weighted_cross_entropy,
    prepare_batch,
    prepare_sft_batch,
    weighted_cross_entropy,
)
from ..moe import add_aux_losses
from .batch import Batch, Sharding
from .documents import AttentionPlan, attended_pairs

S = TypeVar("S")  # what the loader yields: a token window tensor, or a micro-batch's RL records
N = TypeVar("N", bound=BatchNoise)  # a global batch's noise
B = TypeVar("B", bound=Batch)  # the objective's micro-batch


class Objective(ABC, Generic[S, N, B]):
    """The interface: it makes batches and losses, nothing else. `draw_noise` -> `micro_batches` make a global
    batch's micro-batches, `loss` (or, on a pipeline's last stage, `loss_from_hidden`) scores one; the same calls
    for training and validation (evaluation=True: the evaluation noise, whole windows, the final attention).
    What an objective adds beyond that (state to checkpoint, metrics, work during validation) is a hook or a
    validation plug-in (`megadlms.training.plugins`); context parallelism's split is the layout's (`Sharding`)."""

    name = "objective"
    bound = True  # the loss bounds the NLL from above (diffusion ELBOs); False: it is the exact NLL (AR)
    subs_mask_id: int | None = None  # the loss's SUBS parameterisation: the [MASK] logit -inf; None: full vocabulary
    ignore_bos = False  # position 0 never masked, and out of the validation loss's denominator
    block_masks = False  # every batch carries an attention mask (BD3-LM), whatever the AttentionPlan says

    def __init__(self, model_config: TransformerConfig, attention: AttentionPlan, sharding: Sharding, *,
                 flex: bool, loss_chunk_tokens: int, on_data_wait: Callable[[float], None] | None = None):
        self.model_config, self.attention, self.sharding = model_config, attention, sharding
        # context parallelism slices dense whole-sequence masks to the rank's rows (no BlockMask yet)
        self.flex, self.loss_chunk_tokens = flex and sharding.cp_size == 1, loss_chunk_tokens
        self._on_data_wait = on_data_wait
        self.token_flops = model_config.flops_per_token(model_config.seq_length)  # training FLOPs per token

    # -- what the log lines say of it
    def attention_kernel(self, device: torch.device) -> str:
        if self.block_masks:
            return "FlexAttention, block mask" if self.flex else "SDPA, dense mask"
        if self.attention.needs_masks():  # the AttentionPlan's masks are BlockMasks on CUDA, dense elsewhere and CP
            flex = device.type == "cuda" and self.sharding.cp_size == 1
            return "FlexAttention, block mask" if flex else "SDPA, dense mask"
        return "SDPA"

    def validation_note(self) -> str:
        """What the validation loss is, for its log line: the cross-entropy and whether the first token counts."""
        if not self.bound:
            return "exact NLL"
        ce = "SUBS" if self.subs_mask_id is not None else "full-vocab CE"
        return f"{ce}, first token {'excluded' if self.ignore_bos else 'included'}"

    # -- the step
    @abstractmethod
    def draw_noise(self, sampler: MaskSampler, global_batch: int, micro_steps: int, *,
                   evaluation: bool = False) -> N:
        """One global batch's noise from `sampler`'s generator (evaluation: the evaluation noise)."""

    @abstractmethod
    def micro_batches(self, samples: Iterator[S], noise: N, count: int, device: torch.device) -> Iterator[B]:
        """This rank's `count` micro-batches of the global batch, from the loader's `samples`."""

    def loss(self, model: nn.Module, batch: B, output_weight: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The micro-batch's loss, fp32 scalar (under the caller's autocast), plus the auxiliary losses of an MoE
        model's training forward. output_weight: the LM head's weight [V, H], whole (for the fused head + loss)."""
        return add_aux_losses(model, self._prediction_loss(model, batch, output_weight))

    def _prediction_loss(self, model: nn.Module, batch: B, output_weight: Callable[[], torch.Tensor]
                         ) -> torch.Tensor:
        length = batch.targets.shape[1]
        kwargs = batch.model_kwargs()
        if self.loss_chunk_tokens:
            hidden = model(batch.inputs, output_hidden=True, **kwargs)[:, :length]
            rows = batch.weighted_rows.get() if batch.weighted_rows is not None else None
            return chunked_weighted_cross_entropy(hidden, output_weight(), batch.targets, batch.weights,
                                                  self.loss_chunk_tokens, num_rows=rows,
                                                  denominator=batch.denominator, mask_id=self.subs_mask_id)
        if batch.inputs.shape[1] != length:  # only a prefix of the positions is scored
            hidden = model(batch.inputs, output_hidden=True, **kwargs)[:, :length]
            logits = F.linear(hidden, output_weight())
        else:
            logits = model(batch.inputs, **kwargs)
        return weighted_cross_entropy(logits, batch.targets, batch.weights, batch.denominator,
                                      mask_id=self.subs_mask_id)

    def loss_from_hidden(self, hidden: torch.Tensor, batch: B, output_weight: Callable[[], torch.Tensor]
                         ) -> torch.Tensor:
        """The micro-batch's loss from the model's final hidden states [B, S, H] (a pipeline's last stage, whose
        schedule calls it): the LM head and the weighted cross-entropy of `loss` without the forward."""
        length = batch.targets.shape[1]
        hidden = hidden[:, :length]
        if self.loss_chunk_tokens:
            rows = batch.weighted_rows.get() if batch.weighted_rows is not None else None
            return chunked_weighted_cross_entropy(hidden, output_weight(), batch.targets, batch.weights,
                                                  self.loss_chunk_tokens, num_rows=rows,
                                                  denominator=batch.denominator, mask_id=self.subs_mask_id)
        return weighted_cross_entropy(F.linear(hidden, output_weight()), batch.targets, batch.weights,
                                      batch.denominator, mask_id=self.subs_mask_id)

    # -- helpers
    def _next(self, samples: Iterator[S]) -> S:
        t0 = time.perf_counter()
        sample = next(samples)
        if self._on_data_wait is not None:
            self._on_data_wait(time.perf_counter() - t0)  # host time blocked on the loader
        return sample

    def _placed(self, batch: Batch) -> Batch:
        """The batch as this rank holds it in the parallel layout (`Sharding.shard`), with the count of its weighted
        rows for the host where the fused LM head + loss takes it."""
        return self.sharding.shard(batch, causal=self.model_config.causal, count_rows=bool(self.loss_chunk_tokens))

    def _denominator(self, noise: BatchNoise, rows: int, length: int, device: torch.device) -> torch.Tensor | None:
        """None (B * L), or B * (L - 1) in validation when the first token is left out (ignore_bos)."""
        if not (self.ignore_bos and noise.evaluation):
            return None
        return torch.tensor(float(rows * (length - 1)), device=device)


class Pretraining(Objective[torch.Tensor, BatchNoise, Batch]):
    """Masked diffusion (shifted or not) or AR on token windows; a micro-step may be cut short (varilen)."""

    def __init__(self, objective: ObjectiveConfig, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.objective = objective
        self.name = {"difflm-noshift": "masked diffusion", "difflm-shift": "masked diffusion (shifted)",
                     "vanilla": "autoregressive"}[objective.mode]
        self.bound = objective.diffusion
        self.subs_mask_id = objective.subs_mask_id
        self.ignore_bos = objective.ignore_bos

    def draw_noise(self, sampler: MaskSampler, global_batch: int, micro_steps: int, *,
                   evaluation: bool = False) -> BatchNoise:
        varilen = 0.0 if evaluation else self.objective.varilen_prob
        noise = sampler.draw(global_batch, self.model_config.seq_length, micro_steps, varilen)
        noise.evaluation = evaluation
        return noise

    def micro_batches(self, samples: Iterator[torch.Tensor], noise: BatchNoise, count: int,
                      device: torch.device) -> Iterator[Batch]:
        sh = self.sharding
        for m in range(count):
            sample = self._next(samples).to(device, non_blocking=True)
            rows = sh.rows(m)
            length = int(noise.lengths[m])
            inputs, targets, weights = prepare_batch(sample, (noise.t[rows], noise.u[rows]), length, self.objective)
            mask, positions = None, None
            if self.attention.needs_masks() or self.attention.reset_position_ids:
                mask, positions = self.attention.for_batch(sample[:, :length], None,
                                                           dense=length != self.model_config.seq_length
                                                           or sh.cp_size > 1)
            tokens = length * sh.micro_batch_size * sh.dp_size
            yield self._placed(Batch(
                inputs, targets, weights, tokens=tokens, flops=tokens * self.token_flops, attention_mask=mask,
                position_ids=positions, denominator=self._denominator(noise, targets.shape[0], length, device)))


class BlockDiffusion(Objective[torch.Tensor, BatchNoise, Batch]):
    """BD3-LM: x_t (+) x_0 through the model under the block-diffusion mask, the hidden states of x_t scored."""

    name = "block diffusion"
    block_masks = True

    def __init__(self, config: bd3lm.Bd3lmConfig, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.config = config
        self.subs_mask_id = config.subs_mask_id
        self.ignore_bos = config.ignore_bos
        self.token_flops = bd3lm.flops_per_token(self.model_config, config.block_size)
        # --bd3lm-clip-search: the intervals its validation plug-in scores (`plugins.Bd3lmClipSearch`)
        self.candidates = config.search_candidates() if config.clip_search else []

    def validation_note(self) -> str:
        note = super().validation_note()
        if not self.candidates:
            return note
        return (f"{note} | training t ~ U[{self.config.clip_min:g}, {self.config.clip_max:g}] "
                f"(clip search, {len(self.candidates)} intervals)")

    def draw_noise(self, sampler: MaskSampler, global_batch: int, micro_steps: int, *,
                   evaluation: bool = False) -> BatchNoise:
        """Whole windows (no varilen cut): every block is already predicted from clean prefixes of every length
        that is a multiple of the block size."""
        return bd3lm.draw_noise(sampler, global_batch, micro_steps, self.config, evaluation=evaluation)

    def micro_batches(self, samples: Iterator[torch.Tensor], noise: BatchNoise, count: int,
                      device: torch.device) -> Iterator[Batch]:
        sh = self.sharding
        kwargs = bd3lm.forward_kwargs(self.config, device, self.flex)
        for m in range(count):
            sample = self._next(samples).to(device, non_blocking=True)
            rows = sh.rows(m)
            inputs, targets, weights = bd3lm.prepare_batch(sample, (noise.t[rows], noise.u[rows]), self.config,
                                                           evaluation=noise.evaluation)
            tokens = self.config.seq_length * sh.micro_batch_size * sh.dp_size
            yield self._placed(Batch(
                inputs, targets, weights, tokens=tokens, flops=tokens * self.token_flops,
                attention_mask=kwargs["attention_mask"], position_ids=kwargs["position_ids"],
                denominator=self._denominator(noise, targets.shape[0], self.config.seq_length, device)))


class SupervisedFineTuning(Objective[torch.Tensor, BatchNoise, Batch]):
    """Packed chat windows. All micro-batches of the step are read first, so that the loss can be divided by the
    global batch's conversations (summed over the data-parallel ranks): the step's loss is then the mean over
    every conversation of the global batch, however they fall into micro-batches and ranks."""

    def __init__(self, objective: ObjectiveConfig, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.objective = objective
        self.name = "SFT, " + ("masked diffusion" if objective.diffusion else "autoregressive")
        self.bound = objective.diffusion
        self.subs_mask_id = objective.subs_mask_id

    def draw_noise(self, sampler: MaskSampler, global_batch: int, micro_steps: int, *,
                   evaluation: bool = False) -> BatchNoise:
        """Whole packed windows; t per position (a conversation takes the t of its first position)."""
        return sampler.draw(global_batch, self.model_config.seq_length, micro_steps, 0.0, per_token_t=True)

    def micro_batches(self, samples: Iterator[torch.Tensor], noise: BatchNoise, count: int,
                      device: torch.device) -> Iterator[Batch]:
        sh, cfg = self.sharding, self.model_config
        batches, pairs = [], []
        for m in range(count):
            sample = self._next(samples)
            pairs.append(attended_pairs(sample[:, 2, :cfg.seq_length], self.attention.reset_attention_mask,
                                        cfg.causal))
            sample = sample.to(device, non_blocking=True)
            rows = sh.rows(m)
            batches.append(prepare_sft_batch(sample, (noise.t[rows], noise.u[rows]), self.objective))
        total = torch.stack([b.conversations for b in batches]).sum().float()
        if sh.dp_size > 1:
            dist.all_reduce(total, group=sh.dp_group)
        denominator = (total / (count * sh.dp_size)).clamp(min=1.0)
        tokens = cfg.seq_length * sh.micro_batch_size * sh.dp_size
        for b, n_pairs in zip(batches, pairs):
            mask, positions = self.attention.for_batch(b.inputs, b.segment_ids, dense=sh.cp_size > 1)
            # attention over each conversation's own (query, key) pairs, not whole windows
            flops = (tokens * 6.0 * cfg.num_matmul_params()
                     + sh.dp_size * n_pairs * cfg.attention_flops_per_pair())
            yield self._placed(Batch(
                b.inputs, b.targets, b.weights, tokens=tokens, flops=flops, attention_mask=mask,
                position_ids=positions, denominator=denominator))


def build_objective(objective: ObjectiveConfig, model_config: TransformerConfig, attention: AttentionPlan,
                    sharding: Sharding, *, sft: bool, bd3lm_config: bd3lm.Bd3lmConfig | None, flex: bool,
                    loss_chunk_tokens: int, on_data_wait: Callable[[float], None] | None = None) -> Objective:
    """The run's objective: BD3-LM when the model has a block size, SFT on packed chat windows, else
    pre-training in the objective's running mode."""
    common = dict(flex=flex, loss_chunk_tokens=loss_chunk_tokens, on_data_wait=on_data_wait)
    if bd3lm_config is not None:  # which settings it refuses (--sft, CP with the clip search): `run_plan`
        return BlockDiffusion(bd3lm_config, model_config, attention, sharding, **common)
    if sft:
        return SupervisedFineTuning(objective, model_config, attention, sharding, **common)
    return Pretraining(objective, model_config, attention, sharding, **common)
