"""Loaders: data-parallel sharding, exact resume (also across dp sizes), blending, the bundled corpus."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from megadlms.data import (
    DataConfig,
    DataError,
    add_data_arguments,
    build_loaders,
    data_config_from_args,
    load_tokenizer,
)
from megadlms.data.loader import StatefulLoader

from .conftest import STRIDE


class StubTokenizer:
    """What build_loaders needs of a tokenizer: vocab size and EOD id (the synthetic corpora need no text)."""

    vocab_size = 2_000_000
    eod_id = None


TOK = StubTokenizer()


@pytest.fixture
def corpus(make_corpus):
    lengths = [int(x) for x in np.random.default_rng(0).integers(1, 90, size=400)]
    return make_corpus("corpus", lengths)


def cfg(prefix, **kw) -> DataConfig:
    base = dict(data_path=[prefix], seq_length=24, micro_batch_size=3, seed=11, num_workers=0,
                train_samples=600, eval_samples=60)
    base.update(kw)
    return DataConfig(**base)


def take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def test_batches_shape_dtype_and_position(corpus):
    loaders = build_loaders(cfg(corpus), TOK)
    b = take(loaders.train, 2)
    assert b[0].shape == (3, 25) and b[0].dtype == torch.int64
    assert loaders.train.consumed_samples == 6
    # the micro-batch is samples 0..2 of the sample order
    src = loaders.train.source
    for j in range(3):
        assert b[0][j].tolist() == src[j].tolist() and b[1][j].tolist() == src[3 + j].tolist()
    # 969,30,1 of 400 documents: 12 for valid, 0.4 rounds to none for test
    assert loaders.valid.source.doc_end - loaders.valid.source.doc_start == 12 and loaders.test is None
    assert json.loads(json.dumps(loaders.state_dict()))["train"]["consumed_samples"] == 6


def test_exact_resume_mid_epoch(corpus):
    run = build_loaders(cfg(corpus), TOK)
    it = iter(run.train)
    before = [next(it) for _ in range(5)]
    state = run.state_dict()
    after = [next(it) for _ in range(7)]
    resumed = build_loaders(cfg(corpus), TOK)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON round trip
    got = take(resumed.train, 7)
    assert all(torch.equal(a, g) for a, g in zip(after, got))
    assert not torch.equal(before[-1], got[0])
    assert resumed.train.consumed_samples == run.train.consumed_samples == 36


def global_batches(prefix, dp_size, mbs, steps, state=None):
    """Per micro-step, the concatenation of every rank's micro-batch (rank order)."""
    loaders = [build_loaders(cfg(prefix, micro_batch_size=mbs), TOK, dp_rank=r, dp_size=dp_size)
               for r in range(dp_size)]
    if state is not None:
        for lo in loaders:
            lo.load_state_dict(state)
    its = [iter(lo.train) for lo in loaders]
    out = [torch.cat([next(it) for it in its]) for _ in range(steps)]
    return out, loaders[0].state_dict()


def test_dp_ranks_take_consecutive_slices(corpus):
    (one,), _ = global_batches(corpus, 1, 8, 1)
    (two,), _ = global_batches(corpus, 2, 4, 1)
    (four,), _ = global_batches(corpus, 4, 2, 1)
    assert torch.equal(one, two) and torch.equal(one, four)
    # dp 1 with gradient accumulation sees the same samples per iteration as dp 2
    acc, _ = global_batches(corpus, 1, 4, 2)
    assert torch.equal(torch.cat(acc), two)


@pytest.mark.parametrize("new_dp, new_mbs", [(1, 4), (4, 1), (1, 2)])
def test_resume_with_another_dp_size(corpus, new_dp, new_mbs):
    reference, _ = global_batches(corpus, 1, 4, 12)  # uninterrupted, 4 samples per micro-step
    flat_ref = torch.cat(reference)
    first, state = global_batches(corpus, 2, 2, 5)  # dp 2 x mbs 2 for 5 micro-steps = 20 samples
    assert torch.equal(torch.cat(first), flat_ref[:20])
    assert state["train"]["consumed_samples"] == 20
    rest, _ = global_batches(corpus, new_dp, new_mbs, 28 // (new_dp * new_mbs), state=state)
    assert torch.equal(torch.cat(rest), flat_ref[20:48])


def test_workers_match_in_process(corpus):
    a = take(build_loaders(cfg(corpus), TOK).train, 6)
    b = take(build_loaders(cfg(corpus, num_workers=2), TOK).train, 6)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_endless_and_wraps(corpus):
    loaders = build_loaders(cfg(corpus, train_samples=0), TOK)
    train = loaders.train
    n = train.num_samples
    train.load_state_dict({"consumed_samples": n - 3})
    b = take(train, 2)
    src = train.source
    assert [r.tolist() for r in b[0]] == [src[n - 3].tolist(), src[n - 2].tolist(), src[n - 1].tolist()]
    assert [r.tolist() for r in b[1]] == [src[0].tolist(), src[1].tolist(), src[2].tolist()]


def test_stale_iterator_refuses(corpus):
    train = build_loaders(cfg(corpus), TOK).train
    it = iter(train)
    next(it)
    train.load_state_dict({"consumed_samples": 0})
    with pytest.raises(RuntimeError, match="stale"):
        next(it)


def test_close_ends_the_workers_and_a_new_iterator_goes_on(corpus):
    loaders = build_loaders(cfg(corpus, num_workers=2), TOK)
    its = [iter(loaders.train), iter(loaders.valid)]
    for it in its:
        next(it)  # the workers are running
    workers = [w for it in loaders.train._iterators for w in it._workers] + \
        [w for it in loaders.valid._iterators for w in it._workers]
    assert len(workers) == 4 and all(w.is_alive() for w in workers)
    loaders.close()
    assert not any(w.is_alive() for w in workers)  # they ignore SIGTERM: close() must not rely on it
    with pytest.raises(RuntimeError, match="stale"):
        next(its[0])
    assert torch.equal(next(iter(loaders.train)), take(build_loaders(cfg(corpus), TOK).train, 2)[1])
    loaders.close()


def test_changed_data_warns_on_resume(corpus):
    state = build_loaders(cfg(corpus), TOK).state_dict()
    other = build_loaders(cfg(corpus, seed=12), TOK)
    with pytest.warns(UserWarning, match="data differs from the checkpoint"):
        other.load_state_dict(state)


def test_splits_are_disjoint(corpus):
    loaders = build_loaders(cfg(corpus, split="80,10,10", eval_samples=200), TOK)
    docs = {}
    for name in ("train", "valid", "test"):
        lo = getattr(loaders, name)
        docs[name] = {int(t) // STRIDE for i in range(lo.num_samples) for t in lo.source[i]}
    assert docs["train"] <= set(range(320)) and docs["valid"] <= set(range(320, 360))
    assert docs["test"] <= set(range(360, 400))
    assert loaders.train.num_samples >= 600 and loaders.valid.num_samples >= 200


def test_weighted_blend_follows_weights(make_corpus):
    a = make_corpus("a", [50] * 200, base=0)
    b = make_corpus("b", [30] * 200, base=1_000_000)
    loaders = build_loaders(cfg(None, data_path=["0.2", a, "0.8", b], train_samples=2000), TOK)
    src = loaders.train.source
    from_b = sum(int(src[i][0]) >= 1_000_000 for i in range(2000))
    assert from_b == 1600
    # unweighted: proportional to tokens
    loaders = build_loaders(cfg(None, data_path=[a, b], train_samples=1000), TOK)
    from_b = sum(int(loaders.train.source[i][0]) >= 1_000_000 for i in range(1000))
    assert abs(from_b - 1000 * 30 / 80) <= 1


def test_per_split_paths(make_corpus):
    tr = make_corpus("tr", [40] * 50, base=0)
    va = make_corpus("va", [40] * 10, base=1_000_000)
    loaders = build_loaders(cfg(None, data_path=None, train_data_path=[tr], valid_data_path=[va]), TOK)
    assert loaders.test is None
    assert int(take(loaders.valid, 1)[0].min()) >= 1_000_000
    assert int(take(loaders.train, 1)[0].max()) < 1_000_000
    with pytest.raises(DataError, match="either --data-path .* or --train/valid/test-data-path"):
        DataConfig(data_path=[tr], train_data_path=[tr])


def test_missing_data_path_names_it(tmp_path):
    with pytest.raises(DataError, match=r"--data-path .*nowhere/corpus_text_document: no dataset there .*\.idx"):
        build_loaders(cfg(str(tmp_path / "nowhere" / "corpus_text_document")), TOK)
    assert not (tmp_path / "nowhere").exists()  # no cache folder made beside a path that holds nothing


def test_bad_config_values():
    with pytest.raises(DataError, match="micro_batch_size must be at least 1"):
        DataConfig(micro_batch_size=0)
    with pytest.raises(DataError, match="--split"):
        DataConfig(split="x")
    with pytest.raises(DataError, match="dp_rank 2 is outside"):
        StatefulLoader([np.zeros(3)], micro_batch_size=1, dp_rank=2, dp_size=2)


def test_args_round_trip():
    p = argparse.ArgumentParser()
    add_data_arguments(p)
    a = p.parse_args(["--data-path", "0.3", "x", "0.7", "y", "--split", "98,1,1", "--num-workers", "0",
                      "--data-cache-path", "/tmp/c", "--tokenizer-model", "tok/"])
    c = data_config_from_args(a, seq_length=128, micro_batch_size=4, seed=3, train_samples=100, eval_samples=10)
    assert c.data_path == ["0.3", "x", "0.7", "y"] and c.split == "98,1,1" and c.num_workers == 0
    assert (c.seq_length, c.micro_batch_size, c.seed, c.train_samples, c.eval_samples) == (128, 4, 3, 100, 10)
    assert c.data_cache_path == "/tmp/c" and a.tokenizer_model == "tok/" and a.tokenizer_type == "HuggingFaceTokenizer"
    d = data_config_from_args(p.parse_args([]), seq_length=8, micro_batch_size=1, seed=1, train_samples=0,
                              eval_samples=0)
    assert d.data_path is None and d.train_data_path is None and d.split == "969,30,1"


def test_bundled_corpus_default(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGADLMS_CACHE", str(tmp_path))
    tok = load_tokenizer(None)
    loaders = build_loaders(DataConfig(seq_length=64, micro_batch_size=2, num_workers=0, train_samples=100), tok)
    assert loaders.eod_id == 0 and loaders.valid is not None and loaders.test is not None
    # split 98/1/1 of 20,000 documents
    assert [getattr(loaders, n).source.doc_end - getattr(loaders, n).source.doc_start
            for n in ("train", "valid", "test")] == [19600, 200, 200]
    batch = take(loaders.train, 1)[0]
    assert batch.shape == (2, 65) and int(batch.max()) < tok.vocab_size
    text = tok.decode(batch[0].tolist())
    assert len(text) > 150 and " the " in text
    # the preprocessed corpus and the index cache both live under $MEGADLMS_CACHE
    assert any(p.name.startswith("bundled-") for p in tmp_path.iterdir())


@pytest.mark.parametrize("workers", [0, 1])
def test_the_first_micro_batch_holding_the_mask_id_stops_the_loader_in_one_line(make_corpus, workers):
    """Document 7 holds the [MASK] id: the loader yields the micro-batches before the first that holds it, then
    raises the dataset's one-line error in this process (from a worker too: not the worker's traceback)."""
    from megadlms.data.dataset import MaskTokenInDataError

    prefix = make_corpus("masked", [40] * 20)
    mask = 7 * STRIDE + 12
    samples = build_loaders(cfg(prefix), TOK).train.source
    first = next(i for i in range(len(samples)) if mask in samples[i])
    train = build_loaders(cfg(prefix, num_workers=workers, mask_token_id=mask), TOK).train
    it = iter(train)
    for _ in range(first // 3):  # the micro-batches of 3 samples before the refused one
        next(it)
    with pytest.raises(MaskTokenInDataError) as e:
        next(it)
    assert str(e.value).startswith(f"{prefix}.bin: document 7 (counting from 0) holds the mask token id {mask} "
                                   "(at its token 12)")
    assert "\n" not in str(e.value) and train.consumed_samples == first // 3 * 3
    train.close()
