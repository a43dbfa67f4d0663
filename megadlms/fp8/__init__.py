"""Native FP8 training on torch float8 dtypes and `torch._scaled_mm` (Transformer Engine semantics).

    model = build_model(cfg)                       # cfg.fp8=True converts with recipe_from_config(cfg)
    # or: convert_to_fp8(model, DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16))
    loss = loss_fn(model(tokens))                  # FP8 GEMMs inside the model's transformer layers
    loss.backward(); optimizer.step()
    fp8_step(model)                                # amax reduction + scale update + weight recast

Which code runs where:
    recipe.py      the recipes (DelayedScaling, Float8CurrentScaling, Float8RowwiseScaling, Float8BlockwiseScaling,
                   Float8MXScaling), each stating its capabilities, and every rule about recipes
    tensor.py      FP8Tensor, the one type of FP8 data: data, scale_inv, the scaling it states and its axis
    quantizer.py   one quantizer per (tensor role, recipe): a recipe is a kind of quantizer
    gemm.py        the FP8 GEMMs (fprop, dgrad, wgrad) dispatched on the operands' scaling, the only caller of
                   torch._scaled_mm
    linear.py      Float8Linear: one autograd function over its quantizers and the GEMM helper, which also
                   runs the fused groups' concatenated weights
    fusions.py     the fusions conversion installs (a registry), as modules in the model's fusion slots:
                   fused_linear.py (q/k/v and gate/up as one GEMM, with group quantizers), fused_mlp.py (the MLP
                   as one function of the same GEMMs, the SwiGLU fused into its casts)
    kernels.py     the cast / transpose / amax kernels (triton_cast.py, triton_swiglu.py) and their references
    convert.py     convert_to_fp8, fp8_step; state.py: fp8_autocast; attention.py: FP8 attention (cuDNN, opt-in);
                   swiglu.py: FP8 activation storage; monitor.py: telemetry; weight_amax.py: current scaling's
                   weight amaxes kept by the optimizer step; graph_weights.py: FP8 weights of CUDA-graphed layers;
                   export.py: FP8 inference export.
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
from .hardware import FP8UnsupportedError, check_fp8_support, fp8_backend_note
from .linear import Float8Linear
from .monitor import enable_fp8_stats, fp8_stats, fp8_stats_enabled
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
from .swiglu import SwiGLUFP8InputStore
from .weight_amax import attach_weight_amaxes, detach_weight_amaxes, refresh_weight_amaxes

__all__ = ["Format", "DelayedScaling", "Float8CurrentScaling", "Float8RowwiseScaling", "Float8BlockwiseScaling",
           "Float8MXScaling", "recipe_from_config",
           "fp8_autocast", "FP8GlobalStateManager", "fp8_checkpoint_context_fn", "Float8Linear",
           "Float8DotProductAttention",
           "SwiGLUFP8InputStore", "convert_to_fp8", "fp8_step", "fp8_modules", "invalidate_fp8_weight_caches",
           "fp8_graph_capture", "fp8_weight_caching",
           "set_fp8_weight_caching", "check_fp8_support", "fp8_backend_note", "FP8UnsupportedError", "use_torch_ptxas",
           "fp8_stats", "enable_fp8_stats", "fp8_stats_enabled", "attach_weight_amaxes", "refresh_weight_amaxes",
           "detach_weight_amaxes"]
