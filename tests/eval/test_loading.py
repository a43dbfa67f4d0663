"""`megadlms.eval.loading`: which source loads a folder, and a folder given to the wrong one named in one line."""

import json

import pytest
import torch

from megadlms.config import ConfigError, TransformerConfig
from megadlms.eval.loading import load_model, model_folder_kind
from megadlms.fp8.export import export_model
from megadlms.interop import save_hf_model
from megadlms.model import TransformerLM
from megadlms.training.checkpoint import save_model_checkpoint


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64, vocab_size=64,
                            seq_length=16, mask_token_id=1)
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    save_model_checkpoint(root / "ckpt", model, cfg, iteration=2)
    save_hf_model(model, cfg, root / "hf")
    export_model(model, cfg, root / "export")
    (root / "other").mkdir()
    (root / "other" / "config.json").write_text(json.dumps([1, 2]))
    return root


def test_each_folder_is_told_apart(folders):
    assert model_folder_kind(folders / "ckpt") == "load"
    assert model_folder_kind(folders / "ckpt" / "iter_0000002") == "load"
    assert model_folder_kind(folders / "hf") == "hf_model"
    assert model_folder_kind(folders / "export") == "fp8_export"
    assert model_folder_kind(folders / "other") is None and model_folder_kind(folders / "missing") is None


@pytest.mark.parametrize("source, folder, message", [
    ("hf_model", "export", "--hf-model {p}: that is a `megadlms export` folder; load it with --fp8-export {p} "
                           "(fp8_export=)"),
    ("fp8_export", "hf", "--fp8-export {p}: that is a Hugging Face model folder; load it with --hf-model {p} "
                         "(hf_model=)"),
    ("load", "hf", "--load {p}: that is a Hugging Face model folder; load it with --hf-model {p} (hf_model=)"),
    ("hf_model", "ckpt", "--hf-model {p}: that is a megadlms checkpoint folder (`megadlms train --save`); load it "
                         "with --load {p} (load=)"),
])
def test_a_folder_given_to_the_wrong_source_names_the_right_one(folders, source, folder, message):
    path = folders / folder
    with pytest.raises(ConfigError) as err:
        load_model(**{source: str(path)}, device=torch.device("cpu"))
    assert str(err.value) == message.format(p=path)


def test_each_source_loads_its_folder(folders):
    logits = []
    for source, folder in (("load", "ckpt"), ("hf_model", "hf"), ("fp8_export", "export")):
        model, cfg, _ = load_model(**{source: str(folders / folder)}, device=torch.device("cpu"), dtype="fp32")
        assert cfg.hidden_size == 32
        logits.append(model(torch.arange(8)[None]).float())
    torch.testing.assert_close(logits[1], logits[0])
    torch.testing.assert_close(logits[2], logits[0], rtol=0.02, atol=0.02)  # the export stores bfloat16
