"""megadlms.fp8.fusions.registry: the registry of fusions conversion installs, as modules in the model's fusion
slots."""

from __future__ import annotations

import logging

import pytest
import torch

from megadlms.config import TransformerConfig
from megadlms.fp8 import DelayedScaling, Float8CurrentScaling, Float8RowwiseScaling, convert_to_fp8
from megadlms.fp8.fusions import fused_linear
from megadlms.fp8.fusions.fused_linear import FusedFloat8Projection
from megadlms.fp8.fusions.fused_mlp import FusedFloat8MLP, fused_projections
from megadlms.fp8.fusions.registry import FUSIONS, FusionError, install_fusions, remove_fusions
from megadlms.model import TransformerLM


def _model() -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                           ffn_hidden_size=96, vocab_size=128, seq_length=32))


def _installed(decisions) -> int:
    return sum(why is None for _, why in decisions)


def test_registry_fills_the_slots_the_options_enable():
    assert [(f.option, f.slot) for f in FUSIONS] == [("fuse_projections", "qkv_fusion"),
                                                   ("fuse_projections", "gate_up_fusion"), ("fuse_mlp", "fusion")]
    model = convert_to_fp8(_model(), Float8CurrentScaling(), fuse_projections=False, fuse_mlp=False)
    keys = list(model.state_dict())
    assert _installed(install_fusions(model, {"fuse_mlp": True})) == 2  # one MLP per layer, with its own gate/up
    mlp = model.layers[0].mlp
    assert mlp.gate_up_fusion is None and isinstance(mlp.fusion, FusedFloat8MLP)
    assert mlp.fusion.gate_up.members() == [mlp.gate_proj, mlp.up_proj]
    assert _installed(install_fusions(model, {"fuse_projections": True, "fuse_mlp": True})) == 4  # filled slots stay
    assert list(model.state_dict()) == keys  # no parameters or buffers of their own
    assert len(fused_projections(model)) == 6  # q/k/v, gate/up and the MLPs' own groups
    assert _installed(install_fusions(_model(), {"fuse_projections": True, "fuse_mlp": True})) == 0  # BF16 layers


def test_fused_modules_are_shared_and_named_in_the_module_tree():
    model = convert_to_fp8(_model(), DelayedScaling())
    mlp = model.layers[1].mlp
    assert mlp.fusion.gate_up is mlp.gate_up_fusion  # one concatenated FP8 weight for both
    names = {n for n, m in model.named_modules() if isinstance(m, (FusedFloat8Projection, FusedFloat8MLP))}
    assert "layers.0.self_attn.qkv_fusion" in names and "layers.1.mlp.fusion" in names
    rowwise = convert_to_fp8(_model(), Float8RowwiseScaling())
    assert not any(isinstance(m, (FusedFloat8Projection, FusedFloat8MLP)) for m in rowwise.modules())


def test_the_decisions_are_made_at_conversion_and_logged(caplog):
    with caplog.at_level(logging.INFO, logger="megadlms"):
        convert_to_fp8(_model(), DelayedScaling(), fp8_wgrad=False)
    line = next(r.getMessage() for r in caplog.records if "FP8 fusions" in r.getMessage())
    assert "fused q/k/v on 2 of 2" in line and "fused gate/up on 2 of 2" in line
    assert "fused MLP on 0 of 2 (2: its weight gradients run in high precision (fp8_wgrad=False))" in line
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megadlms"):
        convert_to_fp8(_model(), Float8RowwiseScaling())
    assert "fused q/k/v on 0 of 2 (2: --fp8-recipe rowwise: the fused GEMMs take per-tensor scales)" in caplog.text


def test_a_decision_that_stops_holding_fails_loudly_and_remove_fusions_undoes_them():
    model = convert_to_fp8(_model(), DelayedScaling())
    ids = torch.randint(0, 128, (2, 16))
    model(ids)  # the fused paths run
    model.layers[0].self_attn.k_proj.fprop_fast_accum = False
    with pytest.raises(FusionError, match="no longer holds: its members' fprop_fast_accum differ"):
        model(ids)
    assert remove_fusions(model, "a test") == 6
    assert not any(isinstance(m, (FusedFloat8Projection, FusedFloat8MLP)) for m in model.modules())
    model(ids)  # the layers one by one
    other = convert_to_fp8(_model(), DelayedScaling())
    other.layers[1].mlp.down_proj.fp8_wgrad = False
    with pytest.raises(FusionError, match="FusedFloat8MLP.*fp8_wgrad=False"):
        other(ids)


def test_an_eval_forward_before_the_step_changes_no_amax_of_the_fused_paths():
    """An eval forward (an RL rollout) before each step's training forward leaves every amax history as without it:
    the fused q/k/v, gate/up and MLP paths record their weights' amaxes from the training forward's cast."""
    from megadlms.fp8 import fp8_autocast, fp8_step

    models = [convert_to_fp8(_model(), DelayedScaling()) for _ in range(2)]
    ids = torch.randint(0, 128, (2, 16))
    for _ in range(2):
        for rollout, model in zip((False, True), models):
            if rollout:
                model.eval()
                with torch.no_grad(), fp8_autocast():
                    model(ids)
                model.train()
            with fp8_autocast():
                model(ids).float().pow(2).mean().backward()
            with torch.no_grad():
                for p in model.parameters():
                    p.sub_(0.5 * p.grad)
                    p.grad = None
            fp8_step(model)
        hists = [{n: b.clone() for n, b in m.named_buffers() if n.endswith("fp8_amax_history")} for m in models]
        assert len(hists[0]) == 14 and all(torch.equal(hists[0][n], hists[1][n]) for n in hists[0])
        assert all(bool((h[1, 1] > 0).all()) for h in hists[0].values())  # every weight's amax was recorded


def _hooked_run(model: TransformerLM, ids: torch.Tensor) -> tuple[dict, torch.Tensor, list]:
    """Forward and backward of `model` with a pre-forward, a forward and a full backward hook on every module:
    what each hook saw (by module name), the logits, and the removable handles. The forward hook of layer 0's
    v_proj halves its output (what follows must use it)."""
    seen: dict[str, list] = {}
    handles = []
    for name, m in model.named_modules():
        def pre(mod, args, name=name):
            seen.setdefault(name, []).append(("pre", [a.detach().clone() for a in args if torch.is_tensor(a)]))

        def fwd(mod, args, out, name=name):
            outs = out if isinstance(out, tuple) else (out,)
            seen.setdefault(name, []).append(("fwd", [o.detach().clone() for o in outs if torch.is_tensor(o)]))
            return out * 0.5 if name == "layers.0.self_attn.v_proj" else None

        def bwd(mod, grad_in, grad_out, name=name):
            seen.setdefault(name, []).append(("bwd", [g.detach().clone() for g in grad_out if g is not None]))

        handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(fwd)]
        if name and isinstance(m, torch.nn.Linear):
            handles.append(m.register_full_backward_hook(bwd))
    logits = model(ids)
    logits.float().pow(2).mean().backward()
    return seen, logits.detach(), handles


@pytest.mark.parametrize("fp8", ["hybrid", "e4m3"])
def test_hooks_on_every_module_of_an_fp8_model_fire_with_an_unfused_models_tensors(fp8, caplog):
    """The user's hooks on any module of a converted model (fused q/k/v, gate/up and MLP included): the forward runs,
    every hook fires once per call with the tensors the same model without fusions gives it, an output a hook
    changes is the one used, the backward runs its hooks; once they are removed the fused path runs again."""
    from megadlms.build import build_model

    cfg = TransformerConfig(fp8=fp8, num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=96, vocab_size=128, seq_length=32)
    torch.manual_seed(0)
    fused = build_model(cfg)
    plain = build_model(cfg)
    plain.load_state_dict(fused.state_dict())
    assert remove_fusions(plain, "the reference") == 6
    ids = torch.randint(0, 128, (2, 16))
    fused_linear._logged_hooks.clear()
    with caplog.at_level(logging.INFO, logger="megadlms"):
        seen, logits, handles = _hooked_run(fused, ids)
    want, want_logits, _ = _hooked_run(plain, ids)
    assert torch.equal(logits, want_logits)
    for name, p in fused.named_parameters():
        assert torch.equal(p.grad, dict(plain.named_parameters())[name].grad), name
    fusions = {n for n, m in fused.named_modules() if isinstance(m, (FusedFloat8Projection, FusedFloat8MLP))}
    assert seen.keys() - fusions == want.keys()
    assert {n for n, _ in fused.named_modules()} - seen.keys() == {"layers"}  # all fired but the ModuleList (no call)
    for name in want:
        assert [kind for kind, _ in seen[name]] == [kind for kind, _ in want[name]], name
        for (_, got), (_, ref) in zip(seen[name], want[name]):
            assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref)), name
    attn = "layers.0.self_attn"
    assert [k for k, _ in seen[f"{attn}.q_proj"]] == ["pre", "fwd", "bwd"]
    x = seen["layers.0.input_layernorm"][1][1][0]  # the norm's output is every projection's input
    assert all(torch.equal(seen[f"{attn}.{p}"][0][1][0], x) for p in ("q_proj", "k_proj", "v_proj"))
    assert [k for k, _ in seen["layers.1.mlp.act_fn"]] == ["pre", "fwd"]
    assert sum("with hooked members run their layers one by one" in r.getMessage() for r in caplog.records) == 1
    for h in handles:
        h.remove()
    calls = fused.layers[0].self_attn.qkv_fusion.num_fused_calls
    fused(ids)
    assert fused.layers[0].self_attn.qkv_fusion.num_fused_calls == calls + 1


def test_a_hook_on_the_down_projection_alone_or_a_global_hook_runs_the_mlp_unfused():
    """The fused MLP with only its down projection hooked (its gate/up group is not), and global module hooks
    (`register_module_forward_hook`): the hooks fire and the outputs are those of the MLP's layers run one by one."""
    from megadlms.build import build_model

    cfg = TransformerConfig(fp8="hybrid", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=96, vocab_size=128, seq_length=32)
    torch.manual_seed(0)
    fused = build_model(cfg)
    plain = build_model(cfg)
    plain.load_state_dict(fused.state_dict())
    for layer in plain.layers:  # the reference: the fused q/k/v and gate/up kept, the MLPs' own fusion taken out
        layer.mlp.fusion = None
    ids = torch.randint(0, 128, (2, 16))
    for model in (fused, plain):
        model.layers[1].mlp.down_proj.register_forward_hook(lambda m, a, out: out * 3.0)
    assert torch.equal(fused(ids), plain(ids))
    assert not torch.equal(fused(ids), build_model(cfg).eval()(ids))  # the hook's change was used
    called: list[str] = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, a, out: called.append(type(m).__name__))
    try:
        fused(ids)
    finally:
        handle.remove()
    assert called.count("Float8Linear") == 2 * 7 and called.count("SwiGLU") == 2
