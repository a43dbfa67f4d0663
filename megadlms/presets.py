"""Named architectures (`--model-path NAME`) and architecture from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .config import ConfigError, TransformerConfig

_QWEN3 = dict(kv_channels=128, vocab_size=151936, rotary_base=1e6, norm_epsilon=1e-6, qk_layernorm=True,
              max_position_embeddings=40960, mask_token_id=151669)
_LLAMA3 = dict(vocab_size=128256, rotary_base=500000.0, norm_epsilon=1e-5, max_position_embeddings=8192,
               untie_embeddings_and_output_weights=True)

PRESETS: dict[str, dict[str, Any]] = {
    # CPU demo: a few million parameters; vocab_size is set from the bundled tokenizer
    "tiny": dict(num_layers=4, hidden_size=256, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=768,
                 seq_length=256, max_position_embeddings=1024, qk_layernorm=True, rotary_base=10000.0,
                 untie_embeddings_and_output_weights=False, vocab_size=4096),
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
    # LLaDA-8B: Llama-like, full multi-head attention, its own 126464-token vocabulary
    "llada-8b": dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=32,
                     ffn_hidden_size=12288, vocab_size=126464, rotary_base=500000.0, norm_epsilon=1e-5,
                     max_position_embeddings=4096, seq_length=4096, untie_embeddings_and_output_weights=True,
                     mask_token_id=126336),
    # GPT-3 13B shapes (40 layers, hidden 5120, 40 heads) with a SwiGLU MLP of the same width budget
    "megatron-13b": dict(num_layers=40, hidden_size=5120, num_attention_heads=40, num_query_groups=40,
                         ffn_hidden_size=13824, vocab_size=151936, rotary_base=10000.0, norm_epsilon=1e-5,
                         max_position_embeddings=4096, seq_length=4096, untie_embeddings_and_output_weights=True,
                         mask_token_id=151656),
}

HF_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM")


def preset_config(name: str, **overrides: Any) -> TransformerConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)} "
                          "(or give a Hugging Face config.json / a folder holding one)")
    return TransformerConfig(**{**PRESETS[name], **overrides})


def config_from_hf(hf: dict[str, Any], **overrides: Any) -> TransformerConfig:
    """The field mapping of a Qwen3 / Qwen2 / Llama config dict; `load_model_config` adds the checks
    and family defaults of `megadlms.interop.hf.hf_config_to_megadlms`."""
    archs = hf.get("architectures") or [hf.get("model_type", "?")]
    arch = archs[0]
    model_type = hf.get("model_type", "")
    if arch not in HF_ARCHITECTURES and model_type not in ("qwen3", "qwen2", "llama"):
        raise ConfigError(f"unsupported Hugging Face architecture {arch!r} (model_type {model_type!r}); "
                          f"supported: {list(HF_ARCHITECTURES)}")
    family = "qwen3" if "Qwen3" in arch or model_type == "qwen3" else (
        "qwen2" if "Qwen2" in arch or model_type == "qwen2" else "llama")
    heads = hf["num_attention_heads"]
    rope_theta = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    is_causal = hf.get("attn_mask_type", "causal" if "mask_token_id" not in hf else "bidirectional")
    kwargs: dict[str, Any] = dict(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_hidden_size=hf["intermediate_size"], vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        seq_length=min(4096, hf.get("max_position_embeddings", 4096)),
        rotary_base=float(rope_theta), norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        qk_layernorm=family == "qwen3", add_qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        init_method_std=hf.get("initializer_range", 0.02),
        attn_mask_type=is_causal, mask_token_id=hf.get("mask_token_id"),
        extra={"hf_architecture": arch},
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def load_model_config(model_path: str, **overrides: Any) -> TransformerConfig:
    """`--model-path`: a preset name, a Hugging Face config.json, or a folder holding one."""
    if model_path in PRESETS:
        return preset_config(model_path, **overrides)
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
    from .interop.hf import InteropError, hf_config_to_megadlms  # lazy: interop imports this module

    try:  # the interop layer refuses features the model does not implement (RoPE scaling, ...)
        cfg = hf_config_to_megadlms(hf)
    except InteropError as e:
        raise ConfigError(str(e)) from e
    return cfg.replace(**overrides) if overrides else cfg
