"""megadlms.fp8.fusions.fused_linear: q/k/v and gate/up as one FP8 GEMM each, against the unfused Float8Linears."""

from __future__ import annotations

import copy

import pytest
import torch

from megadlms.config import TransformerConfig
from megadlms.fp8 import (
    DelayedScaling,
    Float8CurrentScaling,
    Float8RowwiseScaling,
    convert_to_fp8,
    fp8_step,
)
from megadlms.fp8.fusions.fused_linear import FusedFloat8Projection
from megadlms.fp8.kernels import triton_cast
from megadlms.fp8.kernels.ops import cast_fp8, cast_fp8_cat
from megadlms.model import TransformerLM

from .helpers import sgd_step


def _cfg(**kw) -> TransformerConfig:
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                vocab_size=128, seq_length=32, untie_embeddings_and_output_weights=True)
    return TransformerConfig(**{**base, **kw})


def _pair(recipe, **kw):
    torch.manual_seed(0)
    base = TransformerLM(_cfg(**kw))
    fused = convert_to_fp8(copy.deepcopy(base), recipe)
    plain = convert_to_fp8(copy.deepcopy(base), recipe, fuse_projections=False)
    return fused, plain


def _equalize_group_scales(model: torch.nn.Module) -> None:
    """Give the members of each group equal scales (what fused and unfused share after the same steps)."""
    for layer in model.layers:
        for owner, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj")), (layer.mlp, ("gate_proj", "up_proj"))):
            mods = [getattr(owner, n) for n in names]
            joint = torch.stack([m.fp8_scale for m in mods]).amin(0)
            for m in mods:
                m.fp8_scale.copy_(joint)


_step = sgd_step


def test_cast_cat_equals_separate_casts():
    torch.manual_seed(0)
    ws = [torch.randn(32, 48), torch.randn(16, 48) * 3, torch.randn(48, 48) * 0.1]
    scale = torch.tensor(17.0)
    q, t = cast_fp8_cat(ws, scale, torch.float8_e4m3fn, want_t=True)
    parts = [cast_fp8(w, scale, None, torch.float8_e4m3fn, want_t=True) for w in ws]
    assert torch.equal(q.view(torch.uint8), torch.cat([p[0] for p in parts]).view(torch.uint8))
    assert torch.equal(t.view(torch.uint8), torch.cat([p[1] for p in parts], dim=1).view(torch.uint8))


def test_convert_installs_fused_projections_keeping_state_dict():
    fused, plain = _pair(DelayedScaling(amax_history_len=4))
    for layer in fused.layers:
        assert isinstance(layer.self_attn.qkv_fusion, FusedFloat8Projection)
        assert isinstance(layer.mlp.gate_up_fusion, FusedFloat8Projection)
        assert layer.self_attn.qkv_fusion.members() == [layer.self_attn.q_proj, layer.self_attn.k_proj,
                                                        layer.self_attn.v_proj]
        assert not vars(layer.self_attn).keys() & {"project_qkv", "forward"}  # no behaviour on the instance
    # the module tree names what runs
    assert "(qkv_fusion): FusedFloat8Projection(q_proj, k_proj, v_proj)" in repr(fused.layers[0])
    assert "(gate_up_fusion): FusedFloat8Projection(gate_proj, up_proj)" in repr(fused.layers[0])
    for layer in plain.layers:
        assert layer.self_attn.qkv_fusion is None and layer.mlp.gate_up_fusion is None
    assert list(fused.state_dict()) == list(plain.state_dict())
    assert sum(1 for _ in fused.parameters()) == sum(1 for _ in plain.parameters())
    rowwise, _ = _pair(Float8RowwiseScaling())
    assert rowwise.layers[0].self_attn.qkv_fusion is None


def test_fused_model_trains_like_unfused():
    """Same start (delayed scales from an unfused pass): three optimizer steps stay close to the unfused
    model (the first logits are bitwise equal; afterwards the input gradients' summation order differs)."""
    fused, plain = _pair(DelayedScaling(amax_history_len=4), add_qkv_bias=True)
    tokens = torch.randint(0, 128, (2, 16))
    plain(tokens).float().sum().backward()
    plain.zero_grad(set_to_none=True)
    fp8_step(plain)
    fused.load_state_dict(plain.state_dict())  # same parameters, histories and scales
    for step in range(3):
        _equalize_group_scales(fused)
        _equalize_group_scales(plain)
        lf, gf = _step(fused, tokens)
        lp, gp = _step(plain, tokens)
        if step == 0:
            assert torch.equal(lf, lp)
        assert (lf - lp).norm() <= 1e-2 * lp.norm(), step
        for n in gf:
            assert (gf[n] - gp[n]).norm() <= 0.05 * gp[n].norm() + 1e-12, (step, n)
    assert fused.layers[0].self_attn.qkv_fusion.num_fused_calls == 3


def test_fused_history_records_shared_amaxes_and_own_weight_amax():
    fused, plain = _pair(DelayedScaling(amax_history_len=4))
    tokens = torch.randint(0, 128, (2, 16))
    for model in (fused, plain):
        model(tokens).float().sum().backward()
    fa, pa = fused.layers[0].self_attn, plain.layers[0].self_attn
    names = ("q_proj", "k_proj", "v_proj")
    for n in names:  # own weight amax, same input amax
        assert torch.equal(getattr(fa, n).fp8_amax_history[0, :2], getattr(pa, n).fp8_amax_history[0, :2])
    grad_amaxes = {float(getattr(fa, n).fp8_amax_history[0, 2]) for n in names}
    assert len(grad_amaxes) == 1 and grad_amaxes.pop() > 0  # the gradient amax of the concatenation, shared


def test_fused_tensorwise_close_to_unfused_and_falls_back_outside_fp8():
    fused, plain = _pair(Float8CurrentScaling())
    tokens = torch.randint(0, 128, (2, 16))
    ctx = fused.layer_context
    fused.layer_context = plain.layer_context = torch.enable_grad  # FP8 off: plain linears, identical
    with torch.no_grad():
        assert torch.equal(fused(tokens), plain(tokens))
    fused.layer_context = plain.layer_context = ctx
    lf, gf = _step(fused, tokens)
    lp, gp = _step(plain, tokens)
    assert (lf - lp).norm() / lp.norm() < 2e-2
    for n in gf:
        assert (gf[n] - gp[n]).norm() / gp[n].norm() < 0.3, n
    assert fused.layers[0].mlp.gate_up_fusion.num_fused_calls == 1


def test_fused_weight_cast_once_per_step_across_micro_batches():
    fused, _ = _pair(DelayedScaling(amax_history_len=4))
    tokens = torch.randint(0, 128, (2, 16))
    attn = fused.layers[0].self_attn
    for micro in range(3):
        fused(tokens).float().sum().backward()
    assert attn.q_proj.num_weight_casts == 1 and attn.v_proj.num_weight_casts == 1
    with torch.no_grad():
        for p in fused.parameters():
            p -= 1e-3 * p.grad
    fp8_step(fused)
    fused(tokens).float().sum().backward()
    assert attn.q_proj.num_weight_casts == 2
    # a member called on its own uses its slice of the group's FP8 weight: no extra cast
    from megadlms.fp8 import fp8_autocast
    with fp8_autocast(True, DelayedScaling(amax_history_len=4)):
        attn.k_proj(torch.randn(4, 64))
    assert attn.k_proj.num_weight_casts == 2


def test_fused_model_compiles_with_graph_breaks_only():
    fused, _ = _pair(DelayedScaling(amax_history_len=4))
    eager = copy.deepcopy(fused)
    tokens = torch.randint(0, 128, (2, 16))
    for layer in fused.layers:
        layer.compile(backend="aot_eager")
    for _ in range(2):
        lf, gf = _step(fused, tokens)
        le, ge = _step(eager, tokens)
        assert torch.allclose(lf, le, rtol=1e-5, atol=1e-5)
    assert fused.layers[0].mlp.gate_up_fusion.num_fused_calls == 2


def test_no_output_of_a_compiled_fp8_layer_graph_has_two_consumers():
    """The FP8 functions split each compiled layer into several graphs. A graph output read by two later graphs gets
    its two gradients summed by an eager kernel over the fp32 residual stream; the layers pass their last residual
    add on to the next layer (`TransformerLayer.forward`), so every output has one consumer and the sums happen
    inside the compiled backwards."""
    fused, _ = _pair(DelayedScaling(amax_history_len=4), num_layers=3)
    for layer in fused.layers:
        layer.compile(backend="aot_eager")
    loss = fused(torch.randint(0, 128, (2, 16))).float().sum()
    consumers: dict[tuple, int] = {}
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for fn, nr in node.next_functions:
            if fn is not None:
                consumers[(fn, nr)] = consumers.get((fn, nr), 0) + 1
                todo.append(fn)
    compiled = [(fn, nr) for fn, nr in consumers if type(fn).__name__ == "CompiledFunctionBackward"]
    assert len({fn for fn, _ in compiled}) >= 3 * 3  # several graphs per layer: the breaks are there
    assert [consumers[k] for k in compiled if consumers[k] > 1] == []


@pytest.mark.parametrize("fp8_wgrad", [True, False])
def test_group_outputs_and_weight_grads_bitwise_dx_to_summation_order(fp8_wgrad):
    """One q/k/v group with equal member scales: outputs and weight/bias gradients bitwise equal to the
    unfused layers' (fp8_wgrad=False: the BF16 weight gradients too), the input gradient up to summation order."""
    torch.manual_seed(0)
    base = TransformerLM(_cfg(add_qkv_bias=True))
    recipe = DelayedScaling(amax_history_len=4)
    fused = convert_to_fp8(copy.deepcopy(base), recipe, fp8_wgrad=fp8_wgrad)
    plain = convert_to_fp8(copy.deepcopy(base), recipe, fp8_wgrad=fp8_wgrad, fuse_projections=False)
    from megadlms.fp8 import fp8_autocast

    torch.manual_seed(1)
    x = torch.randn(2, 16, 64)
    with fp8_autocast(True, DelayedScaling(amax_history_len=4)):  # step 0: current scaling of each operand
        plain.layers[0].self_attn.project_qkv(x)
    fp8_step(plain)
    fused.load_state_dict(plain.state_dict())
    _equalize_group_scales(fused)
    _equalize_group_scales(plain)
    grads = [torch.randn(2, 16, n) for n in (64, 32, 32)]
    res = []
    for model in (fused, plain):
        xi = x.clone().requires_grad_()
        attn = model.layers[0].self_attn
        with fp8_autocast(True, DelayedScaling(amax_history_len=4)):
            outs = attn.project_qkv(xi)
        torch.autograd.backward(outs, grads)
        res.append((outs, xi.grad, [p.grad for p in (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight,
                                                     attn.q_proj.bias, attn.v_proj.bias)]))
    (of, dxf, gwf), (op, dxp, gwp) = res
    assert fused.layers[0].self_attn.qkv_fusion.num_fused_calls == 1
    for a, b in zip(of, op):
        assert torch.equal(a, b)
    for a, b in zip(gwf, gwp):
        assert torch.equal(a, b)
    assert torch.allclose(dxf, dxp, rtol=1e-5, atol=1e-6)


def _emulated_kernel(x, scale, fp8_dtype, want_q, want_t, amax_out=None, q_out=None, t_out=None, t_mode=0,
                     tile=None, sw_round=False):
    """`triton_cast.cast_transpose`'s contract in plain torch (writes into the given blocks, atomic-max amax)."""
    fmax = triton_cast.FP8_MAX[fp8_dtype]
    ref = (x.float() * scale).clamp(-fmax, fmax).to(fp8_dtype)
    if want_q:
        q_out = ref if q_out is None else q_out.copy_(ref)
    if want_t:
        t_out = ref.t().contiguous() if t_out is None else t_out.copy_(ref.t())
    for a in triton_cast._amax_list(amax_out):
        a.copy_(torch.maximum(a, x.abs().amax().float()))
    return (q_out if want_q else None), (t_out if want_t else None)


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling()])
def test_one_pass_kernel_paths_equal_the_compiled_cast_paths(monkeypatch, recipe):
    """The code around the one-pass cast kernel (amax out of the cast, casts into blocks of the concatenated
    weight and gradient) against the torch path, with the kernel emulated: bitwise equal over 3 steps."""
    fused, _ = _pair(recipe, add_qkv_bias=True)
    other = copy.deepcopy(fused)
    unfused = convert_to_fp8(copy.deepcopy(TransformerLM(_cfg(add_qkv_bias=True))), recipe, fuse_projections=False)
    unfused.load_state_dict(fused.state_dict())
    unfused_ref = copy.deepcopy(unfused)
    tokens = torch.randint(0, 128, (2, 16))
    ref = [_step(other, tokens) for _ in range(3)], [_step(unfused_ref, tokens) for _ in range(3)]
    monkeypatch.setattr(triton_cast, "available", lambda x: x.dim() == 2 and x.is_contiguous())
    monkeypatch.setattr(triton_cast, "cast_transpose", _emulated_kernel)
    monkeypatch.setitem(triton_cast._state, "ok", True)
    monkeypatch.setitem(triton_cast._state, "checked", {})
    got = [_step(fused, tokens) for _ in range(3)], [_step(unfused, tokens) for _ in range(3)]
    for runs_ref, runs_got in zip(ref, got):
        for (l1, g1), (l2, g2) in zip(runs_ref, runs_got):
            assert torch.equal(l1, l2)
            for n in g1:
                assert torch.equal(g1[n], g2[n]), n
    for (n, a), (_, b) in zip(fused.named_buffers(), other.named_buffers()):
        assert torch.equal(a, b), n
    assert triton_cast._state["ok"] and len(triton_cast._state["checked"]) >= 4
    assert all(triton_cast._state["checked"].values())


def test_fp8_telemetry_is_recorded_on_the_fused_path():
    """With statistics on, the groups still run fused and every member records every role: for the first layer's
    q/k/v (the same input in both models, cast with the same current scale) exactly the unfused counts; for the
    weights the same amax and element count (the fused cast shares one scale over the group)."""
    from megadlms.fp8 import enable_fp8_stats, fp8_stats
    from megadlms.fp8.linear import GRAD, INPUT, WEIGHT

    fused, plain = _pair(Float8CurrentScaling())
    tokens = torch.randint(0, 128, (2, 16))
    for model in (fused, plain):
        enable_fp8_stats(model)
    calls = [g.num_fused_calls for g in _groups(fused)]
    _step(fused, tokens)
    _step(plain, tokens)
    assert all(g.num_fused_calls == c + 1 for g, c in zip(_groups(fused), calls))
    for name in ("q_proj", "k_proj", "v_proj"):
        a = getattr(fused.layers[0].self_attn, name).fp8_stats_buffer
        b = getattr(plain.layers[0].self_attn, name).fp8_stats_buffer
        assert torch.equal(a[INPUT], b[INPUT]), name
        assert a[WEIGHT, 0] == b[WEIGHT, 0] and a[WEIGHT, 3] == b[WEIGHT, 3], name
        assert a[GRAD, 0] > 0 and a[GRAD, 3] == b[GRAD, 3], name
    s = fp8_stats(fused)
    assert set(s) == {f"{r}_{k}" for r in ("input", "weight", "grad") for k in ("amax", "underflow", "saturation")}
    assert all(0.0 <= v <= 1.0 for k, v in s.items() if not k.endswith("amax"))


def _groups(model):
    return [g for layer in model.layers for g in (layer.self_attn.qkv_fusion, layer.mlp.gate_up_fusion)]


def test_scaled_mm_scales_are_16_byte_aligned(monkeypatch):
    """cuBLASLt rejects scale pointers that are not 16-byte aligned: the per-step scale inverses of delayed scaling
    (views into one buffer) must each sit on a 16-byte boundary, fused and unfused, forward and backward."""
    from megadlms.fp8 import gemm as quantize

    seen, copies = [], []
    real_mm, real_aligned = torch._scaled_mm, quantize._aligned

    def recording_mm(a, b, scale_a, scale_b, **kw):
        seen.extend([scale_a.data_ptr() % 16, scale_b.data_ptr() % 16])
        return real_mm(a, b, scale_a=scale_a, scale_b=scale_b, **kw)

    def counting_aligned(t):
        out = real_aligned(t)
        copies.append(out is not t)
        return out

    monkeypatch.setattr(torch, "_scaled_mm", recording_mm)
    monkeypatch.setattr(quantize, "_aligned", counting_aligned)
    monkeypatch.setattr(quantize, "cpu_scaled_mm", quantize.scaled_mm_kernel)  # the CUDA path, on the CPU
    for fuse in (True, False):
        model = convert_to_fp8(TransformerLM(_cfg()), DelayedScaling(amax_history_len=4), fuse_projections=fuse)
        tokens = torch.randint(0, 128, (2, 16))
        for _ in range(3):  # delayed scales exist from the second step on
            _step(model, tokens)
    assert seen and not any(seen) and not any(copies)
    assert quantize._aligned(torch.zeros(3)[1]).data_ptr() % 16 == 0  # a misaligned view is copied
