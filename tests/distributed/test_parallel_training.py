"""Data parallel (DDP, ZeRO-1/2/3), tensor parallel and their 2-D mix give one process's loss curve; a
checkpoint of 2 ranks resumes on 1 and on 4 ranks (other strategies) and continues the same curve.

Every run trains the same tiny model on the same global batch of 4 sequences for 6 iterations, on CPU
processes launched by torchrun (gloo). Runs are launched once, on first use, and shared by the tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest

from .launch import TINY, launch, train_iterations, train_losses

RTOL = 1e-5  # fp32: only the order of floating-point sums differs between the runs

Spec = Callable[["Runs"], tuple[int, list[str]]]
SPECS: dict[str, Spec] = {
    # one process, 2 micro-batches of 2 accumulated: the reference curve (and the plain, torchrun-less path)
    "single": lambda r: (1, ["--micro-batch-size", "2"]),
    "ddp": lambda r: (2, ["--micro-batch-size", "2", "--async-save", "--save-interval", "3"]),
    # the layers replayed from (emulated) CUDA graphs under DDP, 2 micro-batches of 1 accumulated per rank
    "ddp_graphs": lambda r: (2, ["--micro-batch-size", "1", "--cuda-graphs", "on"]),
    "zero1": lambda r: (2, ["--micro-batch-size", "1", "--use-distributed-optimizer"]),
    "zero2": lambda r: (2, ["--micro-batch-size", "1", "--data-parallel-sharding-strategy", "optim_grads",
                            "--loss-chunk-tokens", "16"]),
    "zero3": lambda r: (2, ["--micro-batch-size", "2", "--data-parallel-sharding-strategy", "optim_grads_params",
                            "--overlap-param-gather"]),
    "tp2": lambda r: (2, ["--micro-batch-size", "2", "--tensor-model-parallel-size", "2"]),
    "fsdp_x_tp": lambda r: (4, ["--micro-batch-size", "1", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                "--data-parallel-sharding-strategy", "optim_grads_params", "--loss-chunk-tokens", "16",
                                "--save-interval", "3"]),
    # resumes from iteration 3 of other runs: fewer ranks, more ranks with another strategy (replicated
    # FSDP2 under TP), and a 2-D FSDP x TP checkpoint back into one process
    "resume_ddp_on_1": lambda r: (1, ["--micro-batch-size", "4", "--load", str(r("ddp")), "--ckpt-step", "3"]),
    "resume_ddp_on_4_tp": lambda r: (4, ["--micro-batch-size", "1", "--tensor-model-parallel-size", "2",
                                         "--load", str(r("ddp")), "--ckpt-step", "3"]),
    "resume_fsdp_x_tp_on_1": lambda r: (1, ["--micro-batch-size", "2", "--load", str(r("fsdp_x_tp")),
                                            "--ckpt-step", "3"]),
}


class Runs:
    """Launch each named run once (after the runs it loads from) and return its save folder."""

    def __init__(self, root: Path):
        self.root, self.outputs, self.failures = root, {}, {}

    def __call__(self, name: str) -> Path:
        save = self.root / name
        if name in self.failures:
            raise AssertionError(f"run {name!r} failed earlier") from self.failures[name]
        if name not in self.outputs:
            nproc, argv = SPECS[name](self)
            try:
                env = {"MEGADLMS_EMULATE_CUDA_GRAPHS": "1"} if "--cuda-graphs" in argv else None
                self.outputs[name] = launch(nproc, TINY + ["--train-iters", "6", "--save", str(save)] + argv,
                                            env=env, rerun_after_native_crash=True, clean_before_rerun=[save])
            except AssertionError as e:
                self.failures[name] = e
                raise
        return save


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("parallel_runs"))


@pytest.fixture(scope="module")
def reference(runs) -> list[float]:
    losses = train_losses(runs("single"))
    assert len(losses) == 6
    return losses


@pytest.mark.parametrize("name", ["ddp", "ddp_graphs", "zero1", "zero2", "zero3"])
def test_data_parallel_matches_one_process(runs, reference, name):
    assert train_losses(runs(name)) == pytest.approx(reference, rel=RTOL)


def test_ddp_replays_the_captured_layers(runs):
    runs("ddp_graphs")
    assert "CUDA graphs: captured the forward and backward of 2 layers" in runs.outputs["ddp_graphs"]


@pytest.mark.parametrize("name", ["tp2", "fsdp_x_tp"])
def test_tensor_parallel_matches_one_process(runs, reference, name):
    assert train_losses(runs(name)) == pytest.approx(reference, rel=RTOL)


@pytest.mark.parametrize("name", ["resume_ddp_on_1", "resume_ddp_on_4_tp", "resume_fsdp_x_tp_on_1"])
def test_resume_on_other_world_sizes_continues_the_curve(runs, reference, name):
    save = runs(name)
    assert train_iterations(save) == [4, 5, 6]
    assert train_losses(save) == pytest.approx(reference[3:], rel=RTOL)


def test_async_save_commits_complete_checkpoints(runs):
    save = runs("ddp")
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    assert not list(save.glob(".tmp_*"))
    for it in (3, 6):
        folder = save / f"iter_{it:07d}"
        meta = json.loads((folder / "meta.json").read_text())
        assert meta["iteration"] == it and meta["world_size"] == 2
        assert (folder / ".metadata").is_file()
        assert sorted(p.name for p in folder.glob("rank_*.pt")) == ["rank_00000.pt", "rank_00001.pt"]


def test_only_rank_0_logs(runs):
    runs("fsdp_x_tp")
    out = runs.outputs["fsdp_x_tp"]
    assert out.count("iter      1/6 | loss") == 1
    assert out.count("model tiny:") == 1
    assert out.count("data parallel: FSDP2 ZeRO-3") == 1
