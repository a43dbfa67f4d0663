"""LoRA adapters as a PEFT adapter folder, loaded by `peft` on top of the base's Hugging Face export.

    adapter_config.json          peft_type LORA, r, lora_alpha, lora_dropout, target_modules (q_proj, ...)
    adapter_model.safetensors    base_model.model.<HF module path>.lora_A.weight [r, in]
                                 base_model.model.<HF module path>.lora_B.weight [out, r]

The HF module path of `layers.0.self_attn.q_proj` in a stock export (Qwen3 / Qwen2 / Llama ...ForCausalLM) is
`model.layers.0.self_attn.q_proj`. LLaDA's and Dream's own formats are not written: merge the adapters
(`megadlms convert merge-lora`) and export the merged model instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import TransformerConfig
from ..dlm_formats import OWN_FORMAT_ARCHITECTURES
from ..lora import LoraConfig, lora_modules
from ..presets import hf_architecture
from ..safetensors_file import save_safetensors
from .hf import InteropError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


def peft_key(module_path: str, which: str) -> str:
    """Our module path of a wrapped linear (`layers.0.self_attn.q_proj`) and "lora_A" | "lora_B" -> PEFT's key."""
    return f"{PREFIX}model.{module_path}.{which}.weight"


def peft_adapter_config(lora: LoraConfig, cfg: TransformerConfig, base_model_name_or_path: str | None = None
                        ) -> dict[str, Any]:
    """PEFT's LoraConfig fields for these adapters (the scale alpha / r as PEFT computes it; no rsLoRA)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
            "lora_alpha": lora.alpha if lora.alpha is not None else lora.rank, "lora_dropout": lora.dropout,
            "target_modules": lora.module_names(), "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "inference_mode": True, "init_lora_weights": True, "modules_to_save": None,
            "base_model_name_or_path": base_model_name_or_path,
            "revision": None, "layers_to_transform": None, "layers_pattern": None}


def save_peft_adapter(model: nn.Module, cfg: TransformerConfig, lora: LoraConfig, save_dir: str | Path, *,
                      base_model_name_or_path: str | None = None, dtype: torch.dtype | None = None,
                      hf_format: str = "auto") -> Path:
    """Write `model`'s adapters (LoraLinears, `megadlms.lora`) as a PEFT adapter folder; returns the folder.
    dtype: of the stored adapters (default: their own, fp32)."""
    arch = hf_architecture(cfg, hf_format)
    if arch in OWN_FORMAT_ARCHITECTURES:
        raise InteropError(f"a PEFT adapter for {arch}'s own format is not written; merge the adapters "
                           "(`megadlms convert merge-lora`) and export the merged model, or pass --hf-format stock")
    tensors = {}
    for path, m in lora_modules(model):
        for which in ("lora_A", "lora_B"):
            w = getattr(m, which).weight.detach()
            tensors[peft_key(path, which)] = (w.to(dtype) if dtype is not None else w).contiguous().cpu()
    if not tensors:
        raise InteropError("the model has no LoRA adapters to export")
    out = Path(save_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(tensors, out / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    config = peft_adapter_config(lora, cfg, base_model_name_or_path)
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out
