"""megadlms.generate.fuse: q/k/v and gate/up as one GEMM each, for inference (CPU)."""

import copy

import torch

from megadlms.build import build_model
from megadlms.config import TransformerConfig
from megadlms.diffusion.sampler import generate
from megadlms.generate.fuse import FusedProjection, fuse_projections
from megadlms.model import TransformerLM


def _model(**kw):
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=96, vocab_size=100, seq_length=32, max_position_embeddings=32,
                            init_method_std=0.2, mask_token_id=99, **kw)
    return TransformerLM(cfg).eval()


def test_fused_model_gives_the_same_logits_and_keeps_its_parameters():
    for bias in (False, True):
        model = _model(add_qkv_bias=bias)
        ref = copy.deepcopy(model)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        assert fuse_projections(model) == 4  # 2 layers x (q/k/v, gate/up)
        assert isinstance(model.layers[0].self_attn.project_qkv, FusedProjection)
        assert list(model.state_dict()) == list(state)  # names unchanged, nothing added
        for k, v in model.state_dict().items():
            assert torch.equal(v, state[k]), k
        attn = model.layers[0].self_attn
        fused = attn.project_qkv.weight
        assert attn.q_proj.weight.data_ptr() == fused.data_ptr()  # views of the fused tensor: no copy
        assert attn.k_proj.weight.data_ptr() == fused[attn.q_proj.out_features:].data_ptr()
        ids = torch.randint(0, 99, (3, 20))
        with torch.no_grad():
            torch.testing.assert_close(model(ids), ref(ids), rtol=1e-5, atol=1e-5)
        assert fuse_projections(model) == 0  # already fused
    prompts = [[5, 6, 7], [8, 9]]
    assert generate(model, prompts, gen_length=8, block_length=4, steps=8) == generate(
        ref, prompts, gen_length=8, block_length=4, steps=8)


def test_fp8_layers_are_left_alone():
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100, seq_length=32,
                            fp8=True, fp8_fuse_projections=False)
    assert fuse_projections(build_model(cfg).eval()) == 0
