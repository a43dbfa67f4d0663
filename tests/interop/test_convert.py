"""megadlms.cli.convert: the `megadlms convert` subcommands, end to end on files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import megadlms.interop.hf as hf_module
import megadlms.training.checkpoint as ckpt
from megadlms.cli.convert import main
from megadlms.interop import load_hf_state_dict

from .helpers import MASK_ID


def _import(src, dst, *extra) -> int:
    return main(["hf-to-megadlms", "--hf-model", str(src), "--save", str(dst), *extra])


def _export(src, dst, *extra) -> int:
    return main(["megadlms-to-hf", "--load", str(src), "--save", str(dst), *extra])


def test_import_with_verify(hf_dirs, tmp_path, capsys):
    rc = _import(hf_dirs["qwen3"], tmp_path / "ck", "--mask-token", "<|mask|>", "--attn-mask-type", "bidirectional",
                 "--verify")
    out = capsys.readouterr().out
    assert rc == 0 and "PASSED" in out and "bidirectional attention" in out
    model, cfg, meta = ckpt.load_model_from_checkpoint(tmp_path / "ck")
    assert cfg.mask_token_id == MASK_ID and cfg.attn_mask_type == "bidirectional" and cfg.qk_layernorm
    assert cfg.extra["hf_architecture"] == "Qwen3ForCausalLM"
    src = load_hf_state_dict(hf_dirs["qwen3"])
    k_norm = "layers.1.self_attn.k_norm.weight"
    assert torch.equal(model.state_dict()[k_norm], src[f"model.{k_norm}"])
    # only the tokenizer files travel, not the weights next to them
    assert sorted(p.name for p in Path(meta["tokenizer_dir"]).iterdir()) == ["tokenizer.json", "tokenizer_config.json"]


def test_import_sharded_causal_with_verify(hf_dirs, tmp_path, capsys):
    assert _import(hf_dirs["qwen2"], tmp_path / "ck", "--verify", "--dtype", "bfloat16") == 0
    assert "causal attention" in capsys.readouterr().out  # a stock model stays causal unless asked
    model, cfg, _ = ckpt.load_model_from_checkpoint(tmp_path / "ck")
    src = load_hf_state_dict(hf_dirs["qwen2"])["model.layers.0.self_attn.q_proj.bias"]
    assert torch.equal(model.layers[0].self_attn.q_proj.bias.float(), src.bfloat16().float()) and cfg.add_qkv_bias


def test_export_with_verify_sharded(hf_dirs, tmp_path, capsys):
    assert _import(hf_dirs["qwen3"], tmp_path / "ck", "--mask-token", "1", "--attn-mask-type", "bidirectional") == 0
    rc = _export(tmp_path / "ck", tmp_path / "hf", "--verify", "--max-shard-size", "20KB")
    assert rc == 0 and "PASSED" in capsys.readouterr().out
    out = tmp_path / "hf"
    assert len(list(out.glob("model-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    conf = json.loads((out / "config.json").read_text())
    assert conf["mask_token_id"] == MASK_ID and conf["attn_mask_type"] == "bidirectional" and not conf["is_causal"]
    assert AutoTokenizer.from_pretrained(str(out))("w3 w4").input_ids == [3, 4]
    # the source's generation_config.json is carried over
    gen_src = json.loads((hf_dirs["qwen3"] / "generation_config.json").read_text())
    assert json.loads((out / "generation_config.json").read_text()) == gen_src
    # weights bit-identical to the original HF folder
    src, back = load_hf_state_dict(hf_dirs["qwen3"]), load_hf_state_dict(out)
    assert set(src) == set(back) and all(torch.equal(src[k], back[k]) for k in src)
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert hf.config.is_causal is False


def test_export_bf16_verifies_against_rounded_weights(hf_dirs, tmp_path):
    assert _import(hf_dirs["llama"], tmp_path / "ck") == 0
    assert _export(tmp_path / "ck", tmp_path / "hf", "--dtype", "bfloat16", "--verify") == 0
    assert load_file(str(tmp_path / "hf" / "model.safetensors"))["lm_head.weight"].dtype == torch.bfloat16
    # the standalone check compares at the lower stored precision too
    assert main(["verify", "--load", str(tmp_path / "ck"), "--hf-model", str(tmp_path / "hf")]) == 0


def test_verify_fails_on_a_corrupted_export(hf_dirs, tmp_path, capsys):
    assert _import(hf_dirs["llama"], tmp_path / "ck") == 0
    assert _export(tmp_path / "ck", tmp_path / "hf") == 0
    assert main(["verify", "--load", str(tmp_path / "ck"), "--hf-model", str(tmp_path / "hf")]) == 0
    f = tmp_path / "hf" / "model.safetensors"
    sd = load_file(str(f))
    sd["model.layers.0.self_attn.v_proj.weight"][0, :4] += 0.05  # a few flipped values on disk
    save_file(sd, str(f), metadata={"format": "pt"})
    capsys.readouterr()
    assert main(["verify", "--load", str(tmp_path / "ck"), "--hf-model", str(tmp_path / "hf")]) == 1
    captured = capsys.readouterr()
    assert "FAILED" in captured.out and "verification failed" in captured.err


def test_import_verify_fails_when_the_checkpoint_is_corrupted(hf_dirs, tmp_path, monkeypatch, capsys):
    real_save = ckpt.save_model_checkpoint

    def corrupting_save(save_dir, model, cfg, **kw):  # a faulty write: one weight changes on the way to disk
        with torch.no_grad():
            model.layers[0].mlp.gate_proj.weight[1, 2] += 0.1
        return real_save(save_dir, model, cfg, **kw)

    monkeypatch.setattr(ckpt, "save_model_checkpoint", corrupting_save)
    assert _import(hf_dirs["llama"], tmp_path / "ck", "--verify") == 1
    assert "verification failed" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:AutoTokenizer.from_pretrained")  # qwen2 with the non-Qwen test tokenizer
def test_export_verify_fails_when_the_files_are_corrupted(hf_dirs, tmp_path, monkeypatch, capsys):
    assert _import(hf_dirs["qwen2"], tmp_path / "ck") == 0
    real_write = hf_module.save_safetensors_sharded

    def corrupting_write(sd, save_dir, **kw):
        sd = dict(sd)
        sd["model.layers.1.self_attn.q_proj.bias"] = sd["model.layers.1.self_attn.q_proj.bias"] + 0.1
        return real_write(sd, save_dir, **kw)

    monkeypatch.setattr(hf_module, "save_safetensors_sharded", corrupting_write)
    assert _export(tmp_path / "ck", tmp_path / "hf", "--verify") == 1
    assert "verification failed" in capsys.readouterr().err


def test_bad_input_exits_2_with_the_reason(hf_copy, tmp_path, capsys):
    d = hf_copy("qwen2")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    (d / shard).unlink()
    assert _import(d, tmp_path / "ck") == 2
    assert f"error: missing shard '{shard}'" in capsys.readouterr().err
    d = hf_copy("llama")
    conf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**conf, "architectures": ["GPT2LMHeadModel"]}))
    assert _import(d, tmp_path / "ck") == 2
    assert "unsupported Hugging Face architecture 'GPT2LMHeadModel'" in capsys.readouterr().err
    assert _import(tmp_path / "nowhere", tmp_path / "ck") == 2
    assert "no config.json" in capsys.readouterr().err
    assert _export(tmp_path / "no_checkpoint", tmp_path / "hf") == 2
    assert "error:" in capsys.readouterr().err
    assert _import(hf_copy("llama"), tmp_path / "ck", "--mask-token", "500") == 2
    assert "mask_token_id=500 is outside the vocabulary" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # argparse: a required flag missing
        main(["hf-to-megadlms", "--save", str(tmp_path / "x")])
    assert e.value.code == 2


def test_megadlms_cli_dispatches_convert(hf_dirs, tmp_path, capsys):
    from megadlms.cli import main as cli_main

    assert cli_main(["convert", "hf-to-megadlms", "--hf-model", str(hf_dirs["llama"]), "--save", str(tmp_path)]) == 0
    assert "imported LlamaForCausalLM" in capsys.readouterr().out
    _, cfg, _ = ckpt.load_model_from_checkpoint(tmp_path)
    assert cfg.extra["hf_source"] == str(hf_dirs["llama"].resolve())


@pytest.mark.parametrize("family, damage", [
    ("llama", "truncated"), ("qwen2", "truncated"), ("llama", "lfs-pointer")])
def test_import_of_a_damaged_safetensors_names_the_file(hf_copy, tmp_path, capsys, family, damage):
    """A truncated file (a single model.safetensors, one shard of a sharded folder) or a Git LFS pointer left in
    place of the weights: one line naming the file and the fix, no traceback."""
    d = hf_copy(family)
    victim = sorted(d.glob("*.safetensors"))[-1]
    if damage == "truncated":
        victim.write_bytes(victim.read_bytes()[:50])
        fix = r"is not a complete safetensors file \(invalid header length\): it is truncated or damaged; copy"
    else:
        victim.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 1234\n")
        fix = r"is a Git LFS pointer, not the weights: run `git lfs pull`"
    assert _import(d, tmp_path / "ck") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert re.fullmatch(rf"megadlms convert hf-to-megadlms: error: {re.escape(str(victim))} {fix}.*\n", err), err
