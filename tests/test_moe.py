import logging

import pytest
import torch
import torch.nn.functional as F

from megadlms import TransformerConfig, build_model
from megadlms.config import ConfigError
from megadlms.model import MLP, moe_block
from megadlms.moe import (
    MoE,
    add_aux_losses,
    dispatch_plan,
    moe_layers,
    moe_metrics,
    moe_step,
    split_expert_weights,
    stack_expert_weights,
)


def moe_cfg(**kw):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=97,
                seq_length=16, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16)
    return TransformerConfig(**{**base, **kw})


def _block(**kw):
    torch.manual_seed(0)
    m = moe_block(moe_cfg(**kw), 0)
    for p in m.parameters():
        torch.nn.init.normal_(p, 0, 0.3)
    return m


def _reference(m: MoE, x):
    """Token by token, expert by expert: what the block must compute."""
    xt = x.reshape(-1, x.shape[-1])
    weights, experts, _ = m.gate.route(m.gate(xt))
    ex = m.experts
    out = torch.zeros_like(xt)
    for t in range(xt.shape[0]):
        for j in range(m.topk):
            e = int(experts[t, j])
            h = F.silu(xt[t] @ ex.gate_proj[e].t()) * (xt[t] @ ex.up_proj[e].t())
            out[t] += weights[t, j] * (h @ ex.down_proj[e].t())
    if m.shared_expert is not None:
        out = out + m.shared_expert(xt)
    return out.view(x.shape)


@pytest.mark.parametrize("kw", [{}, {"moe_router_pre_softmax": True}, {"moe_router_topk": 1},
                                {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True},
                                {"moe_shared_expert_intermediate_size": 24},
                                {"moe_router_topk_scaling_factor": 2.5}])
def test_block_matches_token_by_token_reference(kw):
    m = _block(**kw)
    x = torch.randn(3, 7, 32)
    torch.testing.assert_close(m(x), _reference(m, x), atol=1e-5, rtol=1e-5)


def test_dispatch_is_dropless_and_padded():
    experts = torch.tensor([[0, 3], [3, 0], [3, 2], [0, 3]])  # expert 1 gets nothing
    pos, row_pair, offs, counts, rows = dispatch_plan(experts, 4)
    assert counts.tolist() == [3, 0, 1, 4] and rows == 16 + 16 * 4  # 8 pairs rounded up to 16, + 16 per expert
    assert torch.equal(row_pair[pos], torch.arange(8))  # each row knows its pair ...
    assert (row_pair >= 0).sum() == 8  # ... and the padding rows none
    assert offs.tolist() == [16, 16, 32, rows]  # groups padded to 16 rows; the last one takes the tail
    assert sorted(pos.tolist()) == pos.unique().tolist()  # every pair has a row of its own
    groups = torch.bucketize(pos, offs.long(), right=True)
    assert torch.equal(groups, experts.reshape(-1))  # each pair lands in its expert's group


def test_routing_semantics():
    m = _block()
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    w, e, probs = m.gate.route(logits)
    assert e.tolist() == [[0, 1]]
    torch.testing.assert_close(w, torch.softmax(torch.tensor([[2.0, 1.0]]), -1))  # normalised top-k
    m.gate.pre_softmax = True
    w, _, _ = m.gate.route(logits)
    torch.testing.assert_close(w, torch.softmax(logits, -1)[:, :2])  # not renormalised
    s = _block(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    s.gate.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))
    w, e, _ = s.gate.route(logits)
    assert e.tolist() == [[3, 0]]  # the bias steers the choice ...
    sig = torch.sigmoid(torch.tensor([-1.0, 2.0]))
    torch.testing.assert_close(w, (sig / sig.sum())[None])  # ... but not the weights


def test_aux_losses_recorded_added_once_and_only_in_training():
    m = _block(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    x = torch.randn(2, 8, 32)

    def expected_aux():
        logits = m.gate(x.reshape(-1, 32))
        _, experts, probs = m.gate.route(logits)
        counts = torch.bincount(experts.reshape(-1), minlength=4).float()
        return (4 * 0.01 * (probs.mean(0) * counts / (16 * 2)).sum()
                + 0.001 * torch.logsumexp(logits, -1).square().mean())

    out = m(x)
    expected = expected_aux()
    torch.testing.assert_close(m.aux_loss, expected.detach())
    loss = add_aux_losses(m, out.square().mean())
    torch.testing.assert_close(loss, out.square().mean() + expected)
    assert m.aux_loss == 0 and add_aux_losses(m, torch.tensor(1.0)) == 1.0
    loss.backward()
    got = m.gate.weight.grad.clone()
    # the same gradient as the auxiliary losses added to the loss as differentiable terms
    m.zero_grad()
    (m(x).square().mean() + expected_aux()).backward()
    torch.testing.assert_close(got, m.gate.weight.grad, rtol=1e-5, atol=1e-8)
    m.zero_grad()
    m(x).square().mean().backward()  # no loss took the auxiliary losses: no gradient from them
    assert not torch.allclose(got, m.gate.weight.grad, rtol=1e-3)
    add_aux_losses(m, torch.tensor(0.0))
    m.eval()
    m(x)
    assert m.aux_loss == 0  # an evaluation forward records nothing


def test_activation_checkpointing_recomputes_the_block_and_records_once():
    m = _block(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    x = torch.randn(2, 8, 32)
    grads, counts = [], []
    for recompute in (False, True):
        m.zero_grad()
        m.step_tokens.zero_()
        out = torch.utils.checkpoint.checkpoint(m, x, use_reentrant=False) if recompute else m(x)
        add_aux_losses(m, out.square().mean()).backward()  # the recompute saves what the forward saved
        grads.append([p.grad.clone() for p in m.parameters()])
        counts.append(m.step_tokens.clone())
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert torch.equal(counts[0], counts[1]) and counts[1].sum() == 2 * 8 * 2  # recorded once: T x k pairs
    assert m.aux_loss == 0


def test_uniform_routing_gives_the_coefficient():
    m = _block(moe_aux_loss_coeff=0.5)
    with torch.no_grad():
        m.gate.weight.zero_()  # uniform probabilities; ties pick experts 0 and 1 ...
    load = torch.full((4,), 4.0)  # ... a uniform load: 1 x coeff
    m._record(m._aux_losses(torch.zeros(8, 4), torch.full((8, 4), 0.25), load), load)
    torch.testing.assert_close(m.aux_loss, torch.tensor(0.5))


def test_expert_bias_step_and_telemetry(caplog):
    model = build_model(moe_cfg(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                                moe_router_bias_update_rate=0.1, moe_layer_freq=[0, 1]))
    (layer,) = moe_layers(model)
    assert layer.layer_idx == 1 and isinstance(model.layers[0].mlp, MLP)  # a dense first layer
    layer.step_tokens.copy_(torch.tensor([10.0, 0.0, 6.0, 0.0]))
    moe_step(model)
    torch.testing.assert_close(layer.gate.e_score_correction_bias, torch.tensor([-0.1, 0.1, -0.1, 0.1]))
    assert layer.step_tokens.sum() == 0 and layer.idle_steps.tolist() == [0, 1, 0, 1]
    with caplog.at_level(logging.WARNING, logger="megadlms"):
        m = moe_metrics(model, idle_warn_steps=1)
    assert m["moe/layer1/tokens_min"] == 0 and m["moe/layer1/tokens_max"] == 10
    torch.testing.assert_close(m["moe/layer1/tokens_cv"], torch.tensor([10.0, 0, 6, 0]).std(unbiased=False).item() / 4)
    assert "experts [1, 3] received no tokens" in caplog.text
    assert layer.window_tokens.sum() == 0  # the window starts again
    layer.step_tokens.copy_(torch.tensor([0.0, 0.0, 9.0, 0.0]))
    moe_step(model)
    with caplog.at_level(logging.WARNING, logger="megadlms"):
        moe_metrics(model)
    assert "router collapse, expert 2" in caplog.text


def test_model_trains_and_names_map_to_hugging_face():
    torch.manual_seed(0)
    cfg = moe_cfg(moe_aux_loss_coeff=0.01, moe_shared_expert_intermediate_size=24)
    model = build_model(cfg)
    names = set(dict(model.state_dict()))
    assert {"layers.0.mlp.gate.weight", "layers.0.mlp.experts.gate_proj", "layers.1.mlp.experts.down_proj",
            "layers.0.mlp.shared_expert.up_proj.weight"} <= names
    hf = dict(split_expert_weights(model.state_dict()))
    assert hf["layers.1.mlp.experts.3.down_proj.weight"].shape == (32, 16)
    assert "layers.1.mlp.experts.down_proj" not in hf
    back = stack_expert_weights(hf)
    assert set(back) == names and all(torch.equal(back[k], v) for k, v in model.state_dict().items())
    del hf["layers.0.mlp.experts.2.up_proj.weight"]
    with pytest.raises(KeyError, match="expert 2 is missing"):
        stack_expert_weights(hf)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 97, (4, 16))
    losses = []
    for _ in range(10):
        loss = add_aux_losses(model, F.cross_entropy(model(x).flatten(0, 1), x.flatten()))
        loss.backward()
        opt.step()
        opt.zero_grad()
        moe_step(model)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0
    assert moe_metrics(model)["moe/aux_loss"] > 0


def test_active_parameter_count():
    cfg = moe_cfg(moe_layer_freq=[0, 1], moe_shared_expert_intermediate_size=8)
    h, e, k, f, fs = 32, 4, 2, 16, 8
    attn = 4 * h * h
    expected = 2 * attn + 3 * h * 64 + (h * e + k * 3 * h * f + 3 * h * fs) + 97 * h
    assert cfg.num_matmul_params() == expected


@pytest.mark.parametrize("kw, message", [
    ({"moe_router_topk": 5}, "moe_router_topk=5 exceeds num_moe_experts=4"),
    ({"moe_layer_freq": [1, 0, 1]}, "moe_layer_freq=[1, 0, 1] must be a 0/1 pattern with one entry per layer"),
    ({"moe_layer_freq": 0}, "moe_layer_freq=0 must be a positive integer"),
    ({"moe_router_score_function": "relu"}, "moe_router_score_function='relu' is not one of"),
    ({"moe_router_enable_expert_bias": True}, "takes moe_router_score_function='sigmoid'"),
    ({"moe_aux_loss_coeff": -1.0}, "moe_aux_loss_coeff=-1.0 must be >= 0"),
    ({"num_moe_experts": 0}, "num_moe_experts=0 must be a positive integer"),
    ({"fp8": True, "fp8_recipe": "blockwise", "fp8_format": "e4m3"}, "the FP8 expert GEMMs take"),
])
def test_config_errors_are_one_line(kw, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")) as e:
        moe_cfg(**kw)
    assert "\n" not in str(e.value)


SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero", "unique")


def test_no_host_synchronisation_in_forward_and_backward(monkeypatch):
    """tiny-moe's MoE layers at their default settings (training, auxiliary and z-losses on): no call that copies a
    device value to the host (the CPU stand-ins of CUDA's synchronising calls), forward, backward or in the optimizer
    step's `moe_step` (only `moe_metrics`, at log time, reads the counters)."""
    from megadlms.presets import preset_config

    torch.manual_seed(0)
    model = build_model(preset_config("tiny-moe", tokenizer_vocab_size=512))
    layers = moe_layers(model)
    assert len(layers) == 3 and layers[0].aux_loss_coeff > 0 and layers[0].z_loss_coeff > 0
    x = torch.randn(2, 64, 256, requires_grad=True)
    add_aux_losses(layers[0], layers[0](x).sum()).backward()  # first calls (the GEMM backend's probe) not counted
    calls: list[str] = []

    def counting(name, fn):
        def wrapper(*a, **kw):
            calls.append(name)
            return fn(*a, **kw)
        return wrapper

    for name in SYNC_METHODS:
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    for name in ("nonzero", "unique", "bincount", "masked_select", "repeat_interleave"):
        # repeat_interleave synchronises only without output_size; counted all the same
        monkeypatch.setattr(torch, name, counting(name, getattr(torch, name)))
    for m in layers:
        loss = add_aux_losses(m, m(x).square().mean())
        loss.backward()
    counted = [m.step_tokens.clone() for m in layers]
    moe_step(model)  # the optimizer step's bias update and counters: on the device too
    monkeypatch.undo()
    assert calls == [], calls
    assert [c.sum().item() for c in counted] == [2 * 128 * 2, 128 * 2, 128 * 2]  # T x k pairs a call
    assert all(torch.equal(m.window_tokens, c) for m, c in zip(layers, counted))


def test_layers_replayed_as_cuda_graphs_match_eager_with_auxiliary_losses():
    """The layers of an MoE model captured and replayed (`LayerGraphs`, emulated on the CPU): the auxiliary losses
    reach the loss and the routers from device buffers, so the capture step and the replays train as eager does."""
    import copy

    from megadlms.model import TransformerLM
    from megadlms.training.cuda_graphs import LayerGraphs

    torch.manual_seed(0)
    eager = TransformerLM(moe_cfg(attn_mask_type="bidirectional", moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01))
    graphed = copy.deepcopy(eager)
    graphs = LayerGraphs(graphed, emulate=True)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, graphed)]
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        if step == 2:  # the telemetry of the replayed steps alone (the capture step's forward counts twice here)
            moe_metrics(eager), moe_metrics(graphed)
        ids = torch.randint(0, 97, (2, 16), generator=g)
        losses = []
        for model, opt in zip((eager, graphed), opts):
            loss = add_aux_losses(model, F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()))
            loss.backward()
            losses.append(loss.item())
            opt.step()
            opt.zero_grad(set_to_none=True)
            moe_step(model)
        assert losses[1] == pytest.approx(losses[0], rel=1e-6)
        graphs.arm()  # captured on the second step, replayed on the next two
    assert graphs.num_replays == 3
    for (name, p), q in zip(eager.named_parameters(), graphed.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
    got, want = moe_metrics(graphed), moe_metrics(eager)
    assert got.keys() == want.keys() and all(got[k] == pytest.approx(want[k], rel=1e-6) for k in want)
