"""Checkpoint faults: a disk that fills (or refuses) mid-save, retention, and every kind of damaged checkpoint
on resume. What the user sees is stated per case; none of them ends in a traceback."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import shutil

import pytest
import torch

from megadlms import cli
from megadlms.training import checkpoint as ckpt

from .conftest import TINY, logged_losses, tiny_trainer


def _train(capsys, *flags: str) -> tuple[int, str]:
    rc = cli.main(["train", *TINY, *flags])
    return rc, capsys.readouterr().err


def _latest(save) -> str:
    return (save / ckpt.LATEST).read_text().strip()


def _no_temp_folders(save) -> bool:
    return not [p for p in save.iterdir() if p.name.startswith((".tmp_", ".old_", ".del_"))]


def _fail_fsync(monkeypatch, code: int) -> None:
    """The disk fills (or fails) while DCP flushes its shard: a real write path, mid-save."""
    def fsync(fd):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(os, "fsync", fsync)


# ---------------------------------------------------------------------------------------------- failed saves
@pytest.mark.parametrize("code,shown", [
    (errno.ENOSPC, "No space left on device [ENOSPC]"),
    (errno.EIO, "Input/output error [EIO]"),
], ids=["disk-full-mid-shard->one-line-ENOSPC-latest-kept", "io-error-mid-shard->one-line-EIO-latest-kept"])
def test_a_failed_save_is_one_line_and_keeps_latest(run_copy, capsys, monkeypatch, code, shown):
    _fail_fsync(monkeypatch, code)
    rc, err = _train(capsys, "--train-iters", "3", "--save", str(run_copy), "--load", str(run_copy))
    assert rc == 2
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"megadlms train: error: could not save checkpoint {run_copy / 'iter_0000003'}: ")
    assert shown in line and "latest stays at iteration 2" in line
    assert _latest(run_copy) == "2" and _no_temp_folders(run_copy)
    monkeypatch.undo()
    assert ckpt.verify_checkpoint(ckpt.find_checkpoint(run_copy)) == []


def test_rank_state_write_fails_on_a_full_disk(run_copy, monkeypatch):
    real = torch.save

    def full(obj, f, *a, **k):  # part of the file is written, then the disk is full
        if hasattr(f, "write"):
            f.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, f, *a, **k)
    monkeypatch.setattr(torch, "save", full)
    trainer = tiny_trainer("--train-iters", "3", "--save", str(run_copy), "--load", str(run_copy))
    with pytest.raises(ckpt.CheckpointSaveError, match=r"iter_0000003: No space left on device \[ENOSPC\].*"
                                                        r"\(latest stays at iteration 2\)"):
        trainer.run()
    assert _latest(run_copy) == "2" and _no_temp_folders(run_copy)


def test_permission_denied_for_the_temporary_folder(run_copy, monkeypatch):
    real = pathlib.Path.mkdir

    def denied(self, *a, **k):
        if self.name.startswith(".tmp_"):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self, *a, **k)
    monkeypatch.setattr(pathlib.Path, "mkdir", denied)
    trainer = tiny_trainer("--train-iters", "3", "--save", str(run_copy), "--load", str(run_copy))
    with pytest.raises(ckpt.CheckpointSaveError, match=r"Permission denied \[EACCES\].*make the folder writable"):
        trainer.run()
    assert _latest(run_copy) == "2"


def test_save_failures_ok_lets_training_go_on(tmp_path, capsys, monkeypatch, caplog):
    calls = {"n": 0}
    real = ckpt._write_atomic

    def flaky(path, text):  # the first save's meta.json hits a full disk, later saves succeed
        if path.name == ckpt.META and calls["n"] == 0:
            calls["n"] += 1
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, text)
    monkeypatch.setattr(ckpt, "_write_atomic", flaky)
    save = tmp_path / "ck"
    trainer = tiny_trainer("--train-iters", "3", "--save", str(save), "--save-interval", "1",
                           "--ckpt-save-failures-ok", "1")
    state = trainer.run()
    assert state.iteration == 3
    assert ckpt.complete_iterations(save) == [2, 3] and _latest(save) == "3" and _no_temp_folders(save)
    assert "training goes on (failed save 1 of the 1 --ckpt-save-failures-ok allows)" in caplog.text


def test_an_unexpected_error_in_a_save_keeps_its_traceback(tmp_path, monkeypatch):
    def bug(state, checkpoint_id):
        raise TypeError("a bug, not the disk")
    monkeypatch.setattr(ckpt.dcp, "save", bug)
    trainer = tiny_trainer("--train-iters", "1", "--save", str(tmp_path / "ck"))
    with pytest.raises(TypeError, match="a bug"):
        trainer.run()
    assert _no_temp_folders(tmp_path / "ck")


# ---------------------------------------------------------------------------------------------- retention
def test_keep_last_keeps_the_newest(tmp_path):
    save = tmp_path / "ck"
    tiny_trainer("--train-iters", "4", "--save", str(save), "--save-interval", "1", "--ckpt-keep-last", "2").run()
    assert ckpt.complete_iterations(save) == [3, 4] and _latest(save) == "4" and _no_temp_folders(save)


def test_pruning_never_deletes_what_latest_names(run_copy):
    (run_copy / ckpt.LATEST).write_text("1\n")  # e.g. a rollback: latest is the older one
    assert ckpt.prune_checkpoints(run_copy, 1) == []
    assert ckpt.complete_iterations(run_copy) == [1, 2]


# ---------------------------------------------------------------------------------------------- damaged checkpoints
def _truncate(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


def _flip(path, at=100):
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


D = "iter_0000002"
DAMAGES = {  # id (what is damaged -> what the user sees): (damage, expected message)
    "latest-not-a-number->names-file-lists-1,2": (lambda r: (r / ckpt.LATEST).write_text("abc\n"),
                                                  r"should hold an iteration number, not 'abc'.*: 1, 2"),
    "latest-empty->names-file": (lambda r: (r / ckpt.LATEST).write_text(""), r"not ''"),
    "latest-names-missing-iteration->lists-1,2": (lambda r: (r / ckpt.LATEST).write_text("7\n"),
                                                  r"iter_0000007 is missing or incomplete.*: 1, 2"),
    "latest-deleted->lists-1,2": (lambda r: (r / ckpt.LATEST).unlink(), r"latest_checkpointed_iteration.txt is "
                                                                         r"missing.*: 1, 2"),
    "shard-truncated->names-shard-lists-1": (lambda r: _truncate(r / D / "__0_0.distcp", 1000),
                                             r"damaged: __0_0.distcp has 1000 bytes.*truncated.*: 1; load one"),
    "shard-bit-flip->checksum-mismatch": (lambda r: _flip(r / D / "__0_0.distcp"),
                                          r"__0_0.distcp does not match its checksum"),
    "shard-deleted->names-shard": (lambda r: (r / D / "__0_0.distcp").unlink(), r"__0_0.distcp is missing"),
    "dcp-metadata-truncated->names-it": (lambda r: _truncate(r / D / ".metadata", 10), r"\.metadata has 10 bytes"),
    "meta-json-garbage->cannot-be-read": (lambda r: (r / D / ckpt.META).write_text("{bad"),
                                          r"meta.json cannot be read"),
    "meta-json-other-format->names-format": (lambda r: (r / D / ckpt.META).write_text('{"format": "x"}'),
                                             r"has format 'x'"),
    "meta-json-deleted->incomplete-lists-1": (lambda r: (r / D / ckpt.META).unlink(),
                                              r"iter_0000002 is missing or incomplete.*: 1; load one by its number"),
    "rank-state-truncated->names-file": (lambda r: _truncate(r / D / "rank_00000.pt", 50),
                                         r"rank_00000.pt has 50 bytes"),
    "checksum-record-garbage->names-record": (lambda r: (r / D / "crc32_00000.json").write_text("]"),
                                              r"crc32_00000.json cannot be read"),
}


@pytest.mark.parametrize("kind", list(DAMAGES))
def test_damaged_checkpoint_is_named_on_resume(run_copy, capsys, kind):
    damage, message = DAMAGES[kind]
    damage(run_copy)
    rc, err = _train(capsys, "--train-iters", "3", "--load", str(run_copy))
    assert rc == 2, err
    lines = [x for x in err.splitlines() if "error:" in x]
    assert len(lines) == 1 and "Traceback" not in err
    assert __import__("re").search(message, lines[0]), lines[0]


def test_ckpt_step_picks_a_whole_checkpoint_past_a_damaged_one(run_copy, saved_run, capsys):
    _truncate(run_copy / D / "__0_0.distcp", 1000)
    rc, _ = _train(capsys, "--train-iters", "2", "--load", str(run_copy), "--ckpt-step", "1", "--save",
                   str(run_copy))
    assert rc == 0 and _latest(run_copy) == "2"
    assert logged_losses(run_copy)[2] == logged_losses(saved_run)[2]  # resumed exactly from iteration 1


def test_checkpoint_without_checksums_still_loads(run_copy, capsys):
    for rec in run_copy.glob("iter_*/crc32_*.json"):
        rec.unlink()
    rc, _ = _train(capsys, "--train-iters", "3", "--load", str(run_copy))
    assert rc == 0


@pytest.mark.parametrize("flags,message", [
    (["--hidden-size", "64"], r"parameter embed_tokens.weight has shape \(4096, 32\) in the checkpoint and "
                              r"\(4096, 64\) here; pass --use-checkpoint-args"),
    (["--num-layers", "2"], r"has no \['layers.1.*--use-checkpoint-args"),
], ids=["wider-model->names-parameter-both-shapes", "deeper-model->names-missing-tensors"])
def test_another_architecture_names_the_mismatch(saved_run, capsys, flags, message):
    rc, err = _train(capsys, "--train-iters", "3", "--load", str(saved_run), *flags)
    assert rc == 2 and __import__("re").search(message, err), err


# ---------------------------------------------------------------------------------------------- ckpt verify
def test_ckpt_verify_whole_and_damaged(run_copy, capsys):
    assert cli.main(["ckpt", "verify", str(run_copy)]) == 0
    out = capsys.readouterr().out
    assert "iter_0000001: ok (7 files match their checksums)" in out and "2 of 2 checkpoint folders whole" in out
    _flip(run_copy / D / "rank_00000.pt", 60)
    assert cli.main(["ckpt", "verify", str(run_copy)]) == 1
    out = capsys.readouterr().out
    assert "iter_0000002: DAMAGED: rank_00000.pt does not match its checksum" in out
    assert "latest_checkpointed_iteration.txt: iter_0000002 (DAMAGED)" in out
    assert cli.main(["ckpt", "verify", str(run_copy / "iter_0000001")]) == 0
    shutil.rmtree(run_copy / "iter_0000001")
    assert cli.main(["ckpt", "verify", str(run_copy / "nothing")]) == 2
    assert "error: no checkpoint folder" in capsys.readouterr().err


def test_checksums_cover_every_file_written(saved_run):
    folder = saved_run / "iter_0000001"
    recorded = json.loads((folder / "crc32_00000.json").read_text())
    written = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and not p.name.startswith("crc32")}
    assert set(recorded) == written


# ---------------------------------------------------------------------------------------------- requeued jobs
@pytest.mark.parametrize("before", ["metrics-only", "killed-in-first-save", "missing"],
                         ids=["folder-with-metrics-only->starts-from-scratch",
                              "temporary-folder-of-a-killed-save->starts-from-scratch",
                              "no-folder->starts-from-scratch"])
def test_requeued_run_without_a_checkpoint_starts_from_scratch(tmp_path, saved_run, capsys, caplog, before):
    """A cluster requeues the same command (`--save D --load D`) after a first attempt that ended before its first
    save: it trains from iteration 0, exactly as a fresh run."""
    save = tmp_path / "run"
    if before != "missing":
        save.mkdir()
        (save / "metrics.jsonl").write_text('{"split": "train", "iteration": 1, "loss": 9.0}\n')
    if before == "killed-in-first-save":
        (save / ".tmp_iter_0000001").mkdir()
        (save / ".tmp_iter_0000001" / "rank_00000.pt").write_bytes(b"partial")
    rc, err = _train(capsys, "--train-iters", "2", "--save", str(save), "--save-interval", "1", "--load", str(save))
    assert rc == 0, err
    assert f"no checkpoint in {save} yet (--load names the --save folder): starting from scratch" in caplog.text
    assert _latest(save) == "2" and _no_temp_folders(save)
    assert logged_losses(save) == logged_losses(saved_run)  # this run's lines come after the first attempt's


def test_load_elsewhere_without_a_checkpoint_stays_an_error(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, err = _train(capsys, "--train-iters", "2", "--save", str(tmp_path / "run"), "--load", str(empty))
    lines = [x for x in err.splitlines() if "error:" in x]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err
    assert f"no checkpoint in {empty}: latest_checkpointed_iteration.txt is missing" in lines[0]


def test_damaged_save_folder_is_not_taken_for_an_empty_one(run_copy, capsys):
    """`--load D --save D` where D has checkpoints but lost its `latest` pointer: named, not trained over."""
    (run_copy / ckpt.LATEST).unlink()
    rc, err = _train(capsys, "--train-iters", "3", "--save", str(run_copy), "--load", str(run_copy))
    assert rc == 2 and "latest_checkpointed_iteration.txt is missing" in err and "1, 2" in err
