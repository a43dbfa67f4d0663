"""megadlms.fp8.linear: Float8Linear's three GEMMs against independent references, padding, caching,
saved tensors and the BF16 weight-gradient mode."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megadlms.fp8 import (
    DelayedScaling,
    Float8CurrentScaling,
    Float8Linear,
    Float8RowwiseScaling,
    Format,
    fp8_autocast,
    fp8_step,
)

from .helpers import ref_fake_quant, rel

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = {
    "delayed-hybrid": DelayedScaling(amax_history_len=4),
    "current-hybrid": Float8CurrentScaling(),
    "current-e4m3": Float8CurrentScaling(fp8_format=Format.E4M3),
    "rowwise-hybrid": Float8RowwiseScaling(),
    "rowwise-e4m3": Float8RowwiseScaling(fp8_format=Format.E4M3),
}


def _run(layer: Float8Linear, x: torch.Tensor, g: torch.Tensor):
    x = x.clone().requires_grad_()
    with fp8_autocast(fp8_recipe=layer.recipe):
        y = layer(x)
    y.backward(g)
    return y.detach(), x.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad


def _reference(recipe, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor):
    """fp64 GEMMs of operands quantized with ml_dtypes the way the recipe prescribes (before any
    fp8_step, delayed scaling uses the current amax)."""
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    bwd = recipe.fp8_format.bwd_dtype
    if isinstance(recipe, Float8RowwiseScaling):
        y = ref_fake_quant(x2, E4M3, axis=1) @ ref_fake_quant(w, E4M3, axis=1).T
        dx = ref_fake_quant(g2, bwd, axis=1) @ ref_fake_quant(w, E4M3, axis=0)
        dw = ref_fake_quant(g2, bwd, axis=0).T @ ref_fake_quant(x2, E4M3, axis=0)
    else:
        xq, wq, gq = ref_fake_quant(x2, E4M3), ref_fake_quant(w, E4M3), ref_fake_quant(g2, bwd)
        y, dx, dw = xq @ wq.T, gq @ wq, gq.T @ xq
    return y, dx, dw


@pytest.mark.parametrize("shape", [(3, 7, 40, 24), (2, 16, 32, 48)], ids=["odd", "aligned"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_forward_and_gradients_against_references(name, shape):
    b, s, k, n = shape
    recipe = RECIPES[name]
    torch.manual_seed(0)
    layer = Float8Linear(k, n, bias=True, recipe=recipe)
    x = torch.randn(b, s, k)
    g = torch.randn(b, s, n) * 1e-3  # gradients are small: the scales must adapt
    y, dx, dw, db = _run(layer, x, g)
    assert y.shape == (b, s, n) and dx.shape == x.shape and dw.shape == (n, k)
    assert y.dtype == dx.dtype == dw.dtype == torch.float32

    # 1. exact plumbing: the same quantized operands through float64 GEMMs
    ry, rdx, rdw = _reference(recipe, x, layer.weight.detach(), g)
    bias = layer.bias.detach().double().numpy()
    assert rel(y.reshape(-1, n), ry + bias) < 1e-6
    assert rel(dx.reshape(-1, k), rdx) < 1e-6
    assert rel(dw, rdw) < 1e-6
    assert torch.allclose(db.double(), g.double().sum((0, 1)), rtol=1e-6, atol=1e-9)

    # 2. the FP8 error budget against unquantized float64
    x64, w64, g64 = x.double().reshape(-1, k), layer.weight.detach().double(), g.double().reshape(-1, n)
    e4 = recipe.fp8_format is Format.E4M3
    bwd_budget = 0.06 if e4 else 0.12  # E5M2 keeps 2 mantissa bits instead of 3
    assert 0.005 < rel(y.reshape(-1, n) - layer.bias.detach(), x64 @ w64.T) < 0.06
    assert 0.005 < rel(dx.reshape(-1, k), g64 @ w64) < bwd_budget
    assert 0.005 < rel(dw, g64.T @ x64) < bwd_budget


def test_outside_autocast_is_a_plain_linear():
    layer = Float8Linear(32, 16)
    x = torch.randn(5, 32)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    with fp8_autocast(enabled=False):
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    with fp8_autocast():
        assert not torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert layer.num_weight_casts == 1


def test_autocast_dtype_output_and_grad_dtypes():
    layer = Float8Linear(32, 48, bias=True, recipe=Float8CurrentScaling())
    x = torch.randn(2, 9, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), fp8_autocast(fp8_recipe=layer.recipe):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32
    assert layer.bias.grad.dtype == torch.float32
    xb = torch.randn(2, 9, 32, dtype=torch.bfloat16)
    with fp8_autocast(fp8_recipe=layer.recipe):
        assert layer(xb).dtype == torch.bfloat16


def test_state_dict_keys_and_shared_parameters():
    lin = nn.Linear(32, 16)
    f = Float8Linear.from_linear(lin, DelayedScaling(amax_history_len=8))
    assert f.weight is lin.weight and f.bias is lin.bias
    assert set(f.state_dict()) == {"weight", "bias", "fp8_amax_history", "fp8_scale", "fp8_initialized"}
    assert f.fp8_amax_history.shape == (8, 3) and f.fp8_scale.tolist() == [1.0, 1.0, 1.0]
    cur = Float8Linear.from_linear(nn.Linear(32, 16, bias=False), Float8CurrentScaling())
    assert set(cur.state_dict()) == {"weight"}


def test_recipe_mismatch_is_an_error():
    layer = Float8Linear(16, 16, recipe=Float8CurrentScaling())
    with fp8_autocast(fp8_recipe=DelayedScaling()), pytest.raises(ValueError, match="converted with"):
        layer(torch.randn(4, 16))
    with fp8_autocast():  # no explicit recipe: the layer's own
        layer(torch.randn(4, 16))


def test_weight_cast_once_per_step_across_micro_batches():
    torch.manual_seed(0)
    layer = Float8Linear(32, 32, recipe=DelayedScaling(amax_history_len=2))
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2, foreach=True)
    for step in range(3):
        for _ in range(4):  # micro-batches
            _run(layer, torch.randn(17, 32), torch.randn(17, 32))
        assert layer.num_weight_casts == step + 1
        opt.step()
        opt.zero_grad()
        fp8_step(layer)
    # an update the version counter does not see (a fused optimizer, a `.data` write) is covered by fp8_step
    layer = Float8Linear(32, 32, bias=False, recipe=Float8CurrentScaling())
    with fp8_autocast():
        layer(torch.randn(4, 32))
    casts = layer.num_weight_casts
    layer.weight.data.mul_(2)
    with fp8_autocast():
        layer(torch.randn(4, 32))
    assert layer.num_weight_casts == casts  # stale until the step boundary...
    fp8_step(layer)
    x = torch.randn(4, 32)
    with fp8_autocast():
        y = layer(x)
    assert layer.num_weight_casts == casts + 1
    assert rel(y, x @ layer.weight.detach().T) < 0.06  # ...and fresh after it
    # the version counter alone catches in-place updates without fp8_step
    with torch.no_grad():
        layer.weight.add_(1.0)
    with fp8_autocast():
        layer(x)
    assert layer.num_weight_casts == casts + 2


def test_no_cache_mode_casts_every_forward():
    layer = Float8Linear(32, 32, recipe=Float8CurrentScaling(), cache_weight=False)
    for _ in range(3):
        _run(layer, torch.randn(5, 32), torch.randn(5, 32))
    assert layer.num_weight_casts == 3 and layer.weight_cache is None


def test_amax_slot_is_max_over_micro_batches_and_eval_does_not_record():
    layer = Float8Linear(16, 16, recipe=DelayedScaling(amax_history_len=3))
    x1, x2 = torch.randn(7, 16), torch.randn(7, 16) * 5
    g1, g2 = torch.randn(7, 16) * 3, torch.randn(7, 16)
    _run(layer, x1, g1)
    _run(layer, x2, g2)
    slot = layer.fp8_amax_history[0]
    assert slot[0].item() == max(x1.abs().max(), x2.abs().max()).item()
    assert slot[1].item() == layer.weight.abs().max().item()
    assert slot[2].item() == max(g1.abs().max(), g2.abs().max()).item()
    assert layer.fp8_amax_history[1:].abs().sum() == 0
    layer.eval()
    with fp8_autocast(), torch.no_grad():
        layer(torch.randn(3, 16) * 100)
    assert layer.fp8_amax_history[0, 0].item() == x2.abs().max().item()


def test_an_eval_forward_before_the_step_leaves_the_weight_amax_recorded():
    """An eval forward (an RL rollout) casts the weight without recording it; the step's training forward casts it
    again, so the weight's amax reaches the history and its delayed scale follows the weight."""
    torch.manual_seed(0)
    layer = Float8Linear(16, 16, recipe=DelayedScaling())
    x = torch.randn(7, 16)
    for step in range(3):
        layer.eval()
        with fp8_autocast(), torch.no_grad():
            layer(x)
        assert layer.fp8_amax_history[0, 1].item() == 0  # nothing recorded in eval
        layer.train()
        _run(layer, x, torch.ones(7, 16))
        assert layer.fp8_amax_history[0, 1].item() == layer.weight.abs().max().item()
        with torch.no_grad():
            layer.weight.mul_(2.0)
        fp8_step(layer)
        assert layer.fp8_scale[1].item() == pytest.approx(448 / (layer.weight.abs().max().item() / 2), rel=1e-6)


def _saved(layer: Float8Linear, x: torch.Tensor) -> list[torch.Tensor]:
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), fp8_autocast():
        layer(x.requires_grad_())
    return saved


def test_backward_keeps_fp8_copies_of_the_input():
    for recipe in (DelayedScaling(), Float8CurrentScaling(), Float8RowwiseScaling()):
        saved = _saved(Float8Linear(48, 32, recipe=recipe), torch.randn(21, 48))
        big = [t for t in saved if t.numel() > 48]
        # x^T, K-major over the tokens (the weight-gradient operand), padded 21 -> 32 tokens
        assert len(big) == 1 and big[0].dtype == E4M3 and big[0].shape == (48, 32) and big[0].is_contiguous()
    saved = _saved(Float8Linear(48, 32, fp8_wgrad=False), torch.randn(21, 48))
    assert [t.dtype for t in saved if t.numel() > 48] == [torch.float32]  # compute dtype of an fp32 input


def test_no_fp8_wgrad_is_bf16_exact():
    torch.manual_seed(0)
    layer = Float8Linear(64, 48, bias=False, recipe=Float8CurrentScaling(), fp8_wgrad=False)
    x = torch.randn(3, 11, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), fp8_autocast():
        y = layer(x)
    g = torch.randn_like(y)  # bf16
    y.backward(g)
    ref = (g.reshape(-1, 48).t() @ x.detach().to(torch.bfloat16).reshape(-1, 64)).float()
    assert torch.equal(layer.weight.grad, ref)
    # the FP8 weight gradient of the same layer differs (the comparison can fail)
    layer.weight.grad = None
    layer.fp8_wgrad = True
    with torch.autocast("cpu", dtype=torch.bfloat16), fp8_autocast():
        layer(x).backward(g)
    assert not torch.equal(layer.weight.grad, ref)
    assert rel(layer.weight.grad, ref) < 0.12
    # dgrad stays FP8 in both modes: the input gradient is not the BF16 one
    assert not torch.equal(x.grad, (2 * (g.float() @ layer.weight.detach())).reshape(x.shape))


def test_empty_input():
    layer = Float8Linear(16, 32)
    with fp8_autocast():
        assert layer(torch.randn(0, 16)).shape == (0, 32)


def test_bias_and_bootstrap_then_delayed_scales_are_used():
    """After fp8_step the forward casts with the stored scale (delayed), not the current amax."""
    layer = Float8Linear(32, 16, recipe=DelayedScaling(amax_history_len=1, amax_compute_algo="most_recent"))
    _run(layer, torch.randn(8, 32), torch.randn(8, 16))
    fp8_step(layer)
    assert layer.fp8_initialized.item()
    x = torch.randn(8, 32) * 4  # larger than anything in the history: delayed scaling saturates
    with fp8_autocast():
        y = layer(x)
    scale = layer.fp8_scale[0].item()
    xq = np.clip(x.numpy() * np.float32(scale), -448, 448)
    assert (np.abs(xq) == 448).any()
    w = ref_fake_quant(layer.weight.detach(), E4M3)
    from .helpers import ref_quantize

    ref = (ref_quantize(x.numpy(), np.float32(scale), E4M3) / np.float64(scale)) @ w.T + layer.bias.detach().numpy()
    assert rel(y, ref) < 1e-6


def test_fp8_metadata_stays_fp32_when_the_model_is_cast():
    layer = Float8Linear(32, 16, recipe=DelayedScaling(amax_history_len=2)).to(torch.bfloat16)
    assert layer.weight.dtype == torch.bfloat16
    assert layer.fp8_amax_history.dtype == layer.fp8_scale.dtype == layer.fp8_stats_buffer.dtype == torch.float32
    assert layer.fp8_initialized.dtype == torch.bool
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    _run(layer, x, torch.randn(5, 16, dtype=torch.bfloat16))
    fp8_step(layer)
    assert layer.fp8_scale.dtype == torch.float32
    assert layer.fp8_scale[0].item() == pytest.approx(448.0 / x.abs().max().item(), rel=1e-6)


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_telemetry_of_the_finer_scaled_recipes(recipe):
    """Per-role statistics read the tile/block/MX scales per element: amaxes and counts of the unpadded tensors,
    and nothing saturates (each scale comes from its own block's amax)."""
    from megadlms.fp8.recipe import Float8BlockwiseScaling, Float8MXScaling

    r = Float8BlockwiseScaling() if recipe == "blockwise" else Float8MXScaling()
    layer = Float8Linear(64, 48, recipe=r)
    layer.collect_fp8_stats = True
    x = torch.randn(10, 64, requires_grad=True)
    with fp8_autocast(fp8_recipe=r):
        y = layer(x)
    y.backward(torch.ones_like(y))
    stats = layer.fp8_stats_buffer
    amaxes = [float(x.detach().abs().max()), float(layer.weight.detach().abs().max()), 1.0]
    assert stats[:, 0].tolist() == pytest.approx(amaxes)
    assert stats[:, 2].tolist() == [0, 0, 0] and stats[:, 3].tolist() == [640, 64 * 48, 480]


def test_the_layer_owns_its_per_step_state():
    """The switches and records other modules change go through the layer's methods: caching off drops the cache
    (the next forward casts again), the delayed-scaling buffers come back from a snapshot, the statistics window
    restarts at zero."""
    layer = Float8Linear(32, 16, recipe=DelayedScaling(amax_history_len=4))
    x = torch.randn(8, 32)
    with fp8_autocast(enabled=True):
        layer(x)
        layer(x)
    assert layer.num_weight_casts == 1 and layer.weight_cache is not None
    layer.set_cache_weight(False)
    assert layer.weight_cache is None
    with fp8_autocast(enabled=True):
        layer(x)
    assert layer.num_weight_casts == 2 and layer.weight_cache is None
    saved = layer.save_scaling_state()
    before = [t.clone() for t in saved]
    with fp8_autocast(enabled=True):
        layer(x * 100)  # records a larger input amax into the history
    assert float(layer.fp8_amax_history[0, 0]) == pytest.approx(float((x * 100).abs().max()), rel=1e-6)
    layer.restore_scaling_state(saved)
    assert all(torch.equal(a, b) for a, b in zip((layer.fp8_amax_history, layer.fp8_scale, layer.fp8_initialized),
                                                 before))
    layer.set_collect_fp8_stats(True)
    with fp8_autocast(enabled=True):
        layer(x)
    assert float(layer.fp8_stats_buffer[0, 0]) == pytest.approx(float(x.abs().max()), rel=1e-6)
    epoch = layer.stats_epoch
    layer.new_stats_window()
    assert layer.stats_epoch == epoch + 1 and not layer.fp8_stats_buffer.any()
