"""megadlms.fp8.integrations.monitor: on-device FP8 numerics statistics."""

from __future__ import annotations

import pytest
import torch

from megadlms.build import build_model
from megadlms.config import TransformerConfig
from megadlms.fp8 import DelayedScaling, Float8CurrentScaling, Float8Linear, enable_fp8_stats, fp8_autocast, fp8_stats
from megadlms.fp8.convert import fp8_step


def _step(layer, x, g):
    with fp8_autocast():
        y = layer(x.requires_grad_())
    y.backward(g)


def test_counts_of_one_layer():
    layer = Float8Linear(16, 16, bias=False, recipe=Float8CurrentScaling())
    with torch.no_grad():
        layer.weight.fill_(0.5)
        layer.weight[0, :4] = 1e-9  # 4 weights flush to zero at scale 448 / 0.5
    x = torch.ones(3, 16)
    x[0, 0], x[1, :2] = 1000.0, 1e-9  # amax 1000: the two tiny inputs flush
    g = torch.full((3, 16), 1e-3)
    assert fp8_stats(layer) == {}
    _step(layer, x, g)
    assert fp8_stats(layer) == {}  # collection is off by default
    enable_fp8_stats(layer)
    _step(layer, x, g)
    _step(layer, x, g)  # second micro-batch: inputs/grads count twice, the cached weight once
    s = fp8_stats(layer)
    assert s["input_amax"] == 1000.0
    assert s["input_underflow"] == pytest.approx(2 / 48)
    assert s["input_saturation"] == 0.0  # current scaling maps the amax to 448: nothing is clamped
    assert s["weight_amax"] == 0.5 and s["weight_underflow"] == pytest.approx(4 / 256)
    assert s["weight_saturation"] == 0.0
    assert s["grad_amax"] == pytest.approx(1e-3) and s["grad_underflow"] == 0.0
    assert fp8_stats(layer) == {}  # reset after reading
    _step(layer, x, g)  # a new window records the (cached) weight again
    assert fp8_stats(layer)["weight_underflow"] == pytest.approx(4 / 256)
    enable_fp8_stats(layer, False)
    _step(layer, x, g)
    assert fp8_stats(layer) == {}


def test_delayed_scaling_saturation_is_visible():
    layer = Float8Linear(16, 16, recipe=DelayedScaling(amax_history_len=1, amax_compute_algo="most_recent"))
    _step(layer, torch.randn(4, 16), torch.randn(4, 16))
    fp8_step(layer)
    enable_fp8_stats(layer)
    x = torch.randn(4, 16)
    x[0, 0] = 1e4  # far above the recorded amax: clamps at the delayed scale
    _step(layer, x, torch.randn(4, 16))
    assert fp8_stats(layer)["input_saturation"] >= 1 / 64


def test_model_summary():
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=16,
                            fp8=True)
    model = build_model(cfg)
    enable_fp8_stats(model)
    model(torch.randint(0, 128, (2, 9))).float().pow(2).mean().backward()
    s = fp8_stats(model)
    assert set(s) == {f"{r}_{k}" for r in ("input", "weight", "grad") for k in ("amax", "underflow", "saturation")}
    assert all(0.0 <= s[k] <= 1.0 for k in s if not k.endswith("amax"))
    weights = [m.weight for m in model.modules() if isinstance(m, Float8Linear)]
    assert s["weight_amax"] == max(w.abs().max().item() for w in weights)
