"""GPT-style samples, splits, blending and the sample-index cache."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from megadlms.data import dataset as dsmod
from megadlms.data.dataset import (
    BlendedDataset,
    DataError,
    GPTDataset,
    blending_indices,
    check_tokens,
    parse_blend,
    parse_split,
    resolve_cache_dir,
    split_ranges,
)
from megadlms.data.indexed import IndexedDataset

from .conftest import STRIDE, doc_tokens

# documents shorter and longer than a 16-token sample, empty ones included
LENGTHS = [0, 1, 3, 50, 7, 200, 2, 16, 17, 0, 33, 5, 64, 1, 9, 120, 4, 15]


def test_parse_blend():
    assert parse_blend(["data/a"]) == (["data/a"], None)
    assert parse_blend(["a", "b"]) == (["a", "b"], None)
    assert parse_blend(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    assert parse_blend(["3 a 1 b"]) == (["a", "b"], [0.75, 0.25])
    assert parse_blend(None) == ([], None)
    with pytest.raises(DataError, match="mixes weights and prefixes"):
        parse_blend(["0.3", "a", "b"])
    with pytest.raises(DataError, match="must be finite, non-negative"):
        parse_blend(["-1", "a", "2", "b"])
    with pytest.raises(DataError, match="alternates numbers oddly"):
        parse_blend(["1", "2"])


def test_parse_split_and_ranges():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_split("98/1/1") == pytest.approx([0.98, 0.01, 0.01])
    assert parse_split("1") == [1.0, 0.0, 0.0]
    for bad in ("a,b", "0,0,0", "1,2,3,4", "-1,2"):
        with pytest.raises(DataError, match="--split"):
            parse_split(bad)
    assert split_ranges(1000, parse_split("969,30,1")) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges(10, parse_split("98,1,1")) == [(0, 10), (10, 10), (10, 10)]
    # Megatron's rounding: the surplus is taken off every boundary after the first
    assert split_ranges(7, [0.5, 0.5, 0.0]) == [(0, 3), (3, 7), (7, 7)]


@pytest.fixture
def corpus(make_corpus):
    return IndexedDataset(make_corpus("c", LENGTHS))


def stream_of(ds: GPTDataset) -> np.ndarray:
    return np.concatenate([ds.indexed.document(int(d)) for d in ds.doc_index]).astype(np.int64)


@pytest.mark.parametrize("seq_length, num_samples", [(16, 0), (16, 300), (5, 40), (64, 10), (400, 3)])
def test_samples_are_windows_of_the_shuffled_stream(corpus, tmp_path, seq_length, num_samples):
    ds = GPTDataset(corpus, 0, len(LENGTHS), seq_length=seq_length, num_samples=num_samples, seed=7,
                    cache_dir=tmp_path / "cache")
    T, L, n = sum(LENGTHS), seq_length, len(LENGTHS)
    E = ds.num_epochs
    assert len(ds) >= max(num_samples, 1) and len(ds) == -(-E * T // L)
    # every epoch of the document order is a permutation of the documents
    for e in range(len(ds.doc_index) // n):
        assert sorted(ds.doc_index[e * n:(e + 1) * n].tolist()) == list(range(n))
    stream = stream_of(ds)
    shuffle = np.asarray(ds.shuffle_index)
    assert sorted(shuffle.tolist()) == list(range(len(ds)))
    for i in range(len(ds)):
        s = int(shuffle[i])
        np.testing.assert_array_equal(ds[i], stream[s * L:s * L + L + 1])
        assert (s * L) // T == (i * L) // T  # shuffled only within the epoch the sample starts in
    assert ds[0].dtype == np.int64 and ds[len(ds)].tolist() == ds[0].tolist()  # wraps


def test_one_epoch_covers_every_token_once(corpus, tmp_path):
    L, T = 16, sum(LENGTHS)
    ds = GPTDataset(corpus, 0, len(LENGTHS), seq_length=L, num_samples=0, seed=3, cache_dir=tmp_path)
    assert ds.num_epochs == 1 and len(ds) == -(-T // L)
    # sample inputs (without the token shared with the next sample), put back in stream order
    in_stream_order = np.argsort(np.asarray(ds.shuffle_index))
    inputs = np.concatenate([ds[i][:-1] for i in in_stream_order])
    every_token = np.concatenate([doc_tokens(d, n) for d, n in enumerate(LENGTHS)])
    np.testing.assert_array_equal(np.sort(inputs[:T]), np.sort(every_token))
    # the last sample runs on into the next epoch's first document instead of being dropped
    assert len(inputs) - T == len(ds) * L - T < L


def test_seed_and_determinism(corpus, tmp_path):
    a = GPTDataset(corpus, 0, len(LENGTHS), seq_length=16, num_samples=100, seed=1, cache_dir=tmp_path / "a")
    b = GPTDataset(corpus, 0, len(LENGTHS), seq_length=16, num_samples=100, seed=1, cache_dir=tmp_path / "b")
    c = GPTDataset(corpus, 0, len(LENGTHS), seq_length=16, num_samples=100, seed=2, cache_dir=tmp_path / "a")
    assert all(np.array_equal(a[i], b[i]) for i in range(len(a)))
    assert not np.array_equal(np.asarray(a.doc_index), np.asarray(c.doc_index))
    # different epochs are shuffled differently
    n = len(LENGTHS)
    assert not np.array_equal(np.asarray(a.doc_index[:n]), np.asarray(a.doc_index[n:2 * n]))


def test_more_epochs_keep_earlier_samples(corpus, tmp_path):
    small = GPTDataset(corpus, 0, len(LENGTHS), seq_length=16, num_samples=50, seed=5, cache_dir=tmp_path)
    big = GPTDataset(corpus, 0, len(LENGTHS), seq_length=16, num_samples=700, seed=5, cache_dir=tmp_path)
    assert big.num_epochs > small.num_epochs and small.order_key == big.order_key and small.key != big.key
    for i in range(len(small)):
        np.testing.assert_array_equal(small[i], big[i])


def test_index_is_cached_on_disk(corpus, tmp_path, monkeypatch):
    first = GPTDataset(corpus, 0, len(LENGTHS), seq_length=16, num_samples=80, seed=9, cache_dir=tmp_path / "cache")
    files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(files) == 4 and all(f.startswith(f"c-train-{first.key[:24]}") for f in files)
    desc = json.loads((tmp_path / "cache" / f"{first.cache_stem}.json").read_text())
    assert desc["seq_length"] == 16 and desc["seed"] == 9 and desc["samples"] == len(first)

    def no_build(self, lengths):
        raise AssertionError("the cached index should have been loaded")

    monkeypatch.setattr(GPTDataset, "_build", no_build)
    again = GPTDataset(corpus, 0, len(LENGTHS), seq_length=16, num_samples=80, seed=9, cache_dir=tmp_path / "cache")
    assert isinstance(again.shuffle_index, np.memmap)
    assert all(np.array_equal(first[i], again[i]) for i in range(len(first)))
    with pytest.raises(AssertionError, match="cached index"):  # anything that changes the order rebuilds
        GPTDataset(corpus, 0, len(LENGTHS), seq_length=17, num_samples=80, seed=9, cache_dir=tmp_path / "cache")


def test_pickle_reopens_from_cache(corpus, tmp_path):
    ds = GPTDataset(corpus, 0, len(LENGTHS), seq_length=16, num_samples=20, seed=9, cache_dir=tmp_path)
    blob = pickle.dumps(ds)
    assert len(blob) < 4000  # no arrays inside
    back = pickle.loads(blob)
    assert all(np.array_equal(ds[i], back[i]) for i in range(len(ds)))


def test_splits_do_not_overlap(make_corpus, tmp_path):
    lengths = [int(x) for x in np.random.default_rng(0).integers(1, 60, size=300)]
    corpus = IndexedDataset(make_corpus("split", lengths))
    ranges = split_ranges(corpus.num_documents, parse_split("80,15,5"))
    assert ranges == [(0, 240), (240, 285), (285, 300)]
    docs_seen = []
    for name, (a, b) in zip(("train", "valid", "test"), ranges):
        ds = GPTDataset(corpus, a, b, seq_length=32, num_samples=500, seed=1, cache_dir=tmp_path, name=name)
        docs = {int(t) // STRIDE for i in range(len(ds)) for t in ds[i]}
        assert docs <= set(range(a, b))
        docs_seen.append(docs)
    assert not (docs_seen[0] & docs_seen[1]) and not (docs_seen[0] & docs_seen[2]) and not (docs_seen[1] & docs_seen[2])
    assert docs_seen[0] == set(range(240))  # every training document is used


def test_empty_range_and_bad_settings(corpus, tmp_path):
    with pytest.raises(DataError, match="hold no tokens"):
        GPTDataset(corpus, 0, 1, seq_length=16, num_samples=1, seed=1, cache_dir=tmp_path)
    with pytest.raises(DataError, match=r"document range \[3, 3\) is empty"):
        GPTDataset(corpus, 3, 3, seq_length=16, num_samples=1, seed=1, cache_dir=tmp_path)
    with pytest.raises(DataError, match="seq_length must be positive"):
        GPTDataset(corpus, 0, 5, seq_length=0, num_samples=1, seed=1, cache_dir=tmp_path)


def megatron_reference(weights, size):
    """Megatron's build_blending_indices (helpers.cpp), transcribed directly."""
    current = [0] * len(weights)
    di, si = [], []
    for sample_idx in range(size):
        x = max(float(sample_idx), 1.0)
        best, best_err = 0, weights[0] * x - current[0]
        for d in range(1, len(weights)):
            err = weights[d] * x - current[d]
            if err > best_err:
                best, best_err = d, err
        di.append(best)
        si.append(current[best])
        current[best] += 1
    return di, si


@pytest.mark.parametrize("weights", [[0.5, 0.5], [0.3, 0.7], [0.2, 0.3, 0.5], [0.05, 0.9, 0.04, 0.01],
                                     [1 / 3, 1 / 3, 1 / 3]])
def test_blending_follows_megatron_and_weights(weights):
    size = 5000
    di, si = blending_indices(weights, size)
    ref_di, ref_si = megatron_reference(weights, size)
    assert di.tolist() == ref_di and si.tolist() == ref_si
    # every prefix holds each dataset within two samples of its weight (1.3 at worst for these weights)
    counts = np.cumsum(np.eye(len(weights), dtype=np.int64)[di], axis=0)
    expected = np.arange(1, size + 1)[:, None] * np.asarray(weights)[None, :]
    assert np.abs(counts - expected).max() < 2.0
    np.testing.assert_allclose(counts[-1], np.asarray(weights) * size, atol=1.0)


def test_blended_dataset(make_corpus, tmp_path):
    a = IndexedDataset(make_corpus("a", [40] * 30, base=0))
    b = IndexedDataset(make_corpus("b", [25] * 30, base=1_000_000))
    ga = GPTDataset(a, 0, 30, seq_length=8, num_samples=400, seed=1, cache_dir=tmp_path)
    gb = GPTDataset(b, 0, 30, seq_length=8, num_samples=400, seed=1, cache_dir=tmp_path)
    blend = BlendedDataset([ga, gb], [0.25, 0.75], 1000, cache_dir=tmp_path)
    from_b = sum(int(blend[i][0]) >= 1_000_000 for i in range(1000))
    assert from_b == 750
    for i in range(50):
        child = [ga, gb][int(blend.dataset_index[i])]
        np.testing.assert_array_equal(blend[i], child[int(blend.dataset_sample_index[i])])
    assert blend[1000].tolist() == blend[0].tolist()
    back = pickle.loads(pickle.dumps(blend))
    assert back[7].tolist() == blend[7].tolist()
    assert BlendedDataset([ga, gb], [0.25, 0.75], 3000, cache_dir=tmp_path).order_key == blend.order_key


def test_check_tokens(make_corpus, tmp_path):
    ds = IndexedDataset(make_corpus("v", [5, 5]))
    with pytest.raises(DataError, match="token id 1004, outside the tokenizer's vocabulary of 1000"):
        check_tokens(ds, 1000, 0)
    with pytest.warns(UserWarning, match="do not end with the EOD token 7"):
        check_tokens(ds, 5000, 7)
    check_tokens(ds, 5000, 1004)  # ends with "EOD": fine


def test_cache_dir_resolution(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGADLMS_CACHE", str(tmp_path / "user"))
    assert resolve_cache_dir(None, str(tmp_path / "data" / "x_text_document")) == tmp_path / "data" / "cache"
    (tmp_path / "afile").write_text("")
    # beside the data is impossible (a file is in the way): the user cache is used
    assert resolve_cache_dir(None, str(tmp_path / "afile" / "sub" / "p")) == tmp_path / "user" / "index-cache"
    assert resolve_cache_dir(tmp_path / "explicit", None) == tmp_path / "explicit"
    with pytest.raises(DataError, match="--data-cache-path .* is not a writable folder"):
        resolve_cache_dir(tmp_path / "afile" / "x", None)
    assert dsmod.user_cache_dir() == tmp_path / "user"


@pytest.mark.parametrize("seq_length", [16, 5, 400])
def test_a_sample_holding_the_mask_id_is_refused_naming_the_file_and_document(corpus, tmp_path, seq_length):
    """Token 30 of document 5 is the [MASK] id: every sample holding it (and only those) is refused with one line
    naming the .bin file, the document and the fix; the other samples are as without the check."""
    mask = doc_tokens(5, 200)[30]
    plain = GPTDataset(corpus, 0, len(LENGTHS), seq_length=seq_length, num_samples=200, seed=4, cache_dir=tmp_path)
    checked = GPTDataset(corpus, 0, len(LENGTHS), seq_length=seq_length, num_samples=200, seed=4,
                         cache_dir=tmp_path, mask_token_id=int(mask))
    refused = 0
    for i in range(len(plain)):
        sample = plain[i]
        if mask not in sample:
            assert np.array_equal(checked[i], sample)
            continue
        refused += 1
        with pytest.raises(dsmod.MaskTokenInDataError) as e:
            checked[i]
        assert str(e.value).startswith(f"{corpus.prefix}.bin: document 5 (counting from 0) holds the mask token id "
                                       f"{mask} (at its token 30)")
        assert "--mask-token" in str(e.value) and "re-tokenize" in str(e.value) and "\n" not in str(e.value)
    assert refused >= 1
