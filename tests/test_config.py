import pytest

from megadlms import ConfigError, TransformerConfig, load_model_config, preset_config
from megadlms.presets import PRESETS


def test_defaults_are_derived():
    cfg = TransformerConfig(hidden_size=256, num_attention_heads=8, seq_length=64)
    assert cfg.num_query_groups == 8 and cfg.kv_channels == 32 and cfg.ffn_hidden_size == 1024
    assert cfg.max_position_embeddings == 64


@pytest.mark.parametrize("kwargs, words", [
    (dict(hidden_size=100, num_attention_heads=3), ["hidden_size=100", "num_attention_heads=3", "kv_channels"]),
    (dict(num_attention_heads=4, num_query_groups=3), ["num_query_groups=3", "divides"]),
    (dict(num_layers=0), ["num_layers=0", "positive"]),
    (dict(seq_length=512, max_position_embeddings=256), ["seq_length=512", "max_position_embeddings=256"]),
    (dict(fp8_format="e5m2"), ["fp8_format='e5m2'", "hybrid"]),
    (dict(fp8="fp4"), ["fp8='fp4'"]),
    (dict(fp8_amax_compute_algo="mean"), ["fp8_amax_compute_algo"]),
    (dict(attn_mask_type="sliding"), ["attn_mask_type"]),
    (dict(vocab_size=100, mask_token_id=100), ["mask_token_id=100", "vocab"]),
    (dict(num_layers=2, first_last_layers_bf16=True, num_layers_at_start_in_bf16=2, num_layers_at_end_in_bf16=1),
     ["exceeds num_layers=2"]),
    (dict(fp8_margin=-1), ["fp8_margin=-1", ">= 0"]),
])
def test_validation_errors_name_field_value_and_fix(kwargs, words):
    with pytest.raises(ConfigError) as e:
        TransformerConfig(**kwargs)
    for w in words:
        assert w in str(e.value)


def test_megatron_string_fp8_form():
    cfg = TransformerConfig(fp8="e4m3")
    assert cfg.fp8 is True and cfg.fp8_format == "e4m3"


def test_presets_build_configs_with_known_sizes():
    assert set(PRESETS) >= {"tiny", "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "llama3-8b", "llada-8b",
                            "megatron-13b"}
    n = {name: preset_config(name).num_matmul_params() for name in PRESETS}
    # Qwen3-1.7B: 1.72B parameters with the tied embedding counted once
    assert 1.6e9 < n["qwen3-1.7b"] < 1.8e9
    # the input embedding is a lookup, not a matmul: Llama-3-8B's 8.03B minus its 0.53B embedding
    assert 7.4e9 < n["llama3-8b"] < 7.6e9
    assert 7.4e9 < n["llada-8b"] < 7.6e9
    assert 12e9 < n["megatron-13b"] < 14.5e9


def test_flops_per_token_counts_attention_by_mask_type():
    bi = preset_config("qwen3-1.7b")
    causal = bi.replace(attn_mask_type="causal")
    attn = 28 * 4096 * 16 * 128
    assert bi.flops_per_token() - causal.flops_per_token() == 6 * attn
    assert causal.flops_per_token() == 6 * bi.num_matmul_params() + 6 * attn


def test_hf_config_json(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "vocab_size": 1000, "max_position_embeddings": 512, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True}))
    cfg = load_model_config(str(tmp_path))
    assert (cfg.num_layers, cfg.kv_channels, cfg.num_query_groups, cfg.qk_layernorm) == (2, 32, 2, True)
    assert not cfg.untie_embeddings_and_output_weights and cfg.rotary_base == 1e6
    with pytest.raises(ConfigError, match="neither a preset"):
        load_model_config(str(tmp_path / "nope"))


def test_fp8_settings_are_one_definition_with_megatron_defaults():
    """TransformerConfig and the trainer's FP8Config share FP8Settings (one set of fields and defaults); BF16 edge
    layers count only with first_last_layers_bf16, as in Megatron-Core; a config saved before the switch existed
    keeps its edge layers."""
    import dataclasses

    from megadlms.config import FP8Settings
    from megadlms.training.config import FP8Config
    shared = [f.name for f in dataclasses.fields(FP8Settings)]
    for cls in (TransformerConfig, FP8Config):
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        assert {n: defaults[n] for n in shared} == {f.name: f.default for f in dataclasses.fields(FP8Settings)}
    cfg = TransformerConfig(num_layers=3)
    assert (cfg.num_layers_at_start_in_bf16, cfg.bf16_edges()) == (1, (0, 0))
    assert cfg.replace(first_last_layers_bf16=True).bf16_edges() == (1, 1)
    old = {k: v for k, v in cfg.replace(num_layers_at_start_in_bf16=2, num_layers_at_end_in_bf16=0).to_dict().items()
           if k != "first_last_layers_bf16"}
    assert TransformerConfig.from_dict(old).bf16_edges() == (2, 0)
    assert TransformerConfig.from_dict(cfg.to_dict()) == cfg
