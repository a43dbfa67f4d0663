"""megadlms.fp8.recipe: recipe validation, the config mapping, and each recipe's scale arithmetic."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megadlms.config import TransformerConfig
from megadlms.fp8 import (
    DelayedScaling,
    Float8CurrentScaling,
    Float8Linear,
    Float8RowwiseScaling,
    Format,
    fp8_step,
    recipe_from_config,
)
from megadlms.fp8.linear import INPUT
from megadlms.fp8.quantizer import CurrentQuantizer, RowwiseQuantizer

from .helpers import ref_scale

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def test_format_dtypes():
    assert (Format.HYBRID.fwd_dtype, Format.HYBRID.bwd_dtype) == (E4M3, E5M2)
    assert (Format.E4M3.fwd_dtype, Format.E4M3.bwd_dtype) == (E4M3, E4M3)
    assert (Format.HYBRID.max_fwd, Format.HYBRID.max_bwd, Format.E4M3.max_bwd) == (448.0, 57344.0, 448.0)


def test_defaults_are_transformer_engine_defaults():
    r = DelayedScaling()
    assert (r.margin, r.fp8_format, r.amax_history_len, r.amax_compute_algo, r.reduce_amax) == \
        (0, Format.HYBRID, 1024, "max", True)


@pytest.mark.parametrize("kwargs, match", [
    (dict(amax_history_len=0), "amax_history_len"),
    (dict(amax_compute_algo="mean"), "amax_compute_algo"),
    (dict(margin=-1), "margin"),
    (dict(fp8_format="hybrid"), "Format"),
])
def test_delayed_validation(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        DelayedScaling(**kwargs)
    if "margin" in kwargs or "fp8_format" in kwargs:
        with pytest.raises((ValueError, TypeError), match=match):
            Float8RowwiseScaling(**kwargs)


def test_recipe_from_config():
    cfg = TransformerConfig(fp8=True, fp8_recipe="delayed", fp8_format="e4m3", fp8_margin=2,
                            fp8_amax_history_len=16, fp8_amax_compute_algo="max")
    assert recipe_from_config(cfg) == DelayedScaling(margin=2, fp8_format=Format.E4M3, amax_history_len=16,
                                                     amax_compute_algo="max")
    megatron = recipe_from_config(TransformerConfig(fp8="hybrid"))
    assert (megatron.amax_history_len, megatron.amax_compute_algo, megatron.fp8_format) == \
        (1, "most_recent", Format.HYBRID)
    assert recipe_from_config(TransformerConfig(fp8=True, fp8_recipe="tensorwise", fp8_margin=1)) == \
        Float8CurrentScaling(Format.HYBRID, margin=1)
    assert recipe_from_config(TransformerConfig(fp8="e4m3", fp8_recipe="rowwise")) == \
        Float8RowwiseScaling(Format.E4M3)


def _set_slot(layer: Float8Linear, amaxes: list[float]) -> None:
    layer.fp8_amax_history[0] = torch.tensor(amaxes)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 1])
def test_delayed_scale_update_and_history_roll(algo, margin):
    layer = Float8Linear(16, 16, recipe=DelayedScaling(margin=margin, amax_history_len=3, amax_compute_algo=algo))
    steps = [[4.0, 0.5, 1e-3], [2.0, 0.25, 3e-3], [1.0, 0.125, 2e-3], [0.5, 1.0, 1e-4]]
    for t, amaxes in enumerate(steps):
        _set_slot(layer, amaxes)
        fp8_step(layer)
        window = np.array(steps[max(0, t - 2): t + 1], np.float32)  # the last 3 steps are in the history
        amax = window.max(0) if algo == "max" else window[-1]
        expect = np.concatenate([ref_scale(amax[:2], E4M3, margin), ref_scale(amax[2:], E5M2, margin)])
        np.testing.assert_array_equal(layer.fp8_scale.numpy(), expect)
        assert layer.fp8_amax_history[0].tolist() == [0.0, 0.0, 0.0]  # fresh slot for the next step
        assert layer.fp8_amax_history[1].tolist() == [np.float32(a).item() for a in amaxes]
    assert layer.fp8_initialized.item()


def test_zero_or_non_finite_amax_keeps_the_previous_scale():
    layer = Float8Linear(16, 16, recipe=DelayedScaling(amax_history_len=1, amax_compute_algo="most_recent"))
    _set_slot(layer, [2.0, 4.0, 8.0])
    fp8_step(layer)
    before = layer.fp8_scale.clone()
    assert before.tolist() == [224.0, 112.0, 7168.0]
    _set_slot(layer, [0.0, float("inf"), float("nan")])
    fp8_step(layer)
    assert torch.equal(layer.fp8_scale, before)
    _set_slot(layer, [1.0, 0.0, 1.0])
    fp8_step(layer)
    assert layer.fp8_scale.tolist() == [448.0, 112.0, 57344.0]


@pytest.mark.parametrize("margin", [0, 3])
def test_current_and_rowwise_scales(margin):
    x = torch.tensor([[1.0, -2.0], [0.0, 0.0], [0.5, 0.25]])
    cur = Float8Linear(2, 2, recipe=Float8CurrentScaling(margin=margin))
    assert type(cur.quantizers[INPUT]) is CurrentQuantizer
    scale_inv = cur.quantize(x, INPUT, x.numel(), record=False).rows.scale_inv
    assert scale_inv.item() == pytest.approx(2.0 / 448 * 2 ** margin, rel=1e-7)
    row = RowwiseQuantizer(Float8RowwiseScaling(margin=margin), E5M2)
    t = row.quantize(x, cols=True)
    expect = [2.0 / 57344 * 2 ** margin, 1.0, 0.5 / 57344 * 2 ** margin]  # an all-zero row gets scale 1
    assert t.rows.scale_inv.squeeze(1).tolist() == pytest.approx(expect, rel=1e-7)
    # cols: x^T, one scale per column of x
    assert t.cols.data.shape == (2, 3) and t.cols.scale_inv.squeeze(1).tolist() == pytest.approx(
        [1.0 / 57344 * 2 ** margin, 2.0 / 57344 * 2 ** margin], rel=1e-7)


def test_bootstrap_before_first_step_uses_current_amax():
    layer = Float8Linear(16, 16, recipe=DelayedScaling())
    x = torch.full((4, 16), 0.01)
    rows = layer.quantize(x, INPUT, x.numel(), record=True).row_copy()
    q, scale_inv = rows.data, rows.scale_inv
    assert q.float().max().item() == 448.0  # scaled to the top of the range, not flushed at scale 1
    assert scale_inv.item() == pytest.approx(0.01 / 448, rel=1e-6)


def test_each_recipe_states_its_capabilities():
    from megadlms.fp8 import recipe as r
    assert r.RECIPE_NAMES == ("delayed", "tensorwise", "rowwise", "blockwise", "mxfp8")
    assert [r.recipe_class(n).name for n in r.RECIPE_NAMES] == list(r.RECIPE_NAMES)
    assert r.names_with("param_gather") == ["delayed", "tensorwise", "blockwise"]
    assert r.names_with("attention") == ["delayed"]
    assert r.names_with("experts") == ["tensorwise", "rowwise"]  # delayed: refused (experts_why)
    assert r.names_with("per_tensor") == ["delayed", "tensorwise"]
    assert [n for n in r.RECIPE_NAMES if r.recipe_class(n).formats == (Format.E4M3,)] == ["blockwise", "mxfp8"]
    assert [r.recipe_class(n).export_scaling for n in r.RECIPE_NAMES] == ["tensor"] * 3 + ["block", "tensor"]
    assert r.keeps_history(DelayedScaling()) and not r.keeps_history(Float8CurrentScaling())
    assert r.names_for_gpu(9) == ["delayed", "tensorwise", "rowwise", "blockwise"]
    assert r.names_for_gpu(10) == ["delayed", "tensorwise", "rowwise", "mxfp8"]
    assert r.names_for_gpu(8) == ["delayed", "tensorwise", "rowwise"] and r.names_with("cpu_emulated") == [
        "blockwise", "mxfp8"]
    assert r.alternatives_on_gpu(9, "mxfp8") == "delayed, tensorwise, rowwise or blockwise"
    with pytest.raises(ValueError, match="is not one of"):
        r.recipe_class("fp4")


def test_the_rules_are_asked_of_the_recipe():
    """Each rule answers None where it holds, else the message every caller raises (in its own error type)."""
    from megadlms.fp8 import recipe as r
    assert r.format_problem("blockwise", "e4m3") is None and r.format_problem("delayed", "hybrid") is None
    assert "use --fp8-format e4m3" in r.format_problem("mxfp8", "hybrid")
    assert "--fp8-pow2-scales applies to --fp8-recipe blockwise" in r.format_problem("rowwise", "e4m3", True)
    assert r.attention_problem(DelayedScaling()) is None and "delayed" in r.attention_problem("tensorwise")
    assert r.param_gather_problem("blockwise") is None and "not rowwise" in r.param_gather_problem("rowwise")
    assert r.experts_problem(Float8RowwiseScaling()) is None and "expert GEMMs" in r.experts_problem("blockwise")
    assert "tokens of each expert change with the routing" in r.experts_problem("delayed")
