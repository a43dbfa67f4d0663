"""Shared pieces of the fault-injection suite: a tiny CPU run and a folder of saved checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megadlms.training.args import parse_train_args
from megadlms.training.trainer import setup

# one layer of width 32 on sequences of 16 tokens, fp32 on the CPU: a step takes milliseconds
TINY = ["--model-path", "tiny",  # flags of its own run, not over the demo configuration
        "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--num-query-groups", "1",
        "--ffn-hidden-size", "64", "--seq-length", "16", "--device", "cpu", "--no-compile", "--num-workers", "0",
        "--eval-iters", "0", "--log-interval", "1", "--no-progress", "--micro-batch-size", "2", "--fp32",
        "--difflm-varilen-prob", "0", "--no-generate-sample", "--lr", "3e-3"]


def tiny_trainer(*flags: str):
    return setup(parse_train_args(TINY + list(flags)))


def logged_losses(save_dir: Path) -> dict[int, float]:
    """iteration -> training loss, from a run's metrics.jsonl (exact floats: json round-trips them)."""
    lines = (Path(save_dir) / "metrics.jsonl").read_text().splitlines()
    return {r["iteration"]: r["loss"] for r in map(json.loads, lines) if r["split"] == "train"}


@pytest.fixture(scope="session")
def saved_run(tmp_path_factory) -> Path:
    """A --save folder with whole checkpoints at iterations 1 and 2 (latest 2); copy it before damaging it."""
    save = tmp_path_factory.mktemp("faults") / "run"
    trainer = tiny_trainer("--train-iters", "2", "--save", str(save), "--save-interval", "1")
    trainer.run()
    return save


@pytest.fixture
def run_copy(saved_run, tmp_path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(saved_run, dst)
    return dst
