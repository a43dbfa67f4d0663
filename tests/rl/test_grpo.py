"""diffu-GRPO: the loss of a hand-made group is its definition; the pieces (advantages, completion mask, one-step
input, rewards); a run resumes exactly, rollouts included."""

import json
import math
import random
import re

import pytest
import torch

from megadlms.config import ConfigError
from megadlms.rl.grpo import completion_mask, group_advantages, grpo_loss, one_step_inputs, tidy_completions
from megadlms.rl.rewards import REWARDS, RewardSet, exact_match, extract_answer
from megadlms.training.args import parse_train_args


def test_the_loss_of_a_hand_made_group_is_its_definition():
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5]  # one prompt, G = 5 completions of 3 tokens
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.2], [-0.7, -0.1, -3.0], [-2.0, -0.2, -0.9],
                         [-1.5, -1.1, -0.4]])
    old = logp + torch.tensor([[0.1, -0.4, 0.0], [0.5, 0.0, -0.05], [0.0, 0.3, 0.0], [-0.3, 0.0, 0.2],
                               [0.0, 0.0, 0.0]])
    ref = logp + 0.2
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]], dtype=torch.bool)
    beta, eps = 0.04, 0.2
    adv = group_advantages(torch.tensor(rewards), 5)

    mean = sum(rewards) / 5
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 4)
    total, count, clipped = 0.0, 0, 0
    for i in range(5):
        a = (rewards[i] - mean) / (std + 1e-4)
        assert adv[i].item() == pytest.approx(a, rel=1e-6)
        for k in range(3):
            if not mask[i, k]:
                continue
            rho = math.exp(logp[i, k] - old[i, k])
            c = min(max(rho, 1 - eps), 1 + eps)
            d = float(ref[i, k] - logp[i, k])
            total += -min(rho * a, c * a) + beta * (math.exp(d) - d - 1)
            clipped += c * a < rho * a
            count += 1
    loss, stats = grpo_loss(logp, old, ref, adv, mask, clip_eps=eps, kl_beta=beta)
    assert loss.item() == pytest.approx(total / count, rel=1e-5)
    assert stats["clip_fraction"].item() == pytest.approx(clipped / count) and clipped > 0
    assert stats["kl"].item() == pytest.approx(math.exp(0.2) - 0.2 - 1, rel=1e-5)
    # the gradient reaches the policy's log-probabilities, not the old or the reference ones
    lp = logp.clone().requires_grad_()
    grpo_loss(lp, old, ref, adv, mask, clip_eps=eps, kl_beta=beta)[0].backward()
    assert lp.grad is not None and bool((lp.grad[~mask] == 0).all())


def test_equal_rewards_give_no_advantage():
    assert torch.equal(group_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0]), 2), torch.zeros(4))


def test_completions_end_at_their_first_eos():
    c = torch.tensor([[5, 0, 7, 1], [5, 6, 7, 8]])
    assert completion_mask(c, 0).tolist() == [[True, True, False, False], [True] * 4]
    assert tidy_completions(c, 0).tolist() == [[5, 0, 0, 0], [5, 6, 7, 8]]


def test_the_one_step_input_masks_every_completion_token_and_some_real_prompt_tokens():
    seq = torch.arange(10, 60).view(1, 50).repeat(200, 1)
    real = torch.ones(200, 40, dtype=torch.bool)
    real[:, :5] = False  # left padding is never masked
    x = one_step_inputs(seq, real, 0.15, torch.Generator().manual_seed(0), mask_id=1)
    assert bool((x[:, 40:] == 1).all()) and bool((x[:, :5] == seq[:, :5]).all())
    assert (x[:, 5:40] == 1).float().mean().item() == pytest.approx(0.15, abs=0.01)


def test_rewards():
    assert extract_answer("so \\boxed{1,234}.") == "1234" and extract_answer("x\n#### 42") == "42"
    assert extract_answer("<answer> 3 2 1 </answer>") == "3 2 1"
    assert exact_match("3 2 1\nmore", {"answer": "3 2 1"}) == 1.0 and exact_match("3 2", {"answer": "3 2 1"}) == 0.0
    fmt = RewardSet.parse("format:0.5,exact_match")
    good = "<reasoning>r</reasoning><answer>7</answer>"
    assert fmt([good, "7"], [{"answer": "7"}] * 2) == [1.5, 1.0] and fmt.fields() == ("answer",)
    assert fmt.last == {"format": 0.5, "exact_match": 1.0}  # each term's mean, for the log
    assert RewardSet.parse("position_match")(["3 2 9", "3 2 1 0"], [{"answer": "3 2 1"}] * 2) == [2 / 3, 3 / 4]
    with pytest.raises(ConfigError, match="unknown reward 'f1'; known rewards: code_tests, exact_match, format, "
                                          "position_match"):
        RewardSet.parse("f1")


def test_a_reward_that_raises_scores_zero_and_is_counted(monkeypatch):
    def broken(text, record):
        raise KeyError("score")

    monkeypatch.setitem(REWARDS, "broken", (broken, ()))
    rs = RewardSet.parse("broken,format")
    assert rs(["a", "b"], [{}, {}]) == [0.0, 0.0] and rs.failures == 2


SMALL = ["--model-path", "tiny", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "32", "--device", "cpu",
         "--no-compile", "--num-workers", "0", "--eval-iters", "0", "--log-interval", "1", "--no-progress",
         "--lr-warmup-iters", "0", "--no-generate-sample", "--lr", "3e-3"]


def digit_share(text, record):
    """A dense reward for the tests: the share of digits in the completion."""
    return sum(ch.isdigit() for ch in text) / max(len(text), 1)


def test_resume_is_exact_rollouts_included(tmp_path, monkeypatch):
    from megadlms.training import checkpoint as ckpt
    from megadlms.training.trainer import train

    monkeypatch.setitem(REWARDS, "digits", (digit_share, ()))
    rng = random.Random(0)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": "Q: Reverse: " + " ".join(str(rng.randrange(10)) for _ in range(3))
                                        + "\nA: "}) + "\n" for _ in range(8)))
    rl = ["--rl", "grpo", "--rl-data", str(data), "--rl-reward", "digits", "--micro-batch-size", "2",
          "--grpo-group-size", "3", "--grpo-inner-updates", "2", "--rl-gen-length", "4", "--rl-block-length", "2",
          "--rl-temperature", "1.0"]
    full = train(parse_train_args(SMALL + rl + ["--train-iters", "5", "--save", str(tmp_path / "a")]))
    # stopped after 3 steps: in the middle of a rollout's two updates
    train(parse_train_args(SMALL + rl + ["--train-iters", "5", "--exit-interval", "3", "--save",
                                         str(tmp_path / "b")]))
    resumed = train(parse_train_args(SMALL + rl + ["--train-iters", "5", "--save", str(tmp_path / "b"),
                                                   "--load", str(tmp_path / "b")]))
    keys = ("loss", "rl/reward_mean", "rl/kl")
    tail = [[m.get(k) for k in keys] for m in full.history if m["iteration"] > 3]
    assert tail == [[m.get(k) for k in keys] for m in resumed.history]
    assert any(m.get("rl/reward_mean", 0) > 0 for m in full.history) and full.history[-1]["rl/kl"] > 0
    a, b = (ckpt.load_rank_state(tmp_path / run / "iter_0000005")["objective"] for run in "ab")
    assert all(torch.equal(a["reference"][k], b["reference"][k]) for k in a["reference"])


def test_an_unknown_reward_is_refused_before_training(tmp_path):
    from megadlms.training.trainer import setup

    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "Q: 1 2\nA: ", "answer": "2 1"}) + "\n")
    with pytest.raises(ConfigError, match="--rl-reward 'f1': unknown reward 'f1'"):
        setup(parse_train_args(SMALL + ["--rl", "grpo", "--rl-data", str(data), "--rl-reward", "f1"]))


def test_a_step_raises_the_likelihood_of_the_better_completion():
    from megadlms.config import TransformerConfig
    from megadlms.model import TransformerLM
    from megadlms.rl.vrpo import token_logps

    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, num_query_groups=2,
                            ffn_hidden_size=64, vocab_size=16, seq_length=8, max_position_embeddings=8,
                            mask_token_id=1, attn_mask_type="bidirectional")
    model = TransformerLM(cfg)
    seq = torch.tensor([[5, 6, 7, 8, 9, 10], [5, 6, 11, 12, 13, 14]])  # one prompt (2 tokens), two completions
    real = torch.ones(2, 2, dtype=torch.bool)
    adv = group_advantages(torch.tensor([1.0, 0.0]), 2)
    mask = torch.ones(2, 4, dtype=torch.bool)

    def logps():
        x = one_step_inputs(seq, real, 0.0, torch.Generator().manual_seed(0), mask_id=1)
        return token_logps(model(x)[:, 2:], seq[:, 2:])

    before = logps().detach()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lp = logps()
    grpo_loss(lp, lp.detach(), None, adv, mask, clip_eps=0.2, kl_beta=0.0)[0].backward()
    opt.step()
    change = (logps().detach() - before).sum(1)
    assert change[0] > 0 > change[1]


def test_under_subs_the_log_likelihoods_give_the_mask_token_no_probability():
    from megadlms.rl.vrpo import elbo_estimates, token_logps

    torch.manual_seed(0)
    logits = torch.randn(2, 3, 6)
    logits[..., 1] = 4.0  # a [MASK] logit the SUBS loss never trained (the samplers never emit [MASK])
    targets = torch.tensor([[0, 2, 3], [5, 4, 0]])
    keep = [0, 2, 3, 4, 5]
    want = torch.log_softmax(logits[..., keep], -1).gather(-1, torch.tensor([[0, 1, 2], [4, 3, 0]])[..., None])[..., 0]
    lp = logits.clone().requires_grad_()
    got = token_logps(lp, targets, mask_id=1)
    assert torch.allclose(got, want, atol=1e-6)
    assert (token_logps(logits, targets) - want).max().item() < -0.5  # the full softmax spends mass on [MASK]
    grpo_loss(got, got.detach(), None, torch.tensor([1.0, -1.0]), torch.ones(2, 3, dtype=torch.bool),
              clip_eps=0.2, kl_beta=0.0)[0].backward()
    assert lp.grad is not None and bool((lp.grad[..., 1] == 0).all()) and lp.grad.abs().sum() > 0
    w = torch.ones(2, 3)
    assert torch.allclose(elbo_estimates(logits, targets, w, 1, mask_id=1), want.sum(-1), atol=1e-5)


def test_grpo_raises_a_learnable_reward(tmp_path, monkeypatch):
    """End to end from a random tiny model: the share of digits in the completions goes from about 3% to most of
    them within 40 steps (the reverse-digits exact match needs a trained model: examples/rl/run.sh)."""
    from megadlms.training.trainer import train

    monkeypatch.setitem(REWARDS, "digits", (digit_share, ()))
    rng = random.Random(0)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": "Q: Reverse: " + " ".join(str(rng.randrange(10)) for _ in range(3))
                                        + "\nA: "}) + "\n" for _ in range(16)))
    args = [a if a != "3e-3" else "1e-2" for a in SMALL] + [
        "--lr-decay-style", "constant", "--rl", "grpo", "--rl-data", str(data), "--rl-reward", "digits",
        "--micro-batch-size", "4", "--grpo-group-size", "4", "--rl-gen-length", "4", "--rl-block-length", "4",
        "--rl-temperature", "1.0", "--rl-kl-beta", "0", "--train-iters", "40"]
    state = train(parse_train_args(args))
    rewards = [m["rl/reward_mean"] for m in state.history if "rl/reward_mean" in m]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.1 and last > 0.4, (first, last)


@pytest.mark.parametrize("record, flags, message", [
    ({"prompt": "Q: 1 2\nA: "}, [], r"p.jsonl:1 has no 'answer' field, which its reward reads \(--rl-reward\); add "
                                    "it to every record or pick a reward that does not need it"),
    ({"prompt": "Q: 1 2\nA: ", "answer": "2 1"}, ["--rl-reward", "f1"],
     "--rl-reward 'f1': unknown reward 'f1'; known rewards: code_tests, exact_match, format, position_match"),
    ({"prompt": "Q: 1 2\nA: ", "answer": "2 1"}, ["--grpo-group-size", "1"], "--grpo-group-size 1: group-normalised"),
])
def test_bad_input_is_one_line_on_the_command_line(tmp_path, capsys, record, flags, message):
    from megadlms.cli import train_main

    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps(record) + "\n")
    assert train_main(SMALL + ["--rl", "grpo", "--rl-data", str(data), "--train-iters", "1", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("megadlms train: error: "), err
    assert re.search(message, err[0]), err[0]


def test_a_reward_that_raises_is_logged_with_its_record_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    """A reward that raises on some records scores 0 there, each failure a warning naming FILE:LINE and counted
    (`rl/reward_failures`); the others score as usual and training goes on."""
    from megadlms.training.trainer import train

    def picky(text, record):
        if record["answer"] == "boom":
            raise ValueError("cannot parse")
        return 1.0

    monkeypatch.setitem(REWARDS, "picky", (picky, ("answer",)))
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Q: {i}\nA: ", "answer": "boom" if i == 1 else str(i)}) + "\n"
                            for i in range(2)))
    args = SMALL + ["--rl", "grpo", "--rl-data", str(data), "--rl-reward", "picky", "--micro-batch-size", "2",
                    "--grpo-group-size", "2", "--rl-gen-length", "2", "--rl-block-length", "2", "--train-iters", "2"]
    with caplog.at_level("WARNING", logger="megadlms"):
        state = train(parse_train_args(args))
    logged = [m for m in state.history if "rl/reward_failures" in m]
    assert [m["rl/reward_failures"] for m in logged] == [2.0, 2.0]  # G = 2 completions of the bad record a step
    assert [m["rl/reward_mean"] for m in logged] == [0.5, 0.5]
    lines = [r.getMessage() for r in caplog.records if "reward picky raised" in r.getMessage()]
    assert len(lines) == 4 and all(f"ValueError: cannot parse on a completion of {data}:2 (scored 0;" in s
                                   and s.endswith("fix the reward or the record") for s in lines)
