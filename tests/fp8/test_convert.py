"""megadlms.fp8.convert: model conversion, the FP8 scope of the model's forward, fp8_step (incl. the
amax all-reduce over 2 gloo processes), exact resume and end-to-end training on CPU."""

from __future__ import annotations

import copy
import importlib
import io
import socket

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from megadlms.build import build_model
from megadlms.config import TransformerConfig
from megadlms.fp8 import (
    DelayedScaling,
    Float8CurrentScaling,
    Float8Linear,
    Format,
    FP8GlobalStateManager,
    SwiGLUFP8InputStore,
    convert_to_fp8,
    fp8_step,
)
from megadlms.model import SwiGLU, TransformerLM

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def _cfg(**kw) -> TransformerConfig:
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                vocab_size=128, seq_length=32, untie_embeddings_and_output_weights=True)
    return TransformerConfig(**{**base, **kw})


def test_convert_swaps_layer_linears_in_place_keeping_parameters():
    torch.manual_seed(0)
    model = TransformerLM(_cfg())
    params = {n: p for n, p in model.named_parameters()}
    recipe = DelayedScaling(amax_history_len=2)
    out = convert_to_fp8(model, recipe, num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=1,
                         activation_func_fp8_input_store=True, fp8_wgrad=False)
    assert out is model
    assert {n: p for n, p in model.named_parameters()} == params  # the same Parameter objects
    for i, layer in enumerate(model.layers):
        fp8 = i in (1, 2)
        for name in LINEARS:
            m = layer.get_submodule(name)
            assert isinstance(m, Float8Linear) == fp8
            if fp8:
                assert m.recipe == recipe and not m.fp8_wgrad
        assert type(layer.mlp.act_fn) is (SwiGLUFP8InputStore if fp8 else SwiGLU)
    assert type(model.embed_tokens) is nn.Embedding and type(model.lm_head) is nn.Linear
    assert model.layer_context.keywords == {"enabled": True, "fp8_recipe": recipe}
    assert any(k.endswith("q_proj.fp8_amax_history") for k in model.state_dict())


def test_ineligible_linears_and_bad_arguments():
    model = TransformerLM(_cfg(num_layers=2, ffn_hidden_size=72))  # 72 is not a multiple of 16
    convert_to_fp8(model, Float8CurrentScaling())
    assert type(model.layers[0].mlp.gate_proj) is nn.Linear
    assert isinstance(model.layers[0].self_attn.q_proj, Float8Linear)
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        convert_to_fp8(TransformerLM(_cfg(num_layers=2)), DelayedScaling(), num_layers_at_start_in_bf16=2,
                       num_layers_at_end_in_bf16=1)
    with pytest.raises(TypeError, match="TransformerLM"):
        convert_to_fp8(nn.Linear(16, 16), DelayedScaling())
    with pytest.raises(TypeError, match="recipe"):
        convert_to_fp8(TransformerLM(_cfg(num_layers=2)), "delayed")


def test_fp8_enabled_inside_model_forward_only():
    model = convert_to_fp8(TransformerLM(_cfg(num_layers=2)), Float8CurrentScaling())
    seen = {}

    def record(name):
        def hook(module, args):
            seen[name] = FP8GlobalStateManager.is_fp8_enabled()
        return hook

    model.layers[0].register_forward_pre_hook(record("layer"))
    model.embed_tokens.register_forward_pre_hook(record("embedding"))
    model.norm.register_forward_pre_hook(record("final_norm"))
    assert not FP8GlobalStateManager.is_fp8_enabled()
    model(torch.randint(0, 128, (2, 7)))
    assert seen == {"embedding": False, "layer": True, "final_norm": False}
    assert not FP8GlobalStateManager.is_fp8_enabled()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_amax_reduction_over_two_gloo_processes(tmp_path):
    # imported by its full dotted path, so that the spawned processes can import it too
    amax_worker = importlib.import_module("tests.fp8.helpers").amax_worker
    port = _free_port()
    mp.spawn(amax_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    before = [torch.load(tmp_path / f"before_{r}.pt") for r in range(2)]
    after = [torch.load(tmp_path / f"after_{r}.pt") for r in range(2)]
    expect = torch.maximum(before[0]["amax"], before[1]["amax"])
    assert not torch.equal(before[0]["amax"], before[1]["amax"])  # the ranks saw different data
    for r in range(2):
        assert torch.equal(after[r]["history1"], expect)  # the reduced slot, rolled to position 1
        assert torch.equal(after[r]["scale"], after[0]["scale"])  # every rank ends with the same scales
    fmax = torch.tensor([448.0, 448.0, 57344.0]).repeat(4)
    assert torch.allclose(after[0]["scale"], fmax / expect, rtol=1e-6)
    assert after[0]["collectives"] == 1  # one all_reduce for all 4 modules


def _batch(seed: int, vocab: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 19), generator=g)  # 38 tokens: not a multiple of 16
    return ids, torch.roll(ids, -1, 1)


def _train(model, opt, steps: range, accum: int = 2) -> list[float]:
    losses = []
    for step in steps:
        total = 0.0
        for micro in range(accum):
            ids, tgt = _batch(step * 10 + micro)
            loss = F.cross_entropy(model(ids).flatten(0, 1), tgt.flatten())
            (loss / accum).backward()
            total += loss.item() / accum
        opt.step()
        opt.zero_grad()
        fp8_step(model)
        losses.append(total)
    return losses


def test_resume_from_state_dict_continues_bitwise():
    cfg = _cfg(num_layers=2, fp8=True, fp8_amax_history_len=4, fp8_amax_compute_algo="max")
    torch.manual_seed(0)
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, opt, range(3))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    tail = _train(model, opt, range(3, 6))
    final = copy.deepcopy(model.state_dict())

    torch.manual_seed(123)  # a different initialisation, overwritten by the load
    resumed = build_model(cfg)
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    buf.seek(0)
    state = torch.load(buf)
    resumed.load_state_dict(state["model"])
    opt2.load_state_dict(state["opt"])
    assert _train(resumed, opt2, range(3, 6)) == tail
    for k, v in resumed.state_dict().items():
        assert torch.equal(v, final[k]), k
    assert any("fp8_scale" in k for k in final)


def test_build_model_fp8_e4m3_trains_with_falling_loss():
    cfg = TransformerConfig(hidden_size=64, num_attention_heads=4, activation_func_fp8_input_store=True, fp8=True,
                            fp8_format="e4m3", num_layers=2, vocab_size=128, seq_length=32)
    torch.manual_seed(0)
    model = build_model(cfg)
    layer = model.layers[0]
    assert isinstance(layer.mlp.down_proj, Float8Linear) and isinstance(layer.mlp.act_fn, SwiGLUFP8InputStore)
    assert layer.mlp.down_proj.recipe.fp8_format is Format.E4M3
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids, tgt = _batch(0)
    losses = []
    for _ in range(8):
        loss = F.cross_entropy(model(ids).flatten(0, 1), tgt.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        fp8_step(model)
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert layer.mlp.down_proj.fp8_initialized.item()


def test_config_switches_fusion_and_forward_fast_accumulation():
    """fp8_fuse_projections / fp8_fuse_mlp / fp8_fprop_fast_accum (--no-fp8-fuse-projections, --no-fp8-fuse-mlp,
    --no-fp8-fprop-fast-accum) reach the converted layers; the defaults fuse and use fast accumulation in the
    forward GEMM only."""
    from megadlms.fp8.fusions.fused_linear import FusedFloat8Projection
    from megadlms.fp8.fusions.fused_mlp import FusedFloat8MLP
    from megadlms.training.args import parse_train_args
    from megadlms.training.run_plan import resolve_model_config

    base = dict(hidden_size=64, num_attention_heads=4, num_layers=2, vocab_size=128, seq_length=32, fp8=True)
    layer = build_model(TransformerConfig(**base)).layers[0]
    assert isinstance(layer.self_attn.qkv_fusion, FusedFloat8Projection)
    assert isinstance(layer.mlp.fusion, FusedFloat8MLP) and layer.mlp.fusion.gate_up is layer.mlp.gate_up_fusion
    assert layer.mlp.down_proj.fprop_fast_accum and not layer.mlp.down_proj.backward_fast_accum
    layer = build_model(TransformerConfig(**base, fp8_fuse_projections=False, fp8_fuse_mlp=False,
                                          fp8_fprop_fast_accum=False)).layers[0]
    assert layer.self_attn.qkv_fusion is None and layer.mlp.gate_up_fusion is None and layer.mlp.fusion is None
    assert not any(m.fprop_fast_accum for m in layer.modules() if isinstance(m, Float8Linear))
    args = parse_train_args(["--model-path", "tiny", "--fp8-format", "hybrid", "--no-fp8-fuse-projections",
                             "--no-fp8-fprop-fast-accum", "--no-fp8-fuse-mlp"])
    cfg = resolve_model_config(args, vocab_size=None, mask_id=5)
    assert cfg.fp8 and not cfg.fp8_fuse_projections and not cfg.fp8_fprop_fast_accum and not cfg.fp8_fuse_mlp


def test_finer_scaled_recipes_convert_to_unfused_linears(caplog):
    """Blockwise and MXFP8 scales are not per tensor: the fusion registry installs none of the fused modules, the
    module tree shows plain Float8Linears with their recipe, and the conversion says so."""
    from megadlms.fp8.recipe import Float8BlockwiseScaling, Float8MXScaling

    for recipe in (Float8BlockwiseScaling(pow2_scales=True), Float8MXScaling()):
        model = TransformerLM(_cfg())
        with caplog.at_level("INFO", logger="megadlms"):
            convert_to_fp8(model, recipe)
        tree = repr(model)
        assert "Fused" not in tree and tree.count("Float8Linear(") == 7 and "4 x TransformerLayer" in tree
        assert f"recipe={recipe}" in tree and model.layers[0].mlp.fusion is None
        assert f"fused q/k/v on 0 of 4 (4: --fp8-recipe {recipe.name}: the fused GEMMs take per-tensor" in caplog.text
        assert not any("fp8_amax_history" in k for k in model.state_dict())  # no delayed-scaling state


def test_mxfp8_on_a_hopper_gpu_is_one_line_naming_what_runs_there(monkeypatch):
    from megadlms.fp8.formats.mx import check_mx_gemm_support
    from megadlms.fp8.hardware import FP8UnsupportedError
    from megadlms.fp8.quantizer import make_quantizer
    from megadlms.fp8.recipe import Float8MXScaling

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")
    check_mx_gemm_support.cache_clear()
    try:
        with pytest.raises(FP8UnsupportedError) as e:
            make_quantizer(Float8MXScaling(), torch.float8_e4m3fn, None, 0).check_device(0)
    finally:
        check_mx_gemm_support.cache_clear()
    assert "\n" not in str(e.value) and "NVIDIA H200 (9.0)" in str(e.value)
    assert str(e.value).endswith("use --fp8-recipe delayed, tensorwise, rowwise or blockwise")
