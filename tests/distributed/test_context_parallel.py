"""Context parallelism on 2 processes: every objective's loss and gradients equal the whole-sequence model's; a
CP=2 training run gives one process's loss curve, and its checkpoint resumes on one process; ring attention equals
the all-gather path on 4 ranks (a ring training run: test_pipeline_parallel's PP x CP); bad sizes and combinations
are refused in one line."""

from __future__ import annotations

import json

import pytest

from megadlms.config import TransformerConfig
from megadlms.distributed.config import ParallelConfig
from megadlms.distributed.context_parallel import check_context_parallel, key_positions, rank_positions
from megadlms.distributed.init import init_parallel
from megadlms.training.config import FP8Config, RunConfig
from megadlms.training.run_plan import RunPlan

from .cp_worker import CASES
from .launch import TINY, launch, train_iterations, train_losses
from .ring_worker import CASES as RING_CASES

RTOL = 1e-5  # fp32: only the order of floating-point sums differs


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp") / "results.json"
    launch(2, [str(out)], script="tests/distributed/cp_worker.py", rerun_after_native_crash=True)
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", list(CASES))
def test_objectives_match_the_whole_sequence(results, case):
    r = results[case]
    assert r["loss"] < RTOL, r
    assert r["grads"] < RTOL, r


COMMON = TINY + ["--micro-batch-size", "2", "--train-iters", "4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The one-process reference run and the CP=2 run (each launched once, shared by the tests)."""
    root = tmp_path_factory.mktemp("cp_runs")
    launch(1, COMMON + ["--save", str(root / "one")])
    out = launch(2, COMMON + ["--save", str(root / "cp2"), "--context-parallel-size", "2", "--save-interval", "2"],
                 rerun_after_native_crash=True, clean_before_rerun=[root / "cp2"])
    return root, out


def test_training_matches_one_process(runs):
    root, out = runs
    assert "world 2 (pp 1 x dp 1 x cp 2 x tp 1)" in out
    reference = train_losses(root / "one")
    assert len(reference) == 4
    assert train_losses(root / "cp2") == pytest.approx(reference, rel=RTOL)


def test_resume_from_cp2_on_one_process(runs):
    root, _ = runs
    resumed = root / "resumed"
    launch(1, COMMON + ["--save", str(resumed), "--load", str(root / "cp2"), "--ckpt-step", "2"])
    assert train_iterations(resumed) == [3, 4]
    assert train_losses(resumed) == pytest.approx(train_losses(root / "one")[2:], rel=RTOL)


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    out = tmp_path_factory.mktemp("ring") / "results.json"
    launch(4, [str(out)], script="tests/distributed/ring_worker.py", rerun_after_native_crash=True)
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", RING_CASES)
def test_ring_attention_equals_the_all_gather_path(ring, case):
    """4 cp ranks (a ring whose next and previous ranks differ): outputs and q, k, v gradients."""
    r = ring[case]
    assert r["finite"], r
    assert max(r["out"], r["dq"], r["dk"], r["dv"]) < RTOL, r


def test_zigzag_layout():
    assert rank_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert rank_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert key_positions(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]


@pytest.mark.parametrize("overrides, message", [
    (dict(seq_length=30), "--seq-length 30 is not divisible by 2 x --context-parallel-size 2 = 4"),
])
def test_bad_sizes_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        check_context_parallel(TransformerConfig(**overrides), 2)


@pytest.mark.parametrize("model, fp8, message", [
    (dict(num_moe_experts=4, moe_router_topk=2), FP8Config(), "--context-parallel-size 2 with an MoE model"),
    (dict(), FP8Config(fp8_format="hybrid", fp8_dot_product_attention=True),
     "--context-parallel-size 2 with --fp8-dot-product-attention"),
])
def test_bad_combinations_are_refused_by_the_plan(model, fp8, message):
    run = RunConfig(fp8=fp8, parallel=ParallelConfig(context_parallel_size=2))
    with pytest.raises(ValueError, match=message):
        RunPlan(run, TransformerConfig(**model), world_size=2).check()


def test_context_parallel_needs_that_many_processes(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="--context-parallel-size 2 needs at least 2 processes"):
        init_parallel("cpu", cp_size=2)
