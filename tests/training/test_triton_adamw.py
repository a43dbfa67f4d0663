"""megadlms.training.triton_adamw: StreamingAdamW against torch's fused AdamW, its kernel run by Triton's
interpreter on the CPU (in a subprocess: the interpreter must be on before Triton is imported)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megadlms.training.optim import build_optimizer
from megadlms.training.triton_adamw import StreamingAdamW

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import copy
    import sys

    import pytest
    import torch

    from megadlms.training import triton_adamw
    from megadlms.training.optim import build_optimizer

    triton_adamw.StreamingAdamW.min_numel = 1000  # the two weights stream; biases and norms go through torch's kernel
    launches = []
    kernel = triton_adamw.adamw_update_
    triton_adamw.adamw_update_ = lambda p, *a, **k: (launches.append(tuple(p.shape)), kernel(p, *a, **k))

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.LayerNorm(96), torch.nn.Linear(96, 40))

    def groups_of(m):  # build_optimizer's groups: weight decay on the matrices only
        return [{"params": [p for p in m.parameters() if p.ndim == 2], "weight_decay": 0.1},
                {"params": [p for p in m.parameters() if p.ndim == 1], "weight_decay": 0.0}]

    ours, ref = model(), model()
    opt = build_optimizer(ours, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), fused=True)
    assert type(opt) is triton_adamw.StreamingAdamW
    ref_opt = torch.optim.AdamW(groups_of(ref), lr=1e-2, betas=(0.9, 0.95), fused=True)
    for step in range(4):
        x = torch.randn(32, 48, generator=torch.Generator().manual_seed(step))
        for m, o in ((ours, opt), (ref, ref_opt)):
            m(x).square().sum().backward()
            o.param_groups[0]["lr"] = o.param_groups[1]["lr"] = 1e-2 / (step + 1)
            o.grad_scale = torch.tensor(1.0 + step)  # the clipping divisor
            o.step()
            o.zero_grad(set_to_none=True)
    assert launches == [(96, 48), (40, 96)] * 4, launches
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)
        sa, sb = opt.state[a], ref_opt.state[b]
        assert sa["step"].dtype == torch.float32 and float(sa["step"]) == float(sb["step"]) == 4
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sa[k], sb[k], rtol=1e-5, atol=1e-6 * float(sb[k].abs().max()), msg=f"{name} {k}")

    # checkpoints: either optimizer's state dict continues in the other
    x = torch.randn(8, 48)
    after = []
    for src_model, src in ((ours, opt), (ref, ref_opt)):
        for cls in (triton_adamw.StreamingAdamW, torch.optim.AdamW):
            m = model()
            m.load_state_dict(src_model.state_dict())
            o = cls(groups_of(m), lr=1e-3, fused=True)
            o.load_state_dict(copy.deepcopy(src.state_dict()))  # loading would share the source's tensors
            m(x).sum().backward()
            o.step()
            after.append([p.detach() for p in m.parameters()])
    for other in after[1:]:
        for pa, pb in zip(after[0], other):
            torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-7)

    # found_inf (a skipped step): parameters, moments and step counts stay as they were, streamed or not
    before = [p.detach().clone() for p in ours.parameters()]
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in ours.parameters()]
    for p in ours.parameters():
        p.grad = torch.full_like(p, float("nan"))
    opt.found_inf = torch.ones(())
    opt.step()
    opt.found_inf = None
    for p, b, s in zip(ours.parameters(), before, states):
        assert torch.equal(p, b)
        for k, v in s.items():
            assert torch.equal(opt.state[p][k], v), k

    # the optimizer tests of test_optim, every weight streamed
    triton_adamw.StreamingAdamW.min_numel = 1
    triton_adamw.adamw_update_ = kernel
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "tests/training/test_optim.py", "-k",
                          "clipping_inside or made_before"]))
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_streaming_adamw_matches_torch_fused_adamw_in_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and " passed" in res.stdout, res.stdout + res.stderr


def test_options_it_does_not_have_are_refused():
    p = [torch.nn.Parameter(torch.zeros(4))]
    for option in ("amsgrad", "maximize", "capturable"):
        with pytest.raises(ValueError, match=f"{option}=True"):
            StreamingAdamW(p, **{option: True})
    with pytest.raises(ValueError, match="fused=False"):
        StreamingAdamW(p, fused=False)


def test_without_a_gpu_or_interpreter_the_optimizer_is_torchs(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the interpreter would make the kernel run on the CPU
    opt = build_optimizer(torch.nn.Linear(4, 4), lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95), fused=True)
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"]


def test_step_hooks_run_once_per_step():
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])  # an AdamW made first: its class's step is hooked too
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.ones(4)
    opt = StreamingAdamW([p], lr=0.1)
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    opt.register_step_post_hook(lambda *a: calls.append("post"))
    opt.step()
    assert calls == ["pre", "post"] and torch.allclose(p.detach(), torch.full((4,), -0.1))
