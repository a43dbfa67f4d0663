"""megadlms.cli.export: `megadlms export` of a checkpoint, read back through the FP8 inference model."""

from __future__ import annotations

import argparse
import json

import torch
from safetensors import safe_open

from megadlms.build import build_model
from megadlms.cli import export
from megadlms.config import TransformerConfig
from megadlms.fp8 import Float8Linear
from megadlms.fp8.export import load_fp8_export
from megadlms.training.checkpoint import save_model_checkpoint


def test_export_command_from_checkpoint(tmp_path, capsys):
    cfg = TransformerConfig(num_layers=3, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=96,
                            seq_length=32, fp8=True, add_qkv_bias=True, first_last_layers_bf16=True,
                            num_layers_at_start_in_bf16=0)
    torch.manual_seed(0)
    model = build_model(cfg)
    assert any(isinstance(m, Float8Linear) for m in model.modules())
    save_model_checkpoint(tmp_path / "ckpt", model, cfg)
    parser = argparse.ArgumentParser()
    export.add_arguments(parser)
    assert export.run(parser.parse_args(["--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "out"),
                                         "--fp8"])) == 0
    out = capsys.readouterr().out
    assert "MiB" in out and "BF16 export" in out
    loaded, _ = load_fp8_export(tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        stored = f.get_tensor("layers.1.self_attn.o_proj.weight")
    assert torch.equal(loaded.layers[1].self_attn.o_proj.weight.view(torch.uint8), stored.view(torch.uint8))


def test_export_of_a_blockwise_checkpoint_keeps_its_blocks(tmp_path, capsys):
    cfg = TransformerConfig(num_layers=1, hidden_size=128, num_attention_heads=2, ffn_hidden_size=256, vocab_size=96,
                            seq_length=32, fp8=True, fp8_format="e4m3", fp8_recipe="blockwise")
    torch.manual_seed(0)
    save_model_checkpoint(tmp_path / "ckpt", build_model(cfg), cfg)
    parser = argparse.ArgumentParser()
    export.add_arguments(parser)
    for out, extra in (("out", []), ("hf", ["--hf"])):
        assert export.run(parser.parse_args(["--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / out),
                                             "--fp8", *extra])) == 0
        assert "per-block scales" in capsys.readouterr().out
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert f.metadata()["megadlms.fp8"] == "block"
        assert f.get_tensor("layers.0.mlp.down_proj.weight_scale_inv").shape == (1, 2)
    hf_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_cfg["quantization_config"]["weight_block_size"] == [128, 128]
