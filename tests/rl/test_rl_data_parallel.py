"""RL under data parallelism (two gloo ranks, DDP): the losses of one process with the same global batch."""

import json
import random

import pytest

from tests.distributed.launch import TINY, launch, train_losses

WORKER = "tests/rl/rl_worker.py"  # `megadlms train`, a dense `letters` reward, rank 1 sampling one more step


def reverse_digits(folder):
    """Preference pairs and prompts of the reverse-digits task: (pairs.jsonl, prompts.jsonl) in `folder`."""
    rng = random.Random(0)
    pairs, prompts = folder / "pairs.jsonl", folder / "prompts.jsonl"
    rows = []
    for _ in range(8):
        d = [str(rng.randrange(10)) for _ in range(3)]
        rows.append(("Q: Reverse: " + " ".join(d) + "\nA: ", " ".join(reversed(d)), " ".join(d)))
    pairs.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n" for p, c, r in rows))
    prompts.write_text("".join(json.dumps({"prompt": p, "answer": c}) + "\n" for p, c, _ in rows))
    return pairs, prompts


def test_two_ranks_train_as_one_process(tmp_path):
    pairs, prompts = reverse_digits(tmp_path)
    flags = TINY + ["--micro-batch-size", "2", "--lr-warmup-iters", "0", "--train-iters", "2"]
    runs = {"vrpo": ["--rl", "vrpo", "--rl-data", str(pairs), "--vrpo-samples", "2"],
            "grpo": ["--rl", "grpo", "--rl-data", str(prompts), "--rl-reward", "position_match",
                     "--grpo-group-size", "2", "--rl-gen-length", "4", "--rl-block-length", "4",
                     "--rl-temperature", "1.0"]}
    for name, rl in runs.items():
        launch(1, flags + rl + ["--save", str(tmp_path / f"{name}1")])
        launch(2, flags + rl + ["--save", str(tmp_path / f"{name}2"), "--distributed-backend", "gloo"])
        one, two = train_losses(tmp_path / f"{name}1"), train_losses(tmp_path / f"{name}2")
        assert len(one) == 2 and two == pytest.approx(one, rel=1e-5, abs=1e-7), name
        # the gradient of the global batch (GRPO's step 2: the KL to the reference over every rank's rollouts)
        norms = [grad_norms(tmp_path / f"{name}{n}") for n in (1, 2)]
        assert norms[0][1] > 0 and norms[1] == pytest.approx(norms[0], rel=1e-4), name


def grad_norms(save_dir):
    lines = (save_dir / "metrics.jsonl").read_text().splitlines()
    return [r["grad_norm"] for r in map(json.loads, lines) if r["split"] == "train"]


def test_lora_under_fsdp2_trains_as_one_process(tmp_path):
    """--rl grpo and vrpo with LoRA under FSDP2 (ZeRO-3 on two gloo ranks; the reference is the base with the
    adapters off): the losses and gradient norms of one process, also when one rank's sampler runs more forwards
    than the other's (`rl_worker.py`)."""
    pairs, prompts = reverse_digits(tmp_path)
    flags = TINY + ["--micro-batch-size", "2", "--lr-warmup-iters", "0"]
    launch(1, flags + ["--train-iters", "1", "--save", str(tmp_path / "base")])
    lora = flags + ["--load", str(tmp_path / "base"), "--use-checkpoint-args", "--lora-rank", "4", "--train-iters", "2"]
    runs = {"vrpo": ["--rl", "vrpo", "--rl-data", str(pairs), "--vrpo-samples", "2"],
            "grpo": ["--rl", "grpo", "--rl-data", str(prompts), "--rl-reward", "letters",
                     "--grpo-group-size", "2", "--rl-gen-length", "4", "--rl-block-length", "4",
                     "--rl-temperature", "1.0"]}
    for name, rl in runs.items():
        launch(1, lora + rl + ["--save", str(tmp_path / f"{name}1")], script=WORKER)
        launch(2, lora + rl + ["--save", str(tmp_path / f"{name}2"), "--distributed-backend", "gloo",
                               "--data-parallel-sharding-strategy", "optim_grads_params"], script=WORKER,
               timeout=120)
        one, two = train_losses(tmp_path / f"{name}1"), train_losses(tmp_path / f"{name}2")
        assert len(one) == 2 and two == pytest.approx(one, rel=1e-5, abs=1e-7), name
        norms = [grad_norms(tmp_path / f"{name}{n}") for n in (1, 2)]
        assert norms[0][1] > 0 and norms[1] == pytest.approx(norms[0], rel=1e-4), name
