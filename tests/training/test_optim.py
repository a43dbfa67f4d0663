import math

import pytest
import torch

from megadlms.training.optim import LRSchedule, allocate_optimizer_state, build_optimizer, clip_grad_norm


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


@pytest.mark.parametrize("max_norm", [0.05, 1e9, math.inf])
def test_clipping_inside_the_fused_optimizer_equals_clip_grad_norm(max_norm):
    """The fused AdamW kernel divides by the clipping factor: same norm and same updates as clip_grad_norm_ + step
    (the fused kernel runs on the CPU too)."""
    def run(fold: bool) -> tuple[list[torch.Tensor], list[float]]:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
        opt = build_optimizer(m, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), fused=True)
        norms = []
        for step in range(4):
            x = torch.randn(32, 8, generator=torch.Generator().manual_seed(step))
            m(x).square().sum().mul(10.0 ** (step - 1)).backward()  # norms below and above max_norm
            params = [p for p in m.parameters() if p.grad is not None]
            if fold:
                norm = clip_grad_norm(opt, params, max_norm)
            else:
                norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
            norms.append(float(norm))
            opt.step()
            opt.zero_grad(set_to_none=True)
        return [p.detach().clone() for p in m.parameters()], norms

    folded, n_folded = run(True)
    plain, n_plain = run(False)
    assert n_folded == pytest.approx(n_plain, rel=1e-6)
    if max_norm == 0.05:
        assert max(n_plain) > 0.05  # the clipping did act
    for a, b in zip(folded, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_clipping_without_a_fused_optimizer_rewrites_the_gradients():
    m = torch.nn.Linear(4, 4)
    opt = build_optimizer(m, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95), fused=False)
    m(torch.ones(2, 4)).sum().mul(100).backward()
    params = list(m.parameters())
    norm = clip_grad_norm(opt, params, 1.0)
    assert float(norm) > 1.0 and getattr(opt, "grad_scale", None) is None
    total = torch.nn.utils.get_total_norm([p.grad for p in params])
    assert float(total) == pytest.approx(1.0, rel=1e-4)


@pytest.mark.parametrize("fused", [False, True])
def test_optimizer_state_made_before_the_first_step_changes_nothing(fused):
    """The state made up front (zero moments, step 0) trains bit for bit like the state made by the first step,
    leaves the parameters and the learning rate alone, and is not remade once it exists."""
    def run(early: bool) -> tuple[list[torch.Tensor], dict]:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
        opt = build_optimizer(m, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), fused=fused)
        before = [p.detach().clone() for p in m.parameters()]
        if early:
            allocate_optimizer_state(opt)
            assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
            assert all(p.grad is None for p in m.parameters()) and opt.param_groups[0]["lr"] == 1e-2
            state = opt.state[m[0].weight]
            assert float(state["step"]) == 0 and state["exp_avg"].abs().sum() == 0
            exp_avg = state["exp_avg"]
            allocate_optimizer_state(opt)  # exists: a no-op
            assert opt.state[m[0].weight]["exp_avg"] is exp_avg
        for step in range(3):
            x = torch.randn(32, 8, generator=torch.Generator().manual_seed(step))
            m(x).square().sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return [p.detach().clone() for p in m.parameters()], opt.state_dict()

    (p_early, sd_early), (p_lazy, sd_lazy) = run(True), run(False)
    for a, b in zip(p_early, p_lazy):
        assert torch.equal(a, b)
    for k, st in sd_lazy["state"].items():
        for name, v in st.items():
            assert torch.equal(torch.as_tensor(sd_early["state"][k][name]), torch.as_tensor(v)), name
