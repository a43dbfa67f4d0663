"""FP8 across ranks: one MAX all-reduce per step makes every rank's amaxes the max over the group (data x
tensor parallel, or tensor parallel only with --tp-only-amax-red), so all ranks scale alike; FP8 data
parallelism then follows one process's FP8 curve."""

from __future__ import annotations

import json

import pytest

from .launch import TINY, launch, train_losses

FP8 = TINY + ["--fp8-format", "hybrid", "--fp8-amax-history-len", "2", "--micro-batch-size", "1"]


@pytest.fixture(scope="module")
def fp8_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_runs")
    # one process, 4 accumulated micro-batches of one sequence: the same micro-batches as 4 data-parallel ranks
    launch(1, FP8 + ["--train-iters", "3", "--save", str(root / "single")])
    runs = {
        "dp": ["--train-iters", "3", "--data-parallel-sharding-strategy", "optim_grads"],
        "dp_x_tp": ["--train-iters", "3", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                    "--data-parallel-sharding-strategy", "optim_grads_params"],
        "tp_only": ["--train-iters", "2", "--tensor-model-parallel-size", "2", "--tp-only-amax-red"],
    }
    argv = [str(root / "checks.json")]
    for name, flags in runs.items():
        argv += ["--", name, *FP8, *flags, "--save", str(root / name)]
    launch(4, argv, script="tests/distributed/fp8_worker.py", rerun_after_native_crash=True,
           clean_before_rerun=[root / name for name in runs])
    return root, json.loads((root / "checks.json").read_text())


@pytest.mark.parametrize("name", ["dp", "dp_x_tp"])
def test_amaxes_are_the_max_over_all_ranks(fp8_runs, name):
    _, checks = fp8_runs
    c = checks[name]
    assert c["steps"] == 3 and c["group_size"] == 4
    assert c["locals_differ_in_group"]  # there was something to reduce
    assert c["max_over_group"] and c["one_max_all_reduce"]
    assert c["scales_equal_in_world"]


def test_tp_only_amax_reduction_stays_in_the_tp_group(fp8_runs):
    _, checks = fp8_runs
    c = checks["tp_only"]
    assert c["group_size"] == 2
    assert c["max_over_group"] and c["one_max_all_reduce"] and c["scales_equal_in_group"]
    assert not c["scales_equal_in_world"]  # data-parallel ranks saw other data and keep their own scales


def test_fp8_data_parallel_matches_one_process(fp8_runs):
    root, _ = fp8_runs
    # rtol above fp32's: a sum order that differs can flip an FP8 rounding
    assert train_losses(root / "dp") == pytest.approx(train_losses(root / "single"), rel=1e-4)


def test_fp8_tensor_parallel_tracks_one_process(fp8_runs):
    root, _ = fp8_runs
    # the first step scales each weight shard by its own amax (no scales exist yet), so the curves part slightly
    assert train_losses(root / "dp_x_tp") == pytest.approx(train_losses(root / "single"), rel=2e-3)
