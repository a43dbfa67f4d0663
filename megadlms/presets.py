"""Model architectures by name: the presets (`--model-path NAME`) and the translation of Hugging Face
`config.json` dicts to and from `TransformerConfig` (Qwen3 / Qwen2 / Llama, and LLaDA / Dream through
`megadlms.dlm_formats`), in one place.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from . import dlm_formats
from .config import ConfigError, TransformerConfig
from .dlm_formats import (
    DREAM_ARCHITECTURE,
    LLADA_ARCHITECTURE,
    LLADA_MOE_ARCHITECTURE,
    LLADA_MOE_MASK_TOKEN_ID,
    FormatError,
)
from .errors import MegaDLMsError

BUNDLED_VOCAB_SIZE = 4096  # the bundled demo tokenizer's; a preset without a vocab_size takes the tokenizer's

_QWEN3 = dict(kv_channels=128, vocab_size=151936, rotary_base=1e6, norm_epsilon=1e-6, qk_layernorm=True,
              max_position_embeddings=40960, mask_token_id=151669)
_LLAMA3 = dict(vocab_size=128256, rotary_base=500000.0, norm_epsilon=1e-5, max_position_embeddings=8192,
               untie_embeddings_and_output_weights=True)

_LLADA_8B = dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=32, ffn_hidden_size=12288,
                 vocab_size=126464, rotary_base=500000.0, norm_epsilon=1e-5, max_position_embeddings=4096,
                 seq_length=4096, untie_embeddings_and_output_weights=True, mask_token_id=126336,
                 diffusion_loss="full-vocab")

PRESETS: dict[str, dict[str, Any]] = {
    # CPU demo: a few million parameters; vocab_size None: the tokenizer's (see `load_model_config`)
    "tiny": dict(num_layers=4, hidden_size=256, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=768,
                 seq_length=256, max_position_embeddings=1024, qk_layernorm=True, rotary_base=10000.0,
                 untie_embeddings_and_output_weights=False, vocab_size=None),
    # CPU demo of a mixture of experts: tiny's shapes, a dense first layer, then 8 experts (top-2) per layer
    "tiny-moe": dict(num_layers=4, hidden_size=256, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=768,
                     seq_length=256, max_position_embeddings=1024, qk_layernorm=True, rotary_base=10000.0,
                     untie_embeddings_and_output_weights=False, vocab_size=None, num_moe_experts=8,
                     moe_router_topk=2, moe_ffn_hidden_size=192, moe_layer_freq=[0, 1, 1, 1],
                     moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3),
    "qwen3-0.6b": dict(_QWEN3, num_layers=28, hidden_size=1024, num_attention_heads=16, num_query_groups=8,
                       ffn_hidden_size=3072, untie_embeddings_and_output_weights=False, seq_length=4096),
    "qwen3-1.7b": dict(_QWEN3, num_layers=28, hidden_size=2048, num_attention_heads=16, num_query_groups=8,
                       ffn_hidden_size=6144, untie_embeddings_and_output_weights=False, seq_length=4096),
    "qwen3-4b": dict(_QWEN3, num_layers=36, hidden_size=2560, num_attention_heads=32, num_query_groups=8,
                     ffn_hidden_size=9728, untie_embeddings_and_output_weights=False, seq_length=4096),
    "qwen3-8b": dict(_QWEN3, num_layers=36, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                     ffn_hidden_size=12288, untie_embeddings_and_output_weights=True, seq_length=4096),
    "llama3-8b": dict(_LLAMA3, num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                      ffn_hidden_size=14336, seq_length=4096, mask_token_id=128255),
    # LLaDA-8B (Base, Instruct): Llama-like, full multi-head attention, its own 126464-token vocabulary
    "llada-8b": _LLADA_8B,
    # LLaDA 1.5: LLaDA-8B-Instruct after VRPO preference training, the same shapes
    "llada-1.5-8b": _LLADA_8B,
    # Dream-v0-7B (Base, Instruct): Qwen2.5-7B shapes (q/k/v bias, 4 KV heads), the shifted prediction
    "dream-7b": dict(num_layers=28, hidden_size=3584, num_attention_heads=28, num_query_groups=4,
                     ffn_hidden_size=18944, vocab_size=152064, rotary_base=1e6, norm_epsilon=1e-6,
                     max_position_embeddings=131072, seq_length=4096, add_qkv_bias=True,
                     untie_embeddings_and_output_weights=True, mask_token_id=151666, diffusion_shift=True,
                     diffusion_loss="full-vocab"),
    # LLaDA-MoE-7B-A1B (Base, Instruct): OLMoE-like, 16 layers all MoE (64 experts of FFN 1024, top-8, no shared
    # expert, no dense layer), QK norm, untied head; 7.36B parameters, 1.40B active without the input embedding.
    # The sources of each value are in docs/interop.md ("LLaDA-MoE-7B-A1B: the released shapes").
    "llada-moe-7b-a1b": dict(num_layers=16, hidden_size=2048, num_attention_heads=16, num_query_groups=16,
                             ffn_hidden_size=8192, vocab_size=157184, rotary_base=50000.0, norm_epsilon=1e-5,
                             max_position_embeddings=8192, seq_length=4096, qk_layernorm=True,
                             untie_embeddings_and_output_weights=True, mask_token_id=LLADA_MOE_MASK_TOKEN_ID,
                             num_moe_experts=64, moe_router_topk=8, moe_ffn_hidden_size=1024, moe_layer_freq=[1] * 16,
                             moe_router_score_function="softmax", moe_router_pre_softmax=True,
                             moe_aux_loss_coeff=0.01, diffusion_loss="full-vocab"),
    # GPT-3 13B shapes (40 layers, hidden 5120, 40 heads) with a SwiGLU MLP of the same width budget
    "megatron-13b": dict(num_layers=40, hidden_size=5120, num_attention_heads=40, num_query_groups=40,
                         ffn_hidden_size=13824, vocab_size=151936, rotary_base=10000.0, norm_epsilon=1e-5,
                         max_position_embeddings=4096, seq_length=4096, untie_embeddings_and_output_weights=True,
                         mask_token_id=151656),
}

# HF class -> our family name; the family decides the config fields and the bias layout.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "Qwen3ForCausalLM": "qwen3", "Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama",
    LLADA_ARCHITECTURE: "llada", DREAM_ARCHITECTURE: "dream", LLADA_MOE_ARCHITECTURE: "lladamoe"}
# config.json's model_type -> our family
_MODEL_TYPES = {"qwen3": "qwen3", "qwen2": "qwen2", "llama": "llama", "llada": "llada", "Dream": "dream",
                "lladamoe": "lladamoe"}
_FAMILY_ARCHITECTURES = {family: arch for arch, family in SUPPORTED_ARCHITECTURES.items()}
# transformers' class defaults for fields that a config.json may leave out
_FAMILY_DEFAULTS = {"qwen3": {"max_position_embeddings": 32768, "head_dim": 128},
                    "qwen2": {"max_position_embeddings": 32768},
                    "llama": {"max_position_embeddings": 2048},
                    "dream": {"max_position_embeddings": 32768}}
# `megadlms convert megadlms-to-hf --hf-format`: as imported (auto), the stock transformers class, or a DLM's own
HF_FORMATS = ("auto", "stock", "llada", "dream", "lladamoe")


class InteropError(MegaDLMsError, ValueError):
    """A Hugging Face checkpoint and the architecture disagree; the message names the tensor/field and the fix."""



def preset_config(name: str, *, tokenizer_vocab_size: int | None = None, **overrides: Any) -> TransformerConfig:
    """The preset `name`; a preset whose vocab_size is None takes `tokenizer_vocab_size` (default: the bundled
    tokenizer's)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)} "
                          "(or give a Hugging Face config.json / a folder holding one)")
    fields = dict(PRESETS[name])
    if fields.get("vocab_size") is None:
        fields["vocab_size"] = tokenizer_vocab_size or BUNDLED_VOCAB_SIZE
    return TransformerConfig(**{**fields, **overrides})


def load_model_config(model_path: str, *, tokenizer_vocab_size: int | None = None,
                      **overrides: Any) -> TransformerConfig:
    """`--model-path`: a preset name, a Hugging Face config.json, or a folder holding one.

    tokenizer_vocab_size: the vocabulary of the run's tokenizer, taken by presets that leave vocab_size open.
    """
    if model_path in PRESETS:
        return preset_config(model_path, tokenizer_vocab_size=tokenizer_vocab_size, **overrides)
    p = Path(model_path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(f"--model-path {model_path!r} is neither a preset ({', '.join(sorted(PRESETS))}) "
                          "nor a config.json / a folder holding one")
    try:
        hf = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p} is not valid JSON: {e}") from e
    try:  # refuses features the model does not implement (RoPE scaling, ...)
        cfg = hf_config_to_megadlms(hf)
    except InteropError as e:
        raise ConfigError(str(e)) from e
    return cfg.replace(**overrides) if overrides else cfg


# ------------------------------------------------------------------------------- Hugging Face config.json


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The config.json of a Hugging Face model folder (or the file itself) as a dict."""
    p = Path(path)
    f = p / "config.json" if p.is_dir() else p
    if not f.is_file():
        raise InteropError(f"no config.json in {str(p)!r}; pass a local Hugging Face model folder (hub names "
                           "are not fetched: download it first, e.g. `hf download NAME --local-dir DIR`)")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise InteropError(f"{f} is not valid JSON: {e}") from e


def hf_family(hf: Mapping[str, Any]) -> str:
    """'qwen3' | 'qwen2' | 'llama' | 'llada' | 'dream' | 'lladamoe' for a supported config dict; InteropError
    otherwise."""
    archs = hf.get("architectures") or []
    if archs:
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise InteropError(f"unsupported Hugging Face architecture {arch!r} (config.json 'architectures'); "
                               f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        return SUPPORTED_ARCHITECTURES[arch]
    model_type = hf.get("model_type")
    if model_type == "llada" and "num_experts" in hf:  # LLaDA-MoE's released config.json says "llada"
        return "lladamoe"
    if model_type not in _MODEL_TYPES:
        raise InteropError(f"unsupported Hugging Face model_type {model_type!r} and no 'architectures' in "
                           f"config.json; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    return _MODEL_TYPES[model_type]


def _check_supported_features(hf: Mapping[str, Any], family: str) -> None:
    """Refuse config features the stock families allow but our model does not implement."""
    quant = hf.get("quantization_config")
    if quant:  # e.g. `megadlms export --hf --fp8`: E4M3 weights with scales, which our layers would read as plain
        method = quant.get("quant_method") if isinstance(quant, Mapping) else quant
        raise InteropError(f"quantized weights (quantization_config, quant_method {method!r}) are not supported; "
                           "use a BF16 / FP32 export (`megadlms convert megadlms-to-hf`, or `megadlms export --hf` "
                           "without --fp8); FP8 inference weights run from a `megadlms export --fp8` folder "
                           "(--fp8-export DIR)")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise InteropError(f"hidden_act={act!r} is not supported; the MLP is SwiGLU (hidden_act 'silu')")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, Mapping) else rope
    if rope_type not in (None, "default"):
        raise InteropError(f"RoPE scaling {rope_type!r} (config.json rope_parameters/rope_scaling) is not "
                           "supported; only plain RoPE ('default') is implemented")
    prf = (rope.get("partial_rotary_factor") if isinstance(rope, Mapping) else None) or hf.get("partial_rotary_factor")
    if prf not in (None, 1, 1.0):
        raise InteropError(f"partial_rotary_factor={prf} is not supported; RoPE covers the whole head (1.0)")
    if family in ("qwen3", "llama") and hf.get("attention_bias", False):
        raise InteropError(f"attention_bias=true in a {family} config puts a bias on o_proj too, which is not "
                           "supported (only q/k/v biases, as Qwen2 has)")
    if hf.get("mlp_bias", False):
        raise InteropError("mlp_bias=true is not supported; the MLP projections have no bias")
    if family in ("qwen3", "qwen2", "dream") and hf.get("use_sliding_window", False):
        layer_types = hf.get("layer_types")
        n = hf["num_hidden_layers"]
        sliding = ("sliding_attention" in layer_types) if layer_types else n > hf.get("max_window_layers", n)
        if sliding:
            raise InteropError("use_sliding_window=true with sliding-window layers is not supported; every layer "
                               "attends to the full sequence (set use_sliding_window false if it was never used)")


def hf_config_to_megadlms(hf: Mapping[str, Any], *, attn_mask_type: str | None = None,
                          mask_token_id: int | None = None) -> TransformerConfig:
    """A TransformerConfig for a Qwen3 / Qwen2 / Llama config.json dict.

    attn_mask_type: None -> the config's own record (`attn_mask_type`, or `is_causal: false`), else causal.
    The original bos/eos/pad ids and architecture are kept in `cfg.extra` for a faithful export.
    """
    family = hf_family(hf)
    if family in ("llada", "lladamoe"):
        return _llada_to_megadlms(hf, attn_mask_type=attn_mask_type, mask_token_id=mask_token_id,
                                  moe=family == "lladamoe")
    _check_supported_features(hf, family)
    defaults = _FAMILY_DEFAULTS[family]
    if attn_mask_type is None:  # Dream's attention is bidirectional whatever the config says
        attn_mask_type = hf.get("attn_mask_type") or ("bidirectional" if hf.get("is_causal") is False
                                                      or family == "dream" else "causal")
    heads = hf["num_attention_heads"]
    max_pos = hf.get("max_position_embeddings") or defaults["max_position_embeddings"]
    rope_theta = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    extra: dict[str, Any] = {"hf_architecture": _FAMILY_ARCHITECTURES[family], "hf_token_ids": _token_ids(hf)}
    kwargs: dict[str, Any] = dict(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or defaults.get("head_dim") or hf["hidden_size"] // heads,
        ffn_hidden_size=hf["intermediate_size"], vocab_size=hf["vocab_size"],
        max_position_embeddings=max_pos, seq_length=_imported_length(max_pos, None),
        rotary_base=float(rope_theta), norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        qk_layernorm=family == "qwen3", add_qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        init_method_std=hf.get("initializer_range", 0.02), attn_mask_type=attn_mask_type,
        mask_token_id=hf.get("mask_token_id") if mask_token_id is None else mask_token_id, extra=extra)
    block = hf.get("block_size") if hf.get("model_running_mode") == "bd3lm" else None
    if block:  # a block-diffusion export; its windows hold whole blocks
        kwargs.update(block_size=block, seq_length=_imported_length(max_pos, block))
    kwargs.update(_trained_length(hf))
    if hf.get("model_running_mode") == "difflm-shift":  # written by our export: keep the logits' alignment
        kwargs["diffusion_shift"] = True
    if hf.get("diffusion_loss") is not None:  # written by our export: the loss the model trained with
        kwargs["diffusion_loss"] = hf["diffusion_loss"]
    if family == "dream":
        kwargs.update(dlm_formats.dream_overrides(hf))
        if mask_token_id is not None:
            kwargs["mask_token_id"] = mask_token_id
        extra["hf_config"] = dict(hf)  # written back on export, with the fields we do not interpret
    try:
        return TransformerConfig(**kwargs)
    except ConfigError as e:
        raise InteropError(f"config.json does not give a valid model: {e}") from e


# config.json's record of the sequence length the model was trained at (Megatron's and our name), which our export
# writes: an import, and `eval --hf-model`, score and fine-tune at that length, not at max_position_embeddings
TRAINED_LENGTH_FIELD = "seq_length"


def _imported_length(max_pos: int, block: int | None) -> int:
    """The sequence length an import takes where config.json records none: min(4096, max_position_embeddings),
    whole blocks for a block-diffusion model."""
    length = min(4096, max_pos)
    return length // block * block if block else length


def _trained_length(hf: Mapping[str, Any]) -> dict[str, Any]:
    """{'seq_length': the trained length} when config.json records it (our export does), else {}."""
    length = hf.get(TRAINED_LENGTH_FIELD)
    if length is None:
        return {}
    if not isinstance(length, int) or isinstance(length, bool) or length <= 0:
        raise InteropError(f"{TRAINED_LENGTH_FIELD}={length!r} must be a positive integer (the sequence length "
                           "the model was trained at); fix it or delete the field")
    return {"seq_length": length}


def _token_ids(hf: Mapping[str, Any]) -> dict[str, Any]:
    return {k: hf.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}


def _llada_to_megadlms(hf: Mapping[str, Any], *, attn_mask_type: str | None,
                       mask_token_id: int | None, moe: bool = False) -> TransformerConfig:
    """A TransformerConfig for a LLaDA or LLaDA-MoE config.json dict (bidirectional unless asked otherwise)."""
    name = "LLaDA-MoE" if moe else "LLaDA"
    try:
        fields = dlm_formats.lladamoe_fields(hf) if moe else dlm_formats.llada_fields(hf)
    except FormatError as e:
        raise InteropError(f"{name} config.json: {e}") from e
    except KeyError as e:
        raise InteropError(f"{name} config.json has no {e.args[0]!r} field, which the format requires") from e
    extra = {"hf_architecture": LLADA_MOE_ARCHITECTURE if moe else LLADA_ARCHITECTURE, "hf_token_ids": _token_ids(hf),
             "hf_config": dict(hf)}
    fields.setdefault("mask_token_id", hf.get("mask_token_id"))
    if mask_token_id is not None:
        fields["mask_token_id"] = mask_token_id
    fields.update(_trained_length(hf))
    try:  # LLaDA and LLaDA-MoE were trained, and score likelihoods, with the full-vocabulary CE
        return TransformerConfig(**fields, attn_mask_type=attn_mask_type or "bidirectional",
                                 diffusion_loss="full-vocab", extra=extra)
    except ConfigError as e:
        raise InteropError(f"config.json does not give a valid model: {e}") from e


def hf_architecture(cfg: TransformerConfig, hf_format: str = "auto") -> str:
    """The Hugging Face class an export of `cfg` names: with hf_format 'auto', LLaDA's, Dream's or LLaDA-MoE's when
    the model was imported from one (`cfg.extra['hf_architecture']`), LLaDA-MoE's for any mixture of experts,
    else the stock transformers class that computes exactly what `cfg` does; 'stock', 'llada', 'dream',
    'lladamoe' ask for one."""
    if hf_format not in HF_FORMATS:
        raise InteropError(f"hf_format={hf_format!r} is not one of {list(HF_FORMATS)}")
    own = {"llada": LLADA_ARCHITECTURE, "dream": DREAM_ARCHITECTURE, "lladamoe": LLADA_MOE_ARCHITECTURE}
    if hf_format in own:
        return own[hf_format]
    recorded = (cfg.extra or {}).get("hf_architecture")
    if hf_format == "auto" and recorded in own.values():
        return str(recorded)
    if cfg.is_moe:  # the one mixture-of-experts format written
        if hf_format == "stock":
            raise InteropError("a mixture-of-experts model has no stock transformers architecture here; export with "
                               "--hf-format lladamoe (LLaDA-MoE's format)")
        return LLADA_MOE_ARCHITECTURE
    if cfg.qk_layernorm and cfg.add_qkv_bias:
        raise InteropError("qk_layernorm=True together with add_qkv_bias=True has no stock transformers "
                           "architecture (Qwen3 has QK norm without biases, Qwen2 biases without QK norm)")
    if cfg.qk_layernorm:
        return "Qwen3ForCausalLM"
    return "Qwen2ForCausalLM" if cfg.add_qkv_bias else "LlamaForCausalLM"


def megadlms_config_to_hf(cfg: TransformerConfig, *, dtype: torch.dtype = torch.float32,
                          token_ids: Mapping[str, int | None] | None = None, hf_format: str = "auto"
                          ) -> dict[str, Any]:
    """The config.json dict of the stock architecture for `cfg` (plus `mask_token_id`, `attn_mask_type`,
    `model_running_mode`, `diffusion_loss` when the model records one, for a block-diffusion model `block_size`,
    and in every format `seq_length`, the length it was trained at, which an import reads back, where it is not
    the min(4096, max_position_embeddings) an import takes without it).

    A bidirectional model also gets `is_causal: false`, which transformers >= 5 honours when building
    the attention mask, so `AutoModelForCausalLM.from_pretrained` runs it bidirectionally as saved.
    Token ids: those recorded at import (`cfg.extra['hf_token_ids']`, e.g. Llama 3's list of eos ids)
    win; `token_ids` (bos/eos/pad resolved from the tokenizer) fill the ones not recorded.
    hf_format: see `hf_architecture`; LLaDA's and Dream's own config.json (`megadlms.dlm_formats`) keep the fields
    of the config.json the model was imported from.
    """
    arch = hf_architecture(cfg, hf_format)
    ids = {k: v for k, v in (token_ids or {}).items() if v is not None}
    ids.update({k: v for k, v in ((cfg.extra or {}).get("hf_token_ids") or {}).items() if v is not None})
    source = (cfg.extra or {}).get("hf_config")
    try:
        if arch == LLADA_ARCHITECTURE:
            hf = dlm_formats.llada_config(cfg.to_dict(), source=source, token_ids=ids)
        elif arch == LLADA_MOE_ARCHITECTURE:
            hf = dlm_formats.lladamoe_config(cfg.to_dict(), source=source, token_ids=ids)
        elif arch == DREAM_ARCHITECTURE:
            qwen2 = _stock_config(cfg, "Qwen2ForCausalLM", dtype, ids)
            hf = dlm_formats.dream_config(qwen2, cfg.to_dict(), source=source)
        else:
            hf = _stock_config(cfg, arch, dtype, ids)
    except FormatError as e:
        raise InteropError(f"cannot export as {arch}: {e}") from e
    default = _imported_length(cfg.max_position_embeddings or cfg.seq_length, cfg.block_size)
    if cfg.seq_length != default:  # read back by an import (`_trained_length`); else the file stays as imported
        hf[TRAINED_LENGTH_FIELD] = cfg.seq_length
    return hf


def _stock_config(cfg: TransformerConfig, arch: str, dtype: torch.dtype, ids: Mapping[str, Any]) -> dict[str, Any]:
    """The config.json dict of the stock transformers class `arch` for `cfg`."""
    family = SUPPORTED_ARCHITECTURES[arch]
    n = cfg.num_layers
    hf: dict[str, Any] = {
        "architectures": [arch], "model_type": family,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": n, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups, "head_dim": cfg.kv_channels, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings, "initializer_range": cfg.init_method_std,
        "rms_norm_eps": cfg.norm_epsilon, "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
        # rope_parameters for transformers 5, rope_theta for 4.x readers
        "rope_parameters": {"rope_type": "default", "rope_theta": float(cfg.rotary_base)},
        "rope_theta": float(cfg.rotary_base),
        "attention_dropout": 0.0, "use_cache": True,
        "bos_token_id": ids.get("bos_token_id"), "eos_token_id": ids.get("eos_token_id"),
        "pad_token_id": ids.get("pad_token_id"),
        "dtype": str(dtype).removeprefix("torch."),
        "mask_token_id": cfg.mask_token_id, "attn_mask_type": cfg.attn_mask_type,
        "model_running_mode": cfg.running_mode,
    }
    if cfg.diffusion_loss is not None:
        hf["diffusion_loss"] = cfg.diffusion_loss
    if cfg.attn_mask_type == "bidirectional":
        hf["is_causal"] = False
    if cfg.block_size is not None:  # block diffusion: its sampler needs the block size
        hf.update(block_size=cfg.block_size)
    if family in ("qwen3", "qwen2"):
        hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=n,
                  layer_types=["full_attention"] * n)
    if family in ("qwen3", "llama"):
        hf["attention_bias"] = False
    if family == "llama":
        hf.update(mlp_bias=False, pretraining_tp=1)
    return hf
