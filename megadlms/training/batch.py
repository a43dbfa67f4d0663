"""A training step's micro-batch (`Batch`) and where this rank's micro-batches sit in the parallel layout
(`Sharding`), with the layout's one batch transform: context parallelism's split of the sequence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..distributed.context_parallel import shard_mask, shard_sequence


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

    def shard(self, batch: Batch, *, causal: bool, count_rows: bool) -> Batch:
        """With context parallelism, the rank's positions of a whole-sequence micro-batch (`megadlms.distributed.
        context_parallel`); without, the batch itself. Targets and weights are aligned with the inputs (BD3-LM's
        x_0 half gets weight 0), a length that does not split into 2 x cp chunks is padded (pad keys masked out,
        pad queries weigh 0), and the normaliser stays the whole sequence's, divided by cp: the cp ranks' losses
        average to the one-rank loss, as the gradients averaged over data x context-parallel ranks do.
        causal: the model's attention (the padding's mask); count_rows: count the rank's non-zero weights for the host
        (the fused LM head + loss)."""
        cp, r = self.cp_size, self.cp_rank
        if cp == 1:
            if count_rows:
                batch.weighted_rows = HostCount(batch.weights)
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
                if causal:
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
                     position_ids=positions, denominator=denominator / cp,
                     weighted_rows=HostCount(weights) if count_rows else None)
