"""megadlms.interop.hf: import / export against transformers' own Qwen3, Qwen2 and Llama."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from megadlms.config import TransformerConfig
from megadlms.interop import (
    InteropError,
    hf_config_to_megadlms,
    hf_state_dict_to_megadlms,
    load_hf_model,
    load_hf_state_dict,
    make_bidirectional,
    megadlms_config_to_hf,
    megadlms_state_dict_to_hf,
    save_hf_model,
    save_safetensors_sharded,
)
from megadlms.interop.hf import parse_size
from megadlms.model import TransformerLM

from .helpers import MASK_ID, TOKENIZER_IDS, VOCAB, load_transformers, randomize_, write_tokenizer

FAMILIES = ["qwen3", "qwen2", "llama"]
ARCH = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}


def _batch(seed: int = 0, s: int = 24):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, TOKENIZER_IDS, (2, s), generator=g)
    ids[0, 5] = MASK_ID
    mask = torch.ones(2, s, dtype=torch.bool)
    mask[1, s - 6:] = False  # right padding
    return ids, mask


def _logits_diff(ours, hf, ids, mask) -> float:
    with torch.no_grad():
        a = ours(ids, attention_mask=mask)
        b = hf(input_ids=ids, attention_mask=mask.long()).logits
    return (a - b)[mask].abs().max().item()


# ------------------------------------------------------------------------------------------------ import


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attn", ["bidirectional", "causal"])
def test_import_logits_match_transformers(hf_dirs, family, attn):
    ours, cfg = load_hf_model(hf_dirs[family], attn_mask_type=attn)
    hf = load_transformers(hf_dirs[family], causal=attn == "causal")
    assert cfg.attn_mask_type == attn and cfg.extra["hf_architecture"] == ARCH[family]
    assert cfg.vocab_size == VOCAB  # the embedding's rows, padding included
    ids, mask = _batch()
    assert _logits_diff(ours, hf, ids, mask) < 1e-5
    full = torch.ones_like(mask)
    assert _logits_diff(ours, hf, ids, full) < 1e-5
    # the other attention type really is different (so the comparison above can fail)
    other = load_transformers(hf_dirs[family], causal=attn != "causal")
    assert _logits_diff(ours, other, ids, full) > 1e-2


def test_import_config_fields(hf_dirs):
    _, cfg = load_hf_model(hf_dirs["qwen3"])
    assert (cfg.qk_layernorm, cfg.add_qkv_bias, cfg.untie_embeddings_and_output_weights) == (True, False, False)
    assert cfg.kv_channels == 16 and cfg.hidden_size == 32 and cfg.num_query_groups == 2
    assert cfg.rotary_base == 1e6 and cfg.attn_mask_type == "causal"  # a stock AR model stays causal by default
    _, cfg = load_hf_model(hf_dirs["qwen2"])
    assert (cfg.qk_layernorm, cfg.add_qkv_bias, cfg.untie_embeddings_and_output_weights) == (False, True, True)
    _, cfg = load_hf_model(hf_dirs["llama"], mask_token_id="<|mask|>")
    assert cfg.rotary_base == 500000.0 and cfg.mask_token_id == MASK_ID
    assert cfg.extra["hf_token_ids"] == {"bos_token_id": None, "eos_token_id": 0, "pad_token_id": 2}


def test_import_sharded_folder(hf_dirs):
    d = hf_dirs["qwen2"]
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and not (d / "model.safetensors").exists()
    sd = load_hf_state_dict(d)
    assert set(sd) == set(index["weight_map"]) and "lm_head.weight" in sd


def test_import_keeps_stored_dtype_when_asked(hf_copy):
    d = hf_copy("llama")
    sd = load_hf_state_dict(d)
    save_file({k: v.to(torch.bfloat16) for k, v in sd.items()}, str(d / "model.safetensors"), metadata={"format": "pt"})
    ours, _ = load_hf_model(d, dtype=None)
    assert ours.embed_tokens.weight.dtype == torch.bfloat16
    ours32, _ = load_hf_model(d)
    assert ours32.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(ours32.layers[1].mlp.up_proj.weight, sd["model.layers.1.mlp.up_proj.weight"].bfloat16().float())


def test_hf_config_defaults_and_legacy_fields():
    base = dict(architectures=["Qwen3ForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                num_attention_heads=2, vocab_size=50)
    cfg = hf_config_to_megadlms(base)
    assert cfg.kv_channels == 128  # transformers' Qwen3Config default, not hidden/heads
    assert cfg.max_position_embeddings == 32768 and cfg.num_query_groups == 2
    legacy = dict(base, architectures=["LlamaForCausalLM"], rope_theta=5e5, torch_dtype="bfloat16", rope_scaling=None)
    cfg = hf_config_to_megadlms(legacy)
    assert cfg.kv_channels == 32 and cfg.rotary_base == 5e5 and cfg.max_position_embeddings == 2048
    # an export of ours records the attention type; `is_causal: false` alone also means bidirectional
    assert hf_config_to_megadlms(dict(base, is_causal=False)).attn_mask_type == "bidirectional"
    assert hf_config_to_megadlms(dict(base, attn_mask_type="bidirectional")).attn_mask_type == "bidirectional"
    assert hf_config_to_megadlms(dict(base, is_causal=False), attn_mask_type="causal").attn_mask_type == "causal"


# ------------------------------------------------------------------------------------------------ export


def _our_model(arch: str, tied: bool, attn: str, seed: int = 0) -> tuple[TransformerLM, TransformerConfig]:
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                            ffn_hidden_size=48, vocab_size=VOCAB, seq_length=64, max_position_embeddings=128,
                            rotary_base=1e6, qk_layernorm=arch == "qwen3", add_qkv_bias=arch == "qwen2",
                            untie_embeddings_and_output_weights=not tied, attn_mask_type=attn,
                            mask_token_id=MASK_ID)
    torch.manual_seed(seed)
    return randomize_(TransformerLM(cfg), seed).eval(), cfg


@pytest.mark.parametrize("arch,tied,attn", [("qwen3", True, "bidirectional"), ("qwen2", False, "bidirectional"),
                                            ("llama", False, "causal"), ("llama", True, "bidirectional")])
def test_export_loads_with_stock_transformers(tmp_path, arch, tied, attn):
    ours, cfg = _our_model(arch, tied, attn)
    tok_dir = write_tokenizer(tmp_path / "tok")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = save_hf_model(ours, cfg, tmp_path / "hf", tokenizer_dir=tok_dir)
    # transformers forces Qwen2Tokenizer on qwen2 models; the word-level test tokenizer is not Qwen's
    assert any("Qwen2Tokenizer" in str(w.message) for w in caught) == (arch == "qwen2")
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == [ARCH[arch]] and conf["tie_word_embeddings"] is tied
    assert conf["mask_token_id"] == MASK_ID and conf["attn_mask_type"] == attn
    assert conf["eos_token_id"] == 0 and conf["pad_token_id"] == 2  # resolved from the tokenizer files
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 0
    # plain from_pretrained, nothing set by hand: config.json's is_causal=false makes it bidirectional
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(hf).__name__ == ARCH[arch]
    ids, mask = _batch(1)
    assert _logits_diff(ours, hf, ids, mask) < 1e-5
    assert _logits_diff(ours, hf, ids, torch.ones_like(mask)) < 1e-5
    tok = (PreTrainedTokenizerFast if arch == "qwen2" else AutoTokenizer).from_pretrained(str(out))
    assert tok("w5 w7 w89").input_ids == [5, 7, 89] and tok.mask_token_id == MASK_ID and tok.eos_token_id == 0


def test_readme_recipe_runs_a_stock_causal_model_bidirectionally(hf_dirs):
    # what the README tells a transformers user, on a folder whose config.json says nothing about attention
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dirs["qwen3"]), dtype=torch.float32)
    hf.config.is_causal = False
    for module in hf.modules():
        if hasattr(module, "is_causal"):
            module.is_causal = False
    ours, _ = load_hf_model(hf_dirs["qwen3"], attn_mask_type="bidirectional")
    ids, mask = _batch(2)
    assert _logits_diff(ours, hf.eval(), ids, mask) < 1e-5
    # the helper does the same, for eager attention too
    eager = make_bidirectional(AutoModelForCausalLM.from_pretrained(str(hf_dirs["qwen3"]), dtype=torch.float32,
                                                                    attn_implementation="eager")).eval()
    assert _logits_diff(ours, eager, ids, mask) < 1e-5


def test_export_sharded_and_reloaded(tmp_path):
    ours, cfg = _our_model("qwen2", False, "causal")
    out = save_hf_model(ours, cfg, tmp_path / "hf", max_shard_size="20KB", dtype="bfloat16")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(files) > 2 and set(index["weight_map"].values()) == set(files)
    assert all(p.stat().st_size <= 20_000 + 2_000 for p in out.glob("model-*.safetensors"))  # + header
    assert index["metadata"]["total_size"] == sum(p.numel() * 2 for p in ours.parameters())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    k_bias = ours.layers[0].self_attn.k_proj.bias
    assert torch.equal(hf.model.layers[0].self_attn.k_proj.bias, k_bias.bfloat16().float())
    # re-exporting unsharded removes the old shards and the index
    save_hf_model(ours, cfg, out)
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]


def test_bd3lm_export_records_the_block_size_and_mode(tmp_path):
    ours, cfg = _our_model("qwen3", True, "bidirectional")
    cfg = cfg.replace(block_size=8)
    out = save_hf_model(ours, cfg, tmp_path / "hf")
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_running_mode"] == "bd3lm" and saved["block_size"] == 8 and saved["is_causal"] is False
    model, back = load_hf_model(out)
    assert back.block_size == 8 and back.seq_length % 8 == 0 and back.attn_mask_type == "bidirectional"
    ids = torch.randint(0, VOCAB, (1, 16))
    torch.testing.assert_close(model(ids), ours(ids))


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MiB") == 500 * 2**20
    assert parse_size("1234") == 1234 and parse_size(77) == 77 and parse_size("1.5kb") == 1500
    with pytest.raises(InteropError, match="'5 apples'"):
        parse_size("5 apples")


# ------------------------------------------------------------------------------------------- round trip


@pytest.mark.filterwarnings("ignore:AutoTokenizer.from_pretrained")  # qwen2 + a non-Qwen tokenizer, tested above
@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_hf_ours_hf_is_identical(hf_dirs, tmp_path, family):
    src = load_hf_state_dict(hf_dirs[family])
    ours, cfg = load_hf_model(hf_dirs[family], dtype=None)
    # pure functions: names only, the very same tensors
    back = megadlms_state_dict_to_hf(hf_state_dict_to_megadlms(src, cfg), cfg)
    assert set(back) == set(src) and all(back[k] is src[k] for k in src)
    # through files: bit-identical tensors, the same architecture fields
    out = save_hf_model(ours, cfg, tmp_path / "hf", tokenizer_dir=hf_dirs[family])
    again = load_hf_state_dict(out)
    assert set(again) == set(src)
    assert all(torch.equal(again[k], src[k]) and again[k].dtype == src[k].dtype for k in src)
    a, b = (json.loads((d / "config.json").read_text()) for d in (hf_dirs[family], out))
    for key in ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings",
                "rope_parameters", "max_position_embeddings", "eos_token_id", "pad_token_id", "bos_token_id"):
        assert a.get(key, b[key]) == b[key], key  # the source may leave head_dim implicit
    assert (out / "tokenizer.json").read_bytes() == (hf_dirs[family] / "tokenizer.json").read_bytes()


# ------------------------------------------------------------------------------------------------ errors


def _edit_config(d, **changes):
    conf = json.loads((d / "config.json").read_text())
    conf.update(changes)
    (d / "config.json").write_text(json.dumps(conf))


def test_error_unknown_architecture(hf_copy):
    d = hf_copy("llama")
    _edit_config(d, architectures=["MistralForCausalLM"], model_type="mistral")
    with pytest.raises(InteropError, match=r"unsupported Hugging Face architecture 'MistralForCausalLM'.*"
                                           r"LlamaForCausalLM"):
        load_hf_model(d)


@pytest.mark.parametrize("changes,match", [
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}), "RoPE scaling 'llama3'"),
    (dict(attention_bias=True), "attention_bias=true"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
     r"quantized weights \(quantization_config, quant_method 'fp8'\).*--fp8-export"),
])
def test_error_unsupported_features(hf_copy, changes, match):
    d = hf_copy("llama")
    _edit_config(d, **changes)
    with pytest.raises(InteropError, match=match):
        load_hf_model(d)


def test_error_missing_shard(hf_copy):
    d = hf_copy("qwen2")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (d / victim).unlink()
    with pytest.raises(InteropError, match=f"missing shard '{victim}'.*holding model\\."):
        load_hf_model(d)


def test_error_no_safetensors(hf_copy):
    d = hf_copy("llama")
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    with pytest.raises(InteropError, match="no model.safetensors.*pytorch_model.bin"):
        load_hf_model(d)


def test_error_shape_mismatch_names_tensor_and_shapes(hf_copy):
    d = hf_copy("llama")
    _edit_config(d, intermediate_size=64)
    with pytest.raises(InteropError, match=r"shape mismatch for model\.layers\.0\.mlp\.gate_proj\.weight: the "
                                           r"checkpoint has \[48, 32\], the config expects \[64, 32\]"):
        load_hf_model(d)
    _edit_config(d, intermediate_size=48, vocab_size=120)  # config vocab != embedding rows
    with pytest.raises(InteropError, match=r"model\.embed_tokens\.weight: the checkpoint has \[100, 32\], the "
                                           r"config expects \[120, 32\] \(vocab_size=120"):
        load_hf_model(d)


def test_error_missing_and_unexpected_tensors(hf_copy):
    d = hf_copy("llama")
    _edit_config(d, num_hidden_layers=3)
    with pytest.raises(InteropError, match=r"missing tensors model\.layers\.2\."):
        load_hf_model(d)
    _edit_config(d, num_hidden_layers=1)
    with pytest.raises(InteropError, match=r"unexpected tensors model\.layers\.1\."):
        load_hf_model(d)


def test_error_tied_untied_mismatch(hf_copy):
    d = hf_copy("qwen3")  # saved tied: no lm_head.weight in the file
    _edit_config(d, tie_word_embeddings=False)
    with pytest.raises(InteropError, match="tie_word_embeddings is false but the checkpoint has no lm_head.weight"):
        load_hf_model(d)
    d = hf_copy("llama")  # untied: a separate head that differs from the embedding
    _edit_config(d, tie_word_embeddings=True)
    with pytest.raises(InteropError, match=r"tie_word_embeddings is true but lm_head.weight \[100, 32\] differs "
                                           r"from model.embed_tokens.weight \[100, 32\]"):
        load_hf_model(d)
    # a head equal to the embedding is accepted as tied, and dropped
    sd = load_file(str(d / "model.safetensors"))
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    ours, cfg = load_hf_model(d)
    assert ours.lm_head is None and not cfg.untie_embeddings_and_output_weights
    # export side: the config and the state dict disagree
    with pytest.raises(InteropError, match=r"ties the LM head.*lm_head.weight \[100, 32\]"):
        megadlms_state_dict_to_hf({**ours.state_dict(), "lm_head.weight": sd["lm_head.weight"]}, cfg)
    untied = cfg.replace(untie_embeddings_and_output_weights=True)
    with pytest.raises(InteropError, match="has no lm_head.weight"):
        megadlms_state_dict_to_hf(ours.state_dict(), untied)


def test_vocab_padding_rules(hf_copy, tmp_path):
    # fewer tokenizer ids than embedding rows: fine, the padding rows are kept
    ours, cfg = load_hf_model(hf_copy("llama"), mask_token_id=95)  # a mask id in a padding row is allowed
    assert ours.embed_tokens.weight.shape == (VOCAB, 32) and cfg.mask_token_id == 95
    # more tokenizer ids than rows: refused on import and on export
    d = hf_copy("qwen3")
    write_tokenizer(d, n_ids=120)
    with pytest.raises(InteropError, match=r"has 120 ids but embed_tokens.weight has shape \[100, 32\]"):
        load_hf_model(d)
    with pytest.raises(InteropError, match="has 120 ids"):
        save_hf_model(ours, cfg, tmp_path / "out", tokenizer_dir=d)
    with pytest.raises(InteropError, match="not in"):
        load_hf_model(hf_copy("llama"), mask_token_id="<|nope|>")


def test_export_refuses_architecture_without_stock_class(tmp_path):
    _, cfg = _our_model("qwen3", True, "bidirectional")
    with pytest.raises(InteropError, match="qk_layernorm=True together with add_qkv_bias=True"):
        megadlms_config_to_hf(cfg.replace(add_qkv_bias=True))


def test_save_safetensors_sharded_greedy(tmp_path):
    sd = {f"t{i}": torch.full((10,), float(i)) for i in range(5)}  # 40 bytes each
    files = save_safetensors_sharded(sd, tmp_path, max_shard_size=100)
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [sorted(load_file(str(f))) for f in files] == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    assert load_hf_state_dict(tmp_path)["t3"][0].item() == 3.0


def test_export_of_an_fp8_model_drops_the_fp8_state(tmp_path):
    from megadlms.build import build_model

    _, cfg = _our_model("qwen3", True, "bidirectional")
    fp8_cfg = cfg.replace(fp8=True)
    model = build_model(fp8_cfg)
    sd = model.state_dict()
    assert any(k.endswith("fp8_amax_history") for k in sd)
    with pytest.raises(InteropError, match=r"unexpected tensors layers\.0\.mlp\.down_proj\.fp8_amax_history"):
        megadlms_state_dict_to_hf(sd, fp8_cfg)  # strict: amax histories are not weights of the architecture
    out = save_hf_model(model, fp8_cfg, tmp_path / "hf")
    saved = load_hf_state_dict(out)
    assert len(saved) == 2 * 11 + 2 and not any("fp8" in k for k in saved)
    assert torch.equal(saved["model.layers.1.mlp.up_proj.weight"], sd["layers.1.mlp.up_proj.weight"])


@pytest.mark.parametrize("hf_format, arch, changes", [
    ("stock", "qwen3", {}), ("stock", "llama", {"block_size": 8}), ("llada", "llama", {"kv_channels": 8}),
    ("dream", "qwen2", {"diffusion_shift": True, "kv_channels": 8})])
def test_export_records_the_trained_sequence_length_and_an_import_reads_it(tmp_path, hf_format, arch, changes):
    """A model trained at 24 tokens (max_position_embeddings 128) exports `seq_length: 24` in config.json, in every
    format; the import (and so `eval --hf-model` and a fine-tune of the import) takes 24, not 128."""
    cfg = _our_model(arch, False, "bidirectional")[1].replace(seq_length=24, **changes)
    out = save_hf_model(TransformerLM(cfg), cfg, tmp_path / "hf", hf_format=hf_format)
    saved = json.loads((out / "config.json").read_text())
    assert saved["seq_length"] == 24 and cfg.max_position_embeddings == 128
    _, back = load_hf_model(out)
    assert back.seq_length == 24 and back.max_position_embeddings == 128
    # a config.json without the record (any model not exported here): as before, min(4096, the position limit)
    del saved["seq_length"]
    (out / "config.json").write_text(json.dumps(saved))
    assert load_hf_model(out)[1].seq_length == 128
    # trained at that default: nothing to record (an imported folder exports back as it was)
    cfg = cfg.replace(seq_length=128)
    assert "seq_length" not in json.loads((save_hf_model(TransformerLM(cfg), cfg, tmp_path / "d",
                                                         hf_format=hf_format) / "config.json").read_text())
    saved["seq_length"] = "24"
    (out / "config.json").write_text(json.dumps(saved))
    with pytest.raises(InteropError, match=r"seq_length='24' must be a positive integer .*trained at"):
        load_hf_model(out)
