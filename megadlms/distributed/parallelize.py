"""The model-transformation pipeline, in one fixed order (`build_parallel_model`):

    construct (plain single-device model) -> [load the frozen base] -> FP8 conversion -> [LoRA]
    -> [FP8 parameter all-gather] -> tensor parallel -> context parallel -> expert parallel
    -> activation checkpointing -> torch.compile -> FSDP2 / DDP (over the data- x context-parallel ranks; the
    experts of expert parallelism over the ranks that hold the same experts)

or, with pipeline parallelism, the same up to torch.compile -> the rank's pipeline stages -> FSDP2 / DDP per stage
(over the data- x context-parallel ranks). `check_parallel_plan` checks the layout first.

Each step is a function of its own. (The trainer captures the layers in CUDA graphs afterwards, once its
optimizer exists: `megadlms.training.cuda_graphs`.)
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..build import apply_fp8, construct_model
from ..config import ConfigError, TransformerConfig
from ..model import TransformerLM
from .config import ParallelConfig
from .context_parallel import apply_context_parallel
from .data_parallel import apply_ddp, apply_fsdp
from .expert_parallel import apply_expert_parallel
from .init import ParallelContext
from .tensor_parallel import apply_tensor_parallel

if TYPE_CHECKING:
    from ..lora import LoraConfig
    from .pipeline_parallel import PipelineStageModule

log = logging.getLogger("megadlms")


def apply_activation_checkpointing(model: TransformerLM) -> None:
    """Recompute each transformer layer in backward (composable API: parameter names are kept).

    FP8 models recompute under the FP8 state of the original forward (the recomputation runs in
    backward, outside the model's `fp8_autocast`).
    """
    from torch.distributed._composable import checkpoint

    kwargs: dict[str, Any] = {}
    if model.config.fp8:
        from ..fp8 import fp8_checkpoint_context_fn

        kwargs["context_fn"] = fp8_checkpoint_context_fn
    for layer in model.layers:
        checkpoint(layer, **kwargs)


def apply_compile(model: TransformerLM) -> None:
    """Compile each transformer layer in place (per-layer compile: same code for every layer, so one
    compilation is reused; the FP8 autocast context around the layers stays in eager Python)."""
    for layer in model.layers:
        layer.compile()


def _meshes(ctx: ParallelContext, strategy: str) -> tuple[DeviceMesh | None, DeviceMesh | None]:
    """(TP mesh, data-parallel mesh), both sub-meshes of one root mesh as FSDP2 + TP requires. The data-parallel
    mesh spans the context-parallel ranks too: they hold the same weights and reduce their gradients together."""
    if ctx.mesh is None:
        return None, None
    if strategy == "no_shard" and (ctx.tp_size > 1 or ctx.ep_size > 1) and ctx.dp_cp_size > 1:
        # DDP takes no DTensor parameters (TP's, or the experts' under EP): replicate with FSDP2 over a (dp, 1) mesh
        # instead (HSDP whose shard groups have one rank). Same rank layout as ctx.mesh, so dp ranks and groups are
        # unchanged.
        mesh = init_device_mesh(ctx.device.type, (ctx.dp_cp_size, 1, ctx.tp_size),
                                mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        return mesh["tp"], mesh["dp_replicate", "dp_shard"]
    return ctx.mesh["tp"], ctx.dp_cp_mesh


def _expert_meshes(ctx: ParallelContext, strategy: str) -> tuple[DeviceMesh, DeviceMesh]:
    """(ep mesh, the experts' data-parallel mesh) of expert parallelism, sub-meshes of one root mesh as FSDP2 over
    DTensor parameters requires: the "edp" ranks hold the same experts. no_shard replicates them over a (edp, 1) mesh,
    as `_meshes` does the dense part."""
    assert ctx.expert_mesh is not None  # ep_size > 1
    if strategy != "no_shard":
        return ctx.expert_mesh["ep"], ctx.expert_mesh["edp"]
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size // ctx.ep_size, 1, ctx.ep_size),
                            mesh_dim_names=("edp_replicate", "edp_shard", "ep"))
    return mesh["ep"], mesh["edp_replicate", "edp_shard"]


def apply_fp8_param_gather(model: TransformerLM, ctx: ParallelContext, parallel: ParallelConfig) -> int:
    """--fp8-param-gather: FSDP2 gathers the FP8 linears' weights in FP8, each rank casting its shard
    (`megadlms.fp8.integrations.param_gather`); the members of each fused projection share the fused GEMM's scale. Call
    it after the FP8 conversion and before `fully_shard`. Returns the number of weights gathered in FP8.

    Raises ConfigError / ParamGatherError (one line) where there is nothing to gather in FP8 or the gather could
    not be exact: no FSDP2 sharding, one data-parallel rank, tensor parallelism, a recipe or a shape that cannot."""
    from ..fp8 import fp8_modules
    from ..fp8.fusions.fused_mlp import fused_projections
    from ..fp8.integrations.param_gather import check_gather_shardable, enable_fp8_param_gather

    # the flags' clashes (no FP8, its recipe, no sharding, TP) are the run plan's (`training.run_plan`)
    if ctx.dp_cp_size < 2:
        raise ConfigError("--fp8-param-gather: this run has one data-parallel rank, so FSDP2 gathers nothing; launch "
                          "more ranks (torchrun --nproc-per-node N) or drop --fp8-param-gather")
    linears = list(fp8_modules(model))
    names = {id(m): n for n, m in model.named_modules()}
    for m in linears:
        check_gather_shardable(f"{names[id(m)]}.weight", m.weight.shape, m.recipe.name, ctx.dp_cp_size)
    groups = [tuple(g.members()) for g in fused_projections(model)]
    grouped = {id(m) for g in groups for m in g}
    groups += [(m,) for m in linears if id(m) not in grouped]
    n = enable_fp8_param_gather(groups, ctx.dp_cp_size)
    if ctx.is_main:
        log.info("FP8 parameter all-gather: %d weights gathered as FP8 (%s scaling)", n, model.config.fp8_recipe)
    return n


def check_parallel_plan(cfg: TransformerConfig, ctx: ParallelContext, parallel: ParallelConfig) -> None:
    """The model's sizes against the (pp, dp, cp, tp) layout: each that does not divide is a one-line ConfigError
    naming the values and the fix. (Which features combine is the run plan's, `training.run_plan`; the world's
    split, `init.build_mesh`'s.)"""
    from .context_parallel import check_context_parallel
    from .pipeline_parallel import check_pipeline_parallel, virtual_stages

    check_context_parallel(cfg, ctx.cp_size)
    if ctx.pp_size > 1:
        local = cfg.seq_length // ctx.cp_size
        if parallel.sequence_parallel and ctx.tp_size > 1 and local % ctx.tp_size:
            raise ConfigError(f"--sequence-parallel with --pipeline-model-parallel-size {ctx.pp_size}: the stages "
                              f"send equal sequence shards, and the {local} positions per context-parallel rank do not "
                              f"split over --tensor-model-parallel-size {ctx.tp_size}; pick a --seq-length that does")
        check_pipeline_parallel(cfg, ctx.pp_size)
        virtual_stages(cfg.num_layers, ctx.pp_size, parallel.num_layers_per_virtual_pipeline_stage)


def build_parallel_model(cfg: TransformerConfig, ctx: ParallelContext, parallel: ParallelConfig, *,
                         activation_checkpointing: bool = False, compile: bool = False,
                         param_dtype: torch.dtype | None = None, fp8_param_gather: bool = False,
                         lora: LoraConfig | None = None,
                         load_base: Callable[[TransformerLM], None] | None = None) -> nn.Module:
    """The whole pipeline: the model of `cfg` on `ctx.device`, in FP8 when `cfg.fp8`, then parallelized.

    fp8_param_gather: FSDP2 all-gathers the FP8 layers' weights in FP8 (`apply_fp8_param_gather`).
    lora: freeze the model and add LoRA adapters (`megadlms.lora.apply_lora`), after `load_base` has written the
    base's weights into the plain model (a frozen FP8 base is cast from them once)."""
    model = construct_model(cfg, device=ctx.device)
    if load_base is not None:
        load_base(model)
    model = apply_fp8(model, cfg)
    if lora is not None:
        from ..lora import apply_lora

        model = apply_lora(model, lora)
    if fp8_param_gather:
        apply_fp8_param_gather(model, ctx, parallel)
    return parallelize_model(model, ctx, parallel, activation_checkpointing=activation_checkpointing,
                             compile=compile, param_dtype=param_dtype)


def parallelize_model(model: TransformerLM, ctx: ParallelContext, parallel: ParallelConfig, *,
                      activation_checkpointing: bool = False, compile: bool = False,
                      param_dtype: torch.dtype | None = None) -> nn.Module:
    """Apply tensor parallelism, context parallelism, expert parallelism, activation checkpointing, compile and
    data parallelism to a (converted) model, in that order. With pipeline parallelism the same steps run: the
    model's layers are transformed first, then this rank's stages are cut from the model and data parallelism
    wraps each stage (`_pipeline_stages`).

    param_dtype: FSDP2's compute dtype (the autocast dtype; None keeps the parameters' own).
    Returns the model to train (a DDP wrapper for no_shard without TP, `model` itself, or the rank's
    `RankStages`) and records the strategy in ctx.dp_strategy / ctx.sequence_parallel for the trainer.
    """
    check_parallel_plan(model.config, ctx, parallel)
    strategy = parallel.sharding_strategy
    sequence_parallel = parallel.sequence_parallel and ctx.tp_size > 1
    tp_mesh, dp_mesh = _meshes(ctx, strategy)
    sequence = None
    if ctx.tp_size > 1:
        assert tp_mesh is not None  # ctx has a mesh when it has more than one rank
        sequence = apply_tensor_parallel(model, tp_mesh, sequence_parallel)
    if ctx.cp_size > 1:
        assert ctx.cp_group is not None  # a mesh with a cp dimension
        apply_context_parallel(model, ctx.cp_group, parallel.cp_comm_type)
    expert_dp_mesh = None
    if ctx.ep_size > 1:
        ep_mesh, expert_dp_mesh = _expert_meshes(ctx, strategy)
        apply_expert_parallel(model, ep_mesh)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if compile:
        apply_compile(model)
    ctx.sequence_parallel = sequence_parallel
    ctx.dp_strategy = strategy if ctx.dp_cp_size > 1 else "none"

    def data_parallel(module: TransformerLM | PipelineStageModule) -> nn.Module:
        """DDP or FSDP2 over the data- x context-parallel ranks (`module` itself with one such rank)."""
        if ctx.dp_cp_size > 1 and strategy == "no_shard" and ctx.tp_size == 1 and ctx.ep_size == 1:
            return apply_ddp(module, ctx.dp_cp_group, ctx.device)
        if ctx.dp_cp_size > 1:
            assert dp_mesh is not None  # ctx has a mesh when it has more than one rank
            apply_fsdp(module, dp_mesh, reshard_after_forward=strategy == "optim_grads_params",
                       param_dtype=param_dtype, prefetch=parallel.overlap_param_gather, expert_mesh=expert_dp_mesh)
        return module

    if ctx.pp_size > 1:
        return _pipeline_stages(model, ctx, parallel, sequence, data_parallel, param_dtype)
    trained = data_parallel(model)
    if ctx.dp_cp_size > 1 and strategy in ("optim_grads", "optim_grads_params") and model.config.fp8:
        # these strategies free gathered weights between micro-batches; an FP8 weight cache would keep them
        from ..fp8 import set_fp8_weight_caching

        set_fp8_weight_caching(model, False)
    if ctx.distributed and ctx.is_main:
        tp = f"tensor parallel over {ctx.tp_size} ranks{' + sequence parallel' if sequence_parallel else ''}"
        dp = f"data parallel: {_describe(strategy, ctx.tp_size * ctx.ep_size)} over {ctx.dp_cp_size} ranks"
        if ctx.cp_size > 1:
            dp += f" ({ctx.dp_size} data x {ctx.cp_size} context parallel)"
        cp = f"context parallel over {ctx.cp_size} ranks ({_cp_exchange(parallel)})"
        e = model.config.num_moe_experts or 0
        ep = (f"expert parallel over {ctx.ep_size} ranks ({e // ctx.ep_size} of {e} experts each, all-to-all; "
              f"each expert data parallel over {ctx.world_size // ctx.ep_size})")
        log.info("%s", " | ".join(x for x, on in ((dp, ctx.dp_cp_size > 1), (cp, ctx.cp_size > 1),
                                                  (tp, ctx.tp_size > 1), (ep, ctx.ep_size > 1)) if on))
    return trained


def _pipeline_stages(model: TransformerLM, ctx: ParallelContext, parallel: ParallelConfig, sequence: Any,
                     data_parallel: Callable[[PipelineStageModule], nn.Module],
                     param_dtype: torch.dtype | None) -> nn.Module:
    """This rank's pipeline stages of the transformed `model` (`megadlms.distributed.pipeline_parallel.RankStages`):
    one, or several with virtual stages (interleaved 1F1B); `data_parallel` (parallelize_model's last step) wraps
    each stage module over the data- x context-parallel ranks holding the same stages; the schedule reduces
    gradients on the last micro-batch. sequence: tensor parallelism's sequence layout (None without TP)."""
    from .pipeline_parallel import PipelineStageModule, RankStages, rank_stages, virtual_stages

    pp, cfg = ctx.pp_size, model.config
    virtual = virtual_stages(cfg.num_layers, pp, parallel.num_layers_per_virtual_pipeline_stage)
    num_stages = pp * virtual
    stages = RankStages([PipelineStageModule(model, i, num_stages, sequence=sequence)
                         for i in rank_stages(ctx.pp_rank, pp, virtual)])
    stages.sequence_shards = ctx.tp_size if ctx.sequence_parallel else 1
    strategy = parallel.sharding_strategy
    stages.runners = [data_parallel(s) for s in stages.stages]  # DDP wrappers, or the modules FSDP2 sharded
    if ctx.dp_cp_size > 1 and strategy != "no_shard":
        stages.activation_dtype = param_dtype
        if cfg.fp8:  # the schedule frees gathered weights between micro-batches: an FP8 weight cache would keep them
            from ..fp8 import set_fp8_weight_caching

            set_fp8_weight_caching(model, False)
    if ctx.is_main:
        shape = f"{pp} stages" if virtual == 1 else f"{pp} ranks x {virtual} virtual stages (interleaved 1F1B)"
        dp = f" | data parallel: {_describe(strategy, 1)} over {ctx.dp_cp_size} ranks" if ctx.dp_cp_size > 1 else ""
        if ctx.cp_size > 1:
            dp += f" ({ctx.dp_size} data x {ctx.cp_size} context parallel, {_cp_exchange(parallel)})"
        tp = (f" | tensor parallel over {ctx.tp_size} ranks{' + sequence parallel' if ctx.sequence_parallel else ''}"
              if ctx.tp_size > 1 else "")
        per_stage = cfg.num_layers // num_stages
        log.info("pipeline parallel: %s of %d layer%s%s%s", shape, per_stage, "" if per_stage == 1 else "s", dp, tp)
    return stages


def _cp_exchange(parallel: ParallelConfig) -> str:
    return "ring attention, K/V passed by p2p" if parallel.cp_comm_type == "p2p" else "K/V all-gathered"


def _describe(strategy: str, dtensor_parallel: int) -> str:
    """dtensor_parallel: the product of the sizes that make DTensor parameters (TP, EP), which DDP does not take."""
    return {"no_shard": "DDP" if dtensor_parallel == 1 else "replicated (FSDP2, shard groups of 1)",
            "optim": "FSDP2 ZeRO-1 (sharded optimizer state)",
            "optim_grads": "FSDP2 ZeRO-2 (sharded optimizer state and gradients)",
            "optim_grads_params": "FSDP2 ZeRO-3 (sharded optimizer state, gradients and parameters)"}[strategy]
