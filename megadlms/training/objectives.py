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
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..config import TransformerConfig
from ..diffusion import bd3lm
from ..diffusion.clip_search import ClipSearch, block_means, lowest_variance
from ..diffusion.objective import (
    BatchNoise,
    MaskSampler,
    ObjectiveConfig,
    chunked_weighted_cross_entropy,
    prepare_batch,
    prepare_sft_batch,
    token_losses,
    weighted_cross_entropy,
)
from ..distributed.context_parallel import shard_mask, shard_sequence
from ..moe import add_aux_losses
from .documents import AttentionPlan, attended_pairs


class HostCount:
    """count_nonzero of a tensor for the host. On CUDA it is copied to pinned memory behind the work queued
    so far: made before the forward is queued and read after it, the count is there long before the host asks,
    so reading it does not wait for the forward (as a `nonzero()` after the forward would: the GPU
    would then sit idle until the host has queued the next kernels).
    """

    def __init__(self, t: torch.Tensor):
        self._ready = None
        if not t.is_cuda:  # nothing runs ahead on the CPU
            self._host = torch.count_nonzero(t)
            return
        self._host = torch.empty((), dtype=torch.int64, pin_memory=True)
        self._host.copy_(torch.count_nonzero(t), non_blocking=True)
        self._ready = torch.cuda.Event()
        self._ready.record()

    def get(self) -> int:
        if self._ready is not None:
            self._ready.synchronize()
        return int(self._host)


@dataclass
class Batch:
    """One micro-batch of this rank, ready for the model and the loss."""

    inputs: torch.Tensor  # long [B, S]: the model's input (BD3-LM: x_t (+) x_0, S = 2L)
    targets: torch.Tensor  # long [B, L]: scored against the first L positions' predictions
    weights: torch.Tensor  # fp32 [B, L]: each target's weight in the loss (0: not scored)
    tokens: int  # tokens of this micro-batch summed over the data-parallel ranks (throughput)
    flops: float  # training FLOPs of this micro-batch summed over the data-parallel ranks
    attention_mask: Any = None  # None (the model's own attention), a dense bool mask or a FlexAttention BlockMask
    position_ids: torch.Tensor | None = None  # None: 0..S-1
    denominator: torch.Tensor | None = None  # the loss's normaliser (None: B * L)
    weighted_rows: HostCount | None = None  # with the fused LM head: the count of non-zero weights, for the host

    def model_kwargs(self) -> dict[str, Any]:
        if self.attention_mask is None and self.position_ids is None:
            return {}
        return {"attention_mask": self.attention_mask, "position_ids": self.position_ids}


@dataclass
class Sharding:
    """Where this rank's micro-batches sit in the global batch."""

    micro_batch_size: int
    dp_rank: int = 0
    dp_size: int = 1
    dp_group: dist.ProcessGroup | None = None  # set when dp_size > 1
    cp_rank: int = 0  # context parallelism: this rank holds positions `rank_positions(S, cp_size, cp_rank)`
    cp_size: int = 1

    def rows(self, micro_step: int) -> slice:
        """This rank's rows of the global batch's noise in micro-step `micro_step`."""
        start = (micro_step * self.dp_size + self.dp_rank) * self.micro_batch_size
        return slice(start, start + self.micro_batch_size)


class Objective(ABC):
    """The interface. `draw_noise` -> `micro_batches` -> `loss` per micro-batch; the same calls for training
    and validation (evaluation=True: the evaluation noise, whole windows, the final attention)."""

    name = "objective"
    bound = True  # the loss bounds the NLL from above (diffusion ELBOs); False: it is the exact NLL (AR)
    subs_mask_id: int | None = None  # the loss's SUBS parameterisation: the [MASK] logit -inf; None: full vocabulary
    ignore_bos = False  # position 0 never masked, and out of the validation loss's denominator

    def __init__(self, model_config: TransformerConfig, attention: AttentionPlan, sharding: Sharding, *,
                 flex: bool, loss_chunk_tokens: int, on_data_wait: Callable[[float], None] | None = None):
        self.model_config, self.attention, self.sharding = model_config, attention, sharding
        # context parallelism slices dense whole-sequence masks to the rank's rows (no BlockMask yet)
        self.flex, self.loss_chunk_tokens = flex and sharding.cp_size == 1, loss_chunk_tokens
        self._on_data_wait = on_data_wait

    # -- what the trainer reports
    def flops_per_token(self) -> float:
        return self.model_config.flops_per_token(self.model_config.seq_length)

    def attention_kernel(self, device: torch.device) -> str:
        if self.attention.needs_masks():
            return "FlexAttention, block mask" if self._flex_masks(device) else "SDPA, dense mask"
        return "SDPA"

    def _flex_masks(self, device: torch.device) -> bool:
        """Whether the AttentionPlan's masks are BlockMasks (CUDA), not dense (elsewhere, and under CP)."""
        return device.type == "cuda" and self.sharding.cp_size == 1

    def validation_note(self) -> str:
        """What the validation loss is, for its log line: the cross-entropy and whether the first token counts."""
        if not self.bound:
            return "exact NLL"
        ce = "SUBS" if self.subs_mask_id is not None else "full-vocab CE"
        return f"{ce}, first token {'excluded' if self.ignore_bos else 'included'}"

    # -- what the trainer hands over and keeps (no-ops but for objectives with models and state of their own: RL)
    def bind(self, model: nn.Module) -> None:
        """The model being trained (unwrapped), once the trainer has built it."""

    def metrics(self) -> dict[str, float]:
        """The objective's own metrics over the log window (then reset), for the log line and the sinks."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the objective for an exact resume."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    # -- what validation also measures and adopts (BD3-LM's clip search); nothing for the others
    searches_validation = False  # True: the trainer hands `observe_validation` each validation batch's samples

    def observe_validation(self, model: nn.Module, samples: list[torch.Tensor], batch: int,
                           output_weight: Callable[[], torch.Tensor], seed: int) -> None:
        """Validation batch `batch`: this rank's loader samples (one per micro-step, on the device), under the
        caller's autocast and no_grad; `seed` seeds whatever noise it draws (the same at every validation)."""

    def end_validation(self) -> dict[str, float]:
        """After the validation batches: adopt what they showed; returns the metrics to log beside the loss."""
        return {}

    # -- the step
    @abstractmethod
    def draw_noise(self, sampler: MaskSampler, global_batch: int, micro_steps: int, *,
                   evaluation: bool = False) -> BatchNoise:
        """One global batch's noise from `sampler`'s generator (evaluation: the evaluation noise)."""

    @abstractmethod
    def micro_batches(self, samples: Iterator[torch.Tensor], noise: BatchNoise, count: int,
                      device: torch.device) -> Iterator[Batch]:
        """This rank's `count` micro-batches of the global batch, from the loader's `samples`."""

    def loss(self, model: nn.Module, batch: Batch, output_weight: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The micro-batch's loss, fp32 scalar (under the caller's autocast), plus the auxiliary losses of an MoE
        model's training forward. output_weight: the LM head's weight [V, H], whole (for the fused head + loss)."""
        return add_aux_losses(model, self._prediction_loss(model, batch, output_weight))

    def _prediction_loss(self, model: nn.Module, batch: Batch, output_weight: Callable[[], torch.Tensor]
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

    def loss_from_hidden(self, hidden: torch.Tensor, batch: Batch, output_weight: Callable[[], torch.Tensor]
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
    def _next(self, samples: Iterator[torch.Tensor]) -> torch.Tensor:
        t0 = time.perf_counter()
        sample = next(samples)
        if self._on_data_wait is not None:
            self._on_data_wait(time.perf_counter() - t0)  # host time blocked on the loader
        return sample

    def _context_shard(self, batch: Batch) -> Batch:
        """With context parallelism, the rank's positions of a whole-sequence micro-batch (`megadlms.distributed.
        context_parallel`); without, the batch itself. Targets and weights are aligned with the inputs (BD3-LM's
        x_0 half gets weight 0), a length that does not split into 2 x cp chunks is padded (pad keys masked out,
        pad queries weigh 0), and the normaliser stays the whole sequence's, divided by cp: the cp ranks' losses
        average to the one-rank loss, as the gradients averaged over data x context-parallel ranks do."""
        cp, r = self.sharding.cp_size, self.sharding.cp_rank
        if cp == 1:
            return batch
        inputs, targets, weights = batch.inputs, batch.targets, batch.weights
        b, s = inputs.shape
        device = inputs.device
        denominator = batch.denominator
        if denominator is None:
            denominator = torch.tensor(float(targets.numel()), device=device)
        padded = -(-s // (2 * cp)) * (2 * cp)
        positions = batch.position_ids
        if positions is None:
            positions = torch.arange(s, device=device)
        mask = batch.attention_mask
        if mask is not None and not isinstance(mask, torch.Tensor):
            raise ValueError("context parallelism takes dense attention masks, not FlexAttention BlockMasks")
        if padded != s:
            pad = padded - s
            if mask is None:
                mask = torch.ones(1, 1, s, s, dtype=torch.bool, device=device)
                if self.model_config.causal:
                    mask = mask.tril()
            mask = torch.nn.functional.pad(mask, (0, pad, 0, pad), value=False)
            mask[:, :, s:, :] = True  # pad queries (weight 0) attend anything; no real query sees a pad key
            inputs = torch.nn.functional.pad(inputs, (0, pad))
            positions = torch.nn.functional.pad(positions, (0, pad))
        t_pad = padded - targets.shape[1]
        targets = torch.nn.functional.pad(targets, (0, t_pad))
        weights = torch.nn.functional.pad(weights, (0, t_pad))
        inputs, targets, weights = (shard_sequence(x, cp, r) for x in (inputs, targets, weights))
        positions = shard_sequence(positions, cp, r, dim=positions.dim() - 1)
        if mask is not None:
            mask = shard_mask(mask, cp, r)
        return Batch(inputs, targets, weights, tokens=batch.tokens, flops=batch.flops, attention_mask=mask,
                     position_ids=positions, denominator=denominator / cp, weighted_rows=self._counted(weights))

    def _counted(self, weights: torch.Tensor) -> HostCount | None:
        return HostCount(weights) if self.loss_chunk_tokens else None

    def _denominator(self, noise: BatchNoise, rows: int, length: int, device: torch.device) -> torch.Tensor | None:
        """None (B * L), or B * (L - 1) in validation when the first token is left out (ignore_bos)."""
        if not (self.ignore_bos and noise.evaluation):
            return None
        return torch.tensor(float(rows * (length - 1)), device=device)


class Pretraining(Objective):
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
            yield self._context_shard(Batch(
                inputs, targets, weights, tokens=tokens, flops=tokens * self.flops_per_token(), attention_mask=mask,
                position_ids=positions, weighted_rows=self._counted(weights),
                denominator=self._denominator(noise, targets.shape[0], length, device)))


class BlockDiffusion(Objective):
    """BD3-LM: x_t (+) x_0 through the model under the block-diffusion mask, the hidden states of x_t scored."""

    name = "block diffusion"

    def __init__(self, config: bd3lm.Bd3lmConfig, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.config = config
        self.subs_mask_id = config.subs_mask_id
        self.ignore_bos = config.ignore_bos
        self.candidates = config.search_candidates() if config.clip_search else []
        self.search = ClipSearch([(c.clip_min, c.clip_max) for c in self.candidates]) if self.candidates else None
        self.searches_validation = self.search is not None

    def validation_note(self) -> str:
        note = super().validation_note()
        if self.search is None:
            return note
        return (f"{note} | training t ~ U[{self.config.clip_min:g}, {self.config.clip_max:g}] "
                f"(clip search, {len(self.candidates)} intervals)")

    def state_dict(self) -> dict[str, Any]:
        """With the clip search, the interval it adopted (training uses it until the next validation)."""
        return {"bd3lm_clip": [self.config.clip_min, self.config.clip_max]} if self.search is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.search is not None and "bd3lm_clip" in state:
            self.config.clip_min, self.config.clip_max = (float(v) for v in state["bd3lm_clip"])

    def observe_validation(self, model: nn.Module, samples: list[torch.Tensor], batch: int,
                           output_weight: Callable[[], torch.Tensor], seed: int) -> None:
        """Each candidate interval's per-block training losses on this validation batch: noise drawn for the global
        batch under the training rules of that interval, from a generator seeded by (seed, batch), the same for
        every candidate (common random numbers: the candidates differ by their interval, not by their draws)."""
        search = self.search
        if search is None or not search.wants(batch):
            return
        sh, n, block = self.sharding, self.config.seq_length, self.config.block_size
        device = samples[0].device
        kwargs = bd3lm.forward_kwargs(self.config, device, self.flex)
        global_batch = sh.micro_batch_size * sh.dp_size * len(samples)
        for c, cand in enumerate(self.candidates):
            noise = bd3lm.draw_noise(MaskSampler(seed * 1_000_003 + batch, device=device), global_batch,
                                     len(samples), cand)
            for m, sample in enumerate(samples):
                rows = sh.rows(m)
                inputs, targets, weights = bd3lm.prepare_batch(sample.to(device), (noise.t[rows], noise.u[rows]),
                                                               cand)
                hidden = model(inputs, output_hidden=True, **kwargs)[:, :n]
                losses = token_losses(hidden, output_weight(), targets, weights, mask_id=self.subs_mask_id,
                                      chunk_tokens=self.loss_chunk_tokens or 8192)
                search.observe(batch, c, block_means(losses, block))

    def end_validation(self) -> dict[str, float]:
        """Adopt the interval of lowest summed batch variance (the same on every rank: the moments are summed over
        the data-parallel ranks first); the metrics: the adopted interval, its variance and every candidate's."""
        search = self.search
        stats = None if search is None else search.stacked()
        if search is None or stats is None:
            return {}
        if self.sharding.dp_size > 1:
            dist.all_reduce(stats, group=self.sharding.dp_group)
        best, total = lowest_variance(stats)
        search.reset()
        self.config.clip_min, self.config.clip_max = search.candidates[best]
        out = {"bd3lm_clip_min": self.config.clip_min, "bd3lm_clip_max": self.config.clip_max,
               "bd3lm_clip_variance": float(total[best])}
        for (lo, hi), v in zip(search.candidates, total.tolist()):
            out[f"bd3lm_clip_variance/{lo:g}-{hi:g}"] = v
        return out

    def flops_per_token(self) -> float:
        return bd3lm.flops_per_token(self.model_config, self.config.block_size)

    def attention_kernel(self, device: torch.device) -> str:
        return "FlexAttention, block mask" if self.flex else "SDPA, dense mask"

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
            yield self._context_shard(Batch(
                inputs, targets, weights, tokens=tokens, flops=tokens * self.flops_per_token(),
                attention_mask=kwargs["attention_mask"], position_ids=kwargs["position_ids"],
                weighted_rows=self._counted(weights),
                denominator=self._denominator(noise, targets.shape[0], self.config.seq_length, device)))


class SupervisedFineTuning(Objective):
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
            yield self._context_shard(Batch(
                b.inputs, b.targets, b.weights, tokens=tokens, flops=flops, attention_mask=mask,
                position_ids=positions, denominator=denominator, weighted_rows=self._counted(b.weights)))


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
