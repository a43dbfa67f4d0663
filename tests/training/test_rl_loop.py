"""RL's step: the trainer picks it once for --rl runs; it rolls out and scores every mu steps, then optimises."""

from __future__ import annotations

import json

import pytest
import torch

from megadlms.training.args import parse_train_args
from megadlms.training.rl_loop import RLStep
from megadlms.training.trainer import setup

SMALL = ["--model-path", "tiny", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
         "--num-query-groups", "1", "--ffn-hidden-size", "64", "--seq-length", "32", "--device", "cpu",
         "--no-compile", "--num-workers", "0", "--eval-iters", "0", "--log-interval", "1", "--no-progress",
         "--no-generate-sample", "--fp32"]


def test_grpo_rolls_out_every_mu_steps_and_optimises_every_step(tmp_path):
    data = tmp_path / "p.jsonl"
    records = [{"prompt": f"Q: {i} {i + 1}\nA: ", "answer": f"{i + 1} {i}"} for i in range(8)]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    trainer = setup(parse_train_args(SMALL + [
        "--rl", "grpo", "--rl-data", str(data), "--rl-reward", "position_match", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--grpo-group-size", "2", "--grpo-inner-updates", "2", "--rl-gen-length", "4",
        "--rl-block-length", "2", "--train-iters", "4"]))
    assert isinstance(trainer.step_batches, RLStep)
    obj = trainer.objective
    with pytest.raises(RuntimeError, match="call rollout"):  # the step's micro-batches come from its rollouts
        next(obj.micro_batches(iter([]), obj.draw_noise(trainer.sampler, 4, 2), 2, torch.device("cpu")))
    rollouts = []
    real = obj._rollout

    def counted(records, seed, index, device):
        rollouts.append((trainer.state.iteration, index))
        return real(records, seed, index, device)
    obj._rollout = counted
    state = trainer.run()
    # 2 micro-batches a step, rolled out at steps 0 and 2 (mu = 2), each step optimised
    assert rollouts == [(0, 0), (0, 1), (2, 0), (2, 1)]
    assert len([m for m in state.history if "loss" in m]) == 4
    assert sum("rl/reward_mean" in m for m in state.history) == 2  # rewards are scored with the rollouts


def test_the_rl_step_refuses_an_objective_that_is_not_rl():
    trainer = setup(parse_train_args(SMALL + ["--train-iters", "1"]))
    with pytest.raises(TypeError, match="RL's step runs an RL objective, not Pretraining"):
        RLStep(trainer.objective, trainer.sampler, 2, 1, torch.device("cpu"))
