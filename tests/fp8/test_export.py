"""megadlms.fp8.export: inference export (BF16 and FP8) and the FP8 inference model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from megadlms.build import build_model
from megadlms.config import TransformerConfig
from megadlms.fp8.export import (
    Float8InferenceLinear,
    export_hf,
    export_model,
    export_tensors,
    load_fp8_export,
    quantize_weight,
    scaling_of,
)
from megadlms.interop import InteropError, load_hf_model
from megadlms.model import TransformerLM

from .helpers import ref_fake_quant, rel


def _model(fp8: bool):
    cfg = TransformerConfig(num_layers=3, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=96,
                            seq_length=32, fp8=fp8, add_qkv_bias=True, first_last_layers_bf16=True,
                            num_layers_at_start_in_bf16=0)
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


def _blocks_of(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Block scales [ceil(R/128), ceil(C/128)] repeated over their blocks, cut to [rows, cols]."""
    return t.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]


def test_block_scaled_weight_is_deepseeks_layout_within_fp8_error():
    torch.manual_seed(0)
    w = torch.randn(200, 300) * torch.logspace(-3, 1, 300)  # the blocks along K see amaxes 10^4 apart
    q, s = quantize_weight(w, "block")
    assert q.dtype == torch.float8_e4m3fn and q.shape == (200, 300)
    assert s.dtype == torch.float32 and s.shape == (2, 3)  # one scale per 128x128 block, partial blocks included
    deq = q.float() * _blocks_of(s, 200, 300)
    for i in range(2):
        for j in range(3):
            block = w[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]
            assert rel(deq[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)], ref_fake_quant(block, torch.float8_e4m3fn)
                       ) < 1e-6  # each block: per-tensor current scaling of its own (amax / 448)
            assert abs(s[i, j].item() - block.abs().max().item() / 448) < 1e-6 * s[i, j].item()
    # within FP8 error of the originals: half a step of E4M3 (3 mantissa bits), or of its subnormals
    assert ((deq - w).abs() <= w.abs() / 16 + _blocks_of(s, 200, 300) * 2.0 ** -10).all()


def test_inference_linear_with_block_scales_matches_tiles_times_blocks():
    torch.manual_seed(0)
    w, x = torch.randn(200, 300), torch.randn(2, 5, 300)
    lin = Float8InferenceLinear(300, 200, bias=True, scaling="block", dtype=torch.float32)
    q, s = quantize_weight(w, "block")
    lin.weight.copy_(q)
    lin.weight_scale_inv.copy_(s)
    lin.bias.copy_(torch.arange(200.0))
    x2 = x.reshape(-1, 300)
    x_ref = np.concatenate([ref_fake_quant(x2[:, j:j + 128], torch.float8_e4m3fn, 1) for j in range(0, 300, 128)], 1)
    ref = x_ref @ (q.double() * _blocks_of(s, 200, 300).double()).numpy().T + np.arange(200.0)
    assert rel(lin(x).reshape(-1, 200), ref) < 1e-6


def _blockwise_model():
    cfg = TransformerConfig(num_layers=2, hidden_size=128, num_attention_heads=2, num_query_groups=1,
                            ffn_hidden_size=256, vocab_size=96, seq_length=32, fp8=True, fp8_format="e4m3",
                            fp8_recipe="blockwise", first_last_layers_bf16=True, num_layers_at_start_in_bf16=0,
                            untie_embeddings_and_output_weights=True)
    torch.manual_seed(0)
    return build_model(cfg), cfg


def test_blockwise_model_exports_block_scales_and_runs_them(tmp_path):
    model, cfg = _blockwise_model()
    assert scaling_of(cfg) == "block"
    info = export_model(model, cfg, tmp_path / "out", fp8=True, scaling=scaling_of(cfg))
    assert info["fp8_tensors"] == 7
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert f.metadata()["megadlms.fp8"] == "block"
        assert f.get_tensor("layers.0.mlp.down_proj.weight_scale_inv").shape == (1, 2)  # [128, 256]
        assert f.get_tensor("layers.0.mlp.gate_proj.weight_scale_inv").shape == (2, 1)  # [256, 128]
    loaded, _ = load_fp8_export(tmp_path / "out")
    assert loaded.layers[0].mlp.down_proj.scaling == "block"
    ids = torch.randint(0, 96, (2, 11))
    with torch.no_grad():
        ref = model.float()(ids)
        assert 1e-3 < rel(loaded(ids).float(), ref) < 0.05  # FP8 weights and input tiles: close, not equal


def test_hugging_face_block_fp8_export(tmp_path):
    model, cfg = _blockwise_model()
    info = export_hf(model, cfg, tmp_path / "hf", fp8=True)
    assert info["fp8_tensors"] == 7 and info["bytes"] < info["bf16_bytes"]
    hf_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    q = hf_cfg["quantization_config"]
    assert {k: q[k] for k in ("quant_method", "fmt", "activation_scheme", "weight_block_size")} == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    bf16_linears = [f"model.layers.1.{n}" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                      "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                      "mlp.down_proj")]
    assert sorted(q["modules_to_not_convert"]) == sorted(["lm_head", *bf16_linears])
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        w = f.get_tensor("model.layers.0.mlp.up_proj.weight")
        s = f.get_tensor("model.layers.0.mlp.up_proj.weight_scale_inv")
        assert w.dtype == torch.float8_e4m3fn and s.shape == (2, 1)
        assert f.get_tensor("model.layers.1.mlp.up_proj.weight").dtype == torch.bfloat16
        assert "model.layers.1.mlp.up_proj.weight_scale_inv" not in f.keys()
        master = model.layers[0].mlp.up_proj.weight.detach()
        assert ((w.float() * _blocks_of(s, 256, 128) - master).abs() <= master.abs() / 16 + s.max() * 2.0 ** -10).all()
    with pytest.raises(ValueError, match="--fp8-scaling block"):
        export_hf(model, cfg, tmp_path / "hf2", fp8=True, scaling="tensor")
    # our Hugging Face loader (generate / eval --hf-model) names the quantization instead of the scales' tensors
    with pytest.raises(InteropError, match="quantization_config, quant_method 'fp8'"):
        load_hf_model(tmp_path / "hf")


def test_transformers_loads_the_block_fp8_export(tmp_path):
    """transformers' fine-grained FP8 loader (it dequantises to BF16 without a GPU; it needs accelerate)."""
    pytest.importorskip("accelerate", reason="transformers loads fine-grained FP8 checkpoints through accelerate")
    from megadlms.interop.verify import load_transformers_model

    model, cfg = _blockwise_model()
    export_hf(model, cfg, tmp_path / "hf", fp8=True)
    hf = load_transformers_model(tmp_path / "hf", causal=False)
    tensors, _, _ = export_tensors(model, fp8=True, scaling="block")
    deq = {k: (v.float() * _blocks_of(tensors[k + "_scale_inv"], *v.shape) if v.dtype == torch.float8_e4m3fn
               else v.float()) for k, v in tensors.items() if not k.endswith("_scale_inv")}
    plain = TransformerLM(cfg.replace(fp8=False)).eval()
    plain.load_state_dict(deq, strict=False)
    ids = torch.randint(0, 96, (2, 11))
    with torch.no_grad():
        assert rel(hf(input_ids=ids).logits, plain(ids)) < 1e-5  # the same dequantised weights: fp32 rounding
