"""Turning a `TransformerLM` into an FP8 model, and the once-per-step FP8 update (`fp8_step`)."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import defaultdict
from collections.abc import Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ..model import DotProductAttention, SwiGLU
from .attention import Float8DotProductAttention, check_fp8_attention_support
from .fusions.fused_mlp import fused_projections
from .fusions.registry import install_fusions, log_fusion_decisions
from .fusions.swiglu import SwiGLUFP8InputStore
from .grouped import EXPERTS_FP8_WGRAD, Float8GroupedExperts, fp8_grouped_eligible
from .hardware import check_fp8_support
from .linear import DelayedScalingState, Float8Linear
from .quantizer import make_quantizer
from .recipe import DelayedScaling, Recipe, attention_problem, check_recipe, keeps_history
from .state import FP8GlobalStateManager, fp8_autocast

M = TypeVar("M", bound=nn.Module)
log = logging.getLogger(__name__)


def fp8_eligible(linear: nn.Module) -> bool:
    """A plain nn.Linear whose in and out features are multiples of 16 (what FP8 GEMMs tile)."""
    return (isinstance(linear, nn.Linear) and not isinstance(linear, Float8Linear)
            and linear.in_features % 16 == 0 and linear.out_features % 16 == 0)


def fp8_layer_range(num_layers: int, num_layers_at_start_in_bf16: int = 0,
                    num_layers_at_end_in_bf16: int = 0) -> range:
    """Indices of the transformer layers that run in FP8."""
    for name, v in (("num_layers_at_start_in_bf16", num_layers_at_start_in_bf16),
                    ("num_layers_at_end_in_bf16", num_layers_at_end_in_bf16)):
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"{name}={v!r} must be an integer >= 0")
    if num_layers_at_start_in_bf16 + num_layers_at_end_in_bf16 > num_layers:
        raise ValueError(f"num_layers_at_start_in_bf16 + num_layers_at_end_in_bf16 = "
                         f"{num_layers_at_start_in_bf16 + num_layers_at_end_in_bf16} exceeds the model's "
                         f"{num_layers} layers; keep fewer layers in BF16")
    return range(num_layers_at_start_in_bf16, num_layers - num_layers_at_end_in_bf16)


def _set_child(root: nn.Module, dotted: str, module: nn.Module) -> None:
    parent_name, _, leaf = dotted.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, leaf, module)


def convert_to_fp8(model: M, recipe: Recipe, *, num_layers_at_start_in_bf16: int = 0,
                   num_layers_at_end_in_bf16: int = 0, activation_func_fp8_input_store: bool = False,
                   fp8_wgrad: bool = True, fuse_projections: bool = True, fuse_mlp: bool = True,
                   fprop_fast_accum: bool = True, dot_product_attention: bool = False,
                   experts_fp8_wgrad: bool = EXPERTS_FP8_WGRAD) -> M:
    """Convert `model` (a TransformerLM) to FP8 in place and return it.

    Every eligible nn.Linear inside `model.layers` (in/out features multiples of 16) becomes a
    Float8Linear holding the same weight/bias Parameter objects, so optimizers, initialisation
    and tied references are unaffected. The embedding, final norm and LM head stay in high
    precision, as do the first/last `num_layers_at_{start,end}_in_bf16` transformer layers. The experts of an MoE
    block become `grouped.Float8GroupedExperts` (FP8 grouped GEMMs, per-row or per-expert scales); its router stays
    fp32.
    activation_func_fp8_input_store: the SwiGLU of each FP8 layer keeps its inputs for backward
        in E4M3. fp8_wgrad=False: weight gradients in BF16 (fprop/dgrad stay FP8).
    experts_fp8_wgrad: the MoE experts' weight gradients in FP8 too (with fp8_wgrad); off by default, where the
        FP8 grouped weight-gradient GEMM is slower than the BF16 one (`grouped.EXPERTS_FP8_WGRAD`).
    fuse_projections: q/k/v and gate/up of each FP8 layer run as one FP8 GEMM each, sharing one cast of
        their input (`fused_linear.FusedFloat8Projection` in the Attention's `qkv_fusion` / the MLP's
        `gate_up_fusion`; parameters and state_dict keys are unchanged). Per-tensor recipes only.
    fuse_mlp: each FP8 MLP runs as one function whose SwiGLU is fused into the FP8 casts around it
        (`fused_mlp.FusedFloat8MLP` in the MLP's `fusion`). Delayed and current scaling. The fusions are the
        registry `fusions.FUSIONS`.
    fprop_fast_accum: Hopper's fast (reduced-precision) accumulation in the forward GEMM; False makes it
        accumulate like the backward GEMMs (slower, for numerics checks).
    dot_product_attention: the attention of each FP8 layer runs in FP8 too (`attention.Float8DotProductAttention`:
        cuDNN's FP8 flash attention on CUDA). Delayed scaling only.
    The model's `layer_context` becomes `fp8_autocast(enabled=True, fp8_recipe=recipe)`, which the
    model enters around its transformer layers.
    """
    check_recipe(recipe)
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"convert_to_fp8 expects a TransformerLM (a model with a `layers` ModuleList), got "
                        f"{type(model).__name__}")
    param = next(model.parameters(), None)
    if param is not None:
        check_fp8_support(param.device)
        if param.device.type == "cuda":  # the recipe's own GEMM (blockwise: Hopper, MXFP8: Blackwell)
            index = param.device.index if param.device.index is not None else torch.cuda.current_device()
            make_quantizer(recipe, recipe.fp8_format.fwd_dtype, None, 0).check_device(index)
    attention_recipe: Recipe | None = None
    if dot_product_attention:
        problem = attention_problem(recipe)
        if problem:
            raise ValueError(problem)
        attention_recipe = recipe
        if param is not None:
            check_fp8_attention_support(param.device)
    decisions = []
    fp8_layers = fp8_layer_range(len(layers), num_layers_at_start_in_bf16, num_layers_at_end_in_bf16)
    for i in fp8_layers:
        layer = layers[i]
        for name, child in list(layer.named_modules()):
            if fp8_eligible(child):
                _set_child(layer, name, Float8Linear.from_linear(child, recipe, fp8_wgrad=fp8_wgrad,
                                                                      fprop_fast_accum=fprop_fast_accum))
            elif fp8_grouped_eligible(child):  # MoE experts: FP8 grouped GEMMs (the router stays in fp32)
                _set_child(layer, name, Float8GroupedExperts.from_experts(child, recipe, fprop_fast_accum,
                                                                           fp8_wgrad and experts_fp8_wgrad))
            elif activation_func_fp8_input_store and type(child) is SwiGLU:
                _set_child(layer, name, SwiGLUFP8InputStore())
            elif attention_recipe is not None and type(child) is DotProductAttention:
                fp8_attention = Float8DotProductAttention(attention_recipe,
                                                          device=param.device if param is not None else None)
                _set_child(layer, name, fp8_attention.train(child.training))
        decisions += install_fusions(layer, {"fuse_projections": fuse_projections, "fuse_mlp": fuse_mlp})
    log_fusion_decisions(decisions)
    # (the model is typed as any nn.Module, whose attributes the checker reads as tensors or modules)
    setattr(model, "layer_context", functools.partial(fp8_autocast, enabled=True, fp8_recipe=recipe))
    return model


def fp8_modules(model: nn.Module) -> Iterator[Float8Linear]:
    """The Float8Linear modules of `model` (works through DDP/FSDP wrappers)."""
    return (m for m in model.modules() if isinstance(m, Float8Linear))


ScalingModule = Float8Linear | Float8DotProductAttention  # FP8 modules with amax histories and scales
CachingModule = Float8Linear | Float8GroupedExperts  # FP8 modules with a per-step FP8 weight cache


def fp8_caching_modules(model: nn.Module) -> Iterator[CachingModule]:
    """The modules of `model` that cache their FP8 weights for a step: Float8Linears and FP8 MoE experts."""
    return (m for m in model.modules() if isinstance(m, (Float8Linear, Float8GroupedExperts)))


def fp8_scaling_modules(model: nn.Module) -> Iterator[ScalingModule]:
    """Every module with FP8 amax histories and scales (Float8Linears, FP8 attention): what `fp8_step` updates."""
    return (m for m in model.modules() if isinstance(m, (Float8Linear, Float8DotProductAttention)))


def invalidate_fp8_weight_caches(model: nn.Module) -> None:
    """Make every Float8Linear and FP8 experts module recast its weights on the next forward (after weights changed
    outside an optimizer step followed by `fp8_step`, e.g. a manual load into `.data`), and let go of the cached
    FP8 weights now (the layers' and their fused groups')."""
    for m in fp8_caching_modules(model):
        m.invalidate_fp8_weight_cache()
    for group in fused_projections(model):
        group.invalidate_fp8_weight_cache()


def set_fp8_weight_caching(model: nn.Module, enabled: bool) -> list[CachingModule]:
    """Switch the per-step FP8 weight cache (`Float8Linear.cache_weight`, `Float8GroupedExperts.cache_weight`) of
    `model`'s Float8Linears and FP8 experts on or off, e.g.
    off where no later micro-batch reads a cached weight (one micro-batch per step) or where weights are gathered
    per use (FSDP). Turning it off drops the caches held (the layers' and their fused groups'). Returns the layers
    whose setting changed (to switch back with `fp8_weight_caching`)."""
    changed = [m for m in fp8_caching_modules(model) if m.cache_weight != enabled]
    for m in changed:
        m.set_cache_weight(enabled)
    if changed and not enabled:
        invalidate_fp8_weight_caches(model)
    return changed


@contextlib.contextmanager
def fp8_weight_caching(model: nn.Module, modules: list[CachingModule]) -> Iterator[None]:
    """Inside, `modules` (Float8Linears and FP8 experts of `model`) keep their FP8 weights between forwards
    (`cache_weight=True`), e.g. over the batches of an evaluation, which all see the same weights. On exit their
    setting is back to off and the caches made inside are dropped: training without a cache must not hold them
    through its steps."""
    for m in modules:
        m.set_cache_weight(True)
    try:
        yield
    finally:
        for m in modules:
            m.set_cache_weight(False)
        if modules:
            invalidate_fp8_weight_caches(model)


@contextlib.contextmanager
def fp8_graph_capture(model: nn.Module, weights_in_graph: bool = True) -> Iterator[None]:
    """Around the warm-up and capture of `model`'s FP8 layers in a CUDA graph.

    weights_in_graph: every forward inside casts its FP8 weights afresh: the graph must contain the weight cast,
    because its replays after an optimizer step have to read the new weights (a cached FP8 weight would be a
    constant of the graph); the weight caches are dropped on exit. Without it the caches are left alone (the
    graph reads them and `graph_weights.StepFP8Weights` recasts into them once per step).
    On exit the FP8 buffers (amax histories, scales) get back their values from the entry, since the warm-up
    runs recorded the amaxes of sample inputs.
    """
    modules = list(fp8_caching_modules(model))
    scaling = list(fp8_scaling_modules(model))
    saved = [sm.save_scaling_state() for sm in scaling]
    cache_flags = [m.cache_weight for m in modules]
    if weights_in_graph:
        for m in modules:
            m.set_cache_weight(False)
    try:
        yield
    finally:
        for sm, state in zip(scaling, saved):
            sm.restore_scaling_state(state)
        if weights_in_graph:
            for m, flag in zip(modules, cache_flags):
                m.set_cache_weight(flag)


def _default_group(group: Any) -> Any:
    if group is None:
        group = FP8GlobalStateManager.get_amax_reduction_group()
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = dist.group.WORLD
    return group if dist.get_world_size(group) > 1 else None


def reduce_amaxes(modules: list[ScalingModule], group: Any = None) -> None:
    """MAX-reduce the current-step amax slot of every module across `group` in one all_reduce.

    The slots (one amax per role) of all modules are concatenated into one fp32 tensor (which gloo and NCCL
    both send), reduced, and copied back.
    """
    group = _default_group(group)
    if group is None or not modules:
        return
    slots = [m.delayed_state()[0][0] for m in modules]
    flat = torch.cat(slots)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    torch._foreach_copy_(slots, list(flat.split([s.numel() for s in slots])))


@torch.no_grad()
def fp8_step(model: nn.Module, group: Any = None) -> None:
    """The FP8 update of one optimizer step; call it right after `optimizer.step()`.

    1. MAX-reduce the current amaxes of all delayed-scaling modules across `group` (default: the
       group of the enclosing `fp8_autocast`, else the whole world when torch.distributed is
       initialized) with one collective;
    2. compute the new scales and roll the amax histories (tensor ops only, no host sync);
    3. drop the cached FP8 weights, so the next forward casts the updated weights.
    """
    modules = list(fp8_scaling_modules(model))
    delayed = [(m, m.recipe) for m in modules if keeps_history(m.recipe)]
    reduce_amaxes([m for m, recipe in delayed if recipe.reduce_amax], group)
    groups: dict[tuple[DelayedScaling, torch.device, type], list[ScalingModule]] = defaultdict(list)
    for m, recipe in delayed:
        groups[(recipe, m.delayed_state()[0].device, type(m))].append(m)
    for (recipe, _, _), members in groups.items():
        DelayedScalingState.update_scales(recipe, members)
    for cached in fp8_caching_modules(model):
        cached.invalidate_fp8_weight_cache()
