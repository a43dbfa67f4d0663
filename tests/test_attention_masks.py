"""Attention masks from segment ids: dense and FlexAttention forms agree; positions restart per document."""

import torch

from megadlms.attention_masks import (
    BlockMask,
    and_masks,
    anneal_mask_mod,
    build_attention_mask,
    dense_mask,
    document_mask_mod,
    eod_segment_ids,
    segment_positions,
)
from megadlms.config import TransformerConfig
from megadlms.model import TransformerLM

SEG = torch.tensor([[1, 1, 1, 2, 2, 0, 0, 0], [1, 1, 1, 1, 1, 1, 2, 2]])


def test_document_mask_positions_and_eod_segments():
    m = dense_mask(document_mask_mod(SEG), 2, 8, 8, "cpu")
    assert m.shape == (2, 1, 8, 8)
    assert m[0, 0, 0].tolist() == [True] * 3 + [False] * 5
    assert m[0, 0, 3].tolist() == [False] * 3 + [True] * 2 + [False] * 3
    assert m[0, 0, 6].tolist() == [False] * 5 + [True] * 3  # pads see only pads
    causal = dense_mask(document_mask_mod(SEG, causal=True), 2, 8, 8, "cpu")
    assert causal[1, 0, 7].tolist() == [False] * 6 + [True] * 2 and causal[1, 0, 6].tolist() == [False] * 6 + [
        True, False]
    assert segment_positions(SEG).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1]]
    assert eod_segment_ids(torch.tensor([[5, 0, 7, 8, 0, 9]]), 0).tolist() == [[0, 0, 1, 1, 1, 2]]
    upper = torch.zeros(4, 4, dtype=torch.bool)
    upper[0, 3] = True
    a = dense_mask(and_masks(anneal_mask_mod(upper), document_mask_mod(torch.ones(1, 4, dtype=torch.long))),
                   1, 4, 4, "cpu")
    assert a[0, 0].int().tolist() == [[1, 0, 0, 1], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]


def test_model_takes_block_masks_and_dense_masks_alike():
    # FlexAttention runs forward-only on the CPU (no backward there): enough to check the dispatch
    torch.manual_seed(0)
    model = TransformerLM(TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                            vocab_size=50, seq_length=8)).eval()
    ids = torch.randint(0, 50, (2, 8))
    mod = document_mask_mod(SEG)
    block = build_attention_mask(mod, 2, 8, 8, "cpu", flex=True)
    assert isinstance(block, BlockMask)
    dense = build_attention_mask(mod, 2, 8, 8, "cpu")
    pos = segment_positions(SEG)
    with torch.no_grad():
        a = model(ids, attention_mask=block, position_ids=pos)
        b = model(ids, attention_mask=dense, position_ids=pos)
        # a document alone gives the same logits as packed
        alone = model(ids[:1, 3:5], position_ids=torch.arange(2))
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b[:1, 3:5], alone, atol=1e-5, rtol=1e-5)
