"""Tensor parallelism on 2 processes gives the unsharded model's logits and gradients; bad sizes are refused."""

from __future__ import annotations

import json

import pytest

from megadlms.config import TransformerConfig
from megadlms.distributed.init import init_parallel
from megadlms.distributed.tensor_parallel import check_tensor_parallel

from .launch import launch
from .tp_worker import CASES

# fp32 cases differ only in the order of sums; FP8 ones also where that order flips an FP8 rounding
TOLERANCE = {"logits": 1e-5, "grads": 1e-5}
FP8_TOLERANCE = {"logits": 1e-3, "grads": 1e-2}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp") / "results.json"
    launch(2, [str(out)], script="tests/distributed/tp_worker.py", rerun_after_native_crash=True)
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", list(CASES))
def test_tensor_parallel_matches_the_unsharded_model(results, case):
    r = results[case]
    tol = FP8_TOLERANCE if case.startswith("fp8") else TOLERANCE
    assert r["all_dtensor"], "every parameter must be a DTensor on the TP mesh"
    assert r["logits"] < tol["logits"], r
    assert r["sampler_logits"] < tol["logits"], r
    assert r["grads"] < tol["grads"], r


@pytest.mark.parametrize("sizes, field, value", [
    (dict(num_attention_heads=6, num_query_groups=3), "num_attention_heads", 6),
    (dict(num_attention_heads=8, num_query_groups=2), "num_query_groups", 2),
    (dict(num_attention_heads=8, num_query_groups=4, ffn_hidden_size=130), "ffn_hidden_size", 130),
])
def test_sizes_that_do_not_split_are_refused(sizes, field, value):
    cfg = TransformerConfig(hidden_size=96 if sizes["num_attention_heads"] == 6 else 128, **sizes)
    with pytest.raises(ValueError, match=f"{field}={value} is not divisible by --tensor-model-parallel-size 4"):
        check_tensor_parallel(cfg, 4)
    check_tensor_parallel(cfg, 1)  # nothing to split


def test_tensor_parallel_needs_that_many_processes(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 2 needs at least 2 processes"):
        init_parallel("cpu", tp_size=2)
