"""megadlms.fp8.fusions.registry: the registry of fusions conversion installs, as modules in the model's fusion
slots."""

from __future__ import annotations

import logging

import pytest
import torch

from megadlms.config import TransformerConfig
from megadlms.fp8 import DelayedScaling, Float8CurrentScaling, Float8RowwiseScaling, convert_to_fp8
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
    model.layers[0].self_attn.k_proj.register_forward_hook(lambda *a: None)
    with pytest.raises(FusionError, match="no longer holds: a member has forward hooks"):
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
