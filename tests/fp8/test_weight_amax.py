"""megadlms.fp8.integrations.weight_amax: current scaling's weight amaxes kept by the optimizer step instead of an amax
pass per weight cast. On the CPU (torch's casts), and with StreamingAdamW and the FP8 kernels in Triton's interpreter (a
process of its own: the interpreter must be on before Triton is imported)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megadlms.config import TransformerConfig
from megadlms.fp8 import (
    DelayedScaling,
    Float8CurrentScaling,
    Float8Linear,
    attach_weight_amaxes,
    convert_to_fp8,
    detach_weight_amaxes,
    fp8_autocast,
    invalidate_fp8_weight_caches,
    refresh_weight_amaxes,
)
from megadlms.model import TransformerLM

ROOT = Path(__file__).resolve().parents[2]


def _model(recipe=None) -> TransformerLM:
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=96, vocab_size=128, seq_length=32, attn_mask_type="bidirectional")
    return convert_to_fp8(TransformerLM(cfg), recipe or Float8CurrentScaling())


def _logits(model: TransformerLM, ids: torch.Tensor) -> torch.Tensor:
    invalidate_fp8_weight_caches(model)  # each call casts the weights afresh
    with torch.no_grad(), fp8_autocast(enabled=True):
        return model(ids)


def test_attached_amaxes_are_the_weights_and_the_casts_use_them():
    model = _model()
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    ref = _logits(model, ids)
    pairs = attach_weight_amaxes(model)
    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    assert len(pairs) == len(layers) == 2 * 7
    for m in layers:
        assert torch.equal(m.weight_amax.value, m.weight.detach().abs().amax())
    assert torch.equal(_logits(model, ids), ref)  # the same values: bit for bit
    # the casts read them (fused q/k/v and gate/up groups and the single o/down layers): a wrong amax changes the
    # output, and a refresh puts it right
    for m in layers:
        m.weight_amax.value.mul_(4.0)
    assert not torch.equal(_logits(model, ids), ref)
    refresh_weight_amaxes(model)
    assert torch.equal(_logits(model, ids), ref)


def test_a_write_the_version_counter_sees_makes_the_casts_compute_their_own():
    """An in-place write to the weights that does not keep the amaxes (an EMA's lerp_, a copy_ under no_grad) bumps
    the weights' version counters: the casts then ignore the kept values, which are stale, until a refresh."""
    model = _model()
    attach_weight_amaxes(model)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    target = _model()
    with torch.no_grad():
        for p in target.parameters():
            p.mul_(3.0)
        for p, q in zip(model.parameters(), target.parameters()):
            p.lerp_(q, 1.0)  # the EMA update of a copy, weight 1: model's weights become target's
    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    assert all(m.kept_weight_amax() is None for m in layers)  # stale: 1/3 of the weights' amaxes
    assert torch.equal(_logits(model, ids), _logits(target, ids))
    refresh_weight_amaxes(model)
    assert all(torch.equal(m.kept_weight_amax(), m.weight.detach().abs().amax()) for m in layers)


def test_loads_refresh_and_moves_detach():
    model = _model()
    pairs = attach_weight_amaxes(model)
    other = _model()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(3.0)
    model.load_state_dict(other.state_dict())
    for w, a in pairs:
        assert torch.equal(a.of(w), w.detach().abs().amax())
    model.to(torch.float64)  # another tensor per weight, which no optimizer keeps an amax of
    assert all(m.weight_amax is None for m in model.modules() if isinstance(m, Float8Linear))
    attach_weight_amaxes(model)
    detach_weight_amaxes(model)
    assert all(m.weight_amax is None for m in model.modules() if isinstance(m, Float8Linear))


def test_only_current_scaling_layers_take_them():
    assert attach_weight_amaxes(_model(DelayedScaling())) == []


_SCRIPT = """
import copy, torch
from megadlms.fp8 import attach_weight_amaxes, fp8_autocast, fp8_step, Float8Linear
from megadlms.training import triton_adamw
from tests.fp8.test_weight_amax import _model

# q/k/v/o (64 x 64) go through torch's kernel, gate/up/down (96 x 64) through the Triton one
triton_adamw.StreamingAdamW.min_numel = 64 * 64 + 1
plain, kept = _model(), _model()
opts = [triton_adamw.StreamingAdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (plain, kept)]
pairs = attach_weight_amaxes(kept)
opts[1].publish_amaxes(pairs)
g = torch.Generator().manual_seed(1)
for step in range(3):
    ids = [torch.randint(0, 128, (2, 32), generator=g) for _ in range(2)]
    losses = []
    for model, opt in zip((plain, kept), opts):
        out = []
        for x in ids:
            with fp8_autocast(enabled=True):
                loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()) / len(ids)
            loss.backward()
            out.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        fp8_step(model)
        losses.append(out)
    assert losses[0] == losses[1], (step, losses)
    for w, a in pairs:
        assert a.of(w) is not None and torch.equal(a.value, w.detach().abs().amax()), (step, tuple(w.shape))
assert all(m.weight_amax is None for m in plain.modules() if isinstance(m, Float8Linear))
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_streaming_adamw_keeps_them_and_training_is_unchanged_in_interpreter():
    """StreamingAdamW publishes each weight's amax out of its update (and by an amax pass for the weights torch's
    kernel updates); training with them gives the losses of training without them, bit for bit."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    res = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


def test_the_trainer_attaches_them_to_its_streaming_optimizer(monkeypatch, tmp_path):
    """With StreamingAdamW (the trainer's optimizer on a GPU) the trainer attaches the amaxes and the optimizer keeps
    them through every step (here each parameter goes through torch's kernel: no Triton on this CPU) and a resume's
    load; the losses are those of a run whose casts compute every amax."""
    from megadlms.training import trainer as trainer_mod
    from megadlms.training.args import parse_train_args
    from megadlms.training.triton_adamw import StreamingAdamW

    small = ["--model-path", "tiny",  # flags of its own run, not over the demo configuration
             "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
             "--ffn-hidden-size", "128", "--seq-length", "32", "--device", "cpu", "--no-compile", "--num-workers", "0",
             "--eval-iters", "0", "--log-interval", "1", "--no-progress", "--no-generate-sample",
             "--micro-batch-size", "4", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]

    def losses(state):
        return [m["loss"] for m in state.history if "loss" in m and "eval_loss" not in m]

    import megadlms.fp8

    monkeypatch.setattr(trainer_mod, "build_optimizer",
                        lambda model, lr, weight_decay, betas, eps: StreamingAdamW(
                            model.parameters(), lr=lr, weight_decay=weight_decay, betas=betas, eps=eps))
    with monkeypatch.context() as m:
        m.setattr(megadlms.fp8, "attach_weight_amaxes", lambda model: [])  # every cast computes its weight's amax
        plain = losses(trainer_mod.train(parse_train_args(small + ["--train-iters", "4"])))
    trainer = trainer_mod.setup(parse_train_args(small + ["--train-iters", "4", "--save", str(tmp_path / "ck"),
                                                          "--save-interval", "2"]))
    assert isinstance(trainer.optimizer, StreamingAdamW)
    layers = [m for m in trainer.model.modules() if isinstance(m, Float8Linear)]
    assert layers and all(m.weight_amax is not None for m in layers)
    assert losses(trainer.run()) == plain
    for m in layers:
        assert torch.equal(m.kept_weight_amax(), m.weight.detach().abs().amax())
    resumed = trainer_mod.setup(parse_train_args(small + ["--train-iters", "4", "--load", str(tmp_path / "ck"),
                                                          "--ckpt-step", "2"]))
    resumed.load(str(tmp_path / "ck"), 2)
    for m in (m for m in resumed.model.modules() if isinstance(m, Float8Linear)):
        assert torch.equal(m.kept_weight_amax(), m.weight.detach().abs().amax())
