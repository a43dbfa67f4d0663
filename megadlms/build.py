"""`build_model(cfg)`: the model of a TransformerConfig with its precision applied.

The first two steps of the model-transformation pipeline (`megadlms.distributed.parallelize.build_parallel_model`
runs the rest: tensor parallel -> activation checkpointing -> compile -> FSDP2 / DDP): construct the plain
single-device `TransformerLM`, then swap its eligible linears for FP8 ones when `cfg.fp8` is set.
"""

from __future__ import annotations

import contextlib
from typing import TypeVar

import torch
from torch import nn

from .config import TransformerConfig
from .model import TransformerLM

M = TypeVar("M", bound=nn.Module)


def construct_model(cfg: TransformerConfig, device: torch.device | str | None = None) -> TransformerLM:
    """The plain model (high precision, one device), its parameters created on `device`."""
    with torch.device(device) if device is not None else contextlib.nullcontext():
        return TransformerLM(cfg)


def apply_fp8(model: M, cfg: TransformerConfig) -> M:
    """Convert `model` to FP8 with the recipe and options of `cfg`'s FP8 fields; unchanged when `cfg.fp8` is off.

    The converted model enters FP8 autocast around its transformer layers in its own forward.
    """
    if not cfg.fp8:
        return model
    from .fp8 import convert_to_fp8, recipe_from_config  # lazy: a BF16 model never imports the FP8 engine

    start, end = cfg.bf16_edges()
    return convert_to_fp8(model, recipe_from_config(cfg), num_layers_at_start_in_bf16=start,
                          num_layers_at_end_in_bf16=end,
                          activation_func_fp8_input_store=cfg.activation_func_fp8_input_store,
                          fp8_wgrad=cfg.fp8_wgrad, fuse_projections=cfg.fp8_fuse_projections,
                          fuse_mlp=cfg.fp8_fuse_mlp, fprop_fast_accum=cfg.fp8_fprop_fast_accum,
                          dot_product_attention=cfg.fp8_dot_product_attention,
                          experts_fp8_wgrad=cfg.fp8_experts_wgrad)


def build_model(cfg: TransformerConfig, device: torch.device | str | None = None) -> TransformerLM:
    """Build the model for `cfg` (on `device`), converted to FP8 when `cfg.fp8` is set."""
    return apply_fp8(construct_model(cfg, device), cfg)
