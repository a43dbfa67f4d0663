"""Inference export: weights as safetensors, optionally with FP8 linear weights (`megadlms export` writes one).

Layout of an export folder:
    model.safetensors   tensors named as in `TransformerLM.state_dict()` (no "model." prefix)
    config.json         the TransformerConfig as a dict (`TransformerConfig.from_dict`)
    tokenizer files     copied from the checkpoint's tokenizer folder, when it has one

With fp8=True (--fp8), each FP8 linear (the Float8Linear layers of an FP8 model; for a BF16 model the
linears `convert_to_fp8` would convert) is stored as
    <name>.weight            float8_e4m3fn [out, in]
    <name>.weight_scale_inv  float32 [1] (scaling "tensor"), [out, 1] ("row") or [ceil(out/128), ceil(in/128)]
                             ("block": one scale per 128x128 block, DeepSeek-V3's layout): the dequantization
                             factor, weight ~= weight.float() * weight_scale_inv (per block, repeated over it)
and every other tensor (embedding, norms, LM head, biases, BF16 layers) in bfloat16; without fp8
everything is bfloat16. The safetensors header metadata records "megadlms.fp8" ("tensor", "row", "block" or
"none"). `load_fp8_export` builds a model that runs those FP8 weights directly in the FP8 GEMMs (block scales:
torch's blockwise GEMM on Hopper; emulated on the CPU).

`export_hf` writes the same tensors as a Hugging Face folder instead (transformers' names and config.json); with
block scaling its config.json carries the `quantization_config` of transformers' fine-grained FP8 (DeepSeek-V3's:
`quant_method` "fp8", `fmt` "e4m3", `activation_scheme` "dynamic", `weight_block_size` [128, 128], and the
linears kept in BF16 under `modules_to_not_convert`), which transformers loads as FP8 layers on a GPU of compute
capability >= 8.9 and dequantises to BF16 elsewhere.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..config import TransformerConfig
from ..errors import MegaDLMsError
from ..model import RotaryEmbedding, TransformerLM, compute_dtype
from ..safetensors_file import load_safetensors, open_safetensors, save_safetensors
from .convert import fp8_eligible, fp8_layer_range
from .formats.blockwise import (
    BLOCK,
    block_scale_buffer,
    check_blockwise_gemm_support,
    quantize_blocks,
    quantize_tiles,
)
from .gemm import fp8_gemm, scaled_mm
from .hardware import check_fp8_support
from .kernels.primitives import E4M3, FP8_MAX, amax_to_scale, quantize, round_up16
from .linear import Float8Linear, apply_keeping_dtypes
from .recipe import recipe_class
from .tensor import FP8Tensor, Scaling

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
SCALINGS = ("tensor", "row", "block")
# transformers' fine-grained FP8 (FineGrainedFP8Config), as DeepSeek-V3's config.json has it
HF_BLOCK_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [BLOCK, BLOCK]}


class ExportFolderError(MegaDLMsError, FileNotFoundError):
    """A folder given as an export is not one; the message says what it lacks and how to write one."""


class ExportFormatError(MegaDLMsError, ValueError):
    """An export option that the chosen format cannot store; the message names the option to change."""


def fp8_linear_names(model: TransformerLM) -> list[str]:
    """Module names of the linears an FP8 export quantizes: the model's Float8Linear layers, or, for a
    model that is not FP8, the ones `convert_to_fp8` would convert under its config."""
    names = [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
    if names:
        return names
    cfg = model.config
    keep = fp8_layer_range(len(model.layers), *cfg.bf16_edges())
    return [f"layers.{i}.{n}" for i in keep for n, m in model.layers[i].named_modules() if fp8_eligible(m)]


def scaling_of(cfg: TransformerConfig) -> str:
    """The export scaling that matches the recipe a model was trained with (the recipe's `export_scaling`: "block"
    for blockwise, else "tensor")."""
    return recipe_class(cfg.fp8_recipe).export_scaling if cfg.fp8 else "tensor"


def quantize_weight(w: torch.Tensor, scaling: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (float8_e4m3fn [out, in], scale_inv fp32 [1], [out, 1] or, "block", [ceil(out/128),
    ceil(in/128)]); w ~= q * scale_inv (block scales repeated over their 128x128 blocks)."""
    if scaling not in SCALINGS:
        raise ValueError(f"scaling={scaling!r} must be one of {SCALINGS}")
    w = w.detach().float()
    if scaling == "block":  # the cast of blockwise training (its weights' 128x128 blocks)
        blocks, _ = quantize_blocks(w)
        n, k = w.shape
        return blocks.data[:n, :k].contiguous(), blocks.scale_inv[:, : -(-k // BLOCK)].contiguous()
    amax = w.abs().amax().reshape(1) if scaling == "tensor" else w.abs().amax(dim=1, keepdim=True)
    scale = amax_to_scale(amax, FP8_MAX[E4M3])
    return quantize(w, scale, E4M3), scale.reciprocal()


def export_tensors(model: TransformerLM, *, fp8: bool = False, scaling: str = "tensor"
                   ) -> tuple[dict[str, torch.Tensor], set[str], int]:
    """The tensors of an export under our names (see the module docstring), on the CPU: (tensors, the names of the
    FP8 linears, the bytes of the same weights all in BF16)."""
    fp8_names = set(fp8_linear_names(model)) if fp8 else set()
    tensors: dict[str, torch.Tensor] = {}
    bf16_bytes = 0
    for name, p in model.named_parameters():  # tied weights appear once
        bf16_bytes += p.numel() * 2
        module, _, leaf = name.rpartition(".")
        if module in fp8_names and leaf == "weight":
            q, scale_inv = quantize_weight(p, scaling)
            tensors[name] = q.cpu().contiguous()
            tensors[f"{module}.weight_scale_inv"] = scale_inv.cpu().contiguous()
        else:
            tensors[name] = p.detach().to(torch.bfloat16).cpu().contiguous()
    return tensors, fp8_names, bf16_bytes


def export_model(model: TransformerLM, cfg: TransformerConfig, save_dir: str | Path, *, fp8: bool = False,
                 scaling: str = "tensor", tokenizer_dir: str | Path | None = None) -> dict[str, Any]:
    """Write `model` as an inference export (see the module docstring). Returns a summary:
    {'path', 'bytes' (the safetensors file), 'bf16_bytes' (the same export all in BF16), 'fp8_tensors'}."""
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    tensors, fp8_names, bf16_bytes = export_tensors(model, fp8=fp8, scaling=scaling)
    meta = {"format": "pt", "megadlms.fp8": scaling if fp8 else "none"}
    path = save_dir / WEIGHTS
    save_safetensors(tensors, path, metadata=meta)
    (save_dir / CONFIG).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    if tokenizer_dir is not None:
        for f in Path(tokenizer_dir).iterdir():
            if f.is_file():
                shutil.copy2(f, save_dir / f.name)
    return {"path": str(path), "bytes": path.stat().st_size, "bf16_bytes": bf16_bytes,
            "fp8_tensors": len(fp8_names)}


def export_hf(model: TransformerLM, cfg: TransformerConfig, save_dir: str | Path, *, fp8: bool = False,
              scaling: str = "block", tokenizer_dir: str | Path | None = None) -> dict[str, Any]:
    """Write `model` as a Hugging Face folder that `transformers.AutoModelForCausalLM.from_pretrained` loads: the
    tensors of `export_tensors` under transformers' names, its config.json (with the fine-grained FP8
    `quantization_config` for FP8 weights: block scaling only), the tokenizer files of `tokenizer_dir`.
    Returns the summary `export_model` returns."""
    from ..interop.hf import SAFE_WEIGHTS_NAME, save_hf_model

    if fp8 and scaling != "block":
        raise ExportFormatError(f"a Hugging Face FP8 export takes block scaling (transformers' fine-grained FP8, "
                                f"128x128 weight blocks), not {scaling!r}; use --fp8-scaling block, or drop --hf")
    tensors, fp8_names, bf16_bytes = export_tensors(model, fp8=fp8, scaling=scaling)
    quantization = None
    if fp8:
        linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in fp8_names]
        keep = ["lm_head"] + [f"model.{n}" for n in linears if n != "lm_head"]
        quantization = {**HF_BLOCK_FP8, "modules_to_not_convert": keep}
    save_dir = save_hf_model(model, cfg, save_dir, tokenizer_dir=tokenizer_dir, tensors=tensors,
                             quantization_config=quantization)
    size = sum(f.stat().st_size for f in Path(save_dir).glob("*.safetensors"))
    return {"path": str(Path(save_dir) / SAFE_WEIGHTS_NAME), "bytes": size, "bf16_bytes": bf16_bytes,
            "fp8_tensors": len(fp8_names)}


class Float8InferenceLinear(nn.Module):
    """A linear layer running a stored FP8 weight directly: y = x @ (weight * weight_scale_inv)^T + bias.

    weight: float8_e4m3fn [out, in]; weight_scale_inv: fp32 [1] (per tensor), [out, 1] (per output channel) or
    [ceil(out/128), ceil(in/128)] (per 128x128 block); bias: [out] or None. The input is cast to E4M3 on the fly
    with its own current scale (per tensor; per row when the weight is per channel, as rowwise `_scaled_mm` needs;
    per 1x128 tile with block scales, as blockwise training casts it, for torch's blockwise GEMM).
    x [..., in] -> [..., out] in the compute dtype. Dims that are not multiples of 16 (128 for blocks) are padded.
    """

    weight: torch.Tensor
    weight_scale_inv: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: bool = False, scaling: str = "tensor",
                 device: Any = None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if scaling not in SCALINGS:
            raise ValueError(f"scaling={scaling!r} must be one of {SCALINGS}")
        self.in_features, self.out_features, self.scaling = in_features, out_features, scaling
        self.register_buffer("weight", torch.zeros(out_features, in_features, device=device, dtype=E4M3))
        shape = {"tensor": (1,), "row": (out_features, 1),
                 "block": (-(-out_features // BLOCK), -(-in_features // BLOCK))}[scaling]
        self.register_buffer("weight_scale_inv", torch.ones(shape, device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device, dtype=dtype) if bias else None)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scaling={self.scaling}"

    def _apply(self, fn: Any, recurse: bool = True) -> Float8InferenceLinear:
        # `.to(dtype)` casts the bias; the FP8 weight and its fp32 scales only follow device moves
        return apply_keeping_dtypes(self, fn, ("weight", "weight_scale_inv"), recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = compute_dtype(x)
        n, k = self.weight.shape
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        if m == 0:
            return x.new_zeros(*x.shape[:-1], n, dtype=out_dtype)
        if self.scaling == "block":
            return self._forward_blocks(x2, out_dtype).reshape(*x.shape[:-1], n)
        mp, kp, np_ = round_up16(m), round_up16(k), round_up16(n)
        xp = F.pad(x2, (0, kp - k, 0, mp - m)) if (mp, kp) != (m, k) else x2.contiguous()
        w, w_si = self.weight, self.weight_scale_inv
        if (np_, kp) != (n, k):  # pad the fp8 bytes (0x00 is +0.0 in E4M3)
            w = F.pad(w.view(torch.uint8), (0, kp - k, 0, np_ - n)).view(E4M3)
            if self.scaling == "row":
                w_si = F.pad(w_si, (0, 0, 0, np_ - n), value=1.0)
        if self.scaling == "row":
            amax = xp.abs().amax(dim=1, keepdim=True).float()
            w_si = w_si.reshape(1, -1)
        else:
            amax = xp.abs().amax().float()
            w_si = w_si.reshape(())
        scale = amax_to_scale(amax, FP8_MAX[E4M3])
        y = scaled_mm(quantize(xp, scale, E4M3), w.t(), scale.reciprocal().contiguous(), w_si, out_dtype,
                      use_fast_accum=True)[:m, :n]
        if self.bias is not None:
            y = y + self.bias.to(out_dtype)
        return y.reshape(*x.shape[:-1], n)

    def _forward_blocks(self, x2: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """x2 [M, K] (1x128 tiles) @ the 128x128-block weight^T -> [M, N] (+ bias)."""
        n, k = self.weight.shape
        np_, kp = -(-n // BLOCK) * BLOCK, -(-k // BLOCK) * BLOCK
        w = self.weight
        if (np_, kp) != (n, k):  # pad the fp8 bytes (0x00 is +0.0 in E4M3)
            w = F.pad(w.view(torch.uint8), (0, kp - k, 0, np_ - n)).view(E4M3)
        xq, _ = quantize_tiles(x2)  # padded to multiples of 128
        wq = FP8Tensor(w, block_scale_buffer(self.weight_scale_inv), Scaling.BLOCK)
        y = fp8_gemm(xq, wq, out_dtype, fast_accum=False)
        y = y[: x2.shape[0], :n]
        return y + self.bias.to(out_dtype) if self.bias is not None else y


def load_fp8_export(path: str | Path, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.bfloat16) -> tuple[TransformerLM, TransformerConfig]:
    """Build the model of an export folder (FP8 or not) on `device`, ready for inference.

    FP8 linears become Float8InferenceLinear modules holding the stored FP8 weights and scales;
    the other tensors are loaded as `dtype` (default bfloat16). Returns (model in eval mode, config).
    """
    path = Path(path)
    if not (path / WEIGHTS).is_file() or not (path / CONFIG).is_file():
        raise ExportFolderError(f"{path} is not an export folder: it needs {WEIGHTS} and {CONFIG} "
                                "(write one with `megadlms export --load CKPT --save DIR [--fp8]`)")
    device = torch.device(device)
    cfg = TransformerConfig.from_dict(json.loads((path / CONFIG).read_text()))
    with open_safetensors(path / WEIGHTS) as f:
        scaling = (f.metadata() or {}).get("megadlms.fp8", "none")
    tensors = load_safetensors(path / WEIGHTS, device=str(device))
    if scaling != "none":
        check_fp8_support(device)
    if scaling == "block" and device.type == "cuda":
        check_blockwise_gemm_support(device.index if device.index is not None else torch.cuda.current_device())
    with torch.device("meta"):
        model = TransformerLM(cfg.replace(fp8=False))
    for name in [k[: -len(".weight_scale_inv")] for k in tensors if k.endswith(".weight_scale_inv")]:
        lin = cast(nn.Linear, model.get_submodule(name))
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, Float8InferenceLinear(
            lin.in_features, lin.out_features, bias=lin.bias is not None, scaling=scaling, device="meta"))
    for k, t in tensors.items():
        if t.is_floating_point() and t.dtype not in (E4M3, torch.float32):
            tensors[k] = t.to(dtype)
        elif t.dtype == torch.float32 and not k.endswith(".weight_scale_inv"):
            tensors[k] = t.to(dtype)
    model.load_state_dict(tensors, strict=True, assign=True)
    # non-persistent tables are not in the file: rebuild them on the device
    model.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_positions, cfg.rotary_base).to(device)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval(), cfg
