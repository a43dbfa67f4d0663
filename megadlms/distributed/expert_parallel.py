"""Expert parallelism: the routed experts of every MoE block sharded over the ranks of an `ep` group; each token's
rows travel to the rank that holds their expert and back by all-to-all.

    weights   ep rank r holds experts [r E/ep, (r + 1) E/ep): `experts.{gate,up,down}_proj` become DTensors
              Shard(0) on the ep mesh, of global shape [E, ...], so checkpoints keep one device's names and shapes
              and reshard to any EP size (DCP)
    dispatch  the rank's T*k (token, expert) pairs sorted by expert; the pairs per expert exchanged (an all-to-all of
              E integers, one host copy for the split sizes); the rows all-to-all'd to their experts' ranks, then
              grouped by local expert and padded (`moe.dispatch_plan`)
    experts   the block's own grouped GEMMs (BF16 or FP8) on the local experts
    combine   the rows back to their ranks by the reverse all-to-all, summed per token with the routing weights

The router, its losses and statistics are unchanged: each rank routes its own tokens. The dense part of the model is
data-parallel over every rank; an expert is data-parallel over the world / ep ranks that hold it ("edp"), and its
gradient (a sum over the ep group's tokens) is averaged over the whole world (`data_parallel.apply_fsdp`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..config import ConfigError, TransformerConfig
from ..model import TransformerLM
from ..moe import Dispatched, TokenDispatcher, combine_pairs, dispatch_plan, moe_layers
from ..moe_kernels import permute_rows

EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


def check_expert_parallel(cfg: TransformerConfig, ep_size: int) -> None:
    """Raise ConfigError (one line) where the model has no experts to shard or they do not split evenly."""
    if ep_size == 1:
        return
    if not cfg.is_moe:
        raise ConfigError(f"--expert-model-parallel-size {ep_size} shards the experts of an MoE model, and this model "
                          "is dense; add --num-moe-experts N (a multiple of it) or drop --expert-model-parallel-size")
    e = cfg.num_moe_experts
    assert e is not None  # an MoE model
    if e % ep_size:
        divisors = [d for d in range(1, e + 1) if e % d == 0]
        raise ConfigError(f"--num-moe-experts {e} is not divisible by --expert-model-parallel-size {ep_size} (each EP "
                          f"rank holds the same number of experts); use an expert-parallel size in {divisors}")


class _AllToAll(torch.autograd.Function):
    """x [sum(in_splits), ...] -> [sum(out_splits), ...]: rank r's slice i goes to rank i; backward sends the
    gradients back the same way (splits swapped)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out = grad.new_empty(sum(ctx.in_splits), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return out, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
               group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable `all_to_all_single` along dim 0 with per-rank split sizes."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


class AllToAllTokenDispatcher(TokenDispatcher):
    """`TokenDispatcher` over an ep group (see the module docstring): dispatch returns the rows of this rank's
    experts, from every rank of the group, grouped by local expert; combine returns this rank's tokens.

    One host synchronisation per dispatch (the split sizes); not for CUDA graphs, and a graph break for compile."""

    def __init__(self, num_experts: int, topk: int, group: dist.ProcessGroup):
        super().__init__(num_experts, topk)
        self.group = group
        self.ep_size, self.ep_rank = dist.get_world_size(group), dist.get_rank(group)
        self.local_experts = num_experts // self.ep_size

    def extra_repr(self) -> str:
        first = self.ep_rank * self.local_experts
        return f"ep={self.ep_size}, local experts {first}..{first + self.local_experts - 1} of {self.num_experts}"

    @torch.compiler.disable
    def dispatch(self, x: torch.Tensor, experts: torch.Tensor) -> Dispatched:
        """x [T, H], experts [T, k] -> rows [M, H] of the local experts (M = received pairs + 16 x local experts)."""
        ep, n_local = self.ep_size, self.local_experts
        flat = experts.reshape(-1)
        counts = torch.zeros(self.num_experts, device=flat.device, dtype=torch.int64).scatter_add_(
            0, flat, torch.ones_like(flat))
        order = torch.argsort(flat, stable=True)  # the pairs by expert: by destination rank, then local expert
        received_counts = torch.empty_like(counts)  # [ep * n_local]: from rank s for local expert e at s n_local + e
        dist.all_to_all_single(received_counts, counts, group=self.group)
        host = torch.cat([counts, received_counts]).view(2, ep, n_local).sum(-1).tolist()  # the one host copy
        send_splits, recv_splits = host[0], host[1]
        received = all_to_all(x.index_select(0, order // self.topk), recv_splits, send_splits, self.group)
        local_ids = torch.arange(n_local, device=flat.device).repeat(ep).repeat_interleave(
            received_counts, output_size=received.shape[0])
        plan = dispatch_plan(local_ids[:, None], n_local)
        grouped = permute_rows(received, plan.pos, plan.row_pair, 1)
        return Dispatched(grouped, plan.offs, counts.float(), (order, plan.pos, send_splits, recv_splits))

    @torch.compiler.disable
    def combine(self, y: torch.Tensor, weights: torch.Tensor, handle: Any) -> torch.Tensor:
        """y [M, H] (the local experts' rows), weights [T, k] -> [T, H] in y's dtype (summed in fp32) for this rank's
        tokens."""
        order, pos, send_splits, recv_splits = handle
        back = all_to_all(y[pos], send_splits, recv_splits, self.group)  # this rank's pairs, sorted by expert
        return combine_pairs(torch.empty_like(back).index_copy(0, order, back), weights).to(y.dtype)


def apply_expert_parallel(model: TransformerLM, mesh: DeviceMesh) -> None:
    """Shard every MoE block's experts over the 1-D ep `mesh` (DTensor Shard(0), in place) and swap its dispatcher
    for `AllToAllTokenDispatcher`. Call it after the FP8 conversion (FP8 experts keep their GEMMs) and before
    activation checkpointing, compile and FSDP2 (`data_parallel.apply_fsdp` then shards the experts over the
    remaining ranks, on the same root mesh)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    ep = mesh.size()
    check_expert_parallel(model.config, ep)
    group = mesh.get_group()
    for block in moe_layers(model):
        experts = block.experts
        for name in EXPERT_WEIGHTS:
            w = getattr(experts, name)
            setattr(experts, name, nn.Parameter(distribute_tensor(w.detach(), mesh, [Shard(0)]),
                                                requires_grad=w.requires_grad))
        block.dispatcher = AllToAllTokenDispatcher(block.num_experts, block.topk, group)


__all__ = ["AllToAllTokenDispatcher", "all_to_all", "apply_expert_parallel", "check_expert_parallel",
           "EXPERT_WEIGHTS"]
