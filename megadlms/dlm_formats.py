"""The config.json formats of the field's own diffusion models: LLaDA (`LLaDAModelLM`) and Dream (`DreamModel`).

Both are read and written without their modeling code (which ships with the models, `trust_remote_code`):

- **LLaDA** (GSAI-ML/LLaDA-8B-Base, -Instruct, LLaDA-1.5): an OLMo descendant with its own field names
  (`d_model`, `n_heads`, `n_kv_heads`, `n_layers`, `mlp_hidden_size`, `embedding_size`, `weight_tying`, ...).
  Block type `llama`: separate q/k/v and a SwiGLU MLP whose `ff_proj` is the gate and `up_proj` the up
  projection, so `mlp_hidden_size` is the FFN width. Block type `sequential`: q/k/v fused in `att_proj` and
  gate/up fused in `ff_proj` as [up; gate] (its `swiglu` activation splits the output in halves and gates the
  first with the second), so the FFN width is `mlp_hidden_size / 2`. Attention is always bidirectional; RMSNorm
  everywhere; no position embeddings but RoPE.
- **Dream** (Dream-org/Dream-v0-Base-7B, -Instruct-7B): Qwen2.5's config fields and tensor names, q/k/v with
  bias, bidirectional attention, and the shifted prediction (the logits at position i predict token i + 1).
- **LLaDA-MoE** (inclusionAI/LLaDA-MoE-7B-A1B-Base, -Instruct; `LLaDAMoEModelLM`): OLMoE-style names
  (`model.layers.N.mlp.gate`, `mlp.experts.E.{gate,up,down}_proj`, a layer-level `shared_expert`), QK norm per
  head, dense layers where `moe_layer_freq[i]` is 0. Its router is a softmax over all experts whose top-k
  probabilities are the weights, not renormalised (`moe_router_pre_softmax`); its forward ignores
  `norm_topk_prob`, `routed_scaling_factor`, `moe_router_score_function` and the router groups, and so does the
  import (they are kept for the export). The released config.json says `model_type: "llada"` (the class of its
  `configuration_lladamoe.py` is `LLaDAConfig`) and names no mask token: the import takes 156895, the export
  writes `model_type` as the source had it.

An import keeps the source's config.json in `cfg.extra['hf_config']`, so an export writes back the fields this
module does not interpret (`init_fn`, `precision`, ...) as the original had them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

LLADA_ARCHITECTURE = "LLaDAModelLM"
DREAM_ARCHITECTURE = "DreamModel"
LLADA_MOE_ARCHITECTURE = "LLaDAMoEModelLM"
# the architectures whose modeling code is not in transformers: exported in their own format, checked by name
OWN_FORMAT_ARCHITECTURES = (LLADA_ARCHITECTURE, DREAM_ARCHITECTURE, LLADA_MOE_ARCHITECTURE)
LLADA_AUTO_MAP = {"AutoConfig": "configuration_llada.LLaDAConfig",
                  "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
                  "AutoModel": "modeling_llada.LLaDAModelLM"}
DREAM_AUTO_MAP = {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"}
LLADA_MOE_AUTO_MAP = {"AutoConfig": "configuration_lladamoe.LLaDAMoEConfig",
                      "AutoModel": "modeling_lladamoe.LLaDAMoEModelLM",
                      "AutoModelForCausalLM": "modeling_lladamoe.LLaDAMoEModelLM"}
LLADA_MASK_TOKEN_ID = 126336
DREAM_MASK_TOKEN_ID = 151666
LLADA_MOE_MASK_TOKEN_ID = 156895  # `<|mask|>` of its tokenizer; its config.json does not record it
LLADA_BLOCK_TYPES = ("llama", "sequential")

# LLaDA's config.json as GSAI-ML/LLaDA-8B-Base writes it, less the shapes (filled from the model): what an export
# of a model that was not imported from LLaDA starts from.
_LLADA_TEMPLATE: dict[str, Any] = {
    "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0, "architectures": [LLADA_ARCHITECTURE],
    "attention_dropout": 0.0, "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
    "auto_map": LLADA_AUTO_MAP, "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama",
    "embedding_dropout": 0.0, "flash_attention": False, "include_bias": False, "include_qkv_bias": False,
    "init_cutoff_factor": None, "init_device": "meta", "init_fn": "mitchell", "init_std": 0.02,
    "input_emb_norm": False, "layer_norm_type": "rms", "layer_norm_with_affine": True, "mlp_ratio": 4,
    "model_type": "llada", "multi_query_attention": None, "precision": "amp_bf16", "residual_dropout": 0.0,
    "rope": True, "rope_full_precision": True, "scale_logits": False, "use_cache": False,
}

# LLaDA options that change the computation away from what TransformerLM does: field -> (LLaDA's default when
# config.json leaves it out, the value it must have, what another value would mean). Checked on import, so no
# such checkpoint is converted wrongly.
_LLADA_REQUIRED: dict[str, tuple[Any, Any, str]] = {
    "alibi": (False, False, "ALiBi position biases instead of RoPE"),
    "rope": (False, True, "no rotary embeddings"),
    "include_bias": (False, False, "biases on every linear layer and norm"),
    "attention_layer_norm": (False, False, "a LayerNorm over the whole q and k projections"),
    "input_emb_norm": (False, False, "embeddings scaled by sqrt(d_model)"),
    "scale_logits": (False, False, "logits scaled by 1/sqrt(d_model)"),
    "layer_norm_type": ("default", "rms", "a norm other than RMSNorm"),
    "layer_norm_with_affine": (True, True, "norms without a weight"),
    "block_group_size": (1, 1, "blocks stored in groups (`block_groups.N` names)"),
}


class FormatError(ValueError):
    """A config.json of a known format asks for something the model does not implement (raised as InteropError
    by the callers in `megadlms.presets`)."""


def dlm_format(hf: Mapping[str, Any]) -> str | None:
    """'llada' | 'dream' | 'lladamoe' for a config.json dict of those models (by `architectures`, else
    `model_type`), else None."""
    archs = hf.get("architectures") or []
    if archs:
        return {LLADA_ARCHITECTURE: "llada", DREAM_ARCHITECTURE: "dream", LLADA_MOE_ARCHITECTURE: "lladamoe"}.get(
            archs[0])
    if hf.get("model_type") == "llada" and "num_experts" in hf:  # LLaDA-MoE's released config.json
        return "lladamoe"
    return {"llada": "llada", "Dream": "dream", "lladamoe": "lladamoe"}.get(str(hf.get("model_type")))


def llada_block_type(hf: Mapping[str, Any]) -> str:
    """The block type of a LLaDA config dict ('llama' or 'sequential'); FormatError for another."""
    block = hf.get("block_type", "sequential")  # LLaDA's ModelConfig default
    if block not in LLADA_BLOCK_TYPES:
        raise FormatError(f"block_type={block!r} is not supported; LLaDA's block types 'llama' (separate q/k/v, "
                          "ff_proj + up_proj) and 'sequential' (fused att_proj, ff_proj) are")
    return block


def _kv_heads(hf: Mapping[str, Any]) -> int:
    """LLaDA's effective_n_kv_heads."""
    heads, kv, mqa = hf["n_heads"], hf.get("n_kv_heads"), hf.get("multi_query_attention")
    if kv is None:
        return 1 if mqa else heads
    if mqa is not None and kv != (1 if mqa else heads):
        raise FormatError(f"n_kv_heads={kv} contradicts multi_query_attention={mqa}; set one of them")
    return kv


def llada_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """TransformerConfig fields (Megatron names) for a LLaDA config.json dict; FormatError for an option the
    model does not implement, naming the field and the value."""
    for key, (default, want, meaning) in _LLADA_REQUIRED.items():
        got = hf.get(key, default)
        if got != want:
            raise FormatError(f"{key}={got!r} ({meaning}) is not supported; LLaDA's released models have "
                              f"{key}={want!r}")
    if hf.get("bias_for_layer_norm"):
        raise FormatError("bias_for_layer_norm=true (biases on the norms) is not supported; LLaDA's released "
                          "models have none")
    block = llada_block_type(hf)
    act = hf.get("activation_type", "swiglu")
    want_act = "silu" if block == "llama" else "swiglu"
    if act != want_act:
        raise FormatError(f"activation_type={act!r} with block_type={block!r} is not a gated SiLU MLP; "
                          f"block_type {block!r} needs activation_type {want_act!r}")
    d, heads = hf["d_model"], hf["n_heads"]
    if d % heads:
        raise FormatError(f"d_model={d} is not divisible by n_heads={heads}")
    width = hf.get("mlp_hidden_size") or hf.get("mlp_ratio", 4) * d
    if block == "sequential" and width % 2:
        raise FormatError(f"mlp_hidden_size={width} must be even for block_type 'sequential' (ff_proj holds the "
                          "up and gate projections, half each)")
    rows = hf.get("embedding_size") or hf["vocab_size"]
    if rows < hf["vocab_size"]:
        raise FormatError(f"embedding_size={rows} is smaller than vocab_size={hf['vocab_size']}")
    max_pos = hf.get("max_sequence_length", 1024)
    return dict(
        num_layers=hf["n_layers"], hidden_size=d, num_attention_heads=heads, num_query_groups=_kv_heads(hf),
        kv_channels=d // heads, ffn_hidden_size=width if block == "llama" else width // 2, vocab_size=rows,
        max_position_embeddings=max_pos, seq_length=min(4096, max_pos),
        rotary_base=float(hf.get("rope_theta", 10000.0)), norm_epsilon=hf.get("rms_norm_eps", 1e-5),
        qk_layernorm=False, add_qkv_bias=bool(hf.get("include_qkv_bias", False)),
        untie_embeddings_and_output_weights=not hf.get("weight_tying", True),
        init_method_std=hf.get("init_std", 0.02))


def llada_config(fields: Mapping[str, Any], *, source: Mapping[str, Any] | None = None,
                 token_ids: Mapping[str, int | None] | None = None) -> dict[str, Any]:
    """The LLaDA config.json dict for a model of TransformerConfig `fields` (a `to_dict()`).

    source: the config.json it was imported from (its other fields and block type are kept), else LLaDA-8B's.
    FormatError when the model is not one LLaDA's code computes (QK norm, a head dim other than d_model/n_heads,
    causal attention, the shifted prediction, block diffusion).
    """
    _refuse(fields, "LLaDA", shift_ok=False)
    d, heads = fields["hidden_size"], fields["num_attention_heads"]
    if fields["kv_channels"] * heads != d:
        raise FormatError(f"kv_channels={fields['kv_channels']} with hidden_size={d} and {heads} heads: LLaDA's "
                          "head dim is d_model / n_heads; export with --hf-format stock instead")
    src = dict(source) if source is not None and dlm_format(source) == "llada" else {}
    out = {**_LLADA_TEMPLATE, **src}
    block = llada_block_type(out)
    rows = fields["vocab_size"]
    vocab = src.get("vocab_size", rows)
    out.update(
        architectures=[LLADA_ARCHITECTURE], model_type="llada", auto_map=out.get("auto_map") or LLADA_AUTO_MAP,
        activation_type="silu" if block == "llama" else "swiglu", d_model=d, n_heads=heads,
        n_kv_heads=fields["num_query_groups"], multi_query_attention=None, n_layers=fields["num_layers"],
        mlp_hidden_size=fields["ffn_hidden_size"] * (1 if block == "llama" else 2),
        vocab_size=vocab if vocab <= rows else rows, embedding_size=rows,
        max_sequence_length=fields["max_position_embeddings"], rope_theta=float(fields["rotary_base"]),
        rms_norm_eps=fields["norm_epsilon"], include_qkv_bias=bool(fields["add_qkv_bias"]),
        weight_tying=not fields["untie_embeddings_and_output_weights"], init_std=fields["init_method_std"],
        mask_token_id=fields["mask_token_id"])
    for key in ("eos_token_id", "pad_token_id"):
        if (token_ids or {}).get(key) is not None:
            out[key] = token_ids[key]  # type: ignore[index]
    return dict(sorted(out.items()))


def dream_overrides(hf: Mapping[str, Any]) -> dict[str, Any]:
    """TransformerConfig fields in which a Dream config.json differs from a Qwen2 one: q/k/v biases whatever
    `attention_bias` says (Dream's attention always has them), the shift, its mask token, and the full-vocabulary
    CE it was trained with."""
    return dict(add_qkv_bias=True, diffusion_shift=True, mask_token_id=hf.get("mask_token_id", DREAM_MASK_TOKEN_ID),
                diffusion_loss="full-vocab")


def dream_config(qwen2: Mapping[str, Any], fields: Mapping[str, Any], *,
                 source: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The Dream config.json dict from the Qwen2 one `qwen2` of a model of TransformerConfig `fields`.

    source: the config.json it was imported from (fields not set here are kept). FormatError when Dream's code
    would compute something else (no q/k/v bias, QK norm, causal attention, no shift, another head dim).
    """
    _refuse(fields, "Dream", shift_ok=True)
    if not fields["diffusion_shift"]:
        raise FormatError("the model predicts without the shift (difflm-noshift); Dream's samplers read the logits "
                          "at position i as the prediction of token i + 1: export with --hf-format stock or llada")
    if not fields["add_qkv_bias"]:
        raise FormatError("the model has no q/k/v biases, which Dream's attention always has; export with "
                          "--hf-format stock")
    if fields["kv_channels"] * fields["num_attention_heads"] != fields["hidden_size"]:
        raise FormatError(f"kv_channels={fields['kv_channels']}: Dream's head dim is hidden_size / "
                          "num_attention_heads; export with --hf-format stock")
    src = dict(source) if source is not None and dlm_format(source) == "dream" else {}
    out = {**src, **qwen2}
    for key in ("attn_mask_type", "model_running_mode", "diffusion_loss", "is_causal", "layer_types", "head_dim",
                "dtype"):
        out.pop(key, None)  # Dream's code takes none of these; attention is always bidirectional
    if "max_window_layers" in src:  # inert without a sliding window: as the original has it
        out["max_window_layers"] = src["max_window_layers"]
    out.update(architectures=[DREAM_ARCHITECTURE], model_type="Dream",
               auto_map=src.get("auto_map") or DREAM_AUTO_MAP, rope_scaling=None, use_cache=False,
               torch_dtype=qwen2.get("dtype"))  # the field's name in the transformers 4.x its code is written for
    out.pop("rope_parameters", None)  # a transformers 5 field; Dream's code reads rope_theta / rope_scaling
    return dict(sorted(out.items()))


def lladamoe_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """TransformerConfig fields for a LLaDA-MoE config.json dict; FormatError for what the model does not
    implement (o_proj bias, q/k/v clipping, partial RoPE, the expert bias, a moe_layer_freq not one 0/1 per layer)."""
    if hf.get("attention_bias"):
        raise FormatError("attention_bias=true (biases on q/k/v and o_proj) is not supported; the released "
                          "LLaDA-MoE models have none")
    if hf.get("clip_qkv") is not None:
        raise FormatError(f"clip_qkv={hf['clip_qkv']} (clamped q/k/v) is not supported; set it to null")
    prf = hf.get("partial_rotary_factor", 1.0)
    if prf not in (1, 1.0):
        raise FormatError(f"partial_rotary_factor={prf} is not supported; RoPE covers the whole head (1.0)")
    rope = hf.get("rope_scaling")
    if rope:
        kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, Mapping) else rope
        raise FormatError(f"rope_scaling {kind!r} is not supported; only plain RoPE (rope_scaling null) is "
                          "implemented")
    if hf.get("moe_router_enable_expert_bias"):
        raise FormatError("moe_router_enable_expert_bias=true is not supported: LLaDA-MoE adds that bias to the "
                          "routing weights too, which the MoE layer here does not")
    if hf.get("hidden_act", "silu") != "silu":
        raise FormatError(f"hidden_act={hf['hidden_act']!r} is not supported; the MLPs are SwiGLU ('silu')")
    n = hf["num_hidden_layers"]
    freq = hf.get("moe_layer_freq")
    if not isinstance(freq, list) or len(freq) != n or any(f not in (0, 1) for f in freq):
        raise FormatError(f"moe_layer_freq={freq!r} must list 0 (dense) or 1 (MoE) for each of the {n} layers")
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    if d % heads:
        raise FormatError(f"hidden_size={d} is not divisible by num_attention_heads={heads}")
    max_pos = hf.get("max_position_embeddings", 4096)
    shared = hf.get("shared_expert_intermediate_size")
    return dict(
        num_layers=n, hidden_size=d, num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads, kv_channels=d // heads,
        ffn_hidden_size=hf["dense_intermediate_size"], vocab_size=hf["vocab_size"], max_position_embeddings=max_pos,
        seq_length=min(4096, max_pos), rotary_base=float(hf["rope_theta"]), norm_epsilon=hf.get("rms_norm_eps", 1e-5),
        qk_layernorm=bool(hf.get("qk_layernorm")), add_qkv_bias=False,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        init_method_std=hf.get("initializer_range", 0.02), num_moe_experts=hf["num_experts"],
        moe_router_topk=hf["num_experts_per_tok"], moe_ffn_hidden_size=hf["expert_intermediate_size"],
        moe_shared_expert_intermediate_size=shared if shared and shared > 0 else None, moe_layer_freq=list(freq),
        moe_router_score_function="softmax", moe_router_pre_softmax=True,
        mask_token_id=hf.get("mask_token_id", LLADA_MOE_MASK_TOKEN_ID))


# LLaDAMoEConfig's fields that an export of a model not imported from LLaDA-MoE writes as the class defaults them
_LLADA_MOE_TEMPLATE: dict[str, Any] = {
    "architectures": [LLADA_MOE_ARCHITECTURE], "model_type": "lladamoe", "auto_map": LLADA_MOE_AUTO_MAP,
    "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "clip_qkv": None, "use_cache": False,
    "output_router_logits": False, "router_aux_loss_coef": 0.01, "norm_topk_prob": None,
    "moe_router_enable_expert_bias": None, "moe_router_score_function": None, "routed_scaling_factor": 1,
    "router_num_group": -2, "router_topk_group": -2, "partial_rotary_factor": 1.0, "rope_scaling": None,
}


def lladamoe_config(fields: Mapping[str, Any], *, source: Mapping[str, Any] | None = None,
                    token_ids: Mapping[str, int | None] | None = None) -> dict[str, Any]:
    """The LLaDA-MoE config.json dict for a model of TransformerConfig `fields`; FormatError when LLaDA-MoE's code
    would compute something else (another router, q/k/v bias, a head dim other than hidden / heads, ...)."""
    _refuse(fields, "LLaDA-MoE", shift_ok=False, qk_norm_ok=True, moe_ok=True)
    if fields["num_moe_experts"] is None:
        raise FormatError("the model has no experts (num_moe_experts is None); export with --hf-format llada")
    if fields["add_qkv_bias"]:
        raise FormatError("the model has q/k/v biases, which LLaDA-MoE's attention has only with o_proj's")
    d, heads = fields["hidden_size"], fields["num_attention_heads"]
    if fields["kv_channels"] * heads != d:
        raise FormatError(f"kv_channels={fields['kv_channels']}: LLaDA-MoE's head dim is hidden_size / heads")
    router = (fields["moe_router_score_function"], fields["moe_router_pre_softmax"],
              fields["moe_router_topk_scaling_factor"], fields["moe_router_enable_expert_bias"])
    if router != ("softmax", True, None, False):
        raise FormatError(f"the router (score {router[0]}, pre-softmax {router[1]}, scaling {router[2]}, expert "
                          f"bias {router[3]}) is not LLaDA-MoE's (a softmax over all experts, the top-k "
                          "probabilities as weights, no scaling, no bias)")
    n = fields["num_layers"]
    freq = fields["moe_layer_freq"]
    pattern = list(freq) if isinstance(freq, list) else [int(i % freq == 0) for i in range(n)]
    src = dict(source) if source is not None and dlm_format(source) == "lladamoe" else {}
    out = {**_LLADA_MOE_TEMPLATE, **src}
    out.update(
        architectures=[LLADA_MOE_ARCHITECTURE], model_type=src.get("model_type", "lladamoe"),
        auto_map=out.get("auto_map") or LLADA_MOE_AUTO_MAP,
        vocab_size=fields["vocab_size"], hidden_size=d, num_hidden_layers=n, num_attention_heads=heads,
        num_key_value_heads=fields["num_query_groups"], dense_intermediate_size=fields["ffn_hidden_size"],
        expert_intermediate_size=fields["moe_ffn_hidden_size"],
        shared_expert_intermediate_size=fields["moe_shared_expert_intermediate_size"],
        num_experts=fields["num_moe_experts"], num_experts_per_tok=fields["moe_router_topk"], moe_layer_freq=pattern,
        max_position_embeddings=fields["max_position_embeddings"], rope_theta=float(fields["rotary_base"]),
        rms_norm_eps=fields["norm_epsilon"], qk_layernorm=bool(fields["qk_layernorm"]),
        tie_word_embeddings=not fields["untie_embeddings_and_output_weights"],
        initializer_range=fields["init_method_std"], mask_token_id=fields["mask_token_id"])
    for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if (token_ids or {}).get(key) is not None:
            out[key] = token_ids[key]  # type: ignore[index]
    return dict(sorted(out.items()))


def _refuse(fields: Mapping[str, Any], name: str, *, shift_ok: bool, qk_norm_ok: bool = False,
            moe_ok: bool = False) -> None:
    if fields.get("num_moe_experts") is not None and not moe_ok:
        raise FormatError(f"a mixture-of-experts model has no {name} form; export with --hf-format lladamoe")
    if fields["attn_mask_type"] != "bidirectional":
        raise FormatError(f"the model has {fields['attn_mask_type']} attention; {name}'s code always runs "
                          "bidirectional attention: export with --hf-format stock")
    if fields["qk_layernorm"] and not qk_norm_ok:
        raise FormatError(f"the model has QK layernorm, which {name} does not; export with --hf-format stock")
    if fields.get("block_size") is not None:
        raise FormatError(f"a block-diffusion model (block_size={fields['block_size']}) has no {name} form; "
                          "export with --hf-format stock")
    if fields["diffusion_shift"] and not shift_ok:
        raise FormatError(f"the model predicts with the shift (difflm-shift), which {name}'s samplers do not "
                          "apply: export with --hf-format dream or stock")
