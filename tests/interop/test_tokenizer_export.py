"""An export tokenizes as training did: a run given a bare tokenizer.json saves checkpoints and exports whose
tokenizer_config.json makes `AutoTokenizer.from_pretrained` reproduce the training tokenizer.

The tokenizer here is the bundled one (pre-tokenizer: split at spaces, byte level), which is not Qwen's: without a
tokenizer_config.json, transformers builds a Qwen2Tokenizer for a qwen3 export, whose pre-tokenizer splits digits
and punctuation apart (`64y`, `object([`). qwen2 exports are the exception transformers makes (it always builds
Qwen2Tokenizer for them); `save_hf_model` warns there.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoTokenizer

from megadlms.config import TransformerConfig
from megadlms.data.tokenizer import complete_tokenizer_config, default_tokenizer_path, load_tokenizer
from megadlms.interop import save_hf_model
from megadlms.model import TransformerLM
from megadlms.training.checkpoint import load_model_from_checkpoint, save_model_checkpoint

CORPUS = [
    "object([x]) = 64y;\n\n\nreturn a2b3c4",
    "Wait!!! Really???  ...   ---- ====",
    "\ufffd\ufffd bytes \ufffd lost",
    "line one\r\nline two\n\ttabbed\n    indented",
    "abc123def 0x1F 3.14159e-10 v2.0.1-rc3",
    "  leading spaces and trailing   ",
    "<|endoftext|>after eod<|mask|><|pad|> specials inline",
    "naïve café — “quotes” 日本語 😀",
    "",
]
MASK = 1  # "<|mask|>" in the bundled tokenizer


@pytest.fixture
def bare(tmp_path):
    """A folder holding only the bundled tokenizer.json, as a run given `--tokenizer-model tokenizer.json` sees it."""
    folder = tmp_path / "bare"
    folder.mkdir()
    shutil.copyfile(default_tokenizer_path() / "tokenizer.json", folder / "tokenizer.json")
    return folder


def tiny(**kw) -> tuple[TransformerLM, TransformerConfig]:
    torch.manual_seed(0)
    cfg = TransformerConfig(**{**dict(num_layers=1, hidden_size=16, num_attention_heads=2, num_query_groups=1,
                                      ffn_hidden_size=32, vocab_size=4096, seq_length=32,
                                      max_position_embeddings=32, mask_token_id=MASK), **kw})
    return TransformerLM(cfg), cfg


def assert_same_tokenization(folder, training) -> None:
    hf = AutoTokenizer.from_pretrained(str(folder))
    for text in CORPUS:
        assert hf(text)["input_ids"] == training.encode(text), text
        ids = training.encode(text)
        assert hf.decode(ids) == training.decode(ids), text
    assert (hf.eos_token, hf.pad_token, hf.mask_token) == (training.eod_token, training.pad_token,
                                                           training.mask_token)
    assert hf.convert_tokens_to_ids(hf.mask_token) == MASK


def test_a_bare_tokenizer_json_alone_is_read_otherwise(bare, tmp_path):
    """What the tokenizer_config.json prevents: a qwen3 folder without one tokenizes differently."""
    folder = tmp_path / "qwen3"
    shutil.copytree(bare, folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    training = load_tokenizer(bare / "tokenizer.json")
    hf = AutoTokenizer.from_pretrained(str(folder))
    assert hf(CORPUS[0])["input_ids"] != training.encode(CORPUS[0])


@pytest.mark.parametrize("fmt, kw", [("stock", dict(qk_layernorm=True)),  # Qwen3ForCausalLM
                                     ("stock", dict()),  # LlamaForCausalLM
                                     ("llada", dict()),
                                     ("dream", dict(add_qkv_bias=True, diffusion_shift=True))])
@pytest.mark.filterwarnings("ignore:.*auto_map")  # LLaDA's / Dream's modeling code is not part of this test
def test_checkpoint_and_export_tokenize_as_training(bare, tmp_path, fmt, kw):
    training = load_tokenizer(bare / "tokenizer.json")
    model, cfg = tiny(**kw)
    ckpt = save_model_checkpoint(tmp_path / "ckpt", model, cfg, tokenizer_dir=training.source_dir)
    tok_dir = ckpt / "tokenizer"
    conf = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert conf["tokenizer_class"] == "PreTrainedTokenizerFast" and conf["mask_token"] == "<|mask|>"
    assert_same_tokenization(tok_dir, training)
    assert load_tokenizer(tok_dir).fingerprint == training.fingerprint

    loaded, cfg2, meta = load_model_from_checkpoint(tmp_path / "ckpt")
    out = save_hf_model(loaded, cfg2, tmp_path / "hf", tokenizer_dir=meta["tokenizer_dir"], hf_format=fmt)
    assert_same_tokenization(out, training)


def test_an_export_of_an_older_checkpoint_gets_one_too(bare, tmp_path):
    """A tokenizer folder saved without tokenizer_config.json (older checkpoints): the export writes it."""
    training = load_tokenizer(bare)
    model, cfg = tiny(qk_layernorm=True)
    out = save_hf_model(model, cfg, tmp_path / "hf", tokenizer_dir=bare)
    assert not (bare / "tokenizer_config.json").exists()
    assert_same_tokenization(out, training)


def test_an_existing_config_is_kept_and_completed(bare):
    """A folder's own tokenizer_config.json stays; only the special tokens it lacks are added."""
    (bare / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "eos_token": "<|endoftext|>", "chat_template": "T",
                                                            "model_max_length": 77}))
    assert complete_tokenizer_config(bare, mask_id=MASK)
    conf = json.loads((bare / "tokenizer_config.json").read_text())
    assert conf == {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "chat_template": "T",
                    "model_max_length": 77, "pad_token": "<|pad|>", "mask_token": "<|mask|>"}
    assert not complete_tokenizer_config(bare, mask_id=MASK)  # complete: nothing written
    assert not complete_tokenizer_config(bare.parent)  # no tokenizer.json: left alone


def test_the_models_mask_id_names_the_mask_token(bare):
    """A run whose --mask-token id is another token than the tokenizer's <|mask|> records that token."""
    assert complete_tokenizer_config(bare, mask_id=2)
    assert json.loads((bare / "tokenizer_config.json").read_text())["mask_token"] == "<|pad|>"
