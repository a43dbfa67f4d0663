"""AR-to-DLM: adding a mask token to an AR checkpoint, and the export keeping the token, the mode and the id."""

import importlib.util
import json
from pathlib import Path

import torch

from megadlms.cli.convert import main as convert
from megadlms.interop.hf import hf_config_to_megadlms, save_hf_model
from megadlms.training.checkpoint import load_model_from_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def _example():
    spec = importlib.util.spec_from_file_location("ar_to_dlm", ROOT / "examples" / "sft" / "ar_to_dlm.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_add_mask_token_then_export_in_shift_mode(tmp_path):
    example = _example()
    example.build_ar_model(tmp_path / "hf")
    assert convert(["hf-to-megadlms", "--hf-model", str(tmp_path / "hf"), "--save", str(tmp_path / "ck"),
                    "--add-mask-token", "--verify"]) == 0
    model, cfg, meta = load_model_from_checkpoint(tmp_path / "ck")
    tok_dir = Path(meta["tokenizer_dir"])
    tok = json.loads((tok_dir / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert added["<|mask|>"] == 4096 == cfg.mask_token_id
    assert cfg.vocab_size == 4224 and cfg.extra["added_tokens"] == {"<|mask|>": 4096}
    emb = model.embed_tokens.weight
    torch.testing.assert_close(emb[4096], emb[:4096].mean(0))
    torch.testing.assert_close(emb[4200], emb[:4096].mean(0))
    assert json.loads((tok_dir / "tokenizer_config.json").read_text())["mask_token"] == "<|mask|>"
    assert convert(["hf-to-megadlms", "--hf-model", str(tmp_path / "hf"), "--save", str(tmp_path / "x"),
                    "--add-mask-token", "--mask-token", "3"]) == 2

    # trained as difflm-shift (bidirectional, shifted logits): the export records the mode, token and id
    dlm = cfg.replace(attn_mask_type="bidirectional", diffusion_shift=True)
    out = save_hf_model(model, dlm, tmp_path / "export", tokenizer_dir=tok_dir)
    conf = json.loads((out / "config.json").read_text())
    assert conf["model_running_mode"] == "difflm-shift" and conf["mask_token_id"] == 4096
    back = hf_config_to_megadlms(conf)
    assert back.diffusion_shift and back.mask_token_id == 4096 and back.attn_mask_type == "bidirectional"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(str(out))
    assert hf_tok.mask_token_id == 4096 and hf_tok.convert_ids_to_tokens(4096) == "<|mask|>"
    hf_model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = hf_tok("a <|mask|> b", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ref = hf_model(ids).logits
        ours = model.eval()(ids, attention_mask=torch.ones_like(ids, dtype=torch.bool)[:, None, None, :]
                            .expand(-1, 1, ids.shape[1], -1))
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
