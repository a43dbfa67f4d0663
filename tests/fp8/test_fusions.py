"""megadlms.fp8.fusions: the registry of fusions conversion installs, as modules in the model's fusion slots."""

from __future__ import annotations

import torch

from megadlms.config import TransformerConfig
from megadlms.fp8 import DelayedScaling, Float8CurrentScaling, Float8RowwiseScaling, convert_to_fp8
from megadlms.fp8.fused_linear import FusedFloat8Projection
from megadlms.fp8.fused_mlp import FusedFloat8MLP, fused_projections
from megadlms.fp8.fusions import FUSIONS, install_fusions
from megadlms.model import TransformerLM


def _model() -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                           ffn_hidden_size=96, vocab_size=128, seq_length=32))


def test_registry_fills_the_slots_the_options_enable():
    assert [(f.option, f.slot) for f in FUSIONS] == [("fuse_projections", "qkv_fusion"),
                                                   ("fuse_projections", "gate_up_fusion"), ("fuse_mlp", "fusion")]
    model = convert_to_fp8(_model(), Float8CurrentScaling(), fuse_projections=False, fuse_mlp=False)
    keys = list(model.state_dict())
    assert install_fusions(model, {"fuse_mlp": True}) == 2  # one MLP per layer, with its own gate/up group
    mlp = model.layers[0].mlp
    assert mlp.gate_up_fusion is None and isinstance(mlp.fusion, FusedFloat8MLP)
    assert mlp.fusion.gate_up.members() == [mlp.gate_proj, mlp.up_proj]
    assert install_fusions(model, {"fuse_projections": True, "fuse_mlp": True}) == 4  # filled slots stay
    assert list(model.state_dict()) == keys  # no parameters or buffers of their own
    assert len(fused_projections(model)) == 6  # q/k/v, gate/up and the MLPs' own groups
    assert install_fusions(_model(), {"fuse_projections": True, "fuse_mlp": True}) == 0  # BF16 layers: none apply


def test_fused_modules_are_shared_and_named_in_the_module_tree():
    model = convert_to_fp8(_model(), DelayedScaling())
    mlp = model.layers[1].mlp
    assert mlp.fusion.gate_up is mlp.gate_up_fusion  # one concatenated FP8 weight for both
    names = {n for n, m in model.named_modules() if isinstance(m, (FusedFloat8Projection, FusedFloat8MLP))}
    assert "layers.0.self_attn.qkv_fusion" in names and "layers.1.mlp.fusion" in names
    rowwise = convert_to_fp8(_model(), Float8RowwiseScaling())
    assert not any(isinstance(m, (FusedFloat8Projection, FusedFloat8MLP)) for m in rowwise.modules())
