"""kill -9 at every point of a save (each file write, flush, folder creation and rename) and at random times
during back-to-back saves: a resume always finds a whole checkpoint, the previous one or the new one, and its
tensors are the ones saved at that iteration. The killed process is a fork of the test's."""

from __future__ import annotations

import os
import random
import shutil
import signal
import time

import torch

from megadlms.training import checkpoint as ckpt


def _state(it: int) -> dict:
    return {"model": {"w": torch.full((4096,), float(it))}, "train": {"iteration": it}}


def _save(save, it: int) -> None:
    ckpt.save_checkpoint(save, it, _state(it), rank_state={"it": it}, meta={"config": {}})


def _instrument(kill_at: int | None) -> list[int]:
    """Count the durable steps of a save (and SIGKILL this process at step `kill_at`)."""
    count = [0]

    def wrap(owner, name):
        real = getattr(owner, name)

        def step(*a, **k):
            if count[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            count[0] += 1
            return real(*a, **k)
        setattr(owner, name, step)
    for owner, name in ((os, "fsync"), (os, "replace"), (os, "mkdir"), (torch, "save")):
        wrap(owner, name)
    return count


def _in_child(fn) -> int:
    """Run fn() in a forked child; its exit status, or -signal."""
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            code = fn() or 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _check_whole(save, allowed: set[int]) -> int:
    path = ckpt.find_checkpoint(save)
    it = int(path.name.split("_")[1])
    assert it in allowed, (it, allowed)
    assert ckpt.verify_checkpoint(path) == []
    state = {"model": {"w": torch.zeros(4096)}, "train": {"iteration": 0}}
    ckpt.load_app_state(path, state)
    assert torch.equal(state["model"]["w"], torch.full((4096,), float(it))) and state["train"]["iteration"] == it
    assert ckpt.load_rank_state(path)["it"] == it
    return it


def test_kill_at_every_point_of_a_save(tmp_path):
    base = tmp_path / "base"
    _save(base, 1)
    steps = _in_child(lambda: _count(tmp_path))  # the durable steps of one save
    assert 6 <= steps < 60, steps
    renamed = []
    for k in range(steps):
        save = tmp_path / f"k{k}"
        shutil.copytree(base, save)
        status = _in_child(lambda: (_instrument(k), _save(save, 2)) and 0)
        assert status == -signal.SIGKILL, (k, status)
        assert _check_whole(save, {1}) == 1  # `latest` moves last: until then a resume takes iteration 1
        renamed.append((save / "iter_0000002" / ckpt.META).is_file())
        _save(save, 2)  # the next save clears what the killed one left
        assert _check_whole(save, {2}) == 2
        assert not [p for p in save.iterdir() if p.name.startswith(".")]
    assert renamed[0] is False and renamed[-1] is True  # killed before and after the folder's rename


def _count(tmp_path) -> int:
    count = _instrument(None)
    _save(tmp_path / "dry", 1)
    count[0] = 0
    _save(tmp_path / "dry", 2)
    return min(count[0], 250)  # an exit status


def test_kill_at_random_times_during_back_to_back_saves(tmp_path):
    rng = random.Random(33)
    for trial in range(3):
        save = tmp_path / f"t{trial}"
        _save(save, 1)

        pid = os.fork()
        if pid == 0:
            try:
                for it in range(2, 10_000):
                    _save(save, it)
            finally:
                os._exit(0)
        time.sleep(rng.uniform(0.05, 0.4))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        last = _check_whole(save, set(range(1, 10_000)))
        assert last >= 1
