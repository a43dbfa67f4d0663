"""megadlms.fp8.fusions.fused_mlp / triton_swiglu: the FP8 MLP as one function with the SwiGLU fused into its casts.

The kernels run in Triton's interpreter on the CPU (a subprocess: the interpreter must be on before Triton is
imported). In fp32 (no autocast) the fused MLP computes exactly what the unfused FP8 layers compute, so training
with and without it give the same logits and gradients bit for bit on the first fused step, and close after it
(the amaxes of h may differ in their last bit, so later scales may too)."""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megadlms.config import TransformerConfig
from megadlms.fp8 import (
    DelayedScaling,
    Float8CurrentScaling,
    Float8RowwiseScaling,
    convert_to_fp8,
    enable_fp8_stats,
    fp8_autocast,
    fp8_step,
)
from megadlms.fp8.fusions.fused_mlp import FusedFloat8MLP
from megadlms.fp8.kernels import triton_cast, triton_swiglu
from megadlms.model import TransformerLM

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

COMMON = textwrap.dedent("""
    import copy
    import torch
    from megadlms.config import TransformerConfig
    from megadlms.fp8 import DelayedScaling, convert_to_fp8
    from megadlms.fp8.kernels import triton_swiglu as ts
    from megadlms.model import TransformerLM
    from tests.fp8.helpers import sgd_step as step

    def cfg():
        return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                 ffn_hidden_size=96, vocab_size=128, seq_length=32,
                                 untie_embeddings_and_output_weights=True)
""")

KERNELS = COMMON + textwrap.dedent("""
    from megadlms.fp8.kernels import triton_cast
    triton_cast.CHECK_ROWS = 16  # the first-call references built in several row blocks
    torch.manual_seed(0)
    cases = (((40, 48), torch.float8_e4m3fn), ((40, 48), torch.float8_e5m2), ((64, 128), torch.float8_e4m3fn))
    for (m, f), fp8 in cases:
        # partial tiles on both axes, or whole tiles only (the kernels without masks)
        y = (torch.randn(m, 2 * f) * 2).bfloat16()
        assert ts.available(y)
        fmax = torch.finfo(fp8).max
        amax = torch.tensor(0.5)
        q, t = ts.checked_swiglu_cast(y, torch.tensor(8.0), fp8, True, amax)
        h = ts.swiglu_ref(y[:, :f], y[:, f:])
        assert ts._codes_close(q, (h * 8).clamp(-fmax, fmax).to(fp8))
        assert torch.equal(t.view(torch.uint8), q.view(torch.uint8).t())
        assert torch.allclose(amax, h.abs().amax(), rtol=1e-6)
        dh = torch.randn(m, f).bfloat16()
        slots = [torch.tensor(0.0), torch.tensor(1e9)]
        q, t = ts.checked_swiglu_bwd_cast(dh, y[:, :f], y[:, f:], torch.tensor(4.0), fp8, True, True, None, slots)
        d = torch.cat(ts.swiglu_bwd_ref(dh, y[:, :f], y[:, f:]), 1)
        assert ts._codes_close(q, (d * 4).clamp(-fmax, fmax).to(fp8))
        assert torch.equal(t.view(torch.uint8), q.view(torch.uint8).t())
        assert torch.allclose(slots[0], d.abs().amax(), rtol=1e-6) and slots[1] == 1e9
        # gate/up kept in E4M3 with row scales; only the transposed output
        from megadlms.fp8.kernels.primitives import quantize_rowwise
        gq, gs = quantize_rowwise(y[:, :f], torch.float8_e4m3fn)
        uq, us = quantize_rowwise(y[:, f:], torch.float8_e4m3fn)
        q2, t2 = ts.checked_swiglu_bwd_cast(dh, gq, uq, torch.tensor(4.0), fp8, False, True, (gs[:, 0], us[:, 0]))
        d2 = torch.cat(ts.swiglu_bwd_ref(dh, gq.float() * gs, uq.float() * us), 1)
        assert q2 is None and ts._codes_close(t2.t().contiguous(), (d2 * 4).clamp(-fmax, fmax).to(fp8))
        # current scaling's amaxes: of the values the casts scale, nothing written; a NaN wins
        assert torch.allclose(ts.checked_swiglu_amax(y), h.abs().amax(), rtol=1e-6)
        assert torch.allclose(ts.checked_swiglu_bwd_amax(dh, y[:, :f], y[:, f:]), d.abs().amax(), rtol=1e-6)
        assert torch.allclose(ts.checked_swiglu_bwd_amax(dh, gq, uq, (gs[:, 0], us[:, 0])), d2.abs().amax(),
                              rtol=1e-6)
        for tile in ((8, 16, 4, 1), (16, 32, 4, 64)):  # one program striding over every tile; one per tile
            assert torch.allclose(ts.swiglu_amax(y, tile), h.abs().amax(), rtol=1e-6)
            assert torch.allclose(ts.swiglu_bwd_amax(dh, y[:, :f], y[:, f:], None, tile), d.abs().amax(), rtol=1e-6)
        y_nan = y.clone()
        y_nan[m - 1, f + 3] = float("nan")
        assert ts.swiglu_amax(y_nan).isnan() and ts.swiglu_bwd_amax(dh, y_nan[:, :f], y_nan[:, f:]).isnan()
    for mode in sorted(set(ts.FORMULATIONS["fwd"] + ts.FORMULATIONS["bwd"])):  # every way of making q^T
        # the same bytes as q transposed
        q, t = ts.swiglu_cast(y, torch.tensor(8.0), torch.float8_e4m3fn, True, None, mode, marker=True)
        assert torch.equal(t.view(torch.uint8), q.view(torch.uint8).t()), mode
        q, t = ts.swiglu_bwd_cast(dh, y[:, :f], y[:, f:], torch.tensor(4.0), torch.float8_e5m2, True, True,
                                  t_mode=mode, marker=True)
        assert torch.equal(t.view(torch.uint8), q.view(torch.uint8).t()), mode
    assert all(ts._state["checked"].values()) and all(ts._state["amax_ok"].values()), ts._state
    print("OK")
""")

TRAINING = COMMON + textwrap.dedent("""
    import sys
    store = sys.argv[1] == "store"
    torch.manual_seed(0)
    base = TransformerLM(cfg())
    recipe = DelayedScaling(amax_history_len=4)
    fused = convert_to_fp8(copy.deepcopy(base), recipe, activation_func_fp8_input_store=store)
    plain = convert_to_fp8(copy.deepcopy(base), recipe, activation_func_fp8_input_store=store, fuse_mlp=False)
    calls = fused.layers[0].mlp.fusion
    for it, s in enumerate((24, 24, 23, 24)):  # 23 x 2 tokens: padded to 48 rows inside
        tokens = torch.randint(0, 128, (2, s))
        la, ga = step(fused, tokens)
        lb, gb = step(plain, tokens)
        assert calls.num_fused_calls == it, (it, calls.num_fused_calls)  # the first step (no scales) is unfused
        hist = {n: b for n, b in plain.named_buffers() if "amax_history" in n}
        # the amaxes of h and of the SwiGLU's derivative are fp32 values whose last bit may differ (silu's exp), so
        # the scales of later steps may too: the same numbers exactly on the first fused step (fp32 model, scales
        # from the same unfused step), close after it
        assert all(torch.allclose(b, hist[n], rtol=1e-5) for n, b in fused.named_buffers() if n in hist), it
        if it == 1 and not store:
            assert torch.equal(la, lb) and all(torch.equal(ga[k], gb[k]) for k in gb)
        assert (la - lb).abs().max() <= 1e-2 * lb.abs().max(), it
        assert all((ga[k] - gb[k]).abs().max() <= 5e-2 * gb[k].abs().max() + 1e-6 for k in gb), it
    with torch.no_grad():  # no backward: no transposed copies, same output
        tokens = torch.randint(0, 128, (2, 24))
        la, lb = fused(tokens), plain(tokens)
        assert (la - lb).abs().max() <= 1e-2 * lb.abs().max()
    print("OK")
""")


CURRENT = COMMON + textwrap.dedent("""
    # current scaling: the fused MLP from the first step, against the unfused layers (BF16 SwiGLU; the same casts
    # of x and of the weights, the amaxes of h and of the derivatives from fp32 values instead of BF16 ones). Their
    # FP8 roundings differ, so both are measured against the model without FP8: the fused MLP must be as close
    from megadlms.fp8 import Float8CurrentScaling
    torch.manual_seed(0)
    base = TransformerLM(cfg())
    fused = convert_to_fp8(copy.deepcopy(base), Float8CurrentScaling())
    plain = convert_to_fp8(copy.deepcopy(base), Float8CurrentScaling(), fuse_mlp=False)
    calls = fused.layers[0].mlp.fusion
    rel = lambda a, b: float((a - b).float().norm() / b.float().norm())
    for it, s in enumerate((24, 23, 24)):
        tokens = torch.randint(0, 128, (2, s))
        exact_a, exact_b = copy.deepcopy(base), copy.deepcopy(base)  # each with the weights its FP8 model has now
        exact_a.load_state_dict(fused.state_dict(), strict=False)
        exact_b.load_state_dict(plain.state_dict(), strict=False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            la, ga = step(fused, tokens)
            lb, gb = step(plain, tokens)
            lc, gc = step(exact_a, tokens)
            ld, gd = step(exact_b, tokens)
        assert calls.num_fused_calls == it + 1
        assert rel(la, lc) <= 1.1 * rel(lb, ld) and rel(la, lc) < 0.03, it
        worst_fused, worst_plain = max(rel(ga[k], gc[k]) for k in gc), max(rel(gb[k], gd[k]) for k in gd)
        assert worst_fused <= 1.25 * worst_plain and worst_fused < 0.2, (it, worst_fused, worst_plain)
    assert all(ts._state["amax_ok"].values()) and len(ts._state["amax_ok"]) == 2
    assert ts._state["checked"] and all(ts._state["checked"].values())
    print("OK")
""")


def _run(script: str, *args: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-c", script, *args], env=env, cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stdout + res.stderr


@needs_triton
def test_fused_swiglu_cast_kernels_match_torch_in_interpreter():
    _run(KERNELS)


@needs_triton
@pytest.mark.parametrize("store", ["bf16", "store"])
def test_fused_mlp_trains_like_the_unfused_fp8_layers(store):
    _run(TRAINING, store)


@needs_triton
def test_fused_mlp_with_current_scaling_trains_like_the_unfused_layers_in_interpreter():
    _run(CURRENT)


# --------------------------------------------------------------------------------------------- in-process logic
def _cfg() -> TransformerConfig:
    return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                             ffn_hidden_size=96, vocab_size=128, seq_length=32,
                             untie_embeddings_and_output_weights=True)


def _train_steps(model: torch.nn.Module, n: int) -> torch.Tensor:
    for _ in range(n):
        logits = model(torch.randint(0, 128, (2, 16)))
        logits.float().logsumexp(-1).mean().backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= 1e-2 * p.grad
                    p.grad = None
        fp8_step(model)
    return logits.detach()


def _fused_and_plain(recipe) -> tuple[TransformerLM, TransformerLM, TransformerLM]:
    """(base model, its FP8 conversion with the fused MLP, without it), from seed 0."""
    torch.manual_seed(0)
    base = TransformerLM(_cfg())
    return base, convert_to_fp8(copy.deepcopy(base), recipe), convert_to_fp8(copy.deepcopy(base), recipe,
                                                                              fuse_mlp=False)


def _torch_kernels(monkeypatch, wrong_fwd: bool = False, wrong_bwd: bool = False, wrong_amax: bool = False) -> None:
    """The kernels' contract computed with torch, optionally wrong, standing in for Triton on the CPU."""

    def fwd(y, scale, fp8_dtype, want_t, amax_out=None, t_mode=0, tile=None, marker=False, sw_round=False):
        f = y.shape[1] // 2
        h = triton_swiglu.swiglu_ref(y[:, :f], y[:, f:])
        fmax = torch.finfo(fp8_dtype).max
        q = ((h * scale).clamp(-fmax, fmax) * (-1 if wrong_fwd else 1)).to(fp8_dtype)
        if amax_out is not None:
            amax_out.copy_(torch.maximum(amax_out, h.abs().amax()))
        return q, q.t().contiguous() if want_t else None

    def bwd(dh, gate, up, scale, fp8_dtype, want_q, want_t, row_scales=None, amax_out=(), t_mode=0, tile=None,
            marker=False, sw_round=False):
        if row_scales is not None:
            gate, up = gate.float() * row_scales[0][:, None], up.float() * row_scales[1][:, None]
        d = torch.cat(triton_swiglu.swiglu_bwd_ref(dh, gate, up), 1)
        fmax = torch.finfo(fp8_dtype).max
        q = (d * scale).clamp(-fmax, fmax).to(fp8_dtype)
        t = q.t().contiguous()
        if wrong_bwd:
            t.view(torch.uint8).zero_()
        for a in amax_out:
            a.copy_(torch.maximum(a, d.abs().amax()))
        return (q if want_q else None), (t if want_t else None)

    def amax(y, tile=None):
        f = y.shape[1] // 2
        return triton_swiglu.swiglu_ref(y[:, :f], y[:, f:]).abs().amax() * (2 if wrong_amax else 1)

    def bwd_amax(dh, gate, up, row_scales=None, tile=None):
        if row_scales is not None:
            gate, up = gate.float() * row_scales[0][:, None], up.float() * row_scales[1][:, None]
        return torch.cat(triton_swiglu.swiglu_bwd_ref(dh, gate, up), 1).abs().amax()

    monkeypatch.setattr(triton_swiglu, "available", lambda y: True)
    monkeypatch.setattr(triton_swiglu, "swiglu_amax", amax)
    monkeypatch.setattr(triton_swiglu, "swiglu_bwd_amax", bwd_amax)
    monkeypatch.setattr(triton_swiglu, "swiglu_cast", fwd)
    monkeypatch.setattr(triton_swiglu, "swiglu_bwd_cast", bwd)
    monkeypatch.setattr(triton_swiglu, "_state", {"checked": {}, "rejected": {}, "amax_ok": {}})


def test_a_kernel_that_fails_its_first_check_is_switched_off_and_training_matches(monkeypatch):
    """A fused kernel whose first call disagrees with torch is switched off with a warning, the MLP computes the
    same step through the unfused path (BF16 SwiGLU + the layers' own casts), and the amax histories are left as
    if the failed call had not happened."""
    _, fused, plain = _fused_and_plain(DelayedScaling())
    for wrong in ("fwd", "bwd"):
        _torch_kernels(monkeypatch, wrong_fwd=wrong == "fwd", wrong_bwd=wrong == "bwd")
        torch.manual_seed(1)
        ref = _train_steps(copy.deepcopy(plain), 3)
        torch.manual_seed(1)
        model = copy.deepcopy(fused)
        with pytest.warns(RuntimeWarning, match="fused SwiGLU"):
            out = _train_steps(model, 3)
        assert torch.equal(out, ref), wrong
        off = [k for k, ok in triton_swiglu._state["checked"].items() if not ok]
        assert off and (wrong == "fwd") == any(k[0] == "fwd" for k in off)
        # why a variant was switched off stays on record (benchmarks report it)
        assert all(triton_swiglu._state["rejected"][k] for k in off)


def test_fused_path_needs_delayed_scales_and_no_telemetry(monkeypatch):
    """With delayed scaling the first step (no scales yet) and FP8 telemetry steps run the layers one by one; the
    fused path, with torch standing in for the kernels, trains like the unfused."""
    _torch_kernels(monkeypatch)
    _, fused, plain = _fused_and_plain(DelayedScaling())
    mlp_fwd = fused.layers[0].mlp.fusion
    assert isinstance(mlp_fwd, FusedFloat8MLP) and plain.layers[0].mlp.fusion is None
    assert "(fusion): FusedFloat8MLP(\n    gate_proj, up_proj, act_fn, down_proj" in repr(fused.layers[0].mlp)
    torch.manual_seed(1)
    _train_steps(fused, 1)
    assert mlp_fwd.num_fused_calls == 0
    torch.manual_seed(1)
    out = _train_steps(fused, 2)
    assert mlp_fwd.num_fused_calls == 2
    torch.manual_seed(1)
    _train_steps(plain, 1)
    torch.manual_seed(1)
    assert torch.equal(out, _train_steps(plain, 2))
    enable_fp8_stats(fused, True)
    _train_steps(fused, 1)
    assert mlp_fwd.num_fused_calls == 2


def test_current_scaling_fuses_the_mlp_from_its_first_step(monkeypatch):
    """Current scaling takes the fused path from the first step (its scales come from amax passes over the fused
    kernels' inputs, `swiglu_amax` / `swiglu_bwd_amax`): with torch standing in for the kernels, the first forward
    is the unfused layers' bit for bit (fp32: h is the same fp32 tensor, so its amax, scale and cast are too) and
    training stays close (the derivative's formula differs from autograd's in its last bits). Rowwise scaling
    keeps the unfused MLP."""
    _torch_kernels(monkeypatch)
    base, fused, plain = _fused_and_plain(Float8CurrentScaling())
    mlp_fwd = fused.layers[0].mlp.fusion
    assert isinstance(mlp_fwd, FusedFloat8MLP)
    tokens = torch.randint(0, 128, (2, 16))
    with fp8_autocast():
        assert torch.equal(fused(tokens), plain(tokens))
    assert mlp_fwd.num_fused_calls == 1
    torch.manual_seed(1)
    out = _train_steps(fused, 3)
    torch.manual_seed(1)
    ref = _train_steps(plain, 3)
    assert mlp_fwd.num_fused_calls == 4
    assert (out - ref).abs().max() <= 1e-2 * ref.abs().max()
    assert all(triton_swiglu._state["amax_ok"].values()) and len(triton_swiglu._state["amax_ok"]) == 2
    rowwise = convert_to_fp8(copy.deepcopy(base), Float8RowwiseScaling())
    assert rowwise.layers[0].mlp.fusion is None


def test_an_amax_kernel_that_fails_its_first_check_is_switched_off(monkeypatch):
    """A wrong amax of h switches its kernel off with a warning; the MLP then computes h in BF16 and the down
    projection casts it as the unfused layers do: the same output."""
    _torch_kernels(monkeypatch, wrong_amax=True)
    _, fused, plain = _fused_and_plain(Float8CurrentScaling())
    tokens = torch.randint(0, 128, (2, 16))
    with fp8_autocast(), pytest.warns(RuntimeWarning, match="SwiGLU amax kernel"):
        out = fused(tokens)
    with fp8_autocast():
        assert torch.equal(out, plain(tokens))
    assert triton_swiglu._state["amax_ok"] == {("fwd", torch.float32): False}


def test_first_call_references_are_built_in_row_blocks(monkeypatch):
    """The first-call checks build their torch references a few rows at a time (bounded temporaries at 8B-class
    shapes): the same codes and amaxes as the whole-tensor computation, a NaN in a later block kept, and code
    differences counted over every block."""
    monkeypatch.setattr(triton_cast, "CHECK_ROWS", 7)
    torch.manual_seed(0)
    m, f, fp8 = 40, 24, torch.float8_e4m3fn
    y = (torch.randn(m, 2 * f) * 2).bfloat16()
    dh = torch.randn(m, f).bfloat16()
    scale = torch.tensor(8.0)
    h = triton_swiglu.swiglu_ref(y[:, :f], y[:, f:])
    ref, amax = triton_cast.reference_cast(m, f, scale, fp8, lambda r0, r1: triton_swiglu.swiglu_ref(y[r0:r1, :f],
                                                                                                    y[r0:r1, f:]))
    assert torch.equal(ref.view(torch.uint8), (h * 8).clamp(-448, 448).to(fp8).view(torch.uint8))
    assert torch.equal(amax, h.abs().amax())
    d = torch.cat(triton_swiglu.swiglu_bwd_ref(dh, y[:, :f], y[:, f:]), 1)
    got = triton_swiglu._reference_amax(m, lambda r0, r1: triton_swiglu._derivatives(dh, y[:, :f], y[:, f:], None,
                                                                                     r0, r1))
    assert torch.equal(got, d.abs().amax())
    y[m - 1, 0] = float("nan")
    assert triton_swiglu._reference_amax(m, lambda r0, r1: triton_swiglu.swiglu_ref(y[r0:r1, :f],
                                                                                    y[r0:r1, f:])).isnan()
    near = ref.clone()
    near.view(torch.uint8)[[0, m - 1], 3] += 1  # one step in the first and the last block
    assert triton_swiglu._codes_close(near, ref, max_share=2 / near.numel())
    assert not triton_swiglu._codes_close(near, ref, max_share=1 / near.numel())
    far = ref.clone()
    far.view(torch.uint8)[m - 1, 5] ^= 0x7F  # far off, in the last block only
    assert not triton_swiglu._codes_close(far, ref)
