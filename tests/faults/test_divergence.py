"""Divergence: a step with a non-finite loss or gradient norm is skipped on the device and counted; a run of
them stops the run with one line; a checkpoint is never written with non-finite state; FP8 amax histories
keep no NaN or inf."""

from __future__ import annotations

import pytest
import torch

from megadlms import cli
from megadlms.training import checkpoint as ckpt
from megadlms.training.divergence import DivergenceGuard, NonFiniteStateError
from megadlms.training.trainer import Trainer

from .conftest import TINY, tiny_trainer


def _nan_gradients_at(monkeypatch, steps: set[int]) -> None:
    """A NaN in one gradient at the chosen 0-based steps (as an overflow in the backward would leave it)."""
    clip = Trainer._clip_grads

    def poisoned(self):
        if self.state.iteration in steps:
            p = next(q for q in self.model.parameters() if q.grad is not None)
            p.grad.view(-1)[0] = float("nan")
        return clip(self)
    monkeypatch.setattr(Trainer, "_clip_grads", poisoned)


def test_a_nan_gradient_skips_that_step_only(monkeypatch):
    _nan_gradients_at(monkeypatch, {2})
    trainer = tiny_trainer("--train-iters", "5")
    snapshots = []
    step = trainer.train_step

    def recording():
        out = step()
        snapshots.append([p.detach().clone() for p in trainer.model.parameters()])
        return out
    trainer.train_step = recording
    state = trainer.run()
    assert state.iteration == 5
    for a, b in zip(snapshots[1], snapshots[2]):  # the third step changed nothing
        assert torch.equal(a, b)
    assert not all(torch.equal(a, b) for a, b in zip(snapshots[2], snapshots[3]))
    opt_steps = {int(s["step"]) for s in trainer.optimizer.state.values()}
    assert opt_steps == {4}  # the skipped step is not counted by AdamW's bias correction
    logged = {m["iteration"]: m for m in state.history}
    assert logged[3].get("skipped_steps") == 1 and logged[3]["loss"] != logged[3]["loss"]  # nan: nothing to average
    assert "skipped_steps" not in logged[4] and all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert trainer.guard.total_skipped == 1


def test_consecutive_skips_stop_the_run_with_one_line(monkeypatch, tmp_path, capsys):
    _nan_gradients_at(monkeypatch, {2, 3, 4, 5, 6, 7})
    save = tmp_path / "ck"
    rc = cli.main(["train", *TINY, "--train-iters", "8", "--max-skipped-steps", "3", "--save", str(save),
                   "--save-interval", "1"])
    err = capsys.readouterr().err
    assert rc == 2
    assert ("megadlms train: error: training diverged: the last 3 steps (to iteration 5) had a non-finite loss or "
            "gradient norm and were skipped") in err
    # the skipped steps left the weights finite: the checkpoints up to the stop are good ones
    assert ckpt.complete_iterations(save) == [1, 2, 3, 4]
    model, _, _ = ckpt.load_model_from_checkpoint(save)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_huge_learning_rate_is_stopped(tmp_path, capsys):
    rc = cli.main(["train", *[f for f in TINY if f != "3e-3"][:-1], "--lr", "1e30", "--train-iters", "12",
                   "--max-skipped-steps", "2", "--clip-grad", "0", "--log-interval", "100"])
    err = capsys.readouterr().err
    assert rc == 2 and "training diverged: the last 2 steps" in err, err


def test_non_finite_weights_are_never_saved(tmp_path, capsys):
    save = tmp_path / "ck"
    trainer = tiny_trainer("--train-iters", "1", "--save", str(save))
    trainer.run()
    with torch.no_grad():
        next(trainer.model.parameters()).view(-1)[3] = float("inf")
    trainer.state.iteration = 2
    with pytest.raises(NonFiniteStateError, match="not saving iteration 2: the weights or optimizer state hold NaN "
                                                  "or inf"):
        trainer.save()
    assert ckpt.complete_iterations(save) == [1] and (save / ckpt.LATEST).read_text().strip() == "1"


def test_fused_optimizer_skips_on_the_device():
    """The device path: torch's fused AdamW reads found_inf in its kernel (no host read of the flag)."""
    p = torch.nn.Parameter(torch.ones(8))
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    guard = DivergenceGuard(opt, torch.device("cpu"), max_consecutive=0)
    assert guard.on_device
    p.grad = torch.ones(8)
    guard.step(torch.tensor(1.0), torch.tensor(1.0))
    after_one = p.detach().clone()
    p.grad = torch.full((8,), float("nan"))
    guard.step(torch.tensor(1.0), torch.tensor(float("nan")))
    assert torch.equal(p.detach(), after_one) and float(opt.state[p]["step"]) == 1
    assert float(guard.consecutive) == 1 and getattr(opt, "found_inf", None) is None


def test_fp8_amax_history_ignores_non_finite_values():
    from megadlms.fp8 import fp8_step
    from megadlms.fp8.convert import fp8_scaling_modules

    trainer = tiny_trainer("--fp8-format", "hybrid", "--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max",
                           "--train-iters", "1")
    trainer.run()
    mods = list(fp8_scaling_modules(trainer.model))
    scales = [m.fp8_scale.clone() for m in mods]
    for m in mods:  # a diverging step's forward and backward recorded NaN and inf amaxes
        m.fp8_amax_history[0] = float("nan")
        m.fp8_amax_history[0, 0] = float("inf")
    fp8_step(trainer.model)
    for m, scale in zip(mods, scales):
        assert torch.isfinite(m.fp8_amax_history).all()
        assert torch.equal(m.fp8_scale, scale)  # the scales stay where the finite history put them


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the host syncs that matter are a GPU's")
def test_the_every_step_checks_add_no_host_sync_on_a_gpu():
    from megadlms.training.preemption import RunControl

    dev = torch.device("cuda")
    p = torch.nn.Parameter(torch.ones(1 << 16, device=dev))
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    guard = DivergenceGuard(opt, dev, max_consecutive=3)
    control = RunControl(dev, distributed=False, guard=guard)
    p.grad = torch.ones_like(p)
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call in these steps raises
    try:
        for it in range(3):
            loss = p.sum()
            guard.step(loss, torch.linalg.vector_norm(p.grad))
            guard.finite_loss(loss)
            assert control.after_step(it) is None
    finally:
        torch.cuda.set_sync_debug_mode("default")
