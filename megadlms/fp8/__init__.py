"""Native FP8 training on torch float8 dtypes and `torch._scaled_mm` (Transformer Engine semantics).

    model = build_model(cfg)                       # cfg.fp8=True converts with recipe_from_config(cfg)
    # or: convert_to_fp8(model, DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16))
    loss = loss_fn(model(tokens))                  # FP8 GEMMs inside the model's transformer layers
    loss.backward(); optimizer.step()
    fp8_step(model)                                # amax reduction + scale update + weight recast

Which code runs where (the core at the top, the rest in four packages below it):
    recipe.py      the five recipes (DelayedScaling, Float8CurrentScaling, Float8RowwiseScaling,
                   Float8BlockwiseScaling, Float8MXScaling), each stating its capabilities; every rule about recipes
    tensor.py      FP8Tensor, the one type of FP8 data: data, scale_inv, the scaling it states and its axis
    quantizer.py   one quantizer per (tensor role, recipe): a recipe is a kind of quantizer; expert_quantizer.py:
                   the MoE experts' grouped operands (per row or per expert)
    gemm.py        the FP8 GEMMs (fprop, dgrad, wgrad) dispatched on the operands' scaling; the only caller of
                   torch._scaled_mm and (fp8_grouped_gemm, the experts') torch._scaled_grouped_mm
    linear.py      Float8Linear and its state: one autograd function over its quantizers and the GEMM helper,
                   which also runs the fused groups' concatenated weights
    convert.py     convert_to_fp8, fp8_step; state.py: fp8_autocast; hardware.py: which devices run FP8
    attention.py   FP8 attention (cuDNN, opt-in); grouped.py: FP8 MoE experts; frozen.py: frozen FP8 linears
                   (LoRA bases); export.py: FP8 inference export
    formats/       the finer scalings with their casts and GEMMs: blockwise.py (1x128 / 128x128), mx.py (MXFP8)
    kernels/       ops.py (the cast / transpose / amax interface), primitives.py (the torch casts, the
                   references), triton_cast.py, triton_swiglu.py and triton_grouped_cast.py (the
                   Triton kernels)
    fusions/       registry.py (the fusions conversion installs, as modules in the model's fusion slots),
                   fused_linear.py (q/k/v and gate/up as one GEMM), fused_mlp.py (the MLP as one function, the
                   SwiGLU fused into its casts), swiglu.py (FP8 activation storage)
    integrations/  param_gather.py (FSDP2's FP8 all-gather), graph_weights.py (FP8 weights of CUDA-graphed layers),
                   weight_amax.py / kept_amax.py (weight amaxes kept by the optimizer step), monitor.py (telemetry)
"""

from ..triton_setup import use_torch_ptxas
from .attention import Float8DotProductAttention
from .convert import (
    convert_to_fp8,
    fp8_graph_capture,
    fp8_modules,
    fp8_step,
    fp8_weight_caching,
    invalidate_fp8_weight_caches,
    set_fp8_weight_caching,
)
from .fusions.swiglu import SwiGLUFP8InputStore
from .hardware import FP8UnsupportedError, check_fp8_support, fp8_backend_note
from .integrations.monitor import enable_fp8_stats, fp8_stats, fp8_stats_enabled
from .integrations.weight_amax import attach_weight_amaxes, detach_weight_amaxes, refresh_weight_amaxes
from .linear import Float8Linear
from .recipe import (
    DelayedScaling,
    Float8BlockwiseScaling,
    Float8CurrentScaling,
    Float8MXScaling,
    Float8RowwiseScaling,
    Format,
    recipe_from_config,
)
from .state import FP8GlobalStateManager, fp8_autocast, fp8_checkpoint_context_fn

__all__ = ["Format", "DelayedScaling", "Float8CurrentScaling", "Float8RowwiseScaling", "Float8BlockwiseScaling",
           "Float8MXScaling", "recipe_from_config",
           "fp8_autocast", "FP8GlobalStateManager", "fp8_checkpoint_context_fn", "Float8Linear",
           "Float8DotProductAttention",
           "SwiGLUFP8InputStore", "convert_to_fp8", "fp8_step", "fp8_modules", "invalidate_fp8_weight_caches",
           "fp8_graph_capture", "fp8_weight_caching",
           "set_fp8_weight_caching", "check_fp8_support", "fp8_backend_note", "FP8UnsupportedError", "use_torch_ptxas",
           "fp8_stats", "enable_fp8_stats", "fp8_stats_enabled", "attach_weight_amaxes", "refresh_weight_amaxes",
           "detach_weight_amaxes"]
