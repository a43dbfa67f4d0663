"""megadlms.fp8.quantizer: the quantizer kinds of the recipes, their scales, copies and amax records."""

from __future__ import annotations

import pytest
import torch

from megadlms.fp8 import DelayedScaling, Float8CurrentScaling, Float8Linear, Float8RowwiseScaling, Format
from megadlms.fp8.linear import GRAD, INPUT, WEIGHT
from megadlms.fp8.quantize import E4M3, E5M2, amax_to_scale, quantize, quantize_rowwise
from megadlms.fp8.quantizer import (
    QUANTIZER_KINDS,
    CurrentQuantizer,
    DelayedQuantizer,
    FP8Tensor,
    RowwiseQuantizer,
    make_quantizer,
)


@pytest.mark.parametrize("recipe, kind", [(DelayedScaling(), DelayedQuantizer),
                                          (Float8CurrentScaling(), CurrentQuantizer),
                                          (Float8RowwiseScaling(), RowwiseQuantizer)])
def test_a_recipe_is_a_kind_of_quantizer_chosen_once(recipe, kind):
    layer = Float8Linear(32, 16, recipe=recipe)
    assert [type(q) for q in layer.quantizers] == [kind] * 3 and QUANTIZER_KINDS[type(recipe)] is kind
    assert [q.fp8_dtype for q in layer.quantizers] == [E4M3, E4M3, E5M2]  # hybrid: E5M2 gradients
    assert kind.per_tensor == (kind is not RowwiseQuantizer)
    assert make_quantizer(recipe, E4M3, layer, INPUT).per_tensor == kind.per_tensor


def test_delayed_quantizer_bootstraps_from_the_amax_then_uses_the_step_scale():
    layer = Float8Linear(32, 16, recipe=DelayedScaling(amax_history_len=2, fp8_format=Format.E4M3))
    quant = layer.quantizers[GRAD]
    x = torch.randn(16, 32) * 3
    t = quant.quantize(x, rows=True, cols=True, record=True)
    scale = amax_to_scale(x.abs().amax(), 448.0)  # no fp8_step yet: x's own amax, as current scaling
    assert torch.equal(t.rows.data.view(torch.uint8), quantize(x, scale, E4M3).view(torch.uint8))
    assert torch.equal(t.cols.data.view(torch.uint8), t.rows.data.view(torch.uint8).t())  # q^T of the same values
    assert t.rows.scale_inv is t.cols.scale_inv and layer.fp8_amax_history[0, GRAD] == x.abs().amax()
    assert layer.fp8_amax_history[0, INPUT] == 0  # only its own role's slot
    layer.fp8_scale.copy_(torch.tensor([1.0, 2.0, 4.0]))
    layer.mark_scales_ready()
    assert bool(layer.fp8_initialized) and quant.scale() == 4.0
    t = quant.quantize(x, record=False)
    assert torch.equal(t.rows.data.view(torch.uint8), quantize(x, torch.tensor(4.0), E4M3).view(torch.uint8))
    assert t.cols is None and t.rows.scale_inv == 0.25


def test_current_quantizer_scales_by_the_amax_or_a_kept_one():
    quant = CurrentQuantizer(Float8CurrentScaling(margin=1), E5M2)
    x = torch.randn(16, 48)
    t = quant.quantize(x, rows=False, cols=True)
    assert t.rows is None and t.cols.data.shape == (48, 16)
    assert t.cols.scale_inv.item() == pytest.approx(float(x.abs().amax()) / 57344 * 2, rel=1e-6)
    kept = quant.quantize(x, amax=torch.tensor(8.0)).rows.scale_inv  # the weight's amax kept by its optimizer
    assert kept.item() == pytest.approx(8.0 / 57344 * 2, rel=1e-6)


def test_rowwise_quantizer_scales_rows_and_columns_from_the_values():
    quant = RowwiseQuantizer(Float8RowwiseScaling(), E4M3)
    x = torch.randn(32, 16) * torch.linspace(0.1, 10, 32)[:, None]
    t = quant.quantize(x, rows=True, cols=True)
    q, si, _ = quantize_rowwise(x, E4M3, 1)
    qc, sic, _ = quantize_rowwise(x, E4M3, 0)
    assert torch.equal(t.rows.data.view(torch.uint8), q.view(torch.uint8)) and torch.equal(t.rows.scale_inv, si)
    assert torch.equal(t.cols.data.view(torch.uint8), qc.t().contiguous().view(torch.uint8))
    assert t.cols.scale_inv.shape == (16, 1) and torch.equal(t.cols.scale_inv, sic.reshape(-1, 1))
    # a cached weight's transposed operand: cast again from the master values, not transposed from rows
    cols = quant.cols_of(t.rows, lambda: x)
    assert torch.equal(cols.data.view(torch.uint8), t.cols.data.view(torch.uint8))
    q_back, si_back = FP8Tensor(cols=t.cols).any_copy()
    assert torch.equal(q_back.view(torch.uint8), qc.view(torch.uint8)) and torch.equal(si_back, sic)


def test_weight_quantizer_of_a_layer_reads_its_module_state():
    layer = Float8Linear(32, 16, recipe=DelayedScaling())
    assert layer.quantizers[WEIGHT].owner is layer and layer.quantizers[WEIGHT].role == WEIGHT
    moved = layer.to(torch.float64)  # buffers replaced in place stay the ones the quantizer reads
    assert moved.quantizers[WEIGHT].amax_slot().data_ptr() == moved.fp8_amax_history[0, WEIGHT].data_ptr()
