"""megadlms.fp8.export: inference export (BF16 and FP8) and the FP8 inference model."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from megadlms.build import build_model
from megadlms.config import TransformerConfig
from megadlms.fp8.export import Float8InferenceLinear, export_model, load_fp8_export, quantize_weight

from .helpers import ref_fake_quant, rel


def _model(fp8: bool):
    cfg = TransformerConfig(num_layers=3, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=96,
                            seq_length=32, fp8=fp8, add_qkv_bias=True, num_layers_at_end_in_bf16=1)
    torch.manual_seed(0)
    return build_model(cfg), cfg


@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_fp8_export_layout_and_round_trip(tmp_path, scaling):
    model, cfg = _model(fp8=True)
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    info = export_model(model, cfg, tmp_path / "out", fp8=True, scaling=scaling, tokenizer_dir=tok)
    assert info["fp8_tensors"] == 14  # 7 linears x 2 FP8 layers (the last layer stays BF16)
    assert 0.45 < info["bytes"] / info["bf16_bytes"] < 0.8
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    assert TransformerConfig.from_dict(json.loads((tmp_path / "out" / "config.json").read_text())) == cfg
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert f.metadata()["megadlms.fp8"] == scaling
        w = f.get_tensor("layers.0.mlp.down_proj.weight")
        s = f.get_tensor("layers.0.mlp.down_proj.weight_scale_inv")
        assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        assert s.shape == ((1,) if scaling == "tensor" else (64, 1))
        master = model.layers[0].mlp.down_proj.weight.detach()
        ref = ref_fake_quant(master, torch.float8_e4m3fn, None if scaling == "tensor" else 1)
        assert rel(w.double() * s.double(), ref) < 1e-6  # dequantizes as documented
        assert f.get_tensor("layers.2.mlp.down_proj.weight").dtype == torch.bfloat16  # a BF16 layer
        assert f.get_tensor("layers.0.self_attn.q_proj.bias").dtype == torch.bfloat16
        assert f.get_tensor("embed_tokens.weight").dtype == torch.bfloat16
        assert "layers.0.self_attn.q_proj.fp8_amax_history" not in f.keys()

    loaded, cfg2 = load_fp8_export(tmp_path / "out")
    assert cfg2 == cfg and not loaded.training
    assert isinstance(loaded.layers[0].self_attn.q_proj, Float8InferenceLinear)
    assert type(loaded.layers[2].self_attn.q_proj) is torch.nn.Linear
    ids = torch.randint(0, 96, (2, 11))
    bf16 = _model(fp8=False)[0]  # same seed: same weights
    for p in bf16.parameters():
        p.data = p.data.to(torch.bfloat16)
    with torch.no_grad():
        ref = bf16(ids).float()
        out = loaded(ids).float()
    assert loaded(ids).dtype == torch.bfloat16
    assert 2e-3 < rel(out, ref) < 0.05  # FP8 weights and inputs: close to BF16, but not equal


def test_bf16_export_and_plain_model_fp8_selection(tmp_path):
    model, cfg = _model(fp8=False)
    info = export_model(model, cfg, tmp_path / "bf16")
    assert info["fp8_tensors"] == 0 and abs(info["bytes"] - info["bf16_bytes"]) < 8192
    loaded, _ = load_fp8_export(tmp_path / "bf16")
    ids = torch.randint(0, 96, (1, 5))
    for p in model.parameters():  # BF16 weights; the rotary tables stay fp32 (as in the loaded model)
        p.data = p.data.to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    # a model trained without FP8 still exports the linears convert_to_fp8 would convert
    info = export_model(_model(fp8=False)[0], cfg, tmp_path / "fp8", fp8=True)
    assert info["fp8_tensors"] == 14


def test_inference_linear_matches_quantized_reference_and_pads():
    torch.manual_seed(0)
    w = torch.randn(24, 40)  # neither dim a multiple of 16
    x = torch.randn(3, 7, 40)
    for scaling, axis in (("tensor", None), ("row", 1)):
        lin = Float8InferenceLinear(40, 24, bias=True, scaling=scaling, dtype=torch.float32)
        q, s = quantize_weight(w, scaling)
        lin.weight.copy_(q)
        lin.weight_scale_inv.copy_(s)
        lin.bias.copy_(torch.arange(24.0))
        y = lin(x)
        ref = ref_fake_quant(x.reshape(-1, 40), torch.float8_e4m3fn, axis) @ \
            ref_fake_quant(w, torch.float8_e4m3fn, axis).T + torch.arange(24.0).double().numpy()
        assert y.shape == (3, 7, 24) and rel(y.reshape(-1, 24), ref) < 1e-6


def test_missing_export_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="megadlms export"):
        load_fp8_export(tmp_path)


def test_inference_linear_keeps_fp8_weights_under_dtype_casts():
    lin = Float8InferenceLinear(32, 16, bias=True, scaling="row").to(torch.float32)
    assert lin.weight.dtype == torch.float8_e4m3fn and lin.weight_scale_inv.dtype == torch.float32
    assert lin.bias.dtype == torch.float32
