"""The loop's hooks and step runner: a hook is called at its points without the loop naming it, its state rides
in the checkpoint, and train_step / evaluate / the clip read no feature flag."""

from __future__ import annotations

import ast
import contextlib
import inspect
import textwrap

import torch
from torch import nn

from megadlms.training import checkpoint as ckpt
from megadlms.training.args import parse_train_args
from megadlms.training.batch import Batch
from megadlms.training.hooks import TrainingHook
from megadlms.training.step_runner import PlainRunner
from megadlms.training.trainer import Trainer, setup

SMALL = ["--model-path", "tiny", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
         "--num-query-groups", "1", "--ffn-hidden-size", "64", "--seq-length", "16", "--device", "cpu",
         "--no-compile", "--num-workers", "0", "--log-interval", "2", "--no-progress", "--micro-batch-size", "2",
         "--fp32", "--difflm-varilen-prob", "0", "--no-generate-sample", "--lr", "3e-3"]


class Recorder(TrainingHook):
    def __init__(self):
        self.calls: list[str] = []
        self.steps = 0

    def begin_step(self, logged):
        self.calls.append(f"begin logged={logged}")

    def after_optimizer_step(self):
        self.steps += 1
        self.calls.append("after")

    @contextlib.contextmanager
    def evaluation(self):
        self.calls.append("eval in")
        yield
        self.calls.append("eval out")

    def metrics(self):
        return {"recorder/steps": float(self.steps)}

    def state_dict(self):
        return {"recorder_steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state.get("recorder_steps", 0)


def test_a_hook_runs_at_its_points_and_its_state_resumes(tmp_path):
    flags = SMALL + ["--train-iters", "3", "--eval-interval", "2", "--eval-iters", "1", "--save", str(tmp_path)]
    trainer = setup(parse_train_args(flags))
    hook = Recorder()
    trainer.hooks.attach(hook)
    state = trainer.run()
    # validation at 0 and 2 and after the last step; metrics logged at the end of each log window (2, 3)
    assert hook.calls == ["eval in", "eval out", "begin logged=False", "after", "begin logged=True", "after",
                          "eval in", "eval out", "begin logged=True", "after", "eval in", "eval out"]
    assert [m["recorder/steps"] for m in state.history if "recorder/steps" in m] == [2.0, 3.0]
    assert ckpt.load_rank_state(tmp_path / "iter_0000003")["objective"] == {"recorder_steps": 3}
    resumed = setup(parse_train_args(flags + ["--load", str(tmp_path)]))
    again = Recorder()
    resumed.hooks.attach(again)
    resumed.load(str(tmp_path))
    assert again.steps == 3


def _loop_source(name: str) -> ast.AST:
    return ast.parse(textwrap.dedent(inspect.getsource(getattr(Trainer, name))))


def test_the_step_the_evaluation_and_the_clip_name_no_feature():
    features = {"fp8", "moe", "is_moe", "lora", "rl", "pipeline", "pp_size", "block_size", "layer_graphs",
                "searches_validation", "fp8_stats", "bd3lm"}
    for name in ("train_step", "evaluate", "_clip_grads"):
        names = {n.attr for n in ast.walk(_loop_source(name)) if isinstance(n, ast.Attribute)}
        names |= {n.id for n in ast.walk(_loop_source(name)) if isinstance(n, ast.Name)}
        assert not names & features, (name, names & features)


def test_the_plain_runner_accumulates_the_mean_gradient_and_sums_the_losses():
    torch.manual_seed(0)
    model = nn.Linear(4, 1, bias=False)
    xs = [torch.randn(3, 4) for _ in range(2)]
    batches = [Batch(x, torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1), tokens=3, flops=6.0) for x in xs]
    runner = PlainRunner(model, lambda b: model(b.inputs).square().mean(), lambda last: contextlib.nullcontext(),
                         torch.device("cpu"))
    totals = runner.train(batches, micro_steps=2)
    with torch.no_grad():
        expected = torch.zeros(()) + model(xs[0]).square().mean() + model(xs[1]).square().mean()
    assert torch.equal(totals.loss_sum, expected) and (totals.tokens, totals.flops) == (6, 12.0)
    w = model.weight.detach()
    grad = sum(2 * ((x @ w.T) * x).mean(0) for x in xs) / 2  # d/dw mean((x w)^2), averaged over the micro-batches
    torch.testing.assert_close(model.weight.grad[0], grad)
    norm = runner.clip_grads(torch.optim.SGD(model.parameters(), lr=0.1), max_norm=1e-3)
    assert abs(float(norm) - float(grad.norm())) < 1e-6
    assert abs(float(model.weight.grad.norm()) - 1e-3) < 1e-6  # clipped to max_norm
