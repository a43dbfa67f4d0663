import math

import pytest
import torch

from megadlms.training.optim import LRSchedule, build_optimizer


def test_schedules():
    s = LRSchedule(lr=1.0, min_lr=0.1, warmup_iters=10, decay_iters=110, decay_style="cosine")
    assert s(0) == pytest.approx(0.1) and s(9) == pytest.approx(1.0)
    assert s(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s(110) == pytest.approx(0.1) and s(500) == pytest.approx(0.1)
    lin = LRSchedule(lr=1.0, min_lr=0.0, warmup_iters=0, decay_iters=100, decay_style="linear")
    assert lin(25) == pytest.approx(0.75)
    assert LRSchedule(lr=2.0, decay_style="constant", decay_iters=10)(99) == 2.0
    wsd = LRSchedule(lr=1.0, min_lr=0.0, decay_iters=100, decay_style="WSD", wsd_decay_iters=20)
    assert wsd(79) == 1.0 and wsd(90) == pytest.approx(0.5) and wsd(100) == 0.0
    with pytest.raises(ValueError, match="min-lr"):
        LRSchedule(lr=1.0, min_lr=2.0)


def test_no_weight_decay_on_vectors():
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = build_optimizer(m, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    decayed = {id(p) for p in opt.param_groups[0]["params"]}
    assert opt.param_groups[0]["weight_decay"] == 0.1 and opt.param_groups[1]["weight_decay"] == 0.0
    assert decayed == {id(m[0].weight)}
