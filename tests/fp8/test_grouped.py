"""FP8 grouped GEMMs of the MoE experts (emulated on the CPU): the exact FP8 products per expert, close to the
high-precision ones, and an FP8 MoE model that converts and trains."""

import pytest
import torch
import torch.nn.functional as F

from megadlms import TransformerConfig, build_model
from megadlms.fp8 import Float8Linear, fp8_autocast
from megadlms.fp8.grouped import Float8GroupedExperts, fp8_grouped_linear
from megadlms.fp8.kernels.primitives import quantize
from megadlms.fp8.recipe import E4M3, FP8_MAX, DelayedScaling, Float8CurrentScaling, Float8RowwiseScaling
from megadlms.fp8.tensor import Scaling
from megadlms.grouped_gemm import grouped_linear
from megadlms.moe import Router, add_aux_losses

RECIPES = {"rowwise": Float8RowwiseScaling(), "tensorwise": Float8CurrentScaling()}
SIZES = [16, 0, 32, 48]  # dispatched groups are multiples of 16; one expert without tokens


def _offs():
    return torch.tensor(SIZES).cumsum(0).to(torch.int32)


def _qdq(t, amax):
    """Quantize to E4M3 with scale fp8_max / amax (broadcast) and back."""
    scale = FP8_MAX[E4M3] / amax
    return quantize(t, scale, E4M3).float() / scale


def _ref_fprop(x, w, scaling):
    out = []
    for e, xs in enumerate(x.split(SIZES)):
        if not len(xs):
            continue
        if scaling == "rowwise":
            xa, wa = xs.abs().amax(1, keepdim=True), w[e].abs().amax(1, keepdim=True)
        else:
            xa, wa = xs.abs().amax(), w[e].abs().amax()
        out.append(_qdq(xs, xa) @ _qdq(w[e], wa).t())
    return torch.cat(out)


@pytest.mark.parametrize("scaling", ["rowwise", "tensorwise"])
def test_fprop_is_the_fp8_product_per_expert(scaling):
    torch.manual_seed(0)
    x, w = torch.randn(96, 32), torch.randn(4, 48, 32)
    x[20:30] *= 50  # an expert whose rows are larger: its own scales
    y = fp8_grouped_linear(x, w, _offs(), RECIPES[scaling])
    torch.testing.assert_close(y, _ref_fprop(x, w, scaling), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("scaling", ["rowwise", "tensorwise"])
def test_gradients_track_high_precision(scaling):
    torch.manual_seed(0)
    x = torch.randn(96, 32, requires_grad=True)
    w = torch.randn(4, 48, 32, requires_grad=True)
    g = torch.randn(96, 48)
    fp8_grouped_linear(x, w, _offs(), RECIPES[scaling], fp8_wgrad=True).backward(g)
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    grouped_linear(xr, wr, _offs()).backward(g)

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    assert rel(x.grad, xr.grad) < 0.08 and rel(w.grad, wr.grad) < 0.08
    assert w.grad[1].abs().max() == 0  # no tokens, no gradient
    # the weight gradient is the product of the FP8 operands, scaled per (expert, column) of g and x
    e, s = 2, slice(16, 48)
    gs, xs = g[s], x.detach()[s]
    ga, xa = gs.abs().amax(0), xs.abs().amax(0)
    if scaling == "tensorwise":
        ga, xa = ga.max(), xa.max()
    torch.testing.assert_close(w.grad[e], _qdq(gs, ga).t() @ _qdq(xs, xa), atol=1e-4, rtol=1e-5)


def test_delayed_scaling_is_refused_for_the_experts_with_its_reason():
    with pytest.raises(ValueError, match="tokens of each expert change with the routing"):
        Float8GroupedExperts(4, 32, 48, torch.nn.Identity(), recipe=DelayedScaling())


def test_high_precision_weight_gradient_is_the_default():
    """By default the weight gradient is exactly the grouped GEMM of the unquantized g and x (fp8_wgrad=False)."""
    torch.manual_seed(0)
    x, w, g = torch.randn(96, 32), torch.randn(4, 48, 32, requires_grad=True), torch.randn(96, 48)
    fp8_grouped_linear(x, w, _offs(), RECIPES["rowwise"]).backward(g)
    wr = w.detach().clone().requires_grad_()
    grouped_linear(x, wr, _offs()).backward(g)
    torch.testing.assert_close(w.grad, wr.grad, atol=0, rtol=0)
    fp8_grouped_linear(x, w, _offs(), RECIPES["rowwise"], fp8_wgrad=True).backward(g)  # FP8 differs: accumulates
    assert 0 < (w.grad - 2 * wr.grad).abs().max() < 0.08 * wr.grad.abs().max()


def test_experts_take_fp8_weight_gradients_only_when_asked():
    from megadlms.fp8 import convert_to_fp8
    from megadlms.model import TransformerLM

    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64, vocab_size=64,
                            seq_length=16, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16)

    def experts(**options):
        return convert_to_fp8(TransformerLM(cfg), Float8RowwiseScaling(), **options).layers[0].mlp.experts

    assert experts().fp8_wgrad is False and "fp8_wgrad=False" in repr(experts())
    assert experts(experts_fp8_wgrad=True).fp8_wgrad is True
    assert experts(experts_fp8_wgrad=True, fp8_wgrad=False).fp8_wgrad is False  # --no-fp8-wgrad covers them too
    from megadlms.training.args import parse_train_args
    from megadlms.training.run_plan import resolve_model_config

    flags = ["--model-path", "tiny-moe", "--fp8-format", "e4m3", "--fp8-recipe", "rowwise"]
    for extra, fp8_wgrad in (([], False), (["--fp8-experts-wgrad"], True)):
        run_cfg = resolve_model_config(parse_train_args(flags + extra), vocab_size=None, mask_id=5)
        assert build_model(run_cfg).layers[1].mlp.experts.fp8_wgrad is fp8_wgrad


def test_fp8_moe_model_converts_and_trains():
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=97,
                            seq_length=16, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                            moe_shared_expert_intermediate_size=32, moe_aux_loss_coeff=0.01, fp8=True,
                            fp8_recipe="rowwise", fp8_format="e4m3")
    model = build_model(cfg)
    mlp = model.layers[0].mlp
    assert isinstance(mlp.experts, Float8GroupedExperts) and mlp.experts.scaling is Scaling.ROW
    assert type(mlp.gate) is Router  # the router stays in high precision
    assert isinstance(mlp.shared_expert.gate_proj, Float8Linear)
    ref = build_model(cfg.replace(fp8=False))
    ref.load_state_dict(model.state_dict())
    x = torch.randint(0, 97, (4, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = model(x).float(), ref(x).float()
    assert ((a - b).norm() / b.norm()) < 0.1
    with fp8_autocast(enabled=False):  # outside FP8 autocast the experts run in high precision
        torch.testing.assert_close(model.layers[0].mlp.experts(torch.ones(16, 64), torch.tensor([16, 16, 16, 16],
                                   dtype=torch.int32)), ref.layers[0].mlp.experts(torch.ones(16, 64),
                                   torch.tensor([16, 16, 16, 16], dtype=torch.int32)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = add_aux_losses(model, F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten()))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0


@pytest.mark.parametrize("scaling", ["rowwise", "tensorwise"])
def test_forward_and_backward_read_nothing_back_to_the_host(scaling, monkeypatch):
    """No .item(), .tolist(), .cpu(), bool() or int() of a tensor in the FP8 experts' forward or backward: the
    expert offsets stay on the device (on a GPU each such read would stall the stream)."""
    torch.manual_seed(0)
    x = torch.randn(96, 32, requires_grad=True)
    w = torch.randn(4, 48, 32, requires_grad=True)
    grouped_linear(x, w, _offs())  # the one-time backend probe of the grouped GEMM
    reads = []
    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    fp8_grouped_linear(x, w, _offs(), RECIPES[scaling]).backward(torch.ones(96, 48))
    monkeypatch.undo()
    assert reads == [] and x.grad is not None and w.grad is not None


def test_gate_and_up_projections_share_one_cast_of_their_input(monkeypatch):
    torch.manual_seed(0)
    from megadlms.model import SwiGLU

    experts = Float8GroupedExperts(4, 32, 48, SwiGLU(), recipe=Float8RowwiseScaling(), fp8_wgrad=True)
    for p in experts.parameters():
        torch.nn.init.normal_(p, 0, 0.1)
    x = torch.randn(96, 32, requires_grad=True)
    with fp8_autocast(enabled=False):
        ref = experts(x, _offs())
    casts = []
    original = experts.quantizer.quantize
    monkeypatch.setattr(experts.quantizer, "quantize", lambda t, *a, **k: casts.append(t.shape) or original(t, *a, **k))
    with fp8_autocast(enabled=True, fp8_recipe=experts.recipe):
        y = experts(x, _offs())
    assert casts == [(96, 32), (96, 48)]  # x once for gate and up, h for down
    y.backward(torch.ones_like(y))
    assert casts[2:] == [(96, 32), (96, 48), (96, 48)]  # the three output gradients
    assert ((y - ref).norm() / ref.norm()) < 0.1 and x.grad is not None


def test_grouped_gemm_refuses_what_the_gpu_kernel_would_on_every_backend():
    from megadlms.fp8.gemm import fp8_grouped_gemm
    from megadlms.fp8.tensor import FP8Tensor

    offs = _offs()
    x = FP8Tensor(torch.zeros(96, 32, dtype=E4M3), torch.ones(96), Scaling.ROW, offs=offs)
    w = FP8Tensor(torch.zeros(4, 48, 32, dtype=E4M3), torch.ones(4, 48), Scaling.ROW)
    assert fp8_grouped_gemm(x, w, torch.float32, False).shape == (96, 48)
    bad = [(x.with_data(x.data, torch.ones(96, 1)), w, r"scale_inv is torch.float32 \(96, 1\), not fp32 \(96,\)"),
           (x, w.with_data(w.data.to(torch.float8_e5m2)), "must be E4M3, row-major"),
           (x, w.with_data(torch.zeros(3, 48, 32, dtype=E4M3)), "multiply 4 expert weights"),
           (x.with_data(torch.zeros(96, 24, dtype=E4M3)), w, "multiply 4 expert weights"),
           (FP8Tensor(x.data, x.scale_inv, Scaling.ROW, offs=offs.long()), w, "offsets must be int32"),
           (FP8Tensor(x.data, x.scale_inv, Scaling.TENSOR, offs=offs), w, "per-row or per-expert scaled")]
    for a, b, message in bad:
        with pytest.raises(ValueError, match=message):
            fp8_grouped_gemm(a, b, torch.float32, False)


@pytest.mark.parametrize("backward_fast_accum", [None, False])
def test_backward_gemms_take_fast_accumulation_by_default(backward_fast_accum, monkeypatch):
    """fprop, dgrad and the FP8 wgrad ask `fp8_grouped_gemm` for Hopper's fast accumulation (torch's grouped kernel
    without it spills at MoE shapes), unless backward_fast_accum=False."""
    import megadlms.fp8.grouped as grouped

    calls = []
    original = grouped.fp8_grouped_gemm
    monkeypatch.setattr(grouped, "fp8_grouped_gemm", lambda a, b, dtype, fast: calls.append(
        ("wgrad" if a.transposed else "dgrad" if b.transposed else "fprop", fast)) or original(a, b, dtype, fast))
    x = torch.randn(96, 32, requires_grad=True)
    w = torch.randn(4, 48, 32, requires_grad=True)
    options = {} if backward_fast_accum is None else {"backward_fast_accum": backward_fast_accum}
    fp8_grouped_linear(x, w, _offs(), RECIPES["rowwise"], fp8_wgrad=True, **options).backward(torch.ones(96, 48))
    fast = backward_fast_accum is None
    assert calls == [("fprop", True), ("dgrad", fast), ("wgrad", fast)]


def _tiny_moe_model():
    from megadlms.fp8 import convert_to_fp8
    from megadlms.model import TransformerLM

    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64, vocab_size=64,
                            seq_length=16, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16)
    return convert_to_fp8(TransformerLM(cfg), Float8RowwiseScaling())


def test_expert_weights_cast_once_per_step_and_again_after_it(monkeypatch):
    """Two micro-batches of a step share one FP8 cast of each expert weight (rows for fprop, W^T for dgrad, made by
    the first backward); the optimizer's update and fp8_step make the next forward cast again; the gradients equal
    those of a module casting on every forward, bit for bit."""
    from megadlms.fp8 import fp8_step, set_fp8_weight_caching

    cached, uncached = _tiny_moe_model(), _tiny_moe_model()
    switched = set_fp8_weight_caching(uncached, False)
    assert uncached.layers[0].mlp.experts in switched and not uncached.layers[0].mlp.experts.cache_weight
    experts = cached.layers[0].mlp.experts
    w_t_casts = []
    original = experts.quantizer.quantize_weight
    monkeypatch.setattr(experts.quantizer, "quantize_weight", lambda w, rows=True, cols=False, amax=None: (
        w_t_casts.append(cols), original(w, rows, cols, amax))[1])
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for model in (cached, uncached):
        for _ in range(2):  # two micro-batches
            model(ids).float().square().mean().backward()
    assert experts.num_weight_casts == 3 and w_t_casts.count(True) == 3  # gate, up, down: once each
    assert uncached.layers[0].mlp.experts.num_weight_casts == 6
    for a, b in zip(cached.parameters(), uncached.parameters()):
        assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)
    opt = torch.optim.SGD(cached.parameters(), lr=0.1)
    opt.step()  # in place: the weights' versions move
    cached(ids).float().sum().backward()
    assert experts.num_weight_casts == 6 and w_t_casts.count(True) == 6
    fp8_step(cached)
    assert experts.weight_casts == {}
