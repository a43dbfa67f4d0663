"""GPT-style training samples over indexed datasets: splits, per-epoch shuffling, blending, cached indices.

A `GPTDataset` views a contiguous document range of an `IndexedDataset` as one token stream: the
documents of epoch e in an order shuffled by a seeded RNG, epochs back to back. Sample i is the
`seq_length + 1` tokens starting at stream position `i * seq_length` (consecutive samples share one token,
as in Megatron, so inputs and shifted targets both fit); samples span document boundaries, and a sample
starting in the last epoch runs on into the next epoch's documents. Samples are shuffled within the
epoch they start in. Everything is a pure function of
(document lengths, document range, seq_length, seed, epochs), built with numpy and cached on disk under a
hash of exactly those inputs. Extending the number of epochs leaves earlier epochs unchanged.

A `BlendedDataset` interleaves several datasets by weight with Megatron's rule: sample n goes to the dataset
with the largest `weight_i * n - count_i` (first on ties).

The diffusion [MASK] id must never be a token of the data (under SUBS its logit is minus infinity: a target equal
to it makes the loss infinite, and the step is skipped until the run stops as "diverged"). A dataset given
`mask_token_id` refuses a sample holding it with `MaskTokenInDataError`, naming the file, the document and the
fix. The check runs here, on the host, as each sample is read (in the loader's worker processes): a numpy compare
of the tokens the sample already holds, with no device sync, and only here are the file and document known; a
check on the device per batch would cost a sync per step and could name neither.
"""

from __future__ import annotations

import array
import hashlib
import json
import math
import os
import re
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from ..errors import MegaDLMsError
from .indexed import IndexedDataset, bin_path

INDEX_VERSION = "megadlms-gpt-index-v1"


class DataError(MegaDLMsError, ValueError):
    """Invalid data settings or files; the message names the value and the fix."""


class MaskTokenInDataError(DataError):
    """A sample holds the diffusion [MASK] id; the message names the file, the document and the fix."""


def mask_token_error(prefix: str, doc: int, position: int, mask_token_id: int, what: str = "document"
                     ) -> MaskTokenInDataError:
    """The error for token `position` of document `doc` of dataset `prefix` being the [MASK] id."""
    return MaskTokenInDataError(
        f"{bin_path(prefix)}: {what} {doc} (counting from 0) holds the mask token id {mask_token_id} (at its token "
        f"{position}), which "
        "a masked-diffusion model cannot be trained or scored on: re-tokenize the data without it (`megadlms "
        "preprocess` refuses such documents), or choose a mask token the data never holds (--mask-token ID)")


def find_token(tokens: np.ndarray, token: int | None) -> int | None:
    """The first position of `token` in `tokens`, or None (also when `token` is None)."""
    if token is None:
        return None
    hits = np.flatnonzero(tokens == token)
    return int(hits[0]) if hits.size else None


# --------------------------------------------------------------------------- parsing


def parse_blend(tokens: Sequence[str] | str | None) -> tuple[list[str], list[float] | None]:
    """Megatron's `--data-path` forms -> (prefixes, weights or None).

    `["p1"]`, `["p1", "p2"]` (unweighted) or `["w1", "p1", "w2", "p2"]` (weights normalized to sum 1).
    Entries holding spaces are split, so `["0.3 p1 0.7 p2"]` works as typed in a config file."""
    if tokens is None:
        return [], None
    if isinstance(tokens, str):
        tokens = [tokens]
    flat = [t for item in tokens for t in str(item).split()]
    if not flat:
        return [], None

    def number(t: str) -> float | None:
        try:
            return float(t)
        except ValueError:
            return None

    if len(flat) % 2 == 0 and all(number(flat[i]) is not None for i in range(0, len(flat), 2)):
        weights = [float(flat[i]) for i in range(0, len(flat), 2)]
        prefixes = flat[1::2]
        if any(number(p) is not None for p in prefixes):
            raise DataError(f"data path {flat} alternates numbers oddly; write 'w1 prefix1 w2 prefix2 ...'")
        if any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
            raise DataError(f"blend weights {weights} must be finite, non-negative and not all zero")
        total = sum(weights)
        return prefixes, [w / total for w in weights]
    bad = [t for t in flat if number(t) is not None]
    if bad:
        raise DataError(f"data path {flat} mixes weights and prefixes: {bad[0]!r} looks like a weight; use either "
                        "'prefix1 prefix2 ...' or 'w1 prefix1 w2 prefix2 ...'")
    return flat, None


def parse_split(split: str) -> list[float]:
    """'969,30,1' (or '98/1/1', '0.9,0.1') -> normalized [train, valid, test] fractions."""
    parts = [p for p in re.split(r"[,/ ]+", str(split).strip()) if p]
    try:
        values = [float(p) for p in parts]
    except ValueError as e:
        raise DataError(f"--split {split!r} is not a list of numbers; write e.g. 969,30,1") from e
    if not 1 <= len(values) <= 3 or any(v < 0 or not math.isfinite(v) for v in values) or sum(values) <= 0:
        raise DataError(f"--split {split!r} needs 1-3 non-negative numbers that are not all zero, e.g. 969,30,1")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return [v / total for v in values]


def split_ranges(num_documents: int, fractions: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous [start, end) document ranges, one per fraction (Megatron's rounding)."""
    bounds = [0]
    for f in fractions:
        bounds.append(bounds[-1] + int(round(f * float(num_documents))))
    diff = bounds[-1] - num_documents
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(len(fractions))]


# --------------------------------------------------------------------------- cache


def _writable_dir(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
        return True
    except OSError:
        return False


def user_cache_dir() -> Path:
    """$MEGADLMS_CACHE, else ~/.cache/megadlms."""
    env = os.environ.get("MEGADLMS_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "megadlms"


def resolve_cache_dir(data_cache_path: str | os.PathLike | None, first_prefix: str | None) -> Path:
    """Where sample indices go: `data_cache_path` if given (must be writable); else a `cache` folder beside
    the first data prefix; else (not writable) the user cache dir."""
    if data_cache_path is not None:
        p = Path(data_cache_path).expanduser()
        if not _writable_dir(p):
            raise DataError(f"--data-cache-path {str(p)!r} is not a writable folder; pass another or omit it")
        return p
    if first_prefix is not None:
        beside = Path(first_prefix).expanduser().resolve().parent / "cache"
        if _writable_dir(beside):
            return beside
    p = user_cache_dir() / "index-cache"
    if not _writable_dir(p):
        raise DataError(f"no writable cache folder: tried beside the data and {str(p)!r}; set --data-cache-path")
    return p


def _save_npy(path: Path, arr: np.ndarray) -> None:
    # Written to a unique temp name then renamed: concurrent ranks building the same index are safe.
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        with open(tmp, "wb") as f:
            np.save(f, arr)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _load_cached(cache_dir: Path, stem: str, names: Sequence[str]) -> list[np.ndarray] | None:
    paths = [cache_dir / f"{stem}-{n}.npy" for n in names]
    if not all(p.is_file() for p in paths):
        return None
    try:
        return [np.load(p, mmap_mode="r") for p in paths]
    except (OSError, ValueError):
        return None  # a damaged cache entry is rebuilt


def _save_cached(cache_dir: Path, stem: str, arrays: dict[str, np.ndarray], description: dict) -> None:
    cache_dir.mkdir(parents=True, exist_ok=True)
    for name, arr in arrays.items():
        _save_npy(cache_dir / f"{stem}-{name}.npy", arr)
    (cache_dir / f"{stem}.json").write_text(json.dumps(description, indent=2) + "\n")


def _hash(obj: dict, *buffers: np.ndarray) -> str:
    h = hashlib.sha256(json.dumps(obj, sort_keys=True).encode())
    for b in buffers:
        a = np.ascontiguousarray(b)
        h.update(a.dtype.str.encode())
        h.update(a.data.cast("B"))  # no copy of (possibly huge) memory-mapped arrays
    return h.hexdigest()


def _permutation(n: int, seed: int, *stream: int) -> np.ndarray:
    """A permutation of range(n) from PCG64 raw output (stable across numpy versions, unlike
    Generator.permutation): argsort of n random 64-bit keys."""
    keys = np.random.PCG64(np.random.SeedSequence([seed, *stream])).random_raw(n)
    return np.argsort(keys, kind="stable")


# --------------------------------------------------------------------------- GPT samples


class GPTDataset:
    """Samples of `seq_length + 1` tokens over documents [doc_start, doc_end) of `indexed`.

    `len(ds)` = samples in the cached index (covers at least `num_samples`, at least one epoch);
    `ds[i]` -> int64 array [seq_length + 1] (i is taken modulo len(ds)); `MaskTokenInDataError` when it holds
    `mask_token_id` (None: not checked; see the module docstring).
    """

    def __init__(self, indexed: IndexedDataset, doc_start: int, doc_end: int, *, seq_length: int,
                 num_samples: int, seed: int, cache_dir: str | os.PathLike, name: str = "train",
                 mask_token_id: int | None = None) -> None:
        if seq_length < 1:
            raise DataError(f"seq_length must be positive, got {seq_length}")
        if not 0 <= doc_start < doc_end <= indexed.num_documents:
            raise DataError(f"document range [{doc_start}, {doc_end}) is empty or outside the "
                            f"{indexed.num_documents} documents of {indexed.prefix!r}")
        self.indexed, self.doc_start, self.doc_end = indexed, doc_start, doc_end
        self.seq_length, self.seed, self.name = seq_length, seed, name
        self.mask_token_id = mask_token_id
        self.cache_dir = Path(cache_dir)
        lengths = indexed.document_lengths[doc_start:doc_end]
        self.tokens_per_epoch = int(lengths.sum(dtype=np.int64))
        if self.tokens_per_epoch == 0:
            raise DataError(f"documents [{doc_start}, {doc_end}) of {indexed.prefix!r} ({name}) hold no tokens")
        # Samples are those starting in epochs 0..E-1: n(E) = ceil(E*T / L) >= num_samples (at least one).
        need = max(int(num_samples), 1)
        self.num_epochs = max(1, math.ceil(need * seq_length / self.tokens_per_epoch))
        # order_key identifies the sample order, which does not depend on the number of epochs (epoch e is
        # built the same way whatever comes after it); key (the cache entry) adds the epoch count.
        self.order_key = _hash({"v": INDEX_VERSION, "seq_length": seq_length, "seed": seed,
                                "doc_start": doc_start, "doc_end": doc_end}, lengths)
        self.key = _hash({"order": self.order_key, "epochs": self.num_epochs})
        stem = f"{Path(indexed.prefix).name}-{name}-{self.key[:24]}"
        names = ("doc", "sample", "shuffle")
        arrays = _load_cached(self.cache_dir, stem, names)
        if arrays is None:
            built = self._build(lengths)
            _save_cached(self.cache_dir, stem, dict(zip(names, built)), {
                "version": INDEX_VERSION, "prefix": os.path.abspath(indexed.prefix), "split": name,
                "documents": [doc_start, doc_end], "seq_length": seq_length, "seed": seed,
                "epochs": self.num_epochs, "tokens_per_epoch": self.tokens_per_epoch,
                "samples": int(len(built[2])), "key": self.key})
            arrays = _load_cached(self.cache_dir, stem, names) or list(built)
        self.doc_index, self.sample_index, self.shuffle_index = arrays
        self.cache_stem = stem

    def _build(self, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n_docs, L, T, E = len(lengths), self.seq_length, self.tokens_per_epoch, self.num_epochs
        # The stream runs X epochs past E so that every sample starting in epoch E-1 is complete: then each
        # epoch holds the same samples whatever E is, and extending E leaves earlier epochs unchanged.
        X = math.ceil((L + 1) / T)
        n = -(-E * T // L)  # samples: those starting before stream position E*T
        wide = (E + X) * n_docs >= 2**31 or self.doc_end >= 2**31 or int(lengths.max()) >= 2**31
        idx_dtype = np.int64 if wide else np.int32
        doc_index = np.empty((E + X) * n_docs, dtype=idx_dtype)
        # Boundary b (0..n) is stream position b*L; sample i runs from boundary i to boundary i+1 inclusive.
        # Stored as (position in doc_index, token offset in that document); built one epoch at a time.
        sample_index = np.empty((n + 1, 2), dtype=idx_dtype)
        for e in range(E + X):
            order = _permutation(n_docs, self.seed, 0, e)
            doc_index[e * n_docs:(e + 1) * n_docs] = order + self.doc_start
            lo, hi = -(-e * T // L), min(n, -(-(e + 1) * T // L) - 1)  # boundaries inside epoch e
            if lo > hi:
                continue
            epoch_lengths = lengths[order].astype(np.int64)
            ends = np.cumsum(epoch_lengths)
            pos = np.arange(lo, hi + 1, dtype=np.int64) * L - e * T
            where = np.searchsorted(ends, pos, side="right")  # the document holding that token
            sample_index[lo:hi + 1, 0] = where + e * n_docs
            sample_index[lo:hi + 1, 1] = pos - (ends[where] - epoch_lengths[where])
        # Shuffle samples within the epoch their first token belongs to: [ceil(eT/L), ceil((e+1)T/L)).
        shuffle = np.empty(n, dtype=np.int32 if n < 2**31 else np.int64)
        for e in range(E):
            lo, hi = -(-e * T // L), min(n, -(-(e + 1) * T // L))
            shuffle[lo:hi] = lo + _permutation(hi - lo, self.seed, 1, e)
        return doc_index, sample_index, shuffle

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def __getitem__(self, i: int) -> np.ndarray:
        j = int(self.shuffle_index[int(i) % len(self.shuffle_index)])
        k0, o0 = (int(x) for x in self.sample_index[j])
        k1, o1 = (int(x) for x in self.sample_index[j + 1])
        # (document, first token, tokens) of each piece of the sample
        if k0 == k1:
            pieces = [(int(self.doc_index[k0]), o0, o1 - o0 + 1)]
        else:
            lengths = self.indexed.document_lengths
            pieces = [(int(self.doc_index[k0]), o0, int(lengths[self.doc_index[k0]]) - o0)]
            pieces += [(int(self.doc_index[k]), 0, int(lengths[self.doc_index[k]])) for k in range(k0 + 1, k1)]
            pieces.append((int(self.doc_index[k1]), 0, o1 + 1))
        parts = [self.indexed.document(d, o, n) for d, o, n in pieces]
        if self.mask_token_id is not None:
            for (d, o, _), part in zip(pieces, parts):
                at = find_token(part, self.mask_token_id)
                if at is not None:
                    raise mask_token_error(self.indexed.prefix, d, o + at, self.mask_token_id)
        out = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return out.astype(np.int64)

    # Pickled for spawn-started DataLoader workers: reopen by path, the cached index is reused.
    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        for k in ("doc_index", "sample_index", "shuffle_index"):
            d[k] = None
        return d

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        arrays = _load_cached(self.cache_dir, self.cache_stem, ("doc", "sample", "shuffle"))
        if arrays is None:
            raise DataError(f"sample index {self.cache_stem} vanished from {self.cache_dir}; rebuild the loaders")
        self.doc_index, self.sample_index, self.shuffle_index = arrays

    def __repr__(self) -> str:
        return (f"GPTDataset({self.indexed.prefix!r}, {self.name}, docs=[{self.doc_start}, {self.doc_end}), "
                f"samples={len(self)}, epochs={self.num_epochs}, seq_length={self.seq_length})")


# --------------------------------------------------------------------------- blending


def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's blending: for n in 0..size-1 pick the dataset i with the largest weights[i]*max(n,1) -
    count_i (the first on ties). Returns (dataset_index int16 [size], dataset_sample_index int64 [size])."""
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    chosen = array.array("h", bytes(2 * size))
    others = range(1, len(w))
    # A plain loop (~0.4 us per sample): the greedy choice depends on every earlier choice. Cached on disk.
    for n in range(size):
        x = n if n > 1 else 1.0
        best, best_err = 0, w[0] * x - counts[0]
        for i in others:
            err = w[i] * x - counts[i]
            if err > best_err:
                best, best_err = i, err
        chosen[n] = best
        counts[best] += 1
    dataset_index = np.frombuffer(chosen, dtype=np.int16).copy()
    # The k-th pick of dataset i takes its sample k: a per-dataset running count, vectorised.
    sample_index = np.empty(size, dtype=np.int64)
    for i in range(len(w)):
        mask = dataset_index == i
        sample_index[mask] = np.arange(int(mask.sum()), dtype=np.int64)
    return dataset_index, sample_index


class BlendPart(Protocol):
    """What a blend reads of each dataset in it (GPTDataset and PackedChatDataset both are)."""

    order_key: str
    key: str
    cache_stem: str

    def __len__(self) -> int: ...
    def __getitem__(self, i: int) -> np.ndarray: ...


class BlendedDataset:
    """`size` samples drawn from `datasets` by `weights` (Megatron's rule); `ds[i]` wraps modulo size."""

    def __init__(self, datasets: Sequence[BlendPart], weights: Sequence[float], size: int, *,
                 cache_dir: str | os.PathLike, name: str = "train") -> None:
        if len(datasets) != len(weights) or not datasets:
            raise DataError(f"{len(datasets)} datasets but {len(weights)} weights")
        if size < 1:
            raise DataError(f"blended dataset size must be positive, got {size}")
        self.datasets, self.weights, self.size = list(datasets), [float(w) for w in weights], int(size)
        self.cache_dir = Path(cache_dir)
        # The greedy sequence does not depend on size either, so order_key leaves it out.
        self.order_key = _hash({"v": INDEX_VERSION, "blend": [d.order_key for d in self.datasets],
                                "weights": [repr(w) for w in self.weights]})
        self.key = _hash({"v": INDEX_VERSION, "blend": [d.key for d in self.datasets],
                          "weights": [repr(w) for w in self.weights], "size": self.size})
        self.cache_stem = f"blend-{name}-{self.key[:24]}"
        arrays = _load_cached(self.cache_dir, self.cache_stem, ("dataset", "sample"))
        if arrays is None:
            di, si = blending_indices(self.weights, self.size)
            _save_cached(self.cache_dir, self.cache_stem, {"dataset": di, "sample": si}, {
                "version": INDEX_VERSION, "split": name, "size": self.size, "weights": self.weights,
                "datasets": [d.cache_stem for d in self.datasets], "key": self.key})
            arrays = _load_cached(self.cache_dir, self.cache_stem, ("dataset", "sample")) or [di, si]
        self.dataset_index, self.dataset_sample_index = arrays

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> np.ndarray:
        i = int(i) % self.size
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]

    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        d["dataset_index"] = d["dataset_sample_index"] = None
        return d

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        arrays = _load_cached(self.cache_dir, self.cache_stem, ("dataset", "sample"))
        if arrays is None:
            raise DataError(f"blend index {self.cache_stem} vanished from {self.cache_dir}; rebuild the loaders")
        self.dataset_index, self.dataset_sample_index = arrays


def check_tokens(indexed: IndexedDataset, vocab_size: int, eod_id: int | None, *, probe: int = 64) -> None:
    """Cheap consistency checks of a dataset against the tokenizer, on the first and last `probe` documents:
    token ids must be < vocab_size (else: a different tokenizer made the data); warn when documents do not
    end with EOD (preprocessed without --append-eod: packed documents would run together)."""
    n = indexed.num_documents
    docs = sorted(set(range(min(probe, n))) | set(range(max(0, n - probe), n)))
    seen = [indexed.document(d) for d in docs if indexed.document_lengths[d] > 0]
    if not seen:
        return
    top = max(int(s.max()) for s in seen)
    if top >= vocab_size or min(int(s.min()) for s in seen) < 0:
        raise DataError(f"{indexed.prefix!r} holds token id {top}, outside the tokenizer's vocabulary of "
                        f"{vocab_size}: it was preprocessed with a different tokenizer; pass that tokenizer "
                        "(--tokenizer-model) or re-run preprocessing")
    if eod_id is not None and not any(int(s[-1]) == eod_id for s in seen):
        warnings.warn(f"documents of {indexed.prefix!r} do not end with the EOD token {eod_id} (preprocessed "
                      "without --append-eod?): documents packed into one sample will run together", stacklevel=2)
