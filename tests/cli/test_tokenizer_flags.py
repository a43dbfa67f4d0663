"""The tokenizer flags `train` and `preprocess` take (--tokenizer-model, --tokenizer-type) in every command that
takes a tokenizer; --tokenizer stays as an alias of --tokenizer-model."""

import argparse
import json

import pytest
import torch

from megadlms import cli
from megadlms.config import TransformerConfig
from megadlms.data import default_tokenizer_path
from megadlms.model import TransformerLM
from megadlms.training.checkpoint import save_model_checkpoint


def parser(command):
    p = argparse.ArgumentParser()
    __import__(f"megadlms.cli.{command}", fromlist=["add_arguments"]).add_arguments(p)
    return p


@pytest.mark.parametrize("argv", [["eval", "--load", "ck"], ["generate", "--load", "ck"],
                                  ["convert", "megadlms-to-hf", "--load", "ck", "--save", "hf"]])
def test_both_names_reach_the_same_setting(argv):
    p = parser(argv[0])
    for flag in ("--tokenizer-model", "--tokenizer"):
        args = p.parse_args(argv[1:] + [flag, "tok/tokenizer.json", "--tokenizer-type", "HuggingFaceTokenizer"])
        assert args.tokenizer_model == "tok/tokenizer.json" and args.tokenizer_type == "HuggingFaceTokenizer"
    assert p.parse_args(argv[1:]).tokenizer_model is None


@pytest.mark.parametrize("argv", [["eval", "--load", "{ck}", "--tasks", "x"],
                                  ["generate", "--load", "{ck}", "--prompt", "hi"],
                                  ["convert", "megadlms-to-hf", "--load", "{ck}", "--save", "{tmp}/hf"]])
def test_an_unsupported_tokenizer_type_is_one_line(tmp_path, capsys, argv):
    argv = [a.format(ck=tmp_path / "ck", tmp=tmp_path) for a in argv] + ["--tokenizer-type", "GPT2BPETokenizer"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tokenizer-type 'GPT2BPETokenizer' is not supported; use HuggingFaceTokenizer" \
        in err
    assert not (tmp_path / "hf").exists()


def test_convert_ships_the_tokenizer_named_by_its_file(tmp_path, capsys):
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=4096,
                            seq_length=16, mask_token_id=1)
    save_model_checkpoint(tmp_path / "ck", TransformerLM(cfg), cfg)  # a checkpoint without its tokenizer
    tok = default_tokenizer_path() / "tokenizer.json"
    assert cli.main(["convert", "megadlms-to-hf", "--load", str(tmp_path / "ck"), "--save", str(tmp_path / "hf"),
                     "--tokenizer-model", str(tok)]) == 0
    assert json.loads((tmp_path / "hf" / "tokenizer.json").read_text()) == json.loads(tok.read_text())
    assert "warning" not in capsys.readouterr().err
    assert cli.main(["convert", "megadlms-to-hf", "--load", str(tmp_path / "ck"), "--save", str(tmp_path / "hf2"),
                     "--tokenizer-model", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert "--tokenizer-model " + str(tmp_path / "nothing") + ": no such file or folder" in err
