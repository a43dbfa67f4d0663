"""Loading a model to evaluate: a megadlms checkpoint, a Hugging Face folder or an FP8 export."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import ConfigError

# a model folder's kind -> (what it is, the flag and keyword that load it)
FOLDER_KINDS = {"load": ("a megadlms checkpoint folder (`megadlms train --save`)", "--load"),
                "hf_model": ("a Hugging Face model folder", "--hf-model"),
                "fp8_export": ("a `megadlms export` folder", "--fp8-export")}


def model_folder_kind(path: str | Path) -> str | None:
    """Which source keyword loads the folder `path`: "load" (a checkpoint folder or one of its iteration folders),
    "hf_model" (a config.json naming an architecture or model type), "fp8_export" (a config.json of
    TransformerConfig fields, as `megadlms export` writes), or None where it cannot tell."""
    p = Path(path)
    if (p / "latest_checkpointed_iteration.txt").is_file() or (p / "meta.json").is_file():
        return "load"
    try:
        config = json.loads((p / "config.json").read_text())
    except (OSError, ValueError):  # no readable config.json: the loader's own error says what is missing
        return None
    if not isinstance(config, dict):
        return None
    if "architectures" in config or "model_type" in config:
        return "hf_model"
    return "fp8_export" if "num_layers" in config and "hidden_size" in config else None


def check_model_folder(source: str, path: str | Path) -> None:
    """A folder given to the wrong source (`--hf-model` for a `megadlms export` folder, ...) is an error naming the
    source that loads it, rather than the other loader's complaint about files it does not expect."""
    kind = model_folder_kind(path)
    if kind is not None and kind != source:
        what, flag = FOLDER_KINDS[kind]
        raise ConfigError(f"{FOLDER_KINDS[source][1]} {path}: that is {what}; load it with {flag} {path} "
                          f"({kind}=)")


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
    source, path = next((k, v) for k, v in (("load", load), ("hf_model", hf_model), ("fp8_export", fp8_export))
                        if v is not None)
    check_model_folder(source, path)
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
