"""LoRA (megadlms.lora): the wrapped linear's arithmetic, merging, what is frozen, the FP8 base, bad input."""

import pytest
import torch
from torch import nn

from megadlms.build import apply_fp8, construct_model
from megadlms.config import ConfigError, TransformerConfig
from megadlms.fp8.frozen import FrozenFP8Linear, count_parameters
from megadlms.lora import (
    LoraConfig,
    LoraLinear,
    adapter_state_dict,
    apply_lora,
    describe_memory,
    memory_accounting,
    merge_lora,
)

CFG = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
           vocab_size=96, seq_length=16, max_position_embeddings=16)


def _model(**kw):
    torch.manual_seed(0)
    return construct_model(TransformerConfig(**{**CFG, **kw}))


def _randomize_b(model):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for k, w in adapter_state_dict(model).items():
            if k.endswith("lora_B.weight"):
                w.copy_(torch.randn(w.shape, generator=g) * 0.05)


def test_lora_linear_is_base_plus_scaled_ba():
    torch.manual_seed(0)
    base = nn.Linear(24, 40)
    lora = LoraLinear(base, rank=4, alpha=12)
    assert lora.scaling == 3.0 and torch.count_nonzero(lora.lora_B.weight) == 0
    x = torch.randn(5, 24)
    torch.testing.assert_close(lora(x), base(x))  # B = 0: the base's output
    nn.init.normal_(lora.lora_B.weight)
    a, b = lora.lora_A.weight, lora.lora_B.weight
    torch.testing.assert_close(lora(x), base(x) + 3.0 * x @ a.t() @ b.t())
    # A: nn.Linear's Kaiming-uniform bound 1/sqrt(in)
    assert a.abs().max() <= 1 / 24 ** 0.5 and a.std() > 0.5 / 24 ** 0.5


def test_only_the_adapters_train_and_merged_equals_unmerged():
    model = apply_lora(_model(), LoraConfig(rank=4, alpha=8, base="keep"))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(names) == 2 * 7 * 2 and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert "layers.0.self_attn.q_proj.lora_A.weight" in names and "layers.1.mlp.down_proj.lora_B.weight" in names
    _randomize_b(model)
    ids = torch.randint(0, 96, (2, 16))
    logits = model(ids)
    logits.float().pow(2).mean().backward()
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)  # nothing of the base
    assert all(model.get_parameter(n).grad is not None for n in names)
    merged = merge_lora(model)
    assert not any(isinstance(m, LoraLinear) for m in merged.modules())
    assert set(merged.state_dict()) == set(_model().state_dict())  # a plain model again
    torch.testing.assert_close(merged(ids), logits.detach(), rtol=1e-5, atol=1e-5)


def test_targets_pick_the_wrapped_linears():
    model = apply_lora(_model(), LoraConfig(rank=2, targets="q,v_proj,down", base="keep"))
    wrapped = {n for n, m in model.named_modules() if isinstance(m, LoraLinear)}
    assert wrapped == {f"layers.{i}.{p}" for i in (0, 1) for p in ("self_attn.q_proj", "self_attn.v_proj",
                                                                    "mlp.down_proj")}


def test_fp8_base_stores_one_byte_per_weight_and_tracks_the_bf16_base():
    cfg = LoraConfig(rank=4, base="fp8")
    fp8 = apply_lora(_model(), cfg)
    ref = apply_lora(_model(), LoraConfig(rank=4, base="keep"))
    frozen = [m for m in fp8.modules() if isinstance(m, FrozenFP8Linear)]
    assert len(frozen) == 2 * 7  # targeted or not, every linear of the layers
    acc = memory_accounting(fp8)
    layer_weights = sum(m.in_features * m.out_features for m in frozen)
    assert acc["base_fp8"] == layer_weights + 4 * len(frozen)
    assert acc["trainable_params"] == sum(p.numel() for p in fp8.parameters() if p.requires_grad)
    fp8.load_state_dict(ref.state_dict(), strict=False)  # the same adapters
    _randomize_b(fp8), _randomize_b(ref)
    ids = torch.randint(0, 96, (2, 16))
    a, b = fp8(ids), ref(ids)
    assert (a - b).norm() / b.norm() < 0.05


def test_the_model_counts_the_same_parameters_whatever_the_base_storage():
    whole = sum(p.numel() for p in _model().parameters())
    fp8 = apply_lora(_model(), LoraConfig(rank=4, base="fp8"))
    kept = apply_lora(_model(), LoraConfig(rank=4, base="keep"))
    adapters = sum(p.numel() for p in kept.parameters() if p.requires_grad)
    # A [4, in] + B [out, 4] per linear: q, k, v, o, gate, up, down (in + out) per layer, 2 layers
    assert adapters == 2 * 4 * (128 + 96 + 96 + 128 + 192 + 192 + 192)
    assert count_parameters(kept) == count_parameters(fp8) == whole + adapters  # FP8 layer weights are buffers
    assert sum(p.numel() for p in fp8.parameters()) < whole  # what counting parameters alone would report


# the layers' 73,728 weights at 1 byte (+ 14 fp32 scales), 2 or 4 bytes; 25,856 bytes of fp32 embedding and norms
@pytest.mark.parametrize("base, expect", [
    ("fp8", "| base fp8: FP8 weights 72.1 KiB, other frozen 25.2 KiB |"),
    ("bf16", "| base bf16: frozen 169.2 KiB |"),
    ("keep", "| base as loaded (no BF16 autocast in this run): frozen 313.2 KiB |"),
])
def test_the_startup_line_names_the_base_storage(base, expect):
    line = describe_memory(apply_lora(_model(), LoraConfig(rank=4, base=base)), LoraConfig(rank=4, base=base))
    assert line.startswith("LoRA rank 4 (scale 1) on q,k,v,o,gate,up,down: 0.01M trainable parameters")
    assert expect in line and "keep" not in line


def test_fused_fp8_projections_are_dropped_where_adapters_sit():
    model = apply_fp8(_model(fp8=True, fp8_recipe="tensorwise"), TransformerConfig(**CFG, fp8=True,
                                                                                   fp8_recipe="tensorwise"))
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert attn.qkv_fusion is not None and mlp.fusion is not None
    apply_lora(model, LoraConfig(rank=2, targets="o", base="bf16"))
    assert attn.qkv_fusion is not None and mlp.fusion is not None  # no member wrapped: kept
    assert model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    model = apply_fp8(_model(fp8=True, fp8_recipe="tensorwise"), TransformerConfig(**CFG, fp8=True,
                                                                                   fp8_recipe="tensorwise"))
    apply_lora(model, LoraConfig(rank=2, targets="q,up", base="bf16"))
    layer = model.layers[0]
    assert layer.self_attn.qkv_fusion is None and layer.mlp.gate_up_fusion is None and layer.mlp.fusion is None


@pytest.mark.parametrize("kwargs, match", [
    (dict(rank=0), "--lora-rank 0 must be an integer >= 1"),
    (dict(rank=-2), "--lora-rank -2 must be an integer >= 1"),
    (dict(rank=4, targets="q,qkv"), "unknown target 'qkv'"),
    (dict(rank=4, targets=""), "unknown target ''"),
    (dict(rank=4, dropout=1.0), "--lora-dropout 1.0 must be in"),
    (dict(rank=4, alpha=0), "--lora-alpha 0 must be > 0"),
    (dict(rank=4, base="int4"), "--lora-base 'int4' is not one of fp8, bf16"),
])
def test_bad_settings_are_one_line_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match) as e:
        LoraConfig(**kwargs)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("base", ["bf16", "fp8"])
def test_compiled_layers_break_only_where_the_fp8_layers_do(base):
    """`--compile` compiles each transformer layer: the adapters (dropout on) add no graph break. A BF16 base
    layer is one graph; an FP8 base breaks at each frozen FP8 GEMM alone (`FrozenFP8Linear.forward` runs eager,
    as every FP8 linear's does), so 7 breaks for the 7 linears."""
    model = apply_lora(_model(), LoraConfig(rank=4, dropout=0.1, base=base))
    layer = model.layers[0]
    x = torch.randn(2, 16, 64, requires_grad=True)
    torch._dynamo.reset()
    with torch.autocast("cpu", torch.bfloat16):
        e = torch._dynamo.explain(layer)(x, model.rotary(torch.arange(16)))
    reasons = [str(r.reason) for r in e.break_reasons]
    if base == "bf16":
        assert (e.graph_count, e.graph_break_count) == (1, 0), reasons
    else:
        assert e.graph_break_count == 7 and all("FrozenFP8Linear.forward" in r for r in reasons), reasons
    torch._dynamo.reset()


def test_targets_that_match_no_linear_are_a_one_line_error():
    """An all-MoE model (LLaDA-MoE's layout) has no gate/up/down linears: its experts take no adapters."""
    model = _model(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=[1, 1])
    with pytest.raises(ConfigError, match=r"--lora-targets gate,up matches no linear .*add q,k,v,o") as e:
        apply_lora(model, LoraConfig(rank=4, targets="gate,up"))
    assert "\n" not in str(e.value) and all(p.requires_grad for p in model.parameters())  # left untouched
    apply_lora(model, LoraConfig(rank=4, targets="q,v,gate"))  # attention adapters; the experts stay frozen
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert len(trained) == 2 * 2 * 2 and all("self_attn" in n for n in trained)


def test_a_frozen_router_keeps_its_expert_bias():
    """A LoRA run's MoE base: the step that moves DeepSeek-V3's expert bias leaves a frozen router's alone."""
    from megadlms.moe import moe_layers, moe_step

    model = apply_lora(_model(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=[0, 1],
                              moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                              moe_router_bias_update_rate=0.1), LoraConfig(rank=4, base="keep"))
    (layer,) = moe_layers(model)
    layer.step_tokens.copy_(torch.tensor([10.0, 0.0, 6.0, 0.0]))
    moe_step(model)
    assert layer.gate.e_score_correction_bias.tolist() == [0.0] * 4
    assert layer.idle_steps.tolist() == [0, 1, 0, 1]  # the telemetry still advances
