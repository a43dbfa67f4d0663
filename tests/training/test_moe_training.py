"""The tiny-moe preset trains on the CPU through the trainer: the loss falls, the MoE telemetry and auxiliary loss
are logged, and a resumed run continues bit for bit."""

import json

import pytest
import torch

from megadlms.moe import moe_layers
from megadlms.training.args import parse_train_args
from megadlms.training.trainer import setup, train

TINY_MOE = ["--model-path", "tiny-moe", "--seq-length", "32", "--device", "cpu", "--no-compile", "--num-workers",
            "0", "--eval-iters", "0", "--log-interval", "1", "--no-progress", "--lr", "3e-3", "--lr-warmup-iters", "2",
            "--no-generate-sample", "--micro-batch-size", "4"]


def losses(state):
    return [m["loss"] for m in state.history if "loss" in m and "eval_loss" not in m]


def test_tiny_moe_loss_falls_and_routing_is_logged(tmp_path):
    args = parse_train_args(TINY_MOE + ["--train-iters", "40", "--lr-decay-style", "constant", "--eval-iters", "2",
                                        "--eval-interval", "1000", "--log-interval", "10",
                                        "--save", str(tmp_path / "ck")])
    trainer = setup(args)
    assert [m.layer_idx for m in moe_layers(trainer.model)] == [1, 2, 3]  # a dense first layer
    before = trainer.evaluate()
    state = trainer.run()
    after = trainer.evaluate()
    assert after < 0.85 * before, (before, after)
    lines = [json.loads(x) for x in (tmp_path / "ck" / "metrics.jsonl").read_text().splitlines()]
    rec = [r for r in lines if r["split"] == "train"][-1]
    # three MoE layers, each adding its load-balancing loss (~0.01 near balance) and z-loss
    assert 0.02 < rec["moe/aux_loss"] < 1.0
    for i in (1, 2, 3):
        assert rec[f"moe/layer{i}/tokens_max"] >= rec[f"moe/layer{i}/tokens_min"] >= 0
        assert rec[f"moe/layer{i}/tokens_cv"] >= 0
    assert all(m.aux_loss == 0 for m in moe_layers(trainer.model))  # the objective took each forward's
    step = [m for m in state.history if "moe/cv_max" in m][-1]
    assert step["moe/cv_max"] == max(rec[f"moe/layer{i}/tokens_cv"] for i in (1, 2, 3))


def test_tiny_moe_resumes_exactly(tmp_path):
    common = TINY_MOE + ["--global-batch-size", "8", "--train-iters", "6"]
    straight = train(parse_train_args(common + ["--save", str(tmp_path / "a")]))
    train(parse_train_args(common + ["--save", str(tmp_path / "b"), "--save-interval", "3", "--exit-interval", "3"]))
    resumed = train(parse_train_args(common + ["--save", str(tmp_path / "b"), "--load", str(tmp_path / "b")]))
    assert losses(resumed) == losses(straight)[3:]  # bitwise equal floats
    from megadlms.training import checkpoint as ckpt

    wa = ckpt.load_model_from_checkpoint(tmp_path / "a")[0].state_dict()
    wb = ckpt.load_model_from_checkpoint(tmp_path / "b")[0].state_dict()
    assert "layers.1.mlp.experts.gate_proj" in wa
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_moe_flags_turn_a_dense_preset_into_a_mixture_of_experts():
    """Megatron-Core's MoE flags on the command line, as the config fields of the same names."""
    from megadlms.training.args import parse_train_args

    flags = ["--model-path", "tiny", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
             "--seq-length", "32", "--num-moe-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "0,1",
             "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--train-iters", "2"]
    over = parse_train_args(flags).model.overrides
    assert over["num_moe_experts"] == 4 and over["moe_layer_freq"] == [0, 1]
    assert over["moe_router_score_function"] == "sigmoid" and over["moe_router_enable_expert_bias"] is True
    with pytest.raises(SystemExit):
        parse_train_args(flags[:-2] + ["--moe-layer-freq", "0,2"])
