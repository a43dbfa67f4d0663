import os

import pytest
import torch

from megadlms import TransformerConfig, build_model
from megadlms.training import checkpoint as ckpt


def tiny():
    return TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64,
                             vocab_size=50, seq_length=16)


def test_model_checkpoint_round_trip(tmp_path):
    torch.manual_seed(0)
    cfg = tiny()
    model = build_model(cfg)
    ckpt.save_model_checkpoint(tmp_path, model, cfg, iteration=3)
    loaded, cfg2, meta = ckpt.load_model_from_checkpoint(tmp_path)
    assert cfg2 == cfg and meta["iteration"] == 3 and meta["tokenizer_dir"] is None
    for k, v in model.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k])


def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    cfg = tiny()
    model = build_model(cfg)
    ckpt.save_model_checkpoint(tmp_path, model, cfg, iteration=1)
    real_replace = os.replace

    def crash(src, dst):
        if str(dst).endswith("iter_0000002"):
            raise KeyboardInterrupt("killed")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_model_checkpoint(tmp_path, model, cfg, iteration=2)
    monkeypatch.setattr(os, "replace", real_replace)
    assert ckpt.find_checkpoint(tmp_path).name == "iter_0000001"  # the half-written one is not trusted
    assert not (tmp_path / "iter_0000002").exists()
    ckpt.save_model_checkpoint(tmp_path, model, cfg, iteration=2)  # the next save cleans up
    assert ckpt.find_checkpoint(tmp_path).name == "iter_0000002"
    assert not list(tmp_path.glob(".tmp_*"))


def test_incomplete_or_missing_checkpoints_are_refused(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match="latest_checkpointed_iteration.txt"):
        ckpt.find_checkpoint(tmp_path)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint in .*hf: it holds a config.json, as a Hugging Face "
                                                   "or `megadlms export` folder does; import a Hugging Face folder"):
        ckpt.find_checkpoint(hf)
    (tmp_path / "iter_0000005").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5\n")
    with pytest.raises(ckpt.CheckpointError, match="incomplete"):
        ckpt.find_checkpoint(tmp_path)
