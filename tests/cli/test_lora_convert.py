"""`megadlms convert merge-lora` and `megadlms-to-hf --lora`: the merged model computes what base + adapters
compute, and `peft` loads the exported adapter folder on the base's Hugging Face export with the same logits."""

import json

import pytest
import torch

from megadlms.cli.convert import main
from megadlms.training.args import parse_train_args
from megadlms.training.checkpoint import load_model_from_checkpoint
from megadlms.training.lora_run import load_lora_model
from megadlms.training.trainer import train

SMALL = ["--model-path", "tiny", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--num-query-groups", "2",
         "--ffn-hidden-size", "128", "--seq-length", "32", "--device", "cpu", "--no-compile", "--num-workers", "0",
         "--eval-iters", "0", "--log-interval", "1", "--no-progress", "--lr", "1e-2", "--micro-batch-size", "4",
         "--no-generate-sample", "--model-running-mode", "vanilla"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A causal base (so that transformers' stock class computes what it does) and LoRA adapters trained on it."""
    root = tmp_path_factory.mktemp("lora")
    train(parse_train_args(SMALL + ["--train-iters", "2", "--save", str(root / "base")]))
    train(parse_train_args(SMALL + ["--train-iters", "3", "--load", str(root / "base"), "--use-checkpoint-args",
                                    "--lora-rank", "4", "--lora-alpha", "16", "--lora-targets", "q,v,o,gate,down",
                                    "--save", str(root / "adapters")]))
    return root


def _ids(vocab):
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))


def test_merged_checkpoint_equals_base_plus_adapters(folders):
    assert main(["merge-lora", "--load", str(folders / "adapters"), "--save", str(folders / "merged")]) == 0
    lora_model, cfg, lora, _ = load_lora_model(folders / "adapters")
    merged, merged_cfg, meta = load_model_from_checkpoint(folders / "merged")
    assert "lora" not in merged_cfg.extra and meta["weights_only"]
    base, _, _ = load_model_from_checkpoint(folders / "base")
    ids = _ids(cfg.vocab_size)
    with torch.no_grad():
        want = lora_model(ids)
        assert (want - base(ids)).abs().max() > 1e-3  # the adapters were trained: they change the logits
        torch.testing.assert_close(merged(ids), want, rtol=1e-5, atol=1e-5)


def test_peft_loads_the_adapters_on_the_base_export(folders):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    assert main(["megadlms-to-hf", "--load", str(folders / "base"), "--save", str(folders / "hf_base")]) == 0
    assert main(["megadlms-to-hf", "--lora", "--load", str(folders / "adapters"), "--save",
                 str(folders / "peft")]) == 0
    config = json.loads((folders / "peft" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 16)
    assert config["target_modules"] == ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
    hf = AutoModelForCausalLM.from_pretrained(folders / "hf_base", dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(hf, folders / "peft").eval()
    ours, cfg, _, _ = load_lora_model(folders / "adapters")
    ids = _ids(cfg.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=1e-4, atol=1e-4)
        with hf.disable_adapter():  # and without them, the base
            base, _, _ = load_model_from_checkpoint(folders / "base")
            torch.testing.assert_close(hf(ids).logits, base(ids), rtol=1e-4, atol=1e-4)


def test_exporting_adapters_as_a_whole_model_is_a_one_line_error(folders, capsys):
    assert main(["megadlms-to-hf", "--load", str(folders / "adapters"), "--save", str(folders / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds LoRA adapters, not a whole model: add --lora" in err and "\n" not in err
    assert main(["merge-lora", "--load", str(folders / "base"), "--save", str(folders / "y")]) == 2
    assert "is not a LoRA checkpoint" in capsys.readouterr().err
