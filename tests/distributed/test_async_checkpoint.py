"""--async-save: the write runs in the background on a copy taken at save time, and the checkpoint becomes
visible (renamed into place, `latest` moved) only when it is committed after the write completed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megadlms.training import checkpoint as ckpt


def _state(model: nn.Module) -> dict:
    return {"model": model.state_dict(), "train": {"iteration": 1}}


def test_async_checkpoint_holds_the_values_at_save_time_and_appears_when_committed(tmp_path):
    model = nn.Linear(8, 4)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    pending = ckpt.async_save_checkpoint(tmp_path, 5, _state(model), rank_state={"rng": 1}, meta={"config": {}})
    with torch.no_grad():  # training goes on while the write runs
        model.weight.add_(1.0)
    with pytest.raises(ckpt.CheckpointError, match="latest_checkpointed_iteration.txt is missing"):
        ckpt.find_checkpoint(tmp_path)  # not a checkpoint until committed
    path = pending.wait()
    assert ckpt.find_checkpoint(tmp_path) == path == tmp_path / "iter_0000005"
    assert ckpt.read_meta(path)["iteration"] == 5
    assert ckpt.load_rank_state(path) == {"rng": 1}
    loaded = {"model": {k: torch.zeros_like(v) for k, v in saved.items()}}
    ckpt.load_app_state(path, loaded, partial=True)
    for k, v in saved.items():
        assert torch.equal(loaded["model"][k], v), k


def test_a_write_that_never_committed_is_ignored_and_cleaned_up(tmp_path):
    model = nn.Linear(8, 4)
    ckpt.save_checkpoint(tmp_path, 3, _state(model), meta={"config": {}})
    crashed = ckpt.async_save_checkpoint(tmp_path, 5, _state(model), meta={"config": {}})
    crashed.future.result()  # the files are written, but the process died before committing
    assert (tmp_path / ".tmp_iter_0000005").is_dir()
    assert ckpt.find_checkpoint(tmp_path) == tmp_path / "iter_0000003"
    with pytest.raises(ckpt.CheckpointError, match="missing or incomplete"):
        ckpt.find_checkpoint(tmp_path, 5)
    ckpt.async_save_checkpoint(tmp_path, 6, _state(model), meta={"config": {}}).wait()  # the next run's save
    assert not (tmp_path / ".tmp_iter_0000005").exists()
    assert ckpt.find_checkpoint(tmp_path) == tmp_path / "iter_0000006"
