"""Generation caches: cached forwards equal uncached ones where the cache is exact."""

import pytest
import torch

from megadlms.config import TransformerConfig
from megadlms.diffusion.kv_cache import AppendCache, DualCache, PrefixCache
from megadlms.model import TransformerLM


def model(layers=2, causal=False, seed=0):
    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=layers, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=64, vocab_size=50, seq_length=32, max_position_embeddings=32,
                            init_method_std=0.2, attn_mask_type="causal" if causal else "bidirectional")
    return TransformerLM(cfg).eval()


def hidden(m, ids, **kw):
    with torch.no_grad():
        return m(ids, output_hidden=True, **kw)


IDS = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))


def test_append_cache_matches_full_causal_forward():
    m = model(causal=True)
    full = hidden(m, IDS)
    cache = AppendCache(capacity=12)
    mask = torch.ones(2, 12, dtype=torch.bool)
    parts = [hidden(m, IDS[:, :5], attention_mask=mask[:, :5], kv_cache=cache)]
    for t in range(5, 12):  # one token at a time
        parts.append(hidden(m, IDS[:, t:t + 1], position_ids=torch.tensor([t]), kv_cache=cache))
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)
    assert len(cache) == 12
    with pytest.raises(ValueError, match=r"AppendCache is full: 12 cached \+ 1 new positions exceed capacity=12"):
        hidden(m, IDS[:, :1], position_ids=torch.tensor([12 % 12]), kv_cache=cache)
    with pytest.raises(ValueError, match="capacity=0 must be > 0"):
        AppendCache(0)


def test_prefix_cache_equals_full_forward_of_the_suffix():
    m = model()
    full = hidden(m, IDS)
    cache = PrefixCache()
    cache.refresh(7)
    torch.testing.assert_close(hidden(m, IDS, kv_cache=cache), full, rtol=0, atol=0)
    cache.extend()
    out = hidden(m, IDS[:, 7:], position_ids=torch.arange(7, 12), kv_cache=cache)
    torch.testing.assert_close(out, full[:, 7:], rtol=1e-5, atol=1e-5)
    assert cache._k[0].shape == (2, 2, 7, 8)


def test_dual_cache_equals_full_forward_of_the_block():
    m = model()
    full = hidden(m, IDS)
    cache = DualCache()
    cache.refresh()
    hidden(m, IDS, kv_cache=cache)
    k_before = cache._k[1].clone()
    cache.set_block(torch.arange(4, 8))
    out = hidden(m, IDS[:, 4:8], position_ids=torch.arange(4, 8), kv_cache=cache)
    torch.testing.assert_close(out, full[:, 4:8], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache._k[1], k_before, rtol=1e-5, atol=1e-5)  # rewritten with the same values
    # a refresh writes into the same buffers (fixed addresses, as a CUDA graph needs)
    ptr = cache._k[0].data_ptr()
    cache.refresh()
    hidden(m, IDS.flip(1), kv_cache=cache)
    assert cache._k[0].data_ptr() == ptr


def test_dual_cache_is_exact_for_one_layer_and_approximate_beyond():
    """Outside the block, layer-0 keys depend only on their own tokens: a 1-layer model is exact."""
    new = IDS.clone()
    new[:, 4:8] = torch.tensor([1, 2, 3, 4])  # the block's tokens change after the refresh
    for layers, exact in ((1, True), (2, False)):
        m = model(layers=layers)
        cache = DualCache()
        cache.refresh()
        hidden(m, IDS, kv_cache=cache)
        cache.set_block(torch.arange(4, 8))
        out = hidden(m, new[:, 4:8], position_ids=torch.arange(4, 8), kv_cache=cache)
        ref = hidden(m, new)[:, 4:8]
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5) == exact


def test_padded_keys_are_masked_through_the_cache():
    m = model()
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[0, :3] = False
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    outs = []
    for pad in (0, 9):
        ids = IDS.clone()
        ids[0, :3] = pad
        cache = DualCache()
        cache.refresh()
        hidden(m, ids, attention_mask=mask, position_ids=pos, kv_cache=cache)
        cache.set_block(torch.arange(8, 12))
        outs.append(hidden(m, ids[:, 8:], attention_mask=mask, position_ids=pos[:, 8:], kv_cache=cache))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    alone = hidden(m, IDS[:1, 3:])  # the padded row decoded alone
    torch.testing.assert_close(outs[0][:1], alone[:, 5:], rtol=1e-5, atol=1e-5)


def test_cache_misuse_errors():
    m = model()
    with pytest.raises(RuntimeError, match=r"set_block\(\) before any refresh"):
        DualCache().set_block(torch.arange(2))
    with pytest.raises(RuntimeError, match="used before refresh"):
        hidden(m, IDS, kv_cache=DualCache())
    with pytest.raises(RuntimeError, match=r"extend\(\) before any refresh"):
        PrefixCache().extend()
    cache = DualCache()
    cache.refresh()
    hidden(m, IDS, kv_cache=cache)
    with pytest.raises(ValueError, match=r"outside the cached length 12"):
        cache.set_block(torch.arange(10, 14))
    cache.set_block(torch.arange(4, 8))
    with pytest.raises(ValueError, match="runs 3 positions but set_block"):
        hidden(m, IDS[:, :3], position_ids=torch.arange(3), kv_cache=cache)
    p = PrefixCache()
    p.refresh(20)
    with pytest.raises(ValueError, match="fewer than prefix_len=20"):
        hidden(m, IDS, kv_cache=p)
