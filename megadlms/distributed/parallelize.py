"""Transformations applied to a built model, in a fixed order:
tensor parallel -> activation checkpointing -> torch.compile -> FSDP2 / DDP.

(FP8 conversion comes first of all, in `build_model`.) Each step is a function of its own.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from .init import ParallelContext


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each transformer layer in backward (composable API: parameter names are kept)."""
    from torch.distributed._composable import checkpoint

    for layer in model.layers:
        checkpoint(layer)


def apply_compile(model: nn.Module) -> None:
    """Compile each transformer layer in place (per-layer compile: same code for every layer, so one
    compilation is reused; the FP8 autocast context around the layers stays in eager Python)."""
    for layer in model.layers:
        layer.compile()


def parallelize_model(model: nn.Module, ctx: ParallelContext, args: argparse.Namespace) -> nn.Module:
    if getattr(args, "recompute_granularity", None) == "full":
        apply_activation_checkpointing(model)
    if args.compile:
        apply_compile(model)
    return model
