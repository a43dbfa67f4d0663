"""Context parallelism: each rank of a `cp` group holds a share of every sequence's positions.

Layout: a sequence of S positions is cut into 2 x cp equal chunks, and cp rank r holds chunks r and 2cp - 1 - r
(the load-balanced "zigzag" layout: under causal attention every rank then has the same number of attended
(query, key) pairs). Embedding, norms, MLPs and the LM head run on the rank's S / cp positions alone; attention
all-gathers the keys and values of the whole sequence (`ContextParallelAttention`), so every rank attends its
queries to every key, under a mask whose rows are the rank's queries and whose columns are the gathered keys in
gathered order (`key_positions`). Gradients of the gathered K/V are reduced back to their owners in backward.

All-gathering K/V (--cp-comm-type all_gather, the default) is exact and simple; its memory is one layer's
whole-sequence K/V (G x D per token, a fraction of the activations a rank no longer holds). --cp-comm-type p2p passes
the K/V blocks around the ring instead (`megadlms.distributed.ring_attention`), one block in flight at a time.
The batch's noise, loss weights, masks and normaliser are made for the whole sequence first and sliced afterwards
(`megadlms.training.objectives`), so the loss is the one-rank loss.
"""

from __future__ import annotations

import functools
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from ..config import ConfigError, TransformerConfig
from ..model import Attention, DotProductAttention, TransformerLM
from .ring_attention import ring_attention


def check_context_parallel(cfg: TransformerConfig, cp_size: int) -> None:
    """Raise ConfigError (one line) where the model's sequence does not split into 2 x cp equal chunks (what context
    parallelism does not combine with is the run plan's, `training.run_plan`)."""
    if cp_size == 1:
        return
    seq, step = cfg.seq_length, 2 * cp_size
    if seq % step:
        raise ConfigError(f"--seq-length {seq} is not divisible by 2 x --context-parallel-size {cp_size} = {step} "
                          f"(each rank holds two equal chunks); use --seq-length {seq // step * step or step} or "
                          f"{(seq // step + 1) * step}")


@functools.lru_cache(maxsize=64)
def _positions(seq: int, cp_size: int, cp_rank: int, device: str) -> torch.Tensor:
    chunk = seq // (2 * cp_size)
    idx = torch.arange(seq, device=device).view(2 * cp_size, chunk)
    return torch.cat([idx[cp_rank], idx[2 * cp_size - 1 - cp_rank]])


def rank_positions(seq: int, cp_size: int, cp_rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """long [seq / cp]: the global positions cp rank `cp_rank` holds, in its local order. seq % (2 cp) == 0."""
    if seq % (2 * cp_size):
        raise ValueError(f"a sequence of {seq} positions does not split into 2 x {cp_size} equal chunks")
    return _positions(seq, cp_size, cp_rank, str(device))


@functools.lru_cache(maxsize=64)
def _key_positions(seq: int, cp_size: int, device: str) -> torch.Tensor:
    return torch.cat([_positions(seq, cp_size, r, device) for r in range(cp_size)])


def key_positions(seq: int, cp_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """long [seq]: the global position of each key after the all-gather (rank 0's positions, then rank 1's...)."""
    return _key_positions(seq, cp_size, str(device))


def shard_sequence(x: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """x [..., S, ...] -> the rank's positions along `dim`, [..., S / cp, ...] (the zigzag layout)."""
    return x.index_select(dim, rank_positions(x.shape[dim], cp_size, cp_rank, x.device))


def shard_mask(mask: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """A whole-sequence bool mask [B, 1, S, S] (True = attend) -> the rank's query rows over the gathered keys,
    [B, 1, S / cp, S] (columns in `key_positions` order)."""
    s = mask.shape[-1]
    rows = mask.index_select(2, rank_positions(s, cp_size, cp_rank, mask.device))
    return rows.index_select(3, key_positions(s, cp_size, mask.device))


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 2 ([B, G, S/cp, D] -> [B, G, S, D], ranks in order); backward: the sum over the ranks
    of the gradient of each rank's slice (reduce-scatter; all-reduce + slice on gloo, which has no reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        n = dist.get_world_size(group)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        group = ctx.group
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        chunks = [c.contiguous() for c in grad.chunk(n, dim=2)]
        if dist.get_backend(group) == "gloo":
            full = torch.cat(chunks, dim=2)
            dist.all_reduce(full, group=group)
            return full.chunk(n, dim=2)[rank].contiguous(), None
        out = torch.empty_like(chunks[rank])
        dist.reduce_scatter(out, chunks, group=group)
        return out, None


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """x [B, G, S/cp, D] of every cp rank -> [B, G, S, D] (keys in `key_positions` order), differentiable."""
    return _GatherSequence.apply(x, group)


class ContextParallelAttention(DotProductAttention):
    """Wraps a layer's `core_attention`: gathers the whole sequence's K/V over the cp group, then attends the
    rank's queries to them. attn_mask is the rank's rows over the gathered keys (`shard_mask`), or None for
    bidirectional attention; causal attention without a mask runs per chunk on the keys before it (no mask is
    materialised)."""

    def __init__(self, inner: nn.Module, group: dist.ProcessGroup, cp_size: int, cp_rank: int,
                 comm_type: str = "all_gather"):
        super().__init__()
        self.inner, self.group, self.cp_size, self.cp_rank = inner, group, cp_size, cp_rank
        self.comm_type = comm_type  # all_gather | p2p (`megadlms.distributed.ring_attention`)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any,
                is_causal: bool) -> torch.Tensor:
        """q [B, N, S/cp, D], k and v [B, G, S/cp, D] (this rank's positions) -> [B, N, S/cp, D]."""
        if is_causal and attn_mask is not None:
            raise ValueError("context parallelism: is_causal with a mask; pass the causal rows in the mask")
        if self.comm_type == "p2p":
            return ring_attention(q, k, v, self._block_masks(attn_mask, is_causal, q.shape[2], q.device), self.group)
        k, v = gather_sequence(k, self.group), gather_sequence(v, self.group)
        if not is_causal:
            return self.inner(q, k, v, attn_mask, False)
        return self._causal(q, k, v)

    def _block_masks(self, attn_mask: torch.Tensor | None, is_causal: bool, local: int,
                     device: torch.device) -> list[torch.Tensor | None]:
        """Ring attention's masks: this rank's queries over each cp rank's keys, [B or 1, 1, S/cp, S/cp] bool
        (the gathered mask's column blocks, or causal by global position), or None where all keys are attended."""
        if attn_mask is not None:
            return list(attn_mask.bool().split(local, dim=-1))
        if not is_causal:
            return [None] * self.cp_size
        seq = local * self.cp_size
        queries = rank_positions(seq, self.cp_size, self.cp_rank, device)
        return [(rank_positions(seq, self.cp_size, j, device)[None, :] <= queries[:, None])[None, None]
                for j in range(self.cp_size)]

    def _causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention without a materialised mask: each of the rank's two chunks (global chunk c of n
        positions) attends the keys before its end, (c + 1) n, under SDPA's lower-right causal bias."""
        from torch.nn.attention.bias import causal_lower_right

        seq = k.shape[2]
        order = _natural_order(seq, self.cp_size, str(k.device))
        k, v = k.index_select(2, order), v.index_select(2, order)
        if q.shape[1] != k.shape[1]:  # the causal bias's fused kernels take no grouped K/V
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        n = seq // (2 * self.cp_size)
        outs = []
        for i, c in enumerate((self.cp_rank, 2 * self.cp_size - 1 - self.cp_rank)):
            end = (c + 1) * n
            outs.append(self.inner(q[:, :, i * n:(i + 1) * n], k[:, :, :end], v[:, :, :end],
                                   causal_lower_right(n, end), False))
        return torch.cat(outs, dim=2)


@functools.lru_cache(maxsize=64)
def _natural_order(seq: int, cp_size: int, device: str) -> torch.Tensor:
    """long [seq]: the gathered keys' indices in position order (the inverse of `key_positions`)."""
    return torch.argsort(_key_positions(seq, cp_size, device))


def apply_context_parallel(model: TransformerLM, group: dist.ProcessGroup, comm_type: str = "all_gather") -> None:
    """Wrap every layer's core attention in `ContextParallelAttention` over `group` (in place), exchanging K/V by
    `comm_type`: all_gather or p2p (ring attention). Call it after the FP8 conversion (which may swap the core
    attention) and before compile / data parallelism."""
    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    check_context_parallel(model.config, cp_size)
    for layer in model.layers:
        attn = cast(Attention, layer.self_attn)
        attn.core_attention = ContextParallelAttention(attn.core_attention, group, cp_size, cp_rank, comm_type)
