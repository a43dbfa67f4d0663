"""Data parallelism: DDP or FSDP2 (`fully_shard`), chosen by --data-parallel-sharding-strategy.

    no_shard            DDP: parameters, gradients and optimizer state replicated; gradients all-reduced
                        in buckets while backward runs. With tensor parallelism (DTensor parameters, which
                        DDP does not take) the same replication is done by FSDP2 on a (dp, 1) mesh: a shard
                        group of one rank, gradients all-reduced over dp.
    optim               ZeRO-1: optimizer state sharded. FSDP2 keeps the gathered parameters from the
                        step's first forward to its last backward (no resharding after forward, nor after
                        backward while gradients accumulate) and accumulates full gradients locally; the
                        last micro-batch reduce-scatters them, so each rank updates its shard. One
                        all-gather and one reduce-scatter per step: the traffic of one all-reduce.
                        (ZeroRedundancyOptimizer is not used: its state cannot go through
                        get_state_dict / DCP, so it could not be resharded on resume.)
    optim_grads         ZeRO-2: FSDP2 without resharding after forward; gradients are reduce-scattered
                        after every micro-batch, so only a shard of them is kept.
    optim_grads_params  ZeRO-3: FSDP2 resharding after forward (parameters all-gathered again in backward).

Every strategy stores the model and optimizer in DCP as sharded or replicated tensors of the same
names, so a checkpoint of one strategy / world size loads into any other.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import TYPE_CHECKING, Iterator, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..moe import moe_layers

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    from ..model import TransformerLM
    from .pipeline_parallel import PipelineStageModule

FSDP_STRATEGIES = ("optim", "optim_grads", "optim_grads_params")


def mixed_precision_policy(param_dtype: torch.dtype | None):
    """FSDP2 compute in `param_dtype` (None: the parameters' own dtype), gradients reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if param_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def apply_fsdp(model: TransformerLM | PipelineStageModule, mesh: DeviceMesh, *, reshard_after_forward: bool,
               param_dtype: torch.dtype | None = None, prefetch: bool = False,
               expert_mesh: DeviceMesh | None = None) -> None:
    """fully_shard each transformer layer, then the root (embedding, final norm, LM head), in place. The root is a
    whole model or one pipeline stage.

    mesh: 1-D (sharding) or 2-D (replicate, shard) data-parallel mesh. With tensor parallelism it must
    come from the same root mesh as the TP mesh. The root is not resharded after forward: backward
    starts with it, and a chunked LM head + loss uses its output weight after the forward.
    prefetch: also issue the next layer's all-gather before the current layer runs, in forward and
    backward (--overlap-param-gather), instead of when the CPU reaches it.
    expert_mesh: expert parallelism's "edp" mesh (`expert_parallel`): each MoE block's experts are sharded (or
    replicated, 2-D) over it first, as a unit of their own; their gradients, each a sum over an ep group's tokens,
    are divided by the size of `mesh` (every data-parallel rank), as the dense ones are.
    """
    from torch.distributed.fsdp import fully_shard

    mp = mixed_precision_policy(param_dtype)
    if expert_mesh is not None:
        for block in moe_layers(model):
            experts = fully_shard(block.experts, mesh=expert_mesh, reshard_after_forward=reshard_after_forward,
                                  mp_policy=mp)
            experts.set_gradient_divide_factor(float(mesh.size()))
            if expert_mesh.size(expert_mesh.ndim - 1) > 1:
                # a reduce-scatter: a sum, then the division (gloo has no pre-scaled sum). Not with shard groups of
                # one rank, where FSDP2 divides before its (skipped) reduce-scatter and would divide again after it
                experts.set_force_sum_reduction_for_comms(True)
    blocks = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    layers = [fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
              for layer in blocks]
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    if prefetch and len(layers) > 1:
        for prev, nxt in zip(layers[:-1], layers[1:]):
            prev.set_modules_to_forward_prefetch([nxt])
            nxt.set_modules_to_backward_prefetch([prev])


def apply_ddp(model: nn.Module, group, device: torch.device) -> nn.Module:
    """DistributedDataParallel over `group`. Buffers are not broadcast each forward: they are equal on every
    rank already (RoPE tables) or reduced by their owner (FP8 amax histories, in `fp8_step`)."""
    from torch.nn.parallel import DistributedDataParallel

    with warnings.catch_warnings():
        # torch >= 2.13 deprecates broadcast_buffers for forward_sync_buffers, which still syncs the buffers at
        # init; broadcast_buffers=False is what it advises where buffers are kept by their owners, as here
        warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
        return DistributedDataParallel(model, process_group=group, broadcast_buffers=False,
                                       device_ids=[device.index] if device.type == "cuda" else None)


@contextlib.contextmanager
def _fsdp_accumulate(module: nn.Module, keep_unsharded: bool) -> Iterator[None]:
    model = cast("FSDPModule", module)  # fully_shard made it one
    model.set_requires_gradient_sync(False)
    if keep_unsharded:
        model.set_reshard_after_backward(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
        if keep_unsharded:
            model.set_reshard_after_backward(True)


def grad_sync_context(model: nn.Module, strategy: str, last: bool) -> contextlib.AbstractContextManager:
    """The context of one micro-batch's forward + backward under `strategy` (see the module doc).

    no_shard / optim: gradients are reduced only on the last micro-batch of a step (accumulated locally
    before); optim keeps the gathered parameters until then. optim_grads(_params): every micro-batch
    reduce-scatters, so no full gradient outlives its micro-batch.
    """
    if last or strategy in ("none", "optim_grads", "optim_grads_params"):
        return contextlib.nullcontext()
    if hasattr(model, "no_sync"):  # DDP
        return cast("DistributedDataParallel", model).no_sync()
    return _fsdp_accumulate(model, keep_unsharded=strategy in ("no_shard", "optim"))


@contextlib.contextmanager
def gathered_parameters(model: nn.Module) -> Iterator[None]:
    """Under FSDP2: every sharded module of `model` all-gathered once on entry and kept for the block, resharded on
    exit (as TRL's unwrap_model_for_generation does under ZeRO-3). For forwards whose number differs between ranks,
    such as sampling with a confidence threshold: per-forward all-gathers would not match across ranks. The block
    holds the unsharded weights. Without FSDP2, nothing."""
    from torch.distributed.fsdp import FSDPModule

    mods = [cast("FSDPModule", m) for m in model.modules() if isinstance(m, FSDPModule)]
    if not mods:
        yield
        return
    reshards = [_reshards_after_forward(m) for m in mods]
    for m in mods:  # the same modules in the same order on every rank
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m, reshard in zip(mods, reshards):
            m.set_reshard_after_forward(reshard, recurse=False)
            m.reshard()


def _reshards_after_forward(module: FSDPModule) -> bool:
    """Whether fully_shard reshards `module` after its forward (FSDP2 keeps it in its parameter groups only)."""
    groups = module._get_fsdp_state()._fsdp_param_groups
    return any(g.post_forward_mesh_info is not None for g in groups)
