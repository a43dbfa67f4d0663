"""megadlms.fp8.quantizer: the quantizer kinds of the recipes, their scales, copies and amax records."""

from __future__ import annotations

import pytest
import torch

from megadlms.fp8 import DelayedScaling, Float8CurrentScaling, Float8Linear, Float8RowwiseScaling, Format
from megadlms.fp8.formats.blockwise import dequantize_blocks, dequantize_tiles, quantize_blocks, quantize_tiles
from megadlms.fp8.formats.mx import dequantize_mx, quantize_mx
from megadlms.fp8.kernels.primitives import E4M3, E5M2, amax_to_scale, quantize, quantize_rowwise
from megadlms.fp8.linear import GRAD, INPUT, WEIGHT
from megadlms.fp8.quantizer import (
    QUANTIZER_KINDS,
    BlockwiseQuantizer,
    CurrentQuantizer,
    DelayedQuantizer,
    FP8Copies,
    GroupQuantizer,
    MXQuantizer,
    RowwiseQuantizer,
    StepScales,
    make_quantizer,
)
from megadlms.fp8.recipe import Float8BlockwiseScaling, Float8MXScaling
from megadlms.fp8.state import fp8_autocast
from megadlms.fp8.tensor import Scaling


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
    q, si = quantize_rowwise(x, E4M3, 1)
    qc, sic = quantize_rowwise(x, E4M3, 0)
    assert torch.equal(t.rows.data.view(torch.uint8), q.view(torch.uint8)) and torch.equal(t.rows.scale_inv, si)
    assert torch.equal(t.cols.data.view(torch.uint8), qc.t().contiguous().view(torch.uint8))
    assert t.cols.scale_inv.shape == (16, 1) and torch.equal(t.cols.scale_inv, sic.reshape(-1, 1))
    # a cached weight's transposed operand: cast again from the master values, not transposed from rows
    cols = quant.cols_of(t.rows, lambda: x)
    assert torch.equal(cols.data.view(torch.uint8), t.cols.data.view(torch.uint8))
    assert (t.rows.scaling, t.rows.axis, t.cols.scaling, t.cols.axis) == (Scaling.ROW, 1, Scaling.ROW, 0)
    q_back, si_back = FP8Copies(cols=t.cols).any_copy()
    assert torch.equal(q_back.view(torch.uint8), qc.view(torch.uint8)) and torch.equal(si_back, sic)


def test_weight_quantizer_of_a_layer_reads_its_module_state():
    layer = Float8Linear(32, 16, recipe=DelayedScaling())
    assert layer.quantizers[WEIGHT].owner is layer and layer.quantizers[WEIGHT].role == WEIGHT
    moved = layer.to(torch.float64)  # buffers replaced in place stay the ones the quantizer reads
    assert moved.quantizers[WEIGHT].amax_slot().data_ptr() == moved.fp8_amax_history[0, WEIGHT].data_ptr()


def _bytes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def test_group_quantizer_casts_with_one_scale_and_records_into_every_member():
    """A fused group's casts: before scales exist one scale from the amax of what is cast (the concatenated weights:
    the largest member amax), each member's own weight amax and the shared operands' amax recorded; with the step's
    scales the smallest member scale of the role, as its inverse an aligned view of the step's."""
    layers = [Float8Linear(32, n, recipe=DelayedScaling(amax_history_len=2, fp8_format=Format.E4M3)) for n in (16, 32)]
    layers[1].weight.data *= 4
    x_in, w_q, g_q = (GroupQuantizer([m.quantizers[r] for m in layers], r) for r in (INPUT, WEIGHT, GRAD))
    ws = [m.weight.detach() for m in layers]
    t = w_q.quantize_cat(ws, cols=True, record=True)
    scale = amax_to_scale(ws[1].abs().amax(), 448.0)
    assert torch.equal(_bytes(t.rows.data), _bytes(quantize(torch.cat(ws), scale, E4M3)))
    assert torch.equal(_bytes(t.cols.data), _bytes(t.rows.data).t()) and t.rows.scale_inv == 1 / scale
    assert [float(m.fp8_amax_history[0, WEIGHT]) for m in layers] == [float(w.abs().amax()) for w in ws]
    parts = (torch.randn(21, 16), torch.randn(21, 32) * 5)  # the members' output gradients
    g = g_q.quantize_cols(parts, 32, rows=True, cols=True, record=True)
    cat = torch.cat(parts, 1)
    ref = quantize(cat, amax_to_scale(cat.abs().amax(), 448.0), E4M3)
    assert g.rows.data.shape == (32, 48) and not _bytes(g.rows.data[21:]).any()  # zero padding rows
    assert torch.equal(_bytes(g.rows.data[:21]), _bytes(ref))
    assert torch.equal(_bytes(g.cols.data), _bytes(g.rows.data).t())
    assert all(m.fp8_amax_history[0, GRAD] == cat.abs().amax() for m in layers)
    for m, scales in zip(layers, ([1.0, 2.0, 4.0], [8.0, 0.5, 16.0])):
        m.fp8_scale.copy_(torch.tensor(scales))
        m.mark_scales_ready()
    step = StepScales(torch.stack([m.fp8_scale for m in layers]).amin(0))
    x = torch.randn(16, 32)
    xq = x_in.quantize(x, cols=False, record=True, step=step)
    assert torch.equal(_bytes(xq.rows.data), _bytes(quantize(x, torch.tensor(1.0), E4M3)))
    assert xq.rows.scale_inv.data_ptr() == step.scale_invs[INPUT].data_ptr() and xq.cols is None
    assert all(m.fp8_amax_history[0, INPUT] == x.abs().amax() for m in layers)
    assert torch.equal(step.scales, torch.tensor([1.0, 0.5, 4.0])) and step.scale_invs.data_ptr() % 16 == 0
    # a cast another kernel performs: the step's scale, or (current scaling) one from that kernel's amax
    assert g_q.fused_scale(step, lambda: None) == (step.scales[GRAD], step.scale_invs[GRAD])
    assert g_q.amax_slots()[1].data_ptr() == layers[1].fp8_amax_history[0, GRAD].data_ptr()
    current = CurrentQuantizer(Float8CurrentScaling(), E4M3)
    assert current.fused_scale(None, lambda: None) is None and current.amax_slots() == []
    assert current.fused_scale(None, lambda: torch.tensor(4.0))[0] == 112.0


def _dq_tiles(x: torch.Tensor) -> torch.Tensor:
    """x quantized in 1x128 tiles along its rows, dequantised, unpadded (the blockwise library's cast)."""
    q, _ = quantize_tiles(x)
    return dequantize_tiles(q.data, q.scale_inv)[: x.shape[0], : x.shape[1]]


def _dq_blocks(w: torch.Tensor) -> torch.Tensor:
    q, _ = quantize_blocks(w)
    return dequantize_blocks(q.data, q.scale_inv)[: w.shape[0], : w.shape[1]]


def _dq_mx(x: torch.Tensor) -> torch.Tensor:
    return dequantize_mx(*quantize_mx(x))[:, : x.shape[1]]


@pytest.mark.parametrize("recipe", [Float8BlockwiseScaling(), Float8MXScaling()], ids=["blockwise", "mxfp8"])
@pytest.mark.parametrize("m, k, n", [(37, 200, 144), (16, 128, 128)], ids=["odd", "k128"])
def test_finer_recipes_fprop_dgrad_wgrad_equal_dequantise_then_matmul(recipe, m, k, n):
    """Each GEMM of the linear equals the fp32 matmul of its operands quantized along their own K and dequantised:
    blockwise x, g in 1x128 tiles, x^T, g^T tiled along the tokens, W in 128x128 blocks; MXFP8 per 32 elements."""
    torch.manual_seed(0)
    layer = Float8Linear(k, n, bias=False, recipe=recipe)
    x = (torch.randn(m, k) * torch.logspace(-2, 2, k)).requires_grad_()
    g = torch.randn(m, n) * torch.logspace(1, -1, m)[:, None]
    with fp8_autocast(fp8_recipe=recipe):
        y = layer(x)
    y.backward(g)
    w = layer.weight.detach()
    if isinstance(recipe, Float8BlockwiseScaling):
        y_ref, dx_ref = _dq_tiles(x.detach()) @ _dq_blocks(w).t(), _dq_tiles(g) @ _dq_blocks(w)
        dw_ref = _dq_tiles(g.t()) @ _dq_tiles(x.detach().t()).t()
    else:
        y_ref, dx_ref = _dq_mx(x.detach()) @ _dq_mx(w).t(), _dq_mx(g) @ _dq_mx(w.t()).t()
        dw_ref = _dq_mx(g.t()) @ _dq_mx(x.detach().t()).t()
    for got, ref in ((y, y_ref), (x.grad, dx_ref), (layer.weight.grad, dw_ref)):
        torch.testing.assert_close(got.detach(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    assert float((y.detach() - x.detach() @ w.t()).norm() / (x.detach() @ w.t()).norm()) < 0.1  # FP8, not exact


def test_blockwise_quantizer_kinds_and_layouts():
    layer = Float8Linear(256, 128, recipe=Float8BlockwiseScaling(pow2_scales=True))
    tiles, blocks = layer.quantizers[INPUT], layer.quantizers[WEIGHT]
    assert (type(tiles), tiles.blocks, blocks.blocks, layer.quantizers[GRAD].blocks) == (BlockwiseQuantizer, False,
                                                                                       True, False)
    assert not tiles.per_tensor and QUANTIZER_KINDS[Float8BlockwiseScaling] is BlockwiseQuantizer
    x = torch.randn(32, 256)
    t = tiles.quantize(x, rows=True, cols=True)
    assert t.rows.scaling is t.cols.scaling is Scaling.TILE and t.cols.data.shape == (256, 128)
    assert (t.rows.transposed, t.cols.transposed) == (False, True)
    si = t.rows.scale_inv
    assert torch.equal(si, torch.exp2(torch.round(torch.log2(si))))  # powers of two
    w = torch.randn(128, 256)
    wq = blocks.quantize(w).rows
    assert wq.scaling is Scaling.BLOCK
    cols = blocks.cols_of(wq, lambda: w)  # W^T: the same FP8 values, the block scales transposed
    ref, _ = quantize_blocks(w.t(), pow2=True)
    assert torch.equal(cols.data.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(cols.scale_inv,
                                                                                                 ref.scale_inv)
    assert cols.scaling is Scaling.BLOCK and cols.transposed
    q_back, si_back = FP8Copies(rows=wq).any_copy()  # telemetry's view: a scale per element
    assert si_back.shape == (128, 256) and torch.equal(q_back.float() * si_back,
                                                       dequantize_blocks(wq.data, wq.scale_inv))


def test_mx_quantizer_scales_each_copy_along_its_own_k():
    quant = make_quantizer(Float8MXScaling(), E4M3, None, INPUT)
    assert type(quant) is MXQuantizer and not quant.cols_in_same_pass
    x = torch.randn(48, 64)
    t = quant.quantize(x, rows=True, cols=True)
    assert t.rows.scaling is t.cols.scaling is Scaling.MX
    assert t.rows.scale_inv.shape == (48, 2) and t.cols.scale_inv.shape == (64, 2)
    q, s = quantize_mx(x.t())
    assert torch.equal(t.cols.data.view(torch.uint8), q.view(torch.uint8)) and torch.equal(
        t.cols.scale_inv.view(torch.uint8), s.view(torch.uint8))
