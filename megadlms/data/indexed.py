"""Megatron indexed dataset: the `.bin`/`.idx` pair that preprocessed LM corpora are stored in.

Layout (little-endian), byte-compatible with Megatron-LM's `IndexedDataset` / `IndexedDatasetBuilder`:

    .bin  token ids of every sequence, concatenated (dtype from the .idx)
    .idx  b"MMIDIDX\\x00\\x00"  u64 version (=1)  u8 dtype code  u64 sequence_count  u64 document_count
          int32[sequence_count]  sequence lengths (tokens)
          int64[sequence_count]  sequence pointers (byte offsets into .bin)
          int64[document_count]  document indices: document d = sequences [di[d], di[d+1]); di[0] = 0
          int8[sequence_count]   sequence modes (optional; multimodal datasets only)

Dtype codes: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16.

Reads are memory-mapped and zero-copy: a sequence or document is a read-only numpy view into the .bin.
Every file is checked against its header (magic, version, dtype code, counts vs. file sizes, pointer
bounds) before use, so a truncated or mismatched pair is refused instead of being read as garbage.
The writer streams into temporary files and renames them only in `finalize`.
"""

from __future__ import annotations

import array
import os
import secrets
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import MegaDLMsError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count

DTYPES: dict[int, type[np.number]] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                                      6: np.float64, 7: np.float32, 8: np.uint16}
DTYPE_CODES: dict[np.dtype, int] = {np.dtype(t): c for c, t in DTYPES.items()}

PathLike = str | os.PathLike
_BLOCK = 1 << 22  # elements per block when validating large indices


def _blockwise_all(check, n: int) -> bool:
    """check(lo, hi) over overlapping blocks [lo, hi) of range(n) (neighbours compared across block edges)."""
    return all(check(lo, min(n, lo + _BLOCK + 1)) for lo in range(0, max(n - 1, 1), _BLOCK))


class IndexedDatasetError(MegaDLMsError, ValueError):
    """An indexed dataset file is missing, corrupt, or inconsistent; the message says which file and why."""


def bin_path(prefix: PathLike) -> str:
    """`{prefix}.bin`: the token data file."""
    return f"{os.fspath(prefix)}.bin"


def idx_path(prefix: PathLike) -> str:
    """`{prefix}.idx`: the index file."""
    return f"{os.fspath(prefix)}.idx"


def dataset_exists(prefix: PathLike) -> bool:
    """True when both `{prefix}.idx` and `{prefix}.bin` exist."""
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


def optimal_dtype(vocab_size: int) -> np.dtype:
    """Token dtype for a vocabulary: uint16 if vocab_size < 65500 else int32 (Megatron's rule)."""
    if vocab_size <= 0:
        raise IndexedDatasetError(f"vocab_size must be positive, got {vocab_size}")
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def dtype_code(dtype: Any) -> int:
    """The .idx code of a numpy dtype; raises naming the supported dtypes."""
    dt = np.dtype(dtype)
    code = DTYPE_CODES.get(dt.newbyteorder("=") if dt.byteorder == ">" else dt)
    if code is None:
        names = ", ".join(f"{np.dtype(t).name}" for t in DTYPES.values())
        raise IndexedDatasetError(f"dtype {dt} cannot be stored in an indexed dataset; use one of: {names}")
    return code


def read_header(path: PathLike) -> tuple[int, int, int, int]:
    """(version, dtype_code, sequence_count, document_count) of an .idx file, validated."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        head = f.read(HEADER_SIZE)
    if len(head) < HEADER_SIZE:
        raise IndexedDatasetError(f"{path} is {len(head)} bytes, shorter than the {HEADER_SIZE}-byte .idx header: "
                                  "the file is truncated; re-run preprocessing")
    if head[:9] != MAGIC:
        raise IndexedDatasetError(f"{path} does not start with the indexed-dataset magic {MAGIC!r} (found "
                                  f"{head[:9]!r}): not a Megatron .idx file (or an old, unsupported format)")
    version, code, seqs, docs = struct.unpack("<QBQQ", head[9:])
    if version != VERSION:
        raise IndexedDatasetError(f"{path} has format version {version}; only version {VERSION} is supported")
    if code not in DTYPES:
        raise IndexedDatasetError(f"{path} has dtype code {code}, outside the known codes "
                                  f"{sorted(DTYPES)} ({', '.join(np.dtype(t).name for t in DTYPES.values())}): "
                                  "the file is corrupt")
    return version, code, seqs, docs


class IndexedDataset:
    """Memory-mapped reader of `{prefix}.idx` / `{prefix}.bin`.

    `ds[i]` is sequence i (a read-only 1-D numpy view of dtype `ds.dtype`); `ds[a:b]` a list of views;
    `ds.get(i, offset, length)` part of one; `ds.document(d, offset, length)` the tokens of document d
    (its sequences joined; a view whenever they are contiguous in the .bin, which is always the case for
    files written by `IndexedDatasetBuilder` or Megatron). `multimodal=None` reads the modes array when
    the .idx has one (detected from its size); True requires it; False ignores it.
    """

    def __init__(self, prefix: PathLike, *, multimodal: bool | None = None) -> None:
        self.prefix = os.fspath(prefix)
        self._multimodal_arg = multimodal
        ipath, bpath = idx_path(self.prefix), bin_path(self.prefix)
        missing = [p for p in (ipath, bpath) if not os.path.isfile(p)]
        if missing:
            raise IndexedDatasetError(
                f"indexed dataset {self.prefix!r} not found: missing {', '.join(missing)}. A data path is the "
                "prefix without .bin/.idx, e.g. data/corpus_text_document for data/corpus_text_document.bin")
        _, code, seqs, docs = read_header(ipath)
        self.dtype_code = code
        self.dtype = np.dtype(DTYPES[code]).newbyteorder("<")
        itemsize = self.dtype.itemsize

        base = HEADER_SIZE + seqs * 4 + seqs * 8 + docs * 8
        isize = os.path.getsize(ipath)
        if isize == base:
            has_modes = False
        elif isize == base + seqs:
            has_modes = True
        else:
            raise IndexedDatasetError(
                f"{ipath} is {isize} bytes but its header counts ({seqs} sequences, {docs} document indices) need "
                f"{base} bytes (or {base + seqs} with a modes array): the .idx is truncated or corrupt")
        if multimodal and not has_modes:
            raise IndexedDatasetError(f"{ipath} has no sequence modes array, but multimodal=True was requested")
        if docs < 1:
            raise IndexedDatasetError(f"{ipath} has document_count 0; it must be at least 1 (the leading 0)")

        # The whole .idx is mapped once; the arrays are views into it.
        imap = np.memmap(ipath, dtype=np.uint8, mode="r")
        off = HEADER_SIZE
        self.sequence_lengths = imap[off:off + 4 * seqs].view("<i4")
        off += 4 * seqs
        self.sequence_pointers = imap[off:off + 8 * seqs].view("<i8")
        off += 8 * seqs
        self.document_indices = imap[off:off + 8 * docs].view("<i8")
        off += 8 * docs
        self.sequence_modes = imap[off:off + seqs].view(np.int8) if has_modes and multimodal is not False else None

        di = self.document_indices
        rising = _blockwise_all(lambda lo, hi: bool(np.all(di[lo + 1:hi] >= di[lo:hi - 1])), docs)
        if di[0] != 0 or di[-1] != seqs or not rising:
            raise IndexedDatasetError(
                f"{ipath}: document indices must rise from 0 to the sequence count {seqs}; found first "
                f"{int(di[0])}, last {int(di[-1])}: the .idx is corrupt")
        # One sequence per document (preprocessed text): di == arange and document lengths are a view.
        self._one_seq_per_doc = docs - 1 == seqs and _blockwise_all(
            lambda lo, hi: bool(np.all(di[lo + 1:hi] - di[lo:hi - 1] == 1)), docs)

        bsize = os.path.getsize(bpath)
        if bsize % itemsize:
            raise IndexedDatasetError(f"{bpath} is {bsize} bytes, not a multiple of the {itemsize}-byte "
                                      f"{self.dtype.name} item size: the .bin is truncated")
        # Lengths and pointers, checked block by block (bounded memory for corpora of any size).
        lengths, ptr = self.sequence_lengths, self.sequence_pointers
        total, min_length, contiguous, in_bounds = 0, 0, True, True
        for lo in range(0, seqs, _BLOCK):
            hi = min(seqs, lo + _BLOCK)
            nbytes = lengths[lo:hi].astype(np.int64) * itemsize
            p = ptr[lo:hi]
            min_length = min(min_length, int(nbytes.min()) // itemsize)
            expected = np.empty(hi - lo, dtype=np.int64)
            expected[0] = 0
            np.cumsum(nbytes[:-1], out=expected[1:])
            contiguous = contiguous and bool(np.array_equal(p, expected + total))
            in_bounds = in_bounds and int(p.min()) >= 0 and not np.any(p % itemsize) \
                and int((p + nbytes).max()) <= bsize
            total += int(nbytes.sum())
        if min_length < 0:
            raise IndexedDatasetError(f"{ipath}: negative sequence length {min_length}: the .idx is corrupt")
        if contiguous and bsize != total:  # the usual layout: the .bin must hold exactly the indexed tokens
            what = "truncated" if bsize < total else f"{bsize - total} bytes longer than indexed"
            raise IndexedDatasetError(
                f"{bpath} is {bsize} bytes but {ipath} indexes {total // itemsize} tokens of {self.dtype.name} "
                f"= {total} bytes: the .bin is {what}; the pair comes from different or interrupted runs, "
                "re-run preprocessing")
        if not in_bounds:
            raise IndexedDatasetError(
                f"{ipath}: sequence pointers fall outside {bpath} ({bsize} bytes) or are not multiples of the "
                f"{itemsize}-byte item size: the pair is corrupt or mismatched")
        self.contiguous = contiguous
        # Zero-length files cannot be mapped; an empty array stands in for them.
        self._tokens = (np.memmap(bpath, dtype=self.dtype, mode="r").view(np.ndarray) if bsize
                        else np.empty(0, dtype=self.dtype))
        self._doc_lengths: np.ndarray | None = None

    # --- pickling (DataLoader workers with spawn): reopen the maps instead of copying them ---
    def __getstate__(self) -> dict:
        return {"prefix": self.prefix, "multimodal": self._multimodal_arg}

    def __setstate__(self, state: dict) -> None:
        IndexedDataset.__init__(self, state["prefix"], multimodal=state["multimodal"])

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, idx: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(f"slices of an indexed dataset must be contiguous (step 1), got step {step}")
            return [self.get(i) for i in range(start, stop)]
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset+length) of sequence `idx` as a read-only view; shape [length]."""
        n = len(self)
        i = int(idx)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sequence index {idx} out of range for {n} sequences in {self.prefix!r}")
        size = int(self.sequence_lengths[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence {i} of length {size}")
        s = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        return self._tokens[s:s + length]

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    @property
    def document_lengths(self) -> np.ndarray:
        """[num_documents] tokens per document (0 for a document without sequences); a zero-copy int32 view
        of the sequence lengths when every document is one sequence, else int64."""
        if self._one_seq_per_doc:
            return self.sequence_lengths
        if self._doc_lengths is None:
            cum = np.zeros(len(self) + 1, dtype=np.int64)
            np.cumsum(self.sequence_lengths, out=cum[1:])
            self._doc_lengths = cum[self.document_indices[1:]] - cum[self.document_indices[:-1]]
        return self._doc_lengths

    def document(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset+length) of document `doc` (its sequences joined); shape [length]."""
        d = int(doc)
        if not 0 <= d < self.num_documents:
            raise IndexError(f"document index {doc} out of range for {self.num_documents} documents")
        first, last = int(self.document_indices[d]), int(self.document_indices[d + 1])
        total = int(self.document_lengths[d])
        if length is None:
            length = total - offset
        if offset < 0 or length < 0 or offset + length > total:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for document {d} of length {total}")
        if last - first == 1 or self.contiguous:
            if last == first:
                return self._tokens[:0]
            s = int(self.sequence_pointers[first]) // self.dtype.itemsize + offset
            return self._tokens[s:s + length]
        return np.concatenate([self.get(i) for i in range(first, last)])[offset:offset + length]

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.prefix!r}, dtype={self.dtype.name}, sequences={len(self)}, "
                f"documents={self.num_documents}, tokens={self.num_tokens})")


class IndexedDatasetBuilder:
    """Writer of `{prefix}.bin` / `{prefix}.idx`, streaming tokens to temporary files.

    Nothing named `{prefix}.bin`/`.idx` exists until `finalize()` renames the finished files into place
    (the .bin first, then the .idx, after removing any stale .idx), so an interrupted run never leaves a
    pair that looks complete. Used as a context manager it finalizes on success and deletes its temporary
    files on an exception.

        with IndexedDatasetBuilder("out/corpus_text_document", np.uint16) as b:
            b.add_document(ids)              # one sequence = one document
            b.add_item(s1); b.add_item(s2); b.end_document()   # a document of two sequences
    """

    def __init__(self, prefix: PathLike, dtype: Any = np.int32, *, multimodal: bool = False) -> None:
        self.prefix = os.fspath(prefix)
        self.dtype_code = dtype_code(dtype)
        self.dtype = np.dtype(DTYPES[self.dtype_code])
        self.multimodal = multimodal
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        tag = f".tmp-{os.getpid()}-{secrets.token_hex(4)}"
        self._bin_tmp, self._idx_tmp = bin_path(self.prefix) + tag, idx_path(self.prefix) + tag
        self._bin = open(self._bin_tmp, "wb", buffering=1 << 20)  # noqa: SIM115 - closed in finalize/abort
        self._lengths = array.array("i")
        self._doc_idx = array.array("q", [0])
        self._modes = array.array("b") if multimodal else None
        self._done = False
        self._lo: int | None = None  # the integer dtype's range, for the fit check of _as_tokens
        self._hi: int | None = None
        if self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            self._lo, self._hi = int(info.min), int(info.max)

    def _as_tokens(self, tokens: Any) -> np.ndarray:
        a = np.asarray(tokens)  # numpy arrays, lists and CPU torch tensors alike
        if a.ndim != 1:
            raise IndexedDatasetError(f"a sequence must be 1-D, got shape {a.shape}")
        if a.dtype != self.dtype:
            if self._lo is not None and self._hi is not None and a.size and a.dtype.kind in "iub":
                lo, hi = int(a.min()), int(a.max())
                if lo < self._lo or hi > self._hi:
                    raise IndexedDatasetError(
                        f"token value {hi if hi > self._hi else lo} does not fit the dataset dtype {self.dtype.name} "
                        f"[{self._lo}, {self._hi}]; build with a wider dtype (e.g. optimal_dtype(vocab_size))")
            a = a.astype(self.dtype)
        return np.ascontiguousarray(a)

    def add_item(self, tokens: Any, mode: int = 0) -> None:
        """Append one sequence (1-D array-like or tensor of token ids) to the current document."""
        self._check_open()
        a = self._as_tokens(tokens)
        if a.size > np.iinfo(np.int32).max:
            raise IndexedDatasetError(f"a sequence of {a.size} tokens exceeds the int32 length field; split it")
        self._bin.write(a.data.cast("B"))
        self._lengths.append(a.size)
        if self._modes is not None:
            self._modes.append(mode)

    def end_document(self) -> None:
        """Close the current document (the sequences added since the last `end_document`)."""
        self._check_open()
        self._doc_idx.append(len(self._lengths))

    def add_document(self, tokens: Any, lengths: Sequence[int] | None = None,
                     modes: Sequence[int] | None = None) -> None:
        """Append a whole document: `tokens` split into sequences of `lengths` (default: one sequence)."""
        self._check_open()
        a = self._as_tokens(tokens)
        lengths = [a.size] if lengths is None else [int(x) for x in lengths]
        if sum(lengths) != a.size or any(x < 0 for x in lengths):
            raise IndexedDatasetError(f"sequence lengths {lengths} do not partition the {a.size} document tokens")
        if modes is not None and len(modes) != len(lengths):
            raise IndexedDatasetError(f"{len(modes)} modes given for {len(lengths)} sequences")
        self._bin.write(a.data.cast("B"))
        self._lengths.extend(lengths)
        if self._modes is not None:
            self._modes.extend(modes if modes is not None else [0] * len(lengths))
        self._doc_idx.append(len(self._lengths))

    def add_documents(self, tokens: Any, sequence_lengths: Any, sequences_per_document: Any) -> None:
        """Append many documents at once: `tokens` [sum(sequence_lengths)] holds every sequence back to back,
        `sequences_per_document` [num_docs] says how many consecutive sequences form each document."""
        self._check_open()
        a = self._as_tokens(tokens)
        lengths = np.asarray(sequence_lengths, dtype=np.int64)
        per_doc = np.asarray(sequences_per_document, dtype=np.int64)
        if int(lengths.sum()) != a.size or (lengths.size and int(lengths.min()) < 0):
            raise IndexedDatasetError(f"sequence lengths sum to {int(lengths.sum())}, not the {a.size} tokens given")
        if int(per_doc.sum()) != lengths.size or (per_doc.size and int(per_doc.min()) < 0):
            raise IndexedDatasetError(f"sequences_per_document sums to {int(per_doc.sum())}, not the "
                                      f"{lengths.size} sequences given")
        if self._modes is not None:
            raise IndexedDatasetError("add_documents has no modes; use add_document/add_item for multimodal data")
        self._bin.write(a.data.cast("B"))
        base = len(self._lengths)
        self._lengths.frombytes(lengths.astype(np.int32).tobytes())
        self._doc_idx.frombytes((np.cumsum(per_doc) + base).astype(np.int64).tobytes())

    def add_index(self, prefix: PathLike) -> None:
        """Append every document of an existing dataset of the same dtype (Megatron's merge)."""
        self._check_open()
        other = IndexedDataset(prefix, multimodal=True if self.multimodal else False)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(f"cannot merge {other.prefix!r} of dtype {other.dtype.name} into a "
                                      f"{self.dtype.name} dataset; re-tokenize it or build with {other.dtype.name}")
        base = len(self._lengths)
        for i in range(len(other)):
            self._bin.write(np.ascontiguousarray(other[i]).data.cast("B"))
        self._lengths.extend(other.sequence_lengths.tolist())
        self._doc_idx.extend((other.document_indices[1:] + base).tolist())
        if self._modes is not None:
            assert other.sequence_modes is not None  # opened with multimodal=True: it has modes, or raised
            self._modes.extend(other.sequence_modes.tolist())

    @property
    def num_documents(self) -> int:
        return len(self._doc_idx) - 1

    def finalize(self) -> None:
        """Write the .idx and move both files into place."""
        self._check_open()
        if self._doc_idx[-1] != len(self._lengths):
            self.end_document()  # sequences added with add_item but not closed form the last document
        try:
            self._bin.flush()
            os.fsync(self._bin.fileno())
            self._bin.close()
            lengths = np.frombuffer(self._lengths, dtype=np.int32) if self._lengths else np.empty(0, np.int32)
            pointers = np.zeros(len(lengths), dtype=np.int64)
            if len(lengths) > 1:
                np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
            with open(self._idx_tmp, "wb") as f:
                f.write(MAGIC)
                f.write(struct.pack("<QBQQ", VERSION, self.dtype_code, len(lengths), len(self._doc_idx)))
                f.write(lengths.astype("<i4").tobytes())
                f.write(pointers.astype("<i8").tobytes())
                f.write(np.frombuffer(self._doc_idx, dtype=np.int64).astype("<i8").tobytes())
                if self._modes is not None:
                    f.write(np.frombuffer(self._modes, dtype=np.int8).tobytes() if self._modes else b"")
                f.flush()
                os.fsync(f.fileno())
            # A stale .idx must never pair with the new .bin, even for an instant.
            if os.path.exists(idx_path(self.prefix)):
                os.remove(idx_path(self.prefix))
            os.replace(self._bin_tmp, bin_path(self.prefix))
            os.replace(self._idx_tmp, idx_path(self.prefix))
        except BaseException:
            self.abort()
            raise
        self._done = True

    def abort(self) -> None:
        """Close and delete the temporary files; nothing is left at the output prefix."""
        if not self._bin.closed:
            self._bin.close()
        for p in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(p):
                os.remove(p)
        self._done = True

    def _check_open(self) -> None:
        if self._done:
            raise IndexedDatasetError(f"the builder for {self.prefix!r} is already finalized or aborted")

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._done:
            return
        if exc_type is None:
            self.finalize()
        else:
            self.abort()

    def __del__(self) -> None:
        # A builder dropped without finalize (e.g. the process is shutting down) leaves no temp files.
        try:
            if not self._done:
                self.abort()
        except Exception:
            pass
