"""megadlms.fp8.attention: FP8 dot-product attention (`--fp8-dot-product-attention`) on the CPU's emulated
backend: installation by the conversion, numerics against fp32 SDPA, the delayed-scaling bookkeeping (amax
history, `fp8_step`), the BF16 fallbacks, training through the model, and the errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megadlms.build import build_model
from megadlms.config import ConfigError, TransformerConfig
from megadlms.fp8 import (
    DelayedScaling,
    Float8CurrentScaling,
    Float8RowwiseScaling,
    Format,
    convert_to_fp8,
    fp8_autocast,
    fp8_graph_capture,
    fp8_step,
)
from megadlms.fp8.attention import (
    Float8DotProductAttention,
    FP8AttentionUnsupportedError,
    check_fp8_attention_support,
)
from megadlms.model import DotProductAttention, TransformerLM
from megadlms.training.args import parse_train_args

from .helpers import rel

B, S, N, G, D = 2, 32, 4, 2, 16
Q, K, V, DO, DP, DQ, DK, DV = range(8)
FWD_ROLES, BWD_ROLES = (Q, K, V, DP), (DO, DQ, DK, DV)
ATTN_BUFFERS = ("fp8_amax_history", "fp8_scale", "fp8_initialized")
O_TOL, GRAD_TOL = 0.15, 0.25
FORMATS = [Format.HYBRID, Format.E4M3]


def _cfg(**kw) -> TransformerConfig:
    base = dict(num_layers=3, hidden_size=64, num_attention_heads=N, num_query_groups=G, ffn_hidden_size=96,
                vocab_size=128, seq_length=S, untie_embeddings_and_output_weights=True, fp8=True,
                fp8_dot_product_attention=True)
    return TransformerConfig(**{**base, **kw})


def _leaves(seed: int = 0, s_q: int = S, s_k: int = S, d: int = D, scale: float = 1.0, b: int = B):
    """bf16 leaves xq [B, S, N, D], xk, xv [B, T, G, D] (the projections' layout), requiring grad."""
    gen = torch.Generator().manual_seed(seed)
    shapes = ((b, s_q, N, d), (b, s_k, G, d), (b, s_k, G, d))
    return [(torch.randn(*shape, generator=gen) * scale).bfloat16().requires_grad_() for shape in shapes]


def _grad_out(seed: int, s_q: int = S, d: int = D, b: int = B) -> torch.Tensor:
    """dO [B, N, S, D] in BSHD memory, as the o_proj's backward hands it to attention."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, s_q, N, d, generator=gen).bfloat16().transpose(1, 2)


def _bhsd(xs):
    return [x.transpose(1, 2) for x in xs]  # [B, H, S, D] views of the [B, S, H, D] tensors, as the model makes


def _run(mod, leaves, d_o, is_causal, enabled=True, attn_mask=None, backward=True):
    """Forward (under fp8_autocast(enabled)) and backward of `mod`: (O, [dxq, dxk, dxv])."""
    for x in leaves:
        x.grad = None
    q, k, v = _bhsd(leaves)
    with fp8_autocast(enabled=enabled, fp8_recipe=getattr(mod, "recipe", None) if enabled else None):
        out = mod(q, k, v, attn_mask, is_causal)
    grads = None
    if backward:
        out.backward(d_o)
        grads = [x.grad.clone() for x in leaves]
    return out.detach(), grads


def _reference(leaves, d_o, is_causal):
    """fp32 SDPA over grouped K/V: (O, [dxq, dxk, dxv])."""
    xs = [x.detach().float().requires_grad_() for x in leaves]
    q, k, v = _bhsd(xs)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
    out.backward(d_o.float())
    return out.detach(), [x.grad for x in xs]


def _check_close(out, grads, leaves, d_o, is_causal):
    ref_out, ref_grads = _reference(leaves, d_o, is_causal)
    assert out.dtype == torch.bfloat16 and out.shape == ref_out.shape
    errs = {"O": rel(out, ref_out)} | {name: rel(g, r) for name, g, r in zip(("dQ", "dK", "dV"), grads, ref_grads)}
    assert all(torch.isfinite(torch.tensor(e)) for e in errs.values()), errs
    assert errs["O"] < O_TOL, errs
    assert max(errs["dQ"], errs["dK"], errs["dV"]) < GRAD_TOL, errs
    for g, x in zip(grads, leaves):
        assert g.dtype == torch.bfloat16 and g.shape == x.shape
    return errs


def _recipe(fmt: Format, history: int = 1, algo: str = "most_recent") -> DelayedScaling:
    return DelayedScaling(fp8_format=fmt, amax_history_len=history, amax_compute_algo=algo)


def _attention_modules(model):
    return [layer.self_attn.core_attention for layer in model.layers]


# ------------------------------------------------------------------------------------------- 1. installation
def test_build_model_installs_fp8_attention_in_fp8_layers_only():
    torch.manual_seed(0)
    model = build_model(_cfg())
    assert all(type(m) is Float8DotProductAttention for m in _attention_modules(model))
    assert all(m.recipe == DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=1,
                                          amax_compute_algo="most_recent") for m in _attention_modules(model))

    partial = build_model(_cfg(first_last_layers_bf16=True, num_layers_at_end_in_bf16=0))
    kinds = [type(m) for m in _attention_modules(partial)]
    assert kinds == [DotProductAttention, Float8DotProductAttention, Float8DotProductAttention]

    for cfg in (_cfg(fp8_dot_product_attention=False), _cfg(fp8=False)):  # flag off; or no FP8 (inert flag)
        assert all(type(m) is DotProductAttention for m in _attention_modules(build_model(cfg)))

    # convert_to_fp8 directly
    plain = convert_to_fp8(TransformerLM(_cfg(fp8=False)), DelayedScaling(), num_layers_at_end_in_bf16=1,
                           dot_product_attention=True)
    kinds = [type(m) for m in _attention_modules(plain)]
    assert kinds == [Float8DotProductAttention, Float8DotProductAttention, DotProductAttention]


def test_state_dict_gains_exactly_the_attention_buffers_and_loads_into_bf16_models():
    torch.manual_seed(0)
    cfg = _cfg(first_last_layers_bf16=True, num_layers_at_end_in_bf16=0)
    model = build_model(cfg)
    without = build_model(cfg.replace(fp8_dot_product_attention=False))
    sd = model.state_dict()
    extra = set(sd) - set(without.state_dict())
    assert extra == {f"layers.{i}.self_attn.core_attention.{b}" for i in (1, 2) for b in ATTN_BUFFERS}
    assert set(without.state_dict()) <= set(sd)
    assert sd["layers.1.self_attn.core_attention.fp8_amax_history"].shape == (1, 8)
    assert sd["layers.1.self_attn.core_attention.fp8_amax_history"].dtype == torch.float32
    assert sd["layers.1.self_attn.core_attention.fp8_scale"].shape == (8,)
    assert sd["layers.1.self_attn.core_attention.fp8_initialized"].dtype == torch.bool

    # the FP8 model without FP8 attention loads it minus the attention's keys, strictly
    without.load_state_dict({k: v for k, v in sd.items() if k not in extra}, strict=True)
    # the BF16 model loads it minus every FP8 buffer (the linears' and the attention's), strictly
    bf16 = build_model(cfg.replace(fp8=False))
    bf16_sd = {k: v for k, v in sd.items() if k.rpartition(".")[2] not in ATTN_BUFFERS}
    assert set(sd) - set(bf16_sd) >= extra
    bf16.load_state_dict(bf16_sd, strict=True)
    for k, v in bf16.state_dict().items():
        assert torch.equal(v, sd[k]), k


def test_state_dict_round_trip_restores_the_delayed_scales():
    mod = Float8DotProductAttention(_recipe(Format.HYBRID, history=2, algo="max"))
    leaves = _leaves(0)
    _run(mod, leaves, _grad_out(1), False)
    fp8_step(mod)
    other = Float8DotProductAttention(_recipe(Format.HYBRID, history=2, algo="max"))
    assert not other.scales_ready()
    other.load_state_dict(mod.state_dict())
    assert other.scales_ready()  # fp8_initialized read back: the next forward uses the loaded scales
    for b in ATTN_BUFFERS:
        assert torch.equal(getattr(other, b), getattr(mod, b))
    a, _ = _run(mod, leaves, _grad_out(1), False, backward=False)
    c, _ = _run(other, leaves, _grad_out(1), False, backward=False)
    assert torch.equal(a, c)


def test_buffers_stay_fp32_when_the_module_is_cast():
    mod = Float8DotProductAttention(DelayedScaling(amax_history_len=4)).to(torch.bfloat16)
    assert mod.fp8_amax_history.dtype == torch.float32 and mod.fp8_amax_history.shape == (4, 8)
    assert mod.fp8_scale.dtype == torch.float32 and mod.fp8_initialized.dtype == torch.bool


# -------------------------------------------------------------------------------------- 2. numerics vs SDPA
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
@pytest.mark.parametrize("is_causal", [False, True], ids=["bidirectional", "causal"])
def test_forward_backward_close_to_sdpa_but_fp8(fmt, is_causal):
    mod = Float8DotProductAttention(_recipe(fmt)).train()
    leaves, d_o = _leaves(0), _grad_out(1)
    out, grads = _run(mod, leaves, d_o, is_causal)
    assert mod.num_fp8_calls == 1
    _check_close(out, grads, leaves, d_o, is_causal)

    # not BF16 SDPA: FP8 quantization really happened
    bf16_out, bf16_grads = _run(DotProductAttention(), leaves, d_o, is_causal, enabled=False)
    assert not torch.equal(out, bf16_out)
    assert not any(torch.equal(g, r) for g, r in zip(grads, bf16_grads))
    # and it is less exact than BF16 SDPA against fp32
    ref_out, _ = _reference(leaves, d_o, is_causal)
    assert rel(out, ref_out) > rel(bf16_out, ref_out)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
@pytest.mark.parametrize("grad_scale", [1e-2, 1e-5], ids=["dO_1e-2", "dO_1e-5"])
def test_gradients_do_not_depend_on_the_magnitude_of_dO(fmt, grad_scale):
    """Per-tensor scaling makes the FP8 error independent of dO's magnitude (an LM's dO is small: the loss is a
    mean over many tokens): the first backward (before any fp8_step: each tensor scaled by its own amax) and a
    delayed-scaled one both match SDPA, as they do for unit dO."""
    mod = Float8DotProductAttention(_recipe(fmt)).train()
    leaves = _leaves(0)
    d_o = (_grad_out(1).float() * grad_scale).bfloat16()
    out, grads = _run(mod, leaves, d_o, False)
    first = _check_close(out, grads, leaves, d_o, False)
    fp8_step(mod)
    out, grads = _run(mod, leaves, d_o, False)
    delayed = _check_close(out, grads, leaves, d_o, False)
    for name in ("dQ", "dK", "dV"):
        assert first[name] < 2 * delayed[name], (first, delayed)


def test_causal_mask_is_applied():
    mod = Float8DotProductAttention(DelayedScaling()).train()
    leaves, d_o = _leaves(0), _grad_out(1)
    causal, _ = _run(mod, leaves, d_o, True, backward=False)
    full, _ = _run(mod, leaves, d_o, False, backward=False)
    # the last query sees every key in both; the first sees only itself when causal (O = v's first row)
    assert rel(causal[:, :, -1], full[:, :, -1]) < 0.1
    v0 = leaves[2].detach()[:, 0].repeat_interleave(N // G, dim=1).float()  # [B, N, D]
    assert rel(causal[:, :, 0], v0) < 0.1
    assert rel(full[:, :, 0], v0) > 0.3


# --------------------------------------------------------------------------------------- 3. amax bookkeeping
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_amax_history_fp8_step_and_delayed_scales(fmt):
    mod = Float8DotProductAttention(_recipe(fmt, history=3, algo="max")).train()
    leaves, d_o = _leaves(0), _grad_out(1)
    q_before = mod.fp8_scale.clone()
    out1, grads1 = _run(mod, leaves, d_o, False)
    assert torch.equal(mod.fp8_scale, q_before)  # scales change only in fp8_step
    assert not bool(mod.fp8_initialized) and not mod.scales_ready()

    row = mod.fp8_amax_history[0].clone()
    assert (row > 0).all(), row
    assert (mod.fp8_amax_history[1:] == 0).all()
    for role, x in zip((Q, K, V), leaves):
        assert row[role] == x.detach().abs().amax().float(), role  # exactly the bf16 inputs' amax
    assert row[DO] == d_o.abs().amax().float()
    # dQ, dK, dV's amaxes are those of the (fp32) gradients before their FP8 cast: close to the returned ones
    for role, g in zip((DQ, DK, DV), grads1):
        assert abs(float(row[role]) / float(g.abs().amax()) - 1) < 0.15, role

    fp8_step(mod)
    assert bool(mod.fp8_initialized) and mod.scales_ready()
    assert (mod.fp8_amax_history[0] == 0).all()  # rolled: slot 0 is the new step's
    assert torch.equal(mod.fp8_amax_history[1], row)
    assert (mod.fp8_amax_history[2] == 0).all()
    fmax = torch.empty(8)
    fmax[list(FWD_ROLES)] = 448.0
    fmax[list(BWD_ROLES)] = 57344.0 if fmt is Format.HYBRID else 448.0
    assert torch.equal(mod.fp8_scale, fmax / row), (mod.fp8_scale, fmax / row)

    # step 2 on fresh inputs of the same distribution: the delayed scales, still close to SDPA
    leaves2, d_o2 = _leaves(2), _grad_out(3)
    out2, grads2 = _run(mod, leaves2, d_o2, False)
    assert mod.num_fp8_calls == 2
    _check_close(out2, grads2, leaves2, d_o2, False)
    row2 = mod.fp8_amax_history[0].clone()
    assert (row2 > 0).all()
    for role, x in zip((Q, K, V), leaves2):
        assert row2[role] == x.detach().abs().amax().float()
    assert torch.equal(mod.fp8_amax_history[1], row)  # the previous step's row is kept
    scales = mod.fp8_scale.clone()
    fp8_step(mod)
    # algo "max" over a history of 3: each scale comes from the larger of the two steps' amaxes
    assert torch.equal(mod.fp8_scale, fmax / torch.maximum(row, row2))
    assert not torch.equal(mod.fp8_scale, scales)
    assert torch.equal(mod.fp8_amax_history[1], row2) and torch.equal(mod.fp8_amax_history[2], row)


def test_delayed_scales_are_read_only_after_fp8_step():
    """Before the first fp8_step each tensor is scaled by its own amax (fp8_scale ignored); after it, fp8_scale."""
    mod = Float8DotProductAttention(DelayedScaling(amax_history_len=1, amax_compute_algo="most_recent")).train()
    leaves, d_o = _leaves(0), _grad_out(1)
    first, first_grads = _run(mod, leaves, d_o, False)
    mod.fp8_scale.mul_(2.0 ** -12)  # tampering before fp8_step changes nothing
    again, again_grads = _run(mod, leaves, d_o, False)
    assert torch.equal(first, again) and all(torch.equal(a, b) for a, b in zip(first_grads, again_grads))

    mod.fp8_amax_history.zero_()
    mod.fp8_scale.fill_(1.0)
    _run(mod, leaves, d_o, False)
    fp8_step(mod)
    good, good_grads = _run(mod, leaves, d_o, False)
    _check_close(good, good_grads, leaves, d_o, False)
    mod.fp8_scale[Q] *= 2.0 ** -12  # q now underflows in E4M3: the output must change
    bad, _ = _run(mod, leaves, d_o, False, backward=False)
    assert not torch.equal(good, bad)
    mod.fp8_scale[Q] *= 2.0 ** 12
    mod.fp8_scale[DV] *= 2.0 ** -20  # dV underflows: dV's gradient must change, dQ's not
    _, bad_grads = _run(mod, leaves, d_o, False)
    assert torch.equal(bad_grads[0], good_grads[0])
    assert not torch.equal(bad_grads[2], good_grads[2])


def test_eval_forward_leaves_the_history_alone():
    mod = Float8DotProductAttention(DelayedScaling()).eval()
    leaves = _leaves(0)
    with torch.no_grad():
        out, _ = _run(mod, leaves, None, False, backward=False)
    assert mod.num_fp8_calls == 1
    assert (mod.fp8_amax_history == 0).all()
    assert rel(out, _reference(leaves, _grad_out(1), False)[0]) < O_TOL


def test_fp8_graph_capture_restores_the_attention_buffers():
    torch.manual_seed(0)
    model = build_model(_cfg(num_layers=2))
    tokens = torch.randint(0, 128, (B, S))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(tokens).float().pow(2).mean().backward()
    fp8_step(model)
    attn = model.layers[0].self_attn.core_attention
    saved = [getattr(attn, b).clone() for b in ATTN_BUFFERS]
    with fp8_graph_capture(model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(tokens * 0 + 7).float().pow(2).mean().backward()  # records other amaxes
        assert (attn.fp8_amax_history[0] > 0).any()
        attn.fp8_scale.fill_(3.0)
    for b, s in zip(ATTN_BUFFERS, saved):
        assert torch.equal(getattr(attn, b), s), b


# ------------------------------------------------------------------------------------------- 4. BF16 fallback
def _fallback_case(mod, leaves, d_o, attn_mask, is_causal, enabled=True):
    calls = mod.num_fp8_calls
    hist = mod.fp8_amax_history.clone()
    out, grads = _run(mod, leaves, d_o, is_causal, enabled=enabled, attn_mask=attn_mask)
    ref, ref_grads = _run(DotProductAttention(), leaves, d_o, is_causal, enabled=enabled, attn_mask=attn_mask)
    assert torch.equal(out, ref)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads))
    assert mod.num_fp8_calls == calls
    assert torch.equal(mod.fp8_amax_history, hist)


@pytest.mark.parametrize("is_causal", [False, True], ids=["bidirectional", "causal"])
def test_outside_fp8_autocast_is_plain_attention(is_causal):
    mod = Float8DotProductAttention(DelayedScaling()).train()
    _fallback_case(mod, _leaves(0), _grad_out(1), None, is_causal, enabled=False)


def test_explicit_mask_runs_plain_attention():
    mod = Float8DotProductAttention(DelayedScaling()).train()
    mask = torch.rand(B, 1, S, S, generator=torch.Generator().manual_seed(5)) > 0.3
    mask |= torch.eye(S, dtype=torch.bool)
    _fallback_case(mod, _leaves(0), _grad_out(1), mask, False)


def test_longer_keys_run_plain_attention():
    mod = Float8DotProductAttention(DelayedScaling()).train()
    s_q = 8
    _fallback_case(mod, _leaves(0, s_q=s_q, s_k=S), _grad_out(1, s_q=s_q), None, False)


def test_head_dim_not_multiple_of_16_runs_plain_attention():
    mod = Float8DotProductAttention(DelayedScaling()).train()
    _fallback_case(mod, _leaves(0, d=8), _grad_out(1, d=8), None, False)


def test_empty_batch_runs_plain_attention():
    mod = Float8DotProductAttention(DelayedScaling()).train()
    _fallback_case(mod, _leaves(0, b=0), _grad_out(1, b=0), None, False)


def test_model_with_padding_mask_falls_back_in_every_layer():
    torch.manual_seed(0)
    model = build_model(_cfg(num_layers=2))
    tokens = torch.randint(0, 128, (B, S))
    pad = torch.ones(B, S, dtype=torch.bool)
    pad[0, -5:] = False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens, attention_mask=pad)
    assert torch.isfinite(logits).all()
    assert all(m.num_fp8_calls == 0 for m in _attention_modules(model))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(tokens)
    assert all(m.num_fp8_calls == 1 for m in _attention_modules(model))


# -------------------------------------------------------------------------------- 5. training through the model
@pytest.mark.parametrize("attn_mask_type", ["bidirectional", "causal"])
def test_training_steps_run_attention_in_fp8(attn_mask_type):
    torch.manual_seed(0)
    model = build_model(_cfg(attn_mask_type=attn_mask_type, first_last_layers_bf16=True, num_layers_at_start_in_bf16=0))
    attns = _attention_modules(model)
    assert [type(m) for m in attns] == [Float8DotProductAttention] * 2 + [DotProductAttention]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 128, (B, S), generator=torch.Generator().manual_seed(1))
    losses = []
    for step in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(tokens)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), tokens.view(-1))
        loss.backward()
        for name, p in model.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
        opt.step()
        opt.zero_grad(set_to_none=True)
        fp8_step(model)
        losses.append(loss.item())
        for m in attns[:2]:
            assert m.num_fp8_calls == step + 1
            assert bool(m.fp8_initialized)
            assert torch.isfinite(m.fp8_scale).all() and (m.fp8_scale > 0).all()
            assert not torch.equal(m.fp8_scale, torch.ones(8))  # scales from the recorded amaxes
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], losses  # AdamW on a fixed batch: the loss goes down


def test_model_forward_close_to_bf16_attention():
    torch.manual_seed(0)
    model = build_model(_cfg())
    plain = build_model(_cfg(fp8_dot_product_attention=False))
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if ".core_attention." not in k})
    tokens = torch.randint(0, 128, (B, S), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = model(tokens).float(), plain(tokens).float()
    assert not torch.equal(a, b)
    assert rel(a, b) < 0.05
    assert all(m.num_fp8_calls == 1 for m in _attention_modules(model))


# ------------------------------------------------------------------------------------------------- 6. errors
def test_config_rejects_fp8_attention_without_delayed_scaling():
    for recipe in ("tensorwise", "rowwise"):
        with pytest.raises(ConfigError, match="delayed"):
            TransformerConfig(fp8=True, fp8_recipe=recipe, fp8_dot_product_attention=True)
    # inert without fp8; fine with the delayed recipe
    TransformerConfig(fp8=False, fp8_recipe="tensorwise", fp8_dot_product_attention=True)
    TransformerConfig(fp8="e4m3", fp8_dot_product_attention=True)


def test_cli_flag_needs_an_fp8_format():
    from megadlms.training.run_plan import RunPlan

    plan = RunPlan.resolve(parse_train_args(["--fp8-dot-product-attention"]), TransformerConfig(), device_type="cpu")
    with pytest.raises(ConfigError, match="--fp8-dot-product-attention.*--fp8-format"):
        plan.check()
    args = parse_train_args(["--fp8-format", "hybrid", "--fp8-dot-product-attention"])
    assert args.fp8.fp8_dot_product_attention is True and args.fp8.fp8_format == "hybrid"
    assert parse_train_args(["--fp8-hybrid", "--fp8-dot-product-attention"]).fp8.fp8_dot_product_attention is True
    assert parse_train_args(["--fp8-format", "e4m3"]).fp8.fp8_dot_product_attention is False


def test_check_fp8_attention_support():
    check_fp8_attention_support("cpu")
    check_fp8_attention_support(torch.device("meta"))
    with pytest.raises(FP8AttentionUnsupportedError, match="--fp8-dot-product-attention") as e:
        check_fp8_attention_support("mps")
    assert isinstance(e.value, RuntimeError)


# ------------------------------------------------------------------------------------------ 7. recipe check
@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), Float8RowwiseScaling()], ids=["current", "rowwise"])
def test_non_delayed_recipes_are_rejected(recipe):
    with pytest.raises(ValueError, match="delayed"):
        Float8DotProductAttention(recipe)
    model = TransformerLM(_cfg(fp8=False))
    with pytest.raises(ValueError, match="drop --fp8-dot-product-attention"):
        convert_to_fp8(model, recipe, dot_product_attention=True)
    assert type(model.layers[0].self_attn.q_proj) is torch.nn.Linear  # refused before converting anything
    with pytest.raises(TypeError):
        Float8DotProductAttention("delayed")


# ------------------------------------------------------------------------------------------- telemetry
def test_telemetry_records_the_attention_casts_beside_the_linears():
    """`enable_fp8_stats` covers FP8 attention: the casts of q, k, v and dO, summarised as the roles attn_q,
    attn_k, attn_v, attn_grad next to the linears' roles; a value far above the delayed scale's amax shows as
    saturation; off again, nothing is recorded."""
    from megadlms.fp8 import enable_fp8_stats, fp8_stats, fp8_stats_enabled

    mod = Float8DotProductAttention(_recipe(Format.HYBRID)).train()
    leaves, d_o = _leaves(0), _grad_out(1)
    _run(mod, leaves, d_o, False)
    fp8_step(mod)
    assert fp8_stats(mod) == {} and not fp8_stats_enabled(mod)
    enable_fp8_stats(mod)
    assert fp8_stats_enabled(mod)
    with torch.no_grad():
        leaves[0][0, 0, 0, 0] = 1e4  # far above the recorded amax of q: clamps at the delayed scale
    _run(mod, leaves, d_o, False)
    s = fp8_stats(mod)
    assert set(s) == {f"attn_{r}_{k}" for r in ("q", "k", "v", "grad") for k in ("amax", "underflow", "saturation")}
    big = leaves[0][0, 0, 0, 0].item()  # 1e4 in BF16
    assert s["attn_q_amax"] == big and s["attn_q_saturation"] == pytest.approx(1 / leaves[0].numel())
    for role, x in (("k", leaves[1]), ("v", leaves[2]), ("grad", d_o)):
        assert s[f"attn_{role}_amax"] == pytest.approx(x.detach().float().abs().max().item()), role
        assert s[f"attn_{role}_saturation"] == 0.0, role
    assert fp8_stats(mod) == {}  # reset after reading
    enable_fp8_stats(mod, False)
    _run(mod, leaves, d_o, False)
    assert fp8_stats(mod) == {}

    model = build_model(_cfg())
    enable_fp8_stats(model)
    model(torch.randint(0, 128, (2, S))).float().pow(2).mean().backward()
    keys = set(fp8_stats(model))
    assert {"input_amax", "weight_amax", "grad_amax", "attn_q_amax", "attn_grad_saturation"} <= keys
