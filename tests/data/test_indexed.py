"""The Megatron .bin/.idx reader and writer, against bytes written from the format spec by hand."""

from __future__ import annotations

import os
import struct
import warnings

import numpy as np
import pytest

from megadlms.data.indexed import (
    DTYPES,
    HEADER_SIZE,
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    optimal_dtype,
    read_header,
)

MAGIC = b"MMIDIDX\x00\x00"


def spec_idx(code: int, lengths: list[int], itemsize: int, doc_idx: list[int], modes: list[int] | None = None,
             version: int = 1) -> bytes:
    """An .idx written straight from the layout description, independent of the code under test."""
    pointers, p = [], 0
    for n in lengths:
        pointers.append(p)
        p += n * itemsize
    out = MAGIC + struct.pack("<Q", version) + struct.pack("<B", code)
    out += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_idx))
    out += struct.pack(f"<{len(lengths)}i", *lengths) + struct.pack(f"<{len(lengths)}q", *pointers)
    out += struct.pack(f"<{len(doc_idx)}q", *doc_idx)
    if modes is not None:
        out += struct.pack(f"<{len(modes)}b", *modes)
    return out


def write_pair(prefix, idx: bytes, bin_: bytes) -> str:
    with open(f"{prefix}.idx", "wb") as f:
        f.write(idx)
    with open(f"{prefix}.bin", "wb") as f:
        f.write(bin_)
    return str(prefix)


@pytest.fixture
def spec_pair(tmp_path):
    """uint16 tokens; 3 documents: [1 2 3], [4] + [5 6] (two sequences), and an empty one."""
    idx = spec_idx(8, [3, 1, 2], 2, [0, 1, 3, 3])
    return write_pair(tmp_path / "spec", idx, struct.pack("<6H", 1, 2, 3, 4, 5, 6))


def test_hand_written_pair_reads_back(spec_pair):
    ds = IndexedDataset(spec_pair)
    assert ds.dtype == np.uint16 and ds.dtype_code == 8
    assert len(ds) == 3 and ds.num_documents == 3 and ds.num_tokens == 6
    assert [x.tolist() for x in ds[0:3]] == [[1, 2, 3], [4], [5, 6]]
    assert ds[-1].tolist() == [5, 6]
    assert ds.get(0, offset=1, length=2).tolist() == [2, 3]
    assert ds.sequence_pointers.tolist() == [0, 6, 8]
    assert ds.document_indices.tolist() == [0, 1, 3, 3]
    assert ds.document_lengths.tolist() == [3, 3, 0]
    assert ds.document(1).tolist() == [4, 5, 6]
    assert ds.document(1, 1, 2).tolist() == [5, 6]
    assert ds.document(2).tolist() == []
    assert ds.sequence_modes is None


def test_reads_are_zero_copy_read_only_views(spec_pair):
    ds = IndexedDataset(spec_pair)
    a, b = ds[0], ds.document(1)
    assert np.shares_memory(a, ds._tokens) and np.shares_memory(b, ds._tokens)
    assert not a.flags.writeable
    with pytest.raises(ValueError):
        a[0] = 7


def test_writer_output_is_byte_identical_to_spec(tmp_path, spec_pair):
    with IndexedDatasetBuilder(tmp_path / "ours", np.uint16) as b:
        b.add_document([1, 2, 3])
        b.add_document(np.array([4, 5, 6]), lengths=[1, 2])
        b.add_document([], lengths=[])
    for ext in ("idx", "bin"):
        with open(f"{tmp_path}/ours.{ext}", "rb") as f1, open(f"{spec_pair}.{ext}", "rb") as f2:
            assert f1.read() == f2.read(), ext


def test_modes_array_detected_and_written(tmp_path):
    idx = spec_idx(4, [2, 1], 4, [0, 2], modes=[3, -1])
    p = write_pair(tmp_path / "mm", idx, struct.pack("<3i", -5, 7, 2**31 - 1))
    ds = IndexedDataset(p)
    assert ds.sequence_modes.tolist() == [3, -1]
    assert ds[0].tolist() == [-5, 7] and ds[1].tolist() == [2**31 - 1]
    assert IndexedDataset(p, multimodal=False).sequence_modes is None
    with IndexedDatasetBuilder(tmp_path / "mm2", np.int32, multimodal=True) as b:
        b.add_item([-5, 7], mode=3)
        b.add_item([2**31 - 1], mode=-1)
        b.end_document()
    assert open(tmp_path / "mm2.idx", "rb").read() == idx
    plain = write_pair(tmp_path / "nomodes", spec_idx(4, [1], 4, [0, 1]), struct.pack("<i", 1))
    with pytest.raises(IndexedDatasetError, match="no sequence modes"):
        IndexedDataset(plain, multimodal=True)


@pytest.mark.parametrize("code", sorted(DTYPES))
def test_round_trip_every_dtype(tmp_path, code):
    dtype = np.dtype(DTYPES[code])
    rng = np.random.default_rng(code)
    if dtype.kind == "f":
        docs = [rng.standard_normal(int(rng.integers(0, 9))).astype(dtype) for _ in range(12)]
        docs[0] = np.array([np.finfo(dtype).max, np.finfo(dtype).min, -0.0], dtype=dtype)
    else:
        info = np.iinfo(dtype)
        docs = [rng.integers(info.min, int(info.max) + 1, size=int(rng.integers(0, 9)), dtype=dtype)
                for _ in range(12)]
        docs[0] = np.array([info.min, info.max, 0], dtype=dtype)
    with IndexedDatasetBuilder(tmp_path / "rt", dtype) as b:
        for d in docs:
            b.add_document(d)
    assert read_header(f"{tmp_path}/rt.idx") == (1, code, 12, 13)
    ds = IndexedDataset(tmp_path / "rt")
    assert ds.dtype == dtype and len(ds) == 12
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
        assert ds[i].dtype == dtype
    # the .bin is exactly the concatenated little-endian items
    assert os.path.getsize(f"{tmp_path}/rt.bin") == sum(d.size for d in docs) * dtype.itemsize


def test_optimal_dtype_threshold():
    assert optimal_dtype(4096) == np.uint16 and optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32 and optimal_dtype(151_936) == np.int32


def test_writer_refuses_tokens_that_do_not_fit(tmp_path):
    b = IndexedDatasetBuilder(tmp_path / "x", np.uint16)
    with pytest.raises(IndexedDatasetError, match="70000 does not fit the dataset dtype uint16"):
        b.add_document([1, 70000])
    b.abort()
    with pytest.raises(IndexedDatasetError, match="cannot be stored"):
        IndexedDatasetBuilder(tmp_path / "y", np.complex64)


def test_interrupted_writer_leaves_nothing_that_looks_complete(tmp_path):
    with pytest.raises(RuntimeError), IndexedDatasetBuilder(tmp_path / "part", np.uint16) as b:
        b.add_document([1, 2, 3])
        raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == []
    # before finalize only temporary names exist
    b = IndexedDatasetBuilder(tmp_path / "open", np.uint16)
    b.add_document([1, 2])
    b._bin.flush()
    names = os.listdir(tmp_path)
    assert names and not any(n.endswith((".bin", ".idx")) for n in names)
    b.finalize()
    assert sorted(os.listdir(tmp_path)) == ["open.bin", "open.idx"]


def test_add_index_merges(tmp_path, spec_pair):
    with IndexedDatasetBuilder(tmp_path / "merged", np.uint16) as b:
        b.add_document([9, 9])
        b.add_index(spec_pair)
    ds = IndexedDataset(tmp_path / "merged")
    assert ds.document_indices.tolist() == [0, 1, 2, 4, 4]
    assert [ds.document(d).tolist() for d in range(4)] == [[9, 9], [1, 2, 3], [4, 5, 6], []]


def test_add_documents_bulk_matches_single(tmp_path):
    with IndexedDatasetBuilder(tmp_path / "bulk", np.uint16) as b:
        b.add_documents(np.array([1, 2, 3, 4, 5, 6]), [3, 1, 2], [1, 2, 0])
    with IndexedDatasetBuilder(tmp_path / "single", np.uint16) as b:
        b.add_document([1, 2, 3])
        b.add_document([4, 5, 6], lengths=[1, 2])
        b.add_document([], lengths=[])
    assert open(tmp_path / "bulk.idx", "rb").read() == open(tmp_path / "single.idx", "rb").read()
    with pytest.raises(IndexedDatasetError, match="sum to 5"):
        IndexedDatasetBuilder(tmp_path / "bad", np.uint16).add_documents([1, 2, 3], [2, 3], [2])


# ------------------------------------------------------------------ corrupt files are refused


def corrupt(spec_pair, ext, fn):
    path = f"{spec_pair}.{ext}"
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(fn(data))


@pytest.mark.parametrize("ext, fn, message", [
    ("bin", lambda d: d[:-2], r"spec\.bin is 10 bytes .* 12 bytes: the \.bin is truncated"),
    ("bin", lambda d: d[:-1], r"the \.bin is truncated"),
    ("bin", lambda d: d + b"\x00\x00", r"the \.bin is 2 bytes longer than indexed"),
    ("idx", lambda d: b"MMIDIDY\x00\x00" + d[9:], r"does not start with the indexed-dataset magic"),
    ("idx", lambda d: d[:9] + struct.pack("<Q", 2) + d[17:], r"format version 2; only version 1"),
    ("idx", lambda d: d[:17] + b"\x09" + d[18:], r"dtype code 9, outside the known codes"),
    ("idx", lambda d: d[:17] + b"\x00" + d[18:], r"dtype code 0, outside the known codes"),
    ("idx", lambda d: d[:-8], r"header counts \(3 sequences, 4 document indices\) need 102 bytes"),
    ("idx", lambda d: d[:20], r"shorter than the 34-byte \.idx header"),
    ("idx", lambda d: d[:18] + struct.pack("<Q", 4) + d[26:], r"header counts \(4 sequences"),
    ("idx", lambda d: d[:-8] + struct.pack("<q", 2), r"document indices must rise from 0 to the sequence count 3"),
    ("idx", lambda d: d[:HEADER_SIZE] + struct.pack("<i", 40) + d[HEADER_SIZE + 4:],
     r"sequence pointers fall outside .*spec\.bin \(12 bytes\)"),
])
def test_corrupt_files_are_refused(spec_pair, ext, fn, message):
    corrupt(spec_pair, ext, fn)
    with pytest.raises(IndexedDatasetError, match=message):
        IndexedDataset(spec_pair)


def test_out_of_bounds_pointer_refused(tmp_path):
    idx = bytearray(spec_idx(8, [1, 1], 2, [0, 2]))
    struct.pack_into("<q", idx, HEADER_SIZE + 8 + 8, 100)  # second pointer far past the .bin
    p = write_pair(tmp_path / "oob", bytes(idx), struct.pack("<2H", 1, 2))
    with pytest.raises(IndexedDatasetError, match="sequence pointers fall outside"):
        IndexedDataset(p)


def test_missing_files_name_the_paths(tmp_path):
    with pytest.raises(IndexedDatasetError, match=r"missing .*nothing\.idx, .*nothing\.bin"):
        IndexedDataset(tmp_path / "nothing")


def test_empty_dataset(tmp_path):
    with IndexedDatasetBuilder(tmp_path / "empty", np.uint16):
        pass
    ds = IndexedDataset(tmp_path / "empty")
    assert len(ds) == 0 and ds.num_documents == 0 and ds.num_tokens == 0


def test_pickle_reopens(spec_pair):
    import pickle

    ds = pickle.loads(pickle.dumps(IndexedDataset(spec_pair)))
    assert ds.document(1).tolist() == [4, 5, 6]


# ------------------------------------------------------------------ Megatron-LM interoperability
# Megatron's builder trips a numpy 2 DeprecationWarning of its own (torch tensor -> numpy.array copy=False).
pytestmark_megatron = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def megatron_indexed():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("megatron.core.datasets.indexed_dataset")


@pytestmark_megatron
def test_megatron_reads_ours(tmp_path, megatron_indexed):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 60000, size=int(rng.integers(1, 50)), dtype=np.uint16) for _ in range(40)]
    with IndexedDatasetBuilder(tmp_path / "ours", np.uint16) as b:
        for d in docs[:20]:
            b.add_document(d)
        for d in docs[20:]:
            b.add_document(d, lengths=[1, d.size - 1] if d.size > 1 else [1])
    m = megatron_indexed.IndexedDataset(str(tmp_path / "ours"))
    ours = IndexedDataset(tmp_path / "ours")
    assert len(m) == len(ours)
    np.testing.assert_array_equal(m.document_indices, ours.document_indices)
    np.testing.assert_array_equal(m.sequence_lengths, ours.sequence_lengths)
    for i in range(len(ours)):
        np.testing.assert_array_equal(m[i], ours[i])
    np.testing.assert_array_equal(m.get(3, offset=1, length=2), ours.get(3, offset=1, length=2))


@pytestmark_megatron
@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.float32])
def test_ours_reads_megatron(tmp_path, megatron_indexed, dtype):
    import torch

    rng = np.random.default_rng(1)
    prefix = str(tmp_path / "meg")
    b = megatron_indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    docs = []
    for i in range(30):
        d = rng.integers(0, 1000, size=int(rng.integers(1, 30))).astype(dtype)
        docs.append(d)
        if i % 3 == 0:  # a document of two sequences via add_item/end_document
            cut = d.size // 2
            b.add_item(torch.from_numpy(d[:cut].copy()))
            b.add_item(torch.from_numpy(d[cut:].copy()))
            b.end_document()
        else:
            b.add_document(torch.from_numpy(d.copy()), [d.size])
    b.finalize(prefix + ".idx")
    ours = IndexedDataset(prefix)
    assert ours.num_documents == 30 and ours.dtype == np.dtype(dtype)
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ours.document(i), d)
    # and the bytes equal what our writer produces for the same content
    with IndexedDatasetBuilder(tmp_path / "same", dtype) as w:
        for i, d in enumerate(docs):
            cut = d.size // 2
            w.add_document(d, lengths=[cut, d.size - cut] if i % 3 == 0 else None)
    for ext in ("bin", "idx"):
        assert open(f"{prefix}.{ext}", "rb").read() == open(f"{tmp_path}/same.{ext}", "rb").read(), ext


@pytestmark_megatron
def test_ours_reads_megatron_multimodal(tmp_path, megatron_indexed):
    import torch

    prefix = str(tmp_path / "mm")
    b = megatron_indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32, multimodal=True)
    b.add_item(torch.tensor([1, 2, 3]), mode=0)
    b.add_item(torch.tensor([4]), mode=1)
    b.end_document()
    b.finalize(prefix + ".idx")
    ds = IndexedDataset(prefix)
    assert ds.sequence_modes.tolist() == [0, 1]
    assert ds.document(0).tolist() == [1, 2, 3, 4]


def test_blockwise_validation_matches_whole(tmp_path, monkeypatch):
    from megadlms.data import indexed

    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 500, size=int(rng.integers(0, 12)), dtype=np.uint16) for _ in range(50)]
    with IndexedDatasetBuilder(tmp_path / "blk", np.uint16) as b:
        for d in docs:
            b.add_document(d)
    monkeypatch.setattr(indexed, "_BLOCK", 3)  # many blocks: edges between blocks are exercised
    ds = IndexedDataset(tmp_path / "blk")
    assert ds.contiguous and ds._one_seq_per_doc
    assert np.shares_memory(ds.document_lengths, ds.sequence_lengths)  # zero-copy when one sequence per doc
    assert [ds.document(i).tolist() for i in range(50)] == [d.tolist() for d in docs]
    # a decreasing document index deep inside the array is still found
    idx = bytearray(open(tmp_path / "blk.idx", "rb").read())
    off = HEADER_SIZE + 50 * 12 + 8 * 40
    struct.pack_into("<q", idx, off, 2)
    open(tmp_path / "blk.idx", "wb").write(bytes(idx))
    with pytest.raises(IndexedDatasetError, match="document indices must rise"):
        IndexedDataset(tmp_path / "blk")
