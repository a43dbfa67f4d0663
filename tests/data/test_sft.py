"""Packed SFT windows: whole conversations, loss masks and segment ids; padding; blends, splits and ranks."""

import numpy as np
import pytest

from megadlms.data import DataConfig, build_loaders, load_tokenizer
from megadlms.data.dataset import DataError
from megadlms.data.indexed import IndexedDataset, IndexedDatasetBuilder
from megadlms.data.sft import PackedChatDataset, loss_mask_prefix

EOD = 0


def make_chat(prefix, lengths, base=10):
    """Conversation d: tokens base + 100*d + [0..n), the second half is its response."""
    with IndexedDatasetBuilder(prefix, np.uint16) as t, IndexedDatasetBuilder(loss_mask_prefix(prefix), np.uint8) as m:
        for d, n in enumerate(lengths):
            t.add_document(base + 100 * d + np.arange(n))
            m.add_document((np.arange(n) >= n // 2).astype(np.uint8))
    return str(prefix)


def conversations(window):
    """{segment id: (tokens, mask)} of one window [3, L+1]."""
    tokens, mask, seg = window
    return {int(s): (tokens[seg == s].tolist(), mask[seg == s].tolist()) for s in np.unique(seg) if s}


def test_windows_hold_whole_conversations_once_per_epoch(tmp_path):
    lengths = [5, 9, 3, 12, 7, 4, 8, 6, 2, 10]
    ds = PackedChatDataset(IndexedDataset(make_chat(tmp_path / "c", lengths)), 0, 10, seq_length=16,
                           num_samples=1, seed=3, eod_id=EOD, pad="ignore")
    seen = []
    for i in range(len(ds)):
        w = ds[i]
        assert w.shape == (3, 17) and w[2, -1] == 0 and w[1, -1] == 0
        for toks, mask in conversations(w).values():
            d = (toks[0] - 10) // 100
            n = lengths[d]
            assert toks == list(10 + 100 * d + np.arange(n)) and mask == [int(j >= n // 2) for j in range(n)]
            seen.append(d)
        pads = w[2] == 0
        assert (w[0][pads] == EOD).all() and not w[1][pads].any()
    assert sorted(seen) == list(range(10))  # one epoch: every conversation exactly once, none split
    # eos padding: the pads extend the last conversation's response
    eos = PackedChatDataset(IndexedDataset(make_chat(tmp_path / "c", lengths)), 0, 10, seq_length=16,
                            num_samples=1, seed=3, eod_id=EOD, pad="eos")
    w = eos[0]
    last = w[2, :16].max()
    tail = np.flatnonzero(w[2, :16] == last)
    assert w[1, tail[-1]] == 1 and w[0, tail[-1]] == EOD and (w[2, :16] > 0).all()


def test_long_conversations_error_or_truncate(tmp_path):
    ind = IndexedDataset(make_chat(tmp_path / "c", [4, 20, 6]))
    with pytest.raises(DataError, match=r"conversation 1 .* 20 tokens, more than --seq-length 8.*--truncate"):
        PackedChatDataset(ind, 0, 3, seq_length=8, num_samples=1, seed=0, eod_id=EOD)
    ds = PackedChatDataset(ind, 0, 3, seq_length=8, num_samples=1, seed=0, eod_id=EOD, truncate=True, pad="ignore")
    cut = [c for i in range(len(ds)) for c in conversations(ds[i]).values() if c[0][0] == 110]
    assert cut[0][0] == list(110 + np.arange(8))


def test_loaders_blend_split_and_ranks_like_pretraining(tmp_path):
    tok = load_tokenizer()
    a = make_chat(tmp_path / "a_chat_document", [6] * 30, base=10)
    b = make_chat(tmp_path / "b_chat_document", [5] * 30, base=1000)
    cfg = DataConfig(data_path=["0.5", a, "0.5", b], split="90,10,0", seq_length=16, micro_batch_size=2, seed=1,
                     num_workers=0, train_samples=16, eval_samples=4, sft=True, sft_pad="ignore")
    ranks = [build_loaders(cfg, tok, dp_rank=r, dp_size=2) for r in range(2)]
    one = build_loaders(DataConfig(**{**cfg.__dict__, "micro_batch_size": 4}), tok)
    it = [iter(x.train) for x in ranks]
    batches = [next(i) for i in it]
    assert batches[0].shape == (2, 3, 17)
    # two ranks of 2 see the same windows as one rank of 4
    assert np.array_equal(np.concatenate([x.numpy() for x in batches]), next(iter(one.train)).numpy())
    sources = {"a" if int(t) % 100 >= 10 else "b" for x in batches for t in x[:, 0][x[:, 2] > 0]}
    assert sources == {"a", "b"}  # both prefixes of the blend (a's tokens end in 10..15, b's in 0..4)
    # resume: the loader state continues exactly
    state = ranks[0].train.state_dict()
    nxt = next(it[0])
    fresh = build_loaders(cfg, tok, dp_rank=0, dp_size=2)
    fresh.train.load_state_dict(state)
    assert np.array_equal(next(iter(fresh.train)).numpy(), nxt.numpy())
    # the valid split holds other conversations than train
    v = next(iter(ranks[0].valid))
    assert v.shape == (2, 3, 17)
    # chat data without --sft, and --sft on plain text: one line saying what to change
    with pytest.raises(DataError, match="add --sft"):
        build_loaders(DataConfig(**{**cfg.__dict__, "sft": False}), tok)
    with IndexedDatasetBuilder(tmp_path / "plain", np.uint16) as p:
        p.add_document(np.arange(30))
    with pytest.raises(DataError, match="preprocess --chat"):
        build_loaders(DataConfig(**{**cfg.__dict__, "data_path": [str(tmp_path / "plain")]}), tok)


def test_a_conversation_holding_the_mask_id_is_refused_naming_it(tmp_path):
    prefix = make_chat(tmp_path / "c", [5, 6, 7, 4])
    mask = 10 + 100 * 2 + 3  # token 3 of conversation 2
    ds = PackedChatDataset(IndexedDataset(prefix), 0, 4, seq_length=16, num_samples=4, seed=0, eod_id=EOD,
                           mask_token_id=mask)
    with pytest.raises(DataError, match=rf"c\.bin: conversation 2 \(counting from 0\) holds the mask token id {mask} "
                                        r"\(at its token 3\).*--mask-token"):
        for i in range(len(ds)):
            ds[i]
    plain = PackedChatDataset(IndexedDataset(prefix), 0, 4, seq_length=16, num_samples=4, seed=0, eod_id=EOD)
    clean = PackedChatDataset(IndexedDataset(prefix), 0, 4, seq_length=16, num_samples=4, seed=0, eod_id=EOD,
                              mask_token_id=1)  # an id no conversation holds: the windows as without the check
    assert all(np.array_equal(clean[i], plain[i]) for i in range(len(plain)))
