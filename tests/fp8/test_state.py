"""megadlms.fp8.state: fp8_autocast scoping, nesting and restoration."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from megadlms.fp8 import (
    DelayedScaling,
    Float8CurrentScaling,
    Float8Linear,
    FP8GlobalStateManager,
    fp8_autocast,
    fp8_checkpoint_context_fn,
)


def test_nesting_and_restore():
    r1, r2 = DelayedScaling(amax_history_len=4), Float8CurrentScaling()
    assert not FP8GlobalStateManager.is_fp8_enabled()
    with fp8_autocast(fp8_recipe=r1, amax_reduction_group="g"):
        assert FP8GlobalStateManager.is_fp8_enabled() and FP8GlobalStateManager.get_fp8_recipe() == r1
        with fp8_autocast(enabled=False):
            assert not FP8GlobalStateManager.is_fp8_enabled()
            assert FP8GlobalStateManager.get_amax_reduction_group() == "g"  # inherited
            with fp8_autocast(fp8_recipe=r2):
                assert FP8GlobalStateManager.get_fp8_recipe() == r2
            assert not FP8GlobalStateManager.is_fp8_enabled()
        assert FP8GlobalStateManager.get_fp8_recipe() == r1
    assert not FP8GlobalStateManager.is_fp8_enabled()
    assert FP8GlobalStateManager.get_amax_reduction_group() is None


def test_default_recipe_and_restore_on_exception():
    with fp8_autocast():
        assert FP8GlobalStateManager.get_fp8_recipe() == DelayedScaling()
        assert FP8GlobalStateManager.get_explicit_recipe() is None
    with pytest.raises(RuntimeError, match="boom"):
        with fp8_autocast(fp8_recipe=Float8CurrentScaling()):
            raise RuntimeError("boom")
    assert not FP8GlobalStateManager.is_fp8_enabled()
    assert FP8GlobalStateManager.get_explicit_recipe() is None


def test_bad_recipe_is_rejected():
    with pytest.raises(TypeError, match="DelayedScaling"):
        with fp8_autocast(fp8_recipe="delayed"):
            pass


def test_is_fp8_available_on_cpu():
    assert FP8GlobalStateManager.is_fp8_available("cpu") == (True, "")


def test_activation_checkpoint_recomputes_in_fp8():
    torch.manual_seed(0)
    layer = Float8Linear(32, 32, recipe=Float8CurrentScaling())
    x = torch.randn(5, 32, requires_grad=True)
    with fp8_autocast():
        y = checkpoint(layer, x, use_reentrant=False, context_fn=fp8_checkpoint_context_fn)
    y.sum().backward()  # recomputation runs outside fp8_autocast; the context restores FP8
    grad_ckpt = x.grad.clone()
    x.grad = None
    layer.weight.grad = None
    with fp8_autocast():
        layer(x).sum().backward()
    assert torch.equal(grad_ckpt, x.grad)


def test_recomputation_takes_the_forwards_fp8_weights_instead_of_casting_them_again(monkeypatch):
    """One micro-batch per step (no per-step weight cache) and every layer checkpointed: each FP8 weight, fused
    groups and the fused MLP included, is cast once per step, as without recomputation, with the same gradients."""
    from megadlms.distributed.parallelize import apply_activation_checkpointing
    from megadlms.fp8 import fp8_modules, fp8_step, set_fp8_weight_caching

    from .test_weight_release import _fp8_lm

    base, ids = _fp8_lm(monkeypatch)
    base.config.fp8 = True  # what apply_activation_checkpointing reads to enter the FP8 state in the recomputation
    casts, grads = [], []
    for recompute in (False, True):
        model = copy.deepcopy(base)
        set_fp8_weight_caching(model, False)
        if recompute:
            apply_activation_checkpointing(model)
        per_step = []
        for _ in range(3):  # the fused MLP runs from the second step on (it needs the scales of a first fp8_step)
            before = sum(m.num_weight_casts for m in fp8_modules(model))
            with fp8_autocast():
                model(ids).float().logsumexp(-1).mean().backward()
            per_step.append(sum(m.num_weight_casts for m in fp8_modules(model)) - before)
            fp8_step(model)
        casts.append(per_step)
        grads.append([p.grad for p in model.parameters()])
    n_linears = len(list(fp8_modules(base)))
    assert casts[0] == casts[1] == [n_linears] * 3, casts
    for a, b in zip(*grads):
        assert torch.equal(a, b)
