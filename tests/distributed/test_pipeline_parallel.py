"""Pipeline parallelism on 2 processes (torch.distributed.pipelining, 1F1B and GPipe): a step's micro-batch losses
and every gradient equal the whole model's running the micro-batches in turn; bad sizes are refused in one line."""

from __future__ import annotations

import json

import pytest

from megadlms.build import build_model
from megadlms.config import TransformerConfig
from megadlms.distributed.pipeline_parallel import PipelineStageModule, check_pipeline_parallel, stage_layers

from .launch import launch
from .pp_worker import CASES

RTOL = 1e-5  # fp32: only the order of floating-point sums differs


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp") / "results.json"
    launch(2, [str(out)], script="tests/distributed/pp_worker.py", rerun_after_native_crash=True)
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_matches_the_whole_model(results, case):
    r = results[case]
    assert r["loss"] < RTOL, r
    assert r["grads"] < RTOL, r
    tied = 1 if "untied" not in case and "bd3lm" not in case else 0
    assert sum(r["params_per_stage"]) == r["params"] + tied  # every parameter on one stage; a tied embedding on two


def test_stages_hold_their_layers_under_global_names():
    model = build_model(TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=2, vocab_size=64))
    last = PipelineStageModule(model, stage=1, pp_size=2)
    names = {n for n, _ in last.named_parameters()}
    assert "layers.2.self_attn.q_proj.weight" in names and "layers.1.mlp.up_proj.weight" not in names
    assert {"norm.weight", "embed_tokens.weight"} <= names  # the final norm, and the tied head's weight
    assert list(stage_layers(8, 4, 3)) == [6, 7]


def test_layers_not_divisible_by_stages_are_refused():
    with pytest.raises(ValueError, match="--num-layers 6 is not divisible by --pipeline-model-parallel-size 4; "
                                         "use a pipeline size that divides it, or 8 layers"):
        check_pipeline_parallel(TransformerConfig(num_layers=6), 4)
