"""LLaDA (`LLaDAModelLM`), LLaDA-MoE (`LLaDAMoEModelLM`) and Dream (`DreamModel`) folders: import checked against
the logits of the models' own modeling code, export back to the same files, refusals.

The reference data in tests/interop/data/ (tiny random models saved by the reference classes, and their fp32
logits on fixed inputs) was made with the modeling code of ZHZisZZ/dllm (`dllm/pipelines/{llada,dream}/models/`,
commit ca176752) under transformers 4.46.3, the version that code is written for:

    python tools/make_dlm_reference.py --llada-code DIR_WITH_modeling_llada.py \\
        --dream-code DIR_WITH_modeling_dream.py --out tests/interop/data
    python tools/make_dlm_reference.py --lladamoe-code DIR_WITH_modeling_lladamoe.py --models lladamoe

Tolerance: max |logit_ours - logit_ref| <= 1e-5 * max(1, max |logit_ref|) on the non-pad positions (fp32 CPU;
measured: 3e-7 for LLaDA, 2e-6 for Dream and LLaDA-MoE; a wrong mapping is off by O(0.1)).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import megadlms.training.checkpoint as ckpt
from megadlms.cli.convert import main
from megadlms.config import TransformerConfig
from megadlms.interop import InteropError, load_hf_model, load_hf_state_dict, save_hf_model
from megadlms.interop.hf import model_from_state_dict
from megadlms.presets import preset_config

from .helpers import write_tokenizer

DATA = Path(__file__).parent / "data"
MODELS = ["llada_llama", "llada_sequential", "dream", "lladamoe"]
TOL = 1e-5


def _reference(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(DATA / f"{name}_reference.safetensors"))


def _max_diff(model, ref, padded: bool) -> tuple[float, float]:
    keep = ref["attention_mask"].bool() if padded else torch.ones_like(ref["input_ids"], dtype=torch.bool)
    want = ref["logits_padded" if padded else "logits"]
    with torch.no_grad():
        got = model(ref["input_ids"], attention_mask=keep if padded else None)
    return (got - want)[keep].abs().max().item(), want[keep].abs().max().item()


@pytest.fixture
def folder(tmp_path):
    """A writable copy of a reference folder, with a small tokenizer (300 ids, mask at the config's id)."""
    def copy(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(DATA / name, dst)
        return dst
    return copy


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("padded", [False, True])
def test_import_matches_the_reference_logits(name, padded):
    model, cfg = load_hf_model(DATA / name)
    diff, scale = _max_diff(model, _reference(name), padded)
    assert diff <= TOL * max(1.0, scale), f"{name}: max |dlogit| {diff:.2e}"
    assert cfg.attn_mask_type == "bidirectional"


def test_import_records_the_formats_settings():
    llama, llama_cfg = load_hf_model(DATA / "llada_llama")
    seq, seq_cfg = load_hf_model(DATA / "llada_sequential")
    _, dream_cfg = load_hf_model(DATA / "dream")
    assert (llama_cfg.mask_token_id, llama_cfg.vocab_size, llama_cfg.ffn_hidden_size) == (299, 320, 64)
    assert llama_cfg.untie_embeddings_and_output_weights and not llama_cfg.add_qkv_bias
    assert llama_cfg.num_query_groups == 2 and not llama_cfg.diffusion_shift
    # sequential: att_proj split into q/k/v (with bias), ff_proj [up; gate] halves, tied head
    assert not seq_cfg.untie_embeddings_and_output_weights and seq_cfg.add_qkv_bias and seq_cfg.ffn_hidden_size == 64
    src = load_hf_state_dict(DATA / "llada_sequential")
    ff = src["model.transformer.blocks.1.ff_proj.weight"]
    assert torch.equal(seq.layers[1].mlp.up_proj.weight, ff[:64]) and torch.equal(seq.layers[1].mlp.gate_proj.weight,
                                                                                     ff[64:])
    assert torch.equal(seq.layers[0].self_attn.k_proj.bias, src["model.transformer.blocks.0.att_proj.bias"][32:48])
    assert torch.equal(llama.layers[0].mlp.gate_proj.weight, load_hf_state_dict(DATA / "llada_llama")[
        "model.transformer.blocks.0.ff_proj.weight"])  # ff_proj is the gate
    assert dream_cfg.diffusion_shift and dream_cfg.add_qkv_bias and dream_cfg.mask_token_id == 298
    assert dream_cfg.extra["hf_architecture"] == "DreamModel" and llama_cfg.extra["hf_architecture"] == "LLaDAModelLM"


@pytest.mark.parametrize("name", MODELS)
def test_export_writes_the_reference_files_back(name, tmp_path):
    """The same tensors under the same names and the same config.json as the reference class saved: what loads
    the original loads ours (checked once against the reference class with make_dlm_reference.py --check-export)."""
    model, cfg = load_hf_model(DATA / name)
    with pytest.warns(UserWarning, match="auto_map"):  # no modeling code to bring along here
        out = save_hf_model(model, cfg, tmp_path / "hf")
    src, back = load_hf_state_dict(DATA / name), load_hf_state_dict(out)
    assert sorted(src) == sorted(back) and all(torch.equal(src[k], back[k]) for k in src)
    assert json.loads((out / "config.json").read_text()) == json.loads((DATA / name / "config.json").read_text())
    reloaded, _ = load_hf_model(out)
    diff, scale = _max_diff(reloaded, _reference(name), padded=False)
    assert diff <= TOL * max(1.0, scale)


@pytest.mark.parametrize("fmt", ["llada", "dream"])
def test_a_model_of_ours_exports_in_either_format(fmt, tmp_path):
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=48, vocab_size=128, mask_token_id=5, add_qkv_bias=fmt == "dream",
                            diffusion_shift=fmt == "dream", untie_embeddings_and_output_weights=True)
    torch.manual_seed(0)
    from megadlms.model import TransformerLM

    model = TransformerLM(cfg).eval()
    with pytest.warns(UserWarning, match="auto_map"):
        out = save_hf_model(model, cfg, tmp_path / fmt, hf_format=fmt)
    conf = json.loads((out / "config.json").read_text())
    assert conf["model_type"] == {"llada": "llada", "dream": "Dream"}[fmt] and "auto_map" in conf
    assert conf["mask_token_id"] == 5
    back, back_cfg = load_hf_model(out)
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        assert torch.equal(back(ids), model(ids))
    assert back_cfg.diffusion_shift == (fmt == "dream")


@pytest.mark.parametrize("fmt, changes, match", [
    ("llada", dict(qk_layernorm=True), "QK layernorm"),
    ("llada", dict(attn_mask_type="causal"), "causal attention"),
    ("llada", dict(diffusion_shift=True), "difflm-shift"),
    ("dream", dict(add_qkv_bias=True), "without the shift"),
    ("dream", dict(diffusion_shift=True), "no q/k/v biases"),
])
def test_export_refuses_what_the_format_cannot_compute(fmt, changes, match, tmp_path):
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64, **changes)
    from megadlms.model import TransformerLM

    with pytest.raises(InteropError, match=match):
        save_hf_model(TransformerLM(cfg), cfg, tmp_path / "hf", hf_format=fmt)
    assert not (tmp_path / "hf").exists()


def test_lladamoe_import_records_the_experts():
    """LLaDA-MoE: per-expert tensors stacked in order, the layer-level shared expert moved into the MoE block, the
    router LLaDA-MoE's code computes (softmax over all experts, top-k probabilities unnormalised)."""
    model, cfg = load_hf_model(DATA / "lladamoe")
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (4, 2, 16)
    assert (cfg.moe_shared_expert_intermediate_size, cfg.moe_layer_freq, cfg.ffn_hidden_size) == (24, [0, 1, 1], 64)
    assert cfg.moe_router_pre_softmax and cfg.moe_router_score_function == "softmax"
    assert cfg.qk_layernorm and not cfg.diffusion_shift and cfg.mask_token_id == 297
    assert cfg.extra["hf_architecture"] == "LLaDAMoEModelLM"
    src = load_hf_state_dict(DATA / "lladamoe")
    moe = model.layers[2].mlp
    for e in range(4):
        assert torch.equal(moe.experts.down_proj[e], src[f"model.layers.2.mlp.experts.{e}.down_proj.weight"])
    assert torch.equal(moe.shared_expert.up_proj.weight, src["model.layers.2.shared_expert.up_proj.weight"])
    assert torch.equal(moe.gate.weight, src["model.layers.2.mlp.gate.weight"])
    assert torch.equal(model.layers[0].mlp.gate_proj.weight, src["model.layers.0.mlp.gate_proj.weight"])  # dense


def _moe_cfg(**changes) -> TransformerConfig:
    return TransformerConfig(**{**dict(num_layers=3, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                       ffn_hidden_size=48, vocab_size=128, mask_token_id=5, num_moe_experts=4,
                                       moe_router_topk=2, moe_ffn_hidden_size=16,
                                       moe_shared_expert_intermediate_size=24, moe_layer_freq=[0, 1, 1],
                                       moe_router_pre_softmax=True, qk_layernorm=True,
                                       untie_embeddings_and_output_weights=True), **changes})


@pytest.mark.filterwarnings("ignore:.*auto_map")
def test_a_moe_model_of_ours_exports_as_lladamoe(tmp_path):
    """A mixture of experts exports in LLaDA-MoE's format by default and comes back the same. (This export was
    also loaded with LLaDA-MoE's own LLaDAMoEModelLM: max |dlogit| 2.4e-6 against ours, fp32.)"""
    from megadlms.model import TransformerLM

    torch.manual_seed(0)
    cfg = _moe_cfg(moe_layer_freq=2)  # layers 0 and 2 MoE: written as LLaDA-MoE's per-layer list
    model = TransformerLM(cfg).eval()
    out = save_hf_model(model, cfg, tmp_path / "hf")
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["LLaDAMoEModelLM"] and conf["moe_layer_freq"] == [1, 0, 1]
    assert (conf["num_experts"], conf["num_experts_per_tok"], conf["expert_intermediate_size"]) == (4, 2, 16)
    assert "model.layers.2.shared_expert.gate_proj.weight" in load_hf_state_dict(out)
    back, _ = load_hf_model(out)
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        assert torch.equal(back(ids), model(ids))


@pytest.mark.parametrize("changes, fmt, match", [
    (dict(moe_router_pre_softmax=False), "auto", "is not LLaDA-MoE's"),
    (dict(moe_router_topk_scaling_factor=2.5), "auto", "is not LLaDA-MoE's"),
    (dict(), "stock", "no stock transformers architecture"),
    (dict(qk_layernorm=False), "llada", "no LLaDA form"),
    (dict(add_qkv_bias=True, qk_layernorm=False), "lladamoe", "q/k/v biases"),
])
def test_moe_export_refuses_what_lladamoe_cannot_compute(changes, fmt, match, tmp_path):
    from megadlms.model import TransformerLM

    cfg = _moe_cfg(**changes)
    with pytest.raises(InteropError, match=match):
        save_hf_model(TransformerLM(cfg), cfg, tmp_path / "hf", hf_format=fmt)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("changes, match", [
    ({"moe_router_enable_expert_bias": True}, "moe_router_enable_expert_bias=true"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"moe_layer_freq": [0, 1]}, "moe_layer_freq=\\[0, 1\\] must list"),
    ({"clip_qkv": 8.0}, "clip_qkv=8.0"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling 'linear' is not supported"),
])
def test_lladamoe_options_it_does_not_compute_are_refused(folder, changes, match):
    d = folder("lladamoe")
    conf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**conf, **changes}))
    with pytest.raises(InteropError, match=match) as e:
        load_hf_model(d)
    assert str(d / "config.json") in str(e.value) and "\n" not in str(e.value)


def test_lladamoe_missing_expert_is_named(folder):
    d = folder("lladamoe")
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(InteropError, match="experts.up_proj: expert 2 is missing"):
        load_hf_model(d)


# ------------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("changes, match", [
    ({"block_type": "parallel"}, "block_type='parallel'"),
    ({"layer_norm_type": "default"}, "layer_norm_type='default'"),
    ({"activation_type": "gelu"}, "activation_type='gelu'"),
    ({"alibi": True}, "ALiBi"),
    ({"include_bias": True}, "include_bias=True"),
])
def test_llada_options_it_does_not_compute_are_refused(folder, changes, match):
    d = folder("llada_llama")
    conf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**conf, **changes}))
    with pytest.raises(InteropError, match=match) as e:
        load_hf_model(d)
    assert str(d / "config.json") in str(e.value) and "\n" not in str(e.value)


def test_shape_mismatch_names_the_file_tensor_and_shapes(folder):
    d = folder("llada_llama")
    conf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**conf, "mlp_hidden_size": 96}))
    with pytest.raises(InteropError, match=r"model\.safetensors: shape mismatch for "
                                           r"model\.transformer\.blocks\.0\.ff_proj\.weight: the checkpoint has "
                                           r"\[64, 32\], the config expects \[96, 32\]"):
        load_hf_model(d)


def test_missing_shard_is_named(folder, tmp_path):
    d = folder("dream")
    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    save_file({k: tensors[k] for k in names[:half]}, str(d / "model-00001-of-00002.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        **{k: "model-00001-of-00002.safetensors" for k in names[:half]},
        **{k: "model-00002-of-00002.safetensors" for k in names[half:]}}}))
    with pytest.raises(InteropError, match="missing shard 'model-00002-of-00002.safetensors'"):
        load_hf_model(d)


def test_another_architecture_names_config_json(folder):
    d = folder("dream")
    conf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**conf, "architectures": ["MistralForCausalLM"]}))
    with pytest.raises(InteropError, match=r"config\.json: unsupported Hugging Face architecture 'MistralForCausalLM'"):
        load_hf_model(d)


# ------------------------------------------------------------------------------------------------ command line


@pytest.mark.filterwarnings("ignore:.*auto_map")  # the stand-in code file is not all of the model's code
@pytest.mark.parametrize("name", MODELS)
def test_convert_round_trip_keeps_mode_mask_and_tokenizer(name, folder, tmp_path, capsys):
    d = folder(name)
    write_tokenizer(d, n_ids=300)
    (d / "modeling_llada.py").write_text("# stands for the model's own code\n")
    assert main(["hf-to-megadlms", "--hf-model", str(d), "--save", str(tmp_path / "ck"), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "PASSED" in out and ("difflm-shift" if name == "dream" else "difflm-noshift") in out
    _, cfg, meta = ckpt.load_model_from_checkpoint(tmp_path / "ck")
    assert cfg.diffusion_shift == (name == "dream") and cfg.attn_mask_type == "bidirectional"
    assert cfg.mask_token_id == json.loads((d / "config.json").read_text())["mask_token_id"]
    tok = Path(meta["tokenizer_dir"])
    assert (tok / "tokenizer.json").is_file() and (tok / "modeling_llada.py").is_file()
    assert main(["megadlms-to-hf", "--load", str(tmp_path / "ck"), "--save", str(tmp_path / "hf"), "--verify"]) == 0
    src, back = load_hf_state_dict(d), load_hf_state_dict(tmp_path / "hf")
    assert sorted(src) == sorted(back) and all(torch.equal(src[k], back[k]) for k in src)
    assert (tmp_path / "hf" / "modeling_llada.py").is_file() and (tmp_path / "hf" / "tokenizer.json").is_file()


def test_failed_verification_writes_nothing(folder, tmp_path, monkeypatch, capsys):
    import megadlms.cli.convert as convert

    d = folder("llada_llama")
    monkeypatch.setattr(convert, "_round_trip", lambda *a: "FAILED verify (forced)")
    save = tmp_path / "ck"
    assert main(["hf-to-megadlms", "--hf-model", str(d), "--save", str(save), "--verify"]) == 1
    assert not save.exists() and "nothing written" in capsys.readouterr().err


def test_bad_input_is_one_line_and_writes_nothing(folder, tmp_path, capsys):
    d = folder("llada_llama")
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.transformer.blocks.1.q_proj.weight"] = tensors["model.transformer.blocks.1.q_proj.weight"][:16]
    save_file(tensors, str(d / "model.safetensors"))
    assert main(["hf-to-megadlms", "--hf-model", str(d), "--save", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.safetensors" in err and "blocks.1.q_proj.weight" in err
    assert not (tmp_path / "ck").exists()


# ------------------------------------------------------------------------------------------------ presets


@pytest.mark.parametrize("preset, params", [("llada-8b", 8.02e9), ("llada-1.5-8b", 8.02e9), ("dream-7b", 7.62e9)])
def test_presets_have_the_released_shapes(preset, params):
    cfg = preset_config(preset)
    from megadlms.interop.hf import expected_shapes

    n = sum(torch.Size(s).numel() for s in expected_shapes(cfg).values())
    assert abs(n - params) / params < 0.01
    assert cfg.diffusion_shift == (preset == "dream-7b")
    assert cfg.mask_token_id == (151666 if preset == "dream-7b" else 126336)


def test_model_from_state_dict_of_a_llada_import_round_trips():
    model, cfg = load_hf_model(DATA / "llada_sequential")
    again = model_from_state_dict(cfg, model.state_dict())
    ids = _reference("llada_sequential")["input_ids"]
    with torch.no_grad():
        assert torch.equal(again(ids), model(ids))


# ------------------------------------------------------------------------------------- LLaDA-MoE-7B-A1B

# The config.json fields of inclusionAI/LLaDA-MoE-7B-A1B-Base / -Instruct: the field set is the one its
# `LLaDAConfig` (configuration_lladamoe.py) writes; the values and where each comes from are listed in
# docs/interop.md ("LLaDA-MoE-7B-A1B: the released shapes"). rms_norm_eps and shared_expert_intermediate_size are
# the class defaults / "no shared expert": their released values were not found in a public source.
RELEASED_LLADA_MOE = {
    "architectures": ["LLaDAMoEModelLM"], "model_type": "llada",
    "auto_map": {"AutoConfig": "configuration_lladamoe.LLaDAConfig", "AutoModel": "modeling_lladamoe.LLaDAMoEModelLM",
                 "AutoModelForCausalLM": "modeling_lladamoe.LLaDAMoEModelLM"},
    "vocab_size": 157184, "hidden_size": 2048, "dense_intermediate_size": 8192, "expert_intermediate_size": 1024,
    "shared_expert_intermediate_size": 0, "num_hidden_layers": 16, "num_attention_heads": 16,
    "num_key_value_heads": 16, "hidden_act": "silu", "max_position_embeddings": 8192, "initializer_range": 0.02,
    "rms_norm_eps": 1e-05, "use_cache": False, "pad_token_id": 156892, "bos_token_id": None, "eos_token_id": 156892,
    "tie_word_embeddings": False, "rope_theta": 50000, "partial_rotary_factor": 1.0, "rope_scaling": None,
    "attention_bias": False, "attention_dropout": 0.0, "clip_qkv": None, "num_experts_per_tok": 8, "num_experts": 64,
    "output_router_logits": False, "router_aux_loss_coef": 0.01, "norm_topk_prob": False, "qk_layernorm": True,
    "moe_layer_freq": [1] * 16, "moe_router_enable_expert_bias": False, "moe_router_score_function": "softmax",
    "routed_scaling_factor": 1, "router_num_group": None, "router_topk_group": None, "torch_dtype": "bfloat16",
    "transformers_version": "4.46.3",
}
ARCH_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "vocab_size",
               "rotary_base", "norm_epsilon", "max_position_embeddings", "qk_layernorm", "add_qkv_bias",
               "untie_embeddings_and_output_weights", "mask_token_id", "num_moe_experts", "moe_router_topk",
               "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_layer_freq",
               "moe_router_score_function", "moe_router_pre_softmax", "moe_router_topk_scaling_factor",
               "moe_router_enable_expert_bias", "attn_mask_type", "diffusion_shift")


def test_llada_moe_preset_has_the_released_shapes():
    """7B total, 1.4B active (the model card's numbers: 16 layers of 64 experts, top-8), built on the meta device."""
    from megadlms.build import construct_model

    cfg = preset_config("llada-moe-7b-a1b")
    model = construct_model(cfg, device="meta")
    total = sum(p.numel() for p in model.parameters())
    h, vocab, layers, experts, ffn = 2048, 157184, 16, 64, 1024
    per_layer = 4 * h * h + experts * h + experts * 3 * h * ffn + 2 * h + 2 * 128  # attention, router, experts, norms
    assert total == 2 * vocab * h + layers * per_layer + h == 7_356_880_896
    active = cfg.num_matmul_params()  # the top-8 experts, attention, router and head; the input embedding is a lookup
    assert active == layers * (4 * h * h + experts * h + 8 * 3 * h * ffn) + vocab * h
    assert abs(active - 1.4e9) / 1.4e9 < 0.005
    assert (cfg.mask_token_id, cfg.running_mode, cfg.attn_mask_type) == (156895, "difflm-noshift", "bidirectional")


def test_the_released_llada_moe_config_imports_as_the_preset(tmp_path):
    """The released field set (model_type "llada", no mask token) gives the preset's model; its export keeps the
    original's model_type and auto_map."""
    from megadlms.presets import hf_config_to_megadlms, load_model_config, megadlms_config_to_hf

    cfg = hf_config_to_megadlms(RELEASED_LLADA_MOE)
    preset = preset_config("llada-moe-7b-a1b")
    assert {f: getattr(cfg, f) for f in ARCH_FIELDS} == {f: getattr(preset, f) for f in ARCH_FIELDS}
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in RELEASED_LLADA_MOE.items()
                                                      if k != "architectures"}))  # told apart by its experts
    assert load_model_config(str(tmp_path)).num_moe_experts == 64
    out = megadlms_config_to_hf(cfg)
    assert (out["model_type"], out["auto_map"], out["mask_token_id"]) == ("llada", RELEASED_LLADA_MOE["auto_map"],
                                                                          156895)
    again = hf_config_to_megadlms(out)
    assert {f: getattr(again, f) for f in ARCH_FIELDS} == {f: getattr(cfg, f) for f in ARCH_FIELDS}


def test_a_small_model_with_the_released_field_set_matches_the_reference(folder):
    """The reference folder rewritten with the released config's field set and model_type "llada" imports as
    before (the same logits)."""
    d = folder("lladamoe")
    conf = json.loads((d / "config.json").read_text())
    small = ("vocab_size", "hidden_size", "dense_intermediate_size", "expert_intermediate_size",
             "shared_expert_intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "max_position_embeddings", "num_experts_per_tok", "num_experts", "moe_layer_freq", "mask_token_id",
             "eos_token_id", "pad_token_id", "rope_theta", "torch_dtype")
    (d / "config.json").write_text(json.dumps({**RELEASED_LLADA_MOE, **{k: conf[k] for k in small}}))
    model, cfg = load_hf_model(d)
    diff, scale = _max_diff(model, _reference("lladamoe"), padded=False)
    assert diff <= TOL * max(1.0, scale)
    assert cfg.moe_layer_freq == [0, 1, 1] and cfg.extra["hf_config"]["model_type"] == "llada"


# ------------------------------------------------------------------------------------------------ the recorded loss


def test_llada_and_dream_record_the_full_vocabulary_loss(hf_dirs, tmp_path):
    """LLaDA, LLaDA-MoE and Dream (imports and presets) record the full-vocabulary CE they were trained with; a
    Qwen import records none (the default, SUBS). A stock export writes it and reads it back; LLaDA's and Dream's own
    config.json stay as the originals (`test_export_writes_the_reference_files_back`)."""
    for name in MODELS:
        assert load_hf_model(DATA / name)[1].diffusion_loss == "full-vocab", name
    for preset in ("llada-8b", "llada-1.5-8b", "llada-moe-7b-a1b", "dream-7b"):
        assert preset_config(preset).loss == "full-vocab", preset
    qwen, qwen_cfg = load_hf_model(hf_dirs["qwen2"])
    assert qwen_cfg.diffusion_loss is None and qwen_cfg.loss == "subs"
    model, cfg = load_hf_model(DATA / "llada_llama")
    out = save_hf_model(model, cfg, tmp_path / "stock", hf_format="stock")
    assert json.loads((out / "config.json").read_text())["diffusion_loss"] == "full-vocab"
    assert load_hf_model(out)[1].diffusion_loss == "full-vocab"
    out = save_hf_model(qwen, qwen_cfg, tmp_path / "qwen")
    assert "diffusion_loss" not in json.loads((out / "config.json").read_text())
    with pytest.raises(ValueError, match="diffusion_loss='llada' is not one of \\['subs', 'full-vocab'\\]"):
        cfg.replace(diffusion_loss="llada")


@pytest.mark.filterwarnings("ignore:.*auto_map")
@pytest.mark.parametrize("flag", [None, "subs"])
def test_an_imported_llada_trains_with_its_recorded_loss_unless_told(flag, folder, tmp_path, capsys):
    """`train` on a converted LLaDA: the full-vocabulary CE without --diffusion-loss (the loss equals its definition
    from the logits, [MASK] in the softmax), SUBS with --diffusion-loss subs; the checkpoint records the loss."""
    from megadlms.training.args import parse_train_args
    from megadlms.training.trainer import setup

    d = folder("llada_llama")
    write_tokenizer(d, n_ids=300)
    assert main(["hf-to-megadlms", "--hf-model", str(d), "--save", str(tmp_path / "ck")]) == 0
    argv = ["--load", str(tmp_path / "ck"), "--use-checkpoint-args", "--finetune", "--seq-length", "16",
            "--train-iters", "1", "--micro-batch-size", "2", "--device", "cpu", "--no-compile", "--num-workers", "0",
            "--eval-iters", "0", "--no-progress", "--no-generate-sample", "--difflm-varilen-prob", "0",
            "--save", str(tmp_path / "ft")] + (["--diffusion-loss", flag] if flag else [])
    trainer = setup(parse_train_args(argv))
    obj, mask = trainer.objective, trainer.model_config.mask_token_id
    assert trainer.model_config.loss == (flag or "full-vocab")
    assert obj.validation_note().startswith("SUBS" if flag else "full-vocab CE")
    noise = obj.draw_noise(trainer.sampler, trainer.global_batch, 1)
    batch = next(obj.micro_batches(iter(trainer.loaders.train), noise, 1, trainer.device))
    n = batch.targets.shape[1]
    with torch.no_grad():
        logits = torch.nn.functional.linear(trainer.model(batch.inputs, output_hidden=True)[:, :n],
                                            trainer._output_weight()).float()
        got = obj.loss(trainer.model, batch, trainer._output_weight)
    keep = torch.arange(logits.shape[-1]) != mask
    lse = torch.logsumexp(logits[..., keep] if flag else logits, dim=-1)
    expect = ((lse - logits.gather(-1, batch.targets[..., None]).squeeze(-1)) * batch.weights).sum() / n / 2
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-6)
    trainer.run()
    assert ckpt.load_model_from_checkpoint(tmp_path / "ft")[1].loss == (flag or "full-vocab")
