"""Loading a model to evaluate: a megadlms checkpoint, a Hugging Face folder or an FP8 export."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import ConfigError


def load_model(*, load: str | None = None, hf_model: str | None = None, fp8_export: str | None = None,
               iteration: int | None = None, device: torch.device, dtype: str = "auto"
               ) -> tuple[nn.Module, Any, str | None]:
    """(model in eval mode on `device`, its TransformerConfig, the folder of its tokenizer or None).

    dtype: auto (bf16 on GPU, fp32 on CPU), bf16 or fp32; FP8 checkpoints and exports keep their FP8 layers.
    """
    if sum(x is not None for x in (load, hf_model, fp8_export)) != 1:
        raise ConfigError("give exactly one model source: load=CHECKPOINT_DIR, hf_model=DIR or fp8_export=DIR")
    if dtype not in ("auto", "bf16", "fp32"):
        raise ConfigError(f"dtype={dtype!r} is not one of auto, bf16, fp32")
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(
        dtype, torch.bfloat16 if device.type == "cuda" else torch.float32)
    if load is not None:
        from ..training.checkpoint import load_model_from_checkpoint

        model, cfg, meta = load_model_from_checkpoint(load, device=device, iteration=iteration)
        if not cfg.fp8:  # weights only: the RoPE tables (buffers) stay fp32
            for p in model.parameters():
                p.data = p.data.to(torch_dtype)
        tok = meta.get("tokenizer_dir")
    elif hf_model is not None:
        from ..interop.hf import load_hf_model

        model, cfg = load_hf_model(hf_model, device=device, dtype=torch_dtype)
        tok = hf_model
    else:
        assert fp8_export is not None
        from ..fp8.export import load_fp8_export

        model, cfg = load_fp8_export(fp8_export, device, dtype=torch_dtype)
        tok = fp8_export
    return model.eval(), cfg, tok
