import torch

from megadlms import TransformerConfig, build_model


def small(**kw):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                vocab_size=97, seq_length=32, qk_layernorm=True)
    return TransformerConfig(**{**base, **kw})


def test_shapes_dtypes_and_parameter_names():
    torch.manual_seed(0)
    model = build_model(small())
    x = torch.randint(0, 97, (3, 17))
    logits = model(x)
    assert logits.shape == (3, 17, 97) and logits.dtype == torch.float32
    assert model(x, output_hidden=True).shape == (3, 17, 64)
    names = set(dict(model.named_parameters()))
    assert {"embed_tokens.weight", "layers.0.self_attn.q_proj.weight", "layers.1.mlp.down_proj.weight",
            "layers.0.self_attn.q_norm.weight", "norm.weight"} <= names
    assert model.lm_head is None and model.output_weight is model.embed_tokens.weight
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(x).dtype == torch.bfloat16


def test_bidirectional_vs_causal():
    torch.manual_seed(0)
    dlm = build_model(small())
    ar = build_model(small(attn_mask_type="causal"))
    ar.load_state_dict(dlm.state_dict())
    x = torch.randint(0, 97, (2, 12))
    y = x.clone()
    y[:, -1] = (y[:, -1] + 1) % 97  # change only the last token
    # DLM: every position sees the change; AR: earlier positions do not
    assert (dlm(x)[:, 0] - dlm(y)[:, 0]).abs().max() > 1e-4
    assert torch.equal(ar(x)[:, :-1], ar(y)[:, :-1])
    # with no mask and a full key mask the causal model gives the same logits
    torch.testing.assert_close(ar(x, attention_mask=torch.ones(2, 12, dtype=torch.bool)), ar(x))


def test_padding_keys_are_never_attended():
    torch.manual_seed(0)
    model = build_model(small())
    x = torch.randint(0, 97, (1, 10))
    mask = torch.ones(1, 10, dtype=torch.bool)
    mask[:, :3] = False  # left padding
    a = model(x, attention_mask=mask)
    x2 = x.clone()
    x2[:, :3] = 5
    b = model(x2, attention_mask=mask)
    torch.testing.assert_close(a[:, 3:], b[:, 3:])


def test_untied_head_and_init_scale():
    torch.manual_seed(0)
    model = build_model(small(untie_embeddings_and_output_weights=True, num_layers=8))
    assert model.lm_head is not None and model.output_weight is model.lm_head.weight
    std_q = model.layers[0].self_attn.q_proj.weight.std().item()
    std_o = model.layers[0].self_attn.o_proj.weight.std().item()
    assert abs(std_q - 0.02) < 0.003 and abs(std_o - 0.02 / 4) < 0.001  # out layers scaled by 1/sqrt(2L)


def test_rms_norm_of_the_fp32_residual_under_autocast_is_the_autocast_cast_of_its_fp32_output():
    """Under autocast an fp32 input gives the autocast dtype, rounded once from the fp32 result (what a following
    linear would have cast it to); bf16 inputs and autocast-free calls keep their dtype and values."""
    from megadlms.model import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(64))
    x = torch.randn(5, 64) * 3
    full = norm(x)
    assert full.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = norm(x)
        same = norm(x.bfloat16())
    assert half.dtype == torch.bfloat16
    assert torch.equal(half, full.bfloat16())
    assert torch.equal(same, norm(x.bfloat16()))
    # gradients still reach the input and the weight in fp32
    x.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        norm(x).float().pow(2).sum().backward()
    assert x.grad.dtype == torch.float32 and norm.weight.grad.dtype == torch.float32


def test_eager_swiglu_keeps_only_its_inputs_and_gives_autograds_gradients():
    """Eager autograd of silu(gate) * up would keep silu(gate) too (one more [tokens, ffn] tensor per layer in an
    FP8 MLP's unfused path, which runs outside the compiled layer); SwiGLU keeps gate and up and recomputes it,
    with the same outputs and gradients, bit for bit."""
    import torch.nn.functional as F

    from megadlms.model import SwiGLU

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        gate, up = (torch.randn(48, 80, dtype=dtype, requires_grad=True) for _ in range(2))
        grad = torch.randn(48, 80, dtype=dtype)
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = SwiGLU()(gate, up)
        assert len(saved) == 2 and saved[0] is gate and saved[1] is up
        out.backward(grad)
        g2, u2 = (t.detach().clone().requires_grad_() for t in (gate, up))
        ref = F.silu(g2) * u2
        ref.backward(grad)
        assert torch.equal(out, ref) and torch.equal(gate.grad, g2.grad) and torch.equal(up.grad, u2.grad)
    with torch.no_grad():
        assert torch.equal(SwiGLU()(gate, up), F.silu(gate) * up)
