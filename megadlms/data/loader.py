"""Resumable, data-parallel micro-batch loaders over the (blended, shuffled) sample order.

The only state is the global `consumed_samples`. Global micro-step k covers samples
[consumed + k*mbs*dp, consumed + (k+1)*mbs*dp) of the sample order and data-parallel rank r takes the slice
[r*mbs, (r+1)*mbs) of it (Megatron's MegatronPretrainingSampler). So the samples one training iteration sees
do not depend on dp_size for a fixed global batch, and a checkpoint written with any dp_size resumes
exactly with any other.
"""

from __future__ import annotations

import atexit
import multiprocessing.util  # noqa: F401  (its exit handler is registered before this module's)
import os
import signal
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from .dataset import (
    BlendedDataset,
    DataError,
    GPTDataset,
    check_tokens,
    parse_blend,
    parse_split,
    resolve_cache_dir,
    split_ranges,
    user_cache_dir,
)
from .indexed import IndexedDataset, bin_path, dataset_exists, idx_path
from .sft import SFT_PADS, PackedChatDataset, is_chat_dataset
from .tokenizer import Tokenizer

DEFAULT_SPLIT = "969,30,1"
BUNDLED_SPLIT = "98,1,1"  # the bundled corpus is small: give valid/test 1% each unless --split is set
_BLEND_MARGIN = 1.005  # per-dataset oversampling in a blend (Megatron's), so no dataset wraps early
SPLIT_NAMES = ("train", "valid", "test")


class SampleSource(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, i: int) -> np.ndarray: ...


@dataclass
class DataConfig:
    """Training data settings (Megatron flag names). `data_path=None` and no per-split paths: the bundled
    demo corpus, tokenized on first use into $MEGADLMS_CACHE (default ~/.cache/megadlms) and split 98/1/1
    (or by `split` when it is not the default)."""

    data_path: list[str] | None = None  # prefixes or "w1 p1 w2 p2" tokens as typed on the CLI
    split: str = DEFAULT_SPLIT
    train_data_path: list[str] | None = None
    valid_data_path: list[str] | None = None
    test_data_path: list[str] | None = None
    data_cache_path: str | None = None
    seq_length: int = 256
    micro_batch_size: int = 8
    seed: int = 1234
    num_workers: int = 2
    train_samples: int = 0  # samples the whole training run will consume (train_iters * global_batch)
    eval_samples: int = 0  # samples per valid/test pass budget (eval_iters * global_batch * number of evals)
    sft: bool = False  # chat datasets packed into windows with loss masks (megadlms.data.sft)
    sft_pad: str = "eos"  # eos: pad with EOD and train on it; ignore: pads carry no loss and are not attended
    truncate: bool = False  # SFT: cut conversations longer than seq_length instead of refusing them
    # diffusion objectives: the [MASK] id, which no sample may hold (the first that does stops the loader, naming
    # the file and document: megadlms.data.dataset); None: not checked (an autoregressive run)
    mask_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("seq_length", "micro_batch_size"):
            if int(getattr(self, name)) < 1:
                raise DataError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("num_workers", "train_samples", "eval_samples"):
            if int(getattr(self, name)) < 0:
                raise DataError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
            v = getattr(self, name)
            if isinstance(v, (str, os.PathLike)):
                setattr(self, name, [os.fspath(v)])
        per_split = any(getattr(self, f"{s}_data_path") for s in SPLIT_NAMES)
        if self.data_path and per_split:
            raise DataError("give either --data-path (split by --split) or --train/valid/test-data-path, not both")
        parse_split(self.split)  # validate early
        if self.sft_pad not in SFT_PADS:
            raise DataError(f"--sft-pad {self.sft_pad!r} is not one of {list(SFT_PADS)}")
        if self.sft and not (self.data_path or per_split):
            raise DataError("--sft needs chat data: pass --data-path PREFIX_chat_document (made by "
                            "`megadlms preprocess --chat`); the bundled corpus is plain text")


@dataclass
class _RefusedBatch:
    """What a worker returns for a micro-batch its dataset refused (a DataError): the loader raises `error` in the
    training process, where it is one line, not the worker's traceback that DataLoader would re-raise."""

    error: DataError


class _MicroBatches(Dataset):
    """Indexed by a list of sample positions; returns the stacked micro-batch (int64 [len, seq_length+1])."""

    def __init__(self, source: SampleSource) -> None:
        self.source = source

    def __getitem__(self, positions: list[int]) -> torch.Tensor | _RefusedBatch:
        try:
            return torch.from_numpy(np.stack([self.source[p] for p in positions]))
        except DataError as e:  # e.g. the [MASK] id in a sample: raised by the loader's iterator
            return _RefusedBatch(e)


class _RankPositions(Sampler):
    """Endless: for micro-step k from `start`, this rank's positions [base + r*mbs, base + (r+1)*mbs)."""

    def __init__(self, start: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> None:
        self.start, self.mbs, self.rank, self.dp = start, micro_batch_size, dp_rank, dp_size

    def __iter__(self) -> Iterator[list[int]]:
        base = self.start + self.rank * self.mbs
        while True:
            yield list(range(base, base + self.mbs))
            base += self.mbs * self.dp


def _leave_stop_signals_to_the_trainer(worker_id: int) -> None:
    """DataLoader workers ignore SIGINT, SIGTERM and SIGUSR1: a terminal's Ctrl-C and a scheduler's preemption notice
    reach the whole process group, and the training process, which finishes its step and saves first, decides when
    they end (a worker whose parent died exits by itself). So SIGTERM cannot stop them: `stop_workers` asks them to
    end and kills what is left."""
    for name in ("SIGINT", "SIGTERM", "SIGUSR1"):
        sig = getattr(signal, name, None)
        if sig is not None:
            signal.signal(sig, signal.SIG_IGN)


# DataLoader iterators whose worker processes may still run; stopped at interpreter exit (`_stop_all_workers`)
_WITH_WORKERS: weakref.WeakSet = weakref.WeakSet()
_KILL_WAIT_S = 2.0


def stop_workers(it: object) -> None:
    """End the worker processes of DataLoader iterator `it` (a no-op without workers or when they have ended):
    torch's shutdown (an end marker to each worker, a short join), then SIGKILL for any worker still alive, since
    the workers ignore the SIGTERM that torch and multiprocessing end them with."""
    workers = list(getattr(it, "_workers", ()))
    shutdown = getattr(it, "_shutdown_workers", None)
    if shutdown is not None:
        try:
            shutdown()
        except Exception:  # a worker that died mid-shutdown: kill what is left below
            pass
    for w in workers:
        if w.is_alive():
            w.kill()
    for w in workers:
        w.join(timeout=_KILL_WAIT_S)
    _WITH_WORKERS.discard(it)


def _stop_all_workers() -> None:
    """At interpreter exit, before multiprocessing's handler, which SIGTERMs daemonic children and then joins them
    without a timeout: workers that ignore SIGTERM would keep the process from ever exiting (an exception that
    leaves a loader's iterator referenced from its traceback, say). atexit runs handlers last-registered first, so
    this one runs before multiprocessing's (imported above) and torch's DataLoader handler."""
    for it in list(_WITH_WORKERS):
        stop_workers(it)


atexit.register(_stop_all_workers)


class StatefulLoader:
    """Endless iterator of micro-batches for one data-parallel rank; checkpoint with state_dict().

    `iter(loader)` yields int64 tensors [micro_batch_size, seq_length + 1] ([micro_batch_size, 3, seq_length + 1]
    for packed SFT windows: tokens, loss mask, segment ids) (pinned when CUDA is available);
    each `next` advances the global `consumed_samples` by micro_batch_size * dp_size. A new `iter()`
    (or one after `load_state_dict`) starts at `consumed_samples`; older iterators stop working.
    Sample positions wrap around `num_samples` (one pass over the cached index), looping epochs forever.
    `close()` ends the worker processes of its iterators (`--num-workers`); a later `iter()` starts new ones.
    """

    def __init__(self, source: SampleSource, *, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 num_workers: int = 0, name: str = "train", fingerprint: str = "",
                 pin_memory: bool | None = None) -> None:
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank {dp_rank} is outside [0, dp_size={dp_size})")
        self.source, self.micro_batch_size, self.dp_rank, self.dp_size = source, micro_batch_size, dp_rank, dp_size
        self.num_workers, self.name, self.fingerprint = num_workers, name, fingerprint
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.consumed_samples = 0
        self._generation = 0
        self._iterators: weakref.WeakSet = weakref.WeakSet()  # this loader's DataLoader iterators with workers

    @property
    def num_samples(self) -> int:
        """Samples in one pass of the sample order before it wraps."""
        return len(self.source)

    @property
    def global_micro_batch(self) -> int:
        return self.micro_batch_size * self.dp_size

    def __iter__(self) -> Iterator[torch.Tensor]:
        self._generation += 1
        generation = self._generation
        sampler = _RankPositions(self.consumed_samples, self.micro_batch_size, self.dp_rank, self.dp_size)
        loader = DataLoader(_MicroBatches(self.source), sampler=sampler, batch_size=None,
                            num_workers=self.num_workers, pin_memory=self.pin_memory,
                            prefetch_factor=2 if self.num_workers > 0 else None,
                            worker_init_fn=_leave_stop_signals_to_the_trainer if self.num_workers > 0 else None)
        it = iter(loader)
        if self.num_workers > 0:
            self._iterators.add(it)
            _WITH_WORKERS.add(it)
        return self._run(it, generation)

    def _run(self, it: Iterator[torch.Tensor], generation: int) -> Iterator[torch.Tensor]:
        while True:
            if generation != self._generation:
                raise RuntimeError(f"this {self.name} iterator is stale: iter(), load_state_dict() or close() was "
                                   "called since it was made; use the newest iterator")
            batch = next(it)
            if isinstance(batch, _RefusedBatch):
                raise batch.error
            self.consumed_samples += self.global_micro_batch
            yield batch

    def close(self) -> None:
        """End the worker processes of every iterator made so far (which then refuse, as stale ones do)."""
        self._generation += 1
        for it in list(self._iterators):
            stop_workers(it)
        self._iterators = weakref.WeakSet()

    def state_dict(self) -> dict:
        """Plain ints/strs: consumed_samples (global) plus what identifies the sample order."""
        return {"consumed_samples": int(self.consumed_samples), "name": self.name,
                "fingerprint": self.fingerprint, "micro_batch_size": int(self.micro_batch_size),
                "dp_size": int(self.dp_size)}

    def load_state_dict(self, state: dict) -> None:
        """Restore the position; the next iter() continues exactly there (any micro_batch_size / dp_size)."""
        if "consumed_samples" not in state:
            raise DataError(f"loader state {sorted(state)} has no 'consumed_samples'")
        consumed = int(state["consumed_samples"])
        if consumed < 0:
            raise DataError(f"consumed_samples must be >= 0, got {consumed}")
        fp = state.get("fingerprint")
        if fp and self.fingerprint and fp != self.fingerprint:
            warnings.warn(f"the {self.name} data differs from the checkpoint's (data files, split, seq_length, "
                          "seed or weights changed): resuming at the same sample count, but not the same samples",
                          stacklevel=2)
        self.consumed_samples = consumed
        self._generation += 1


@dataclass
class Loaders:
    """The train / valid / test loaders (None where a split has no documents) and the EOD id."""

    train: StatefulLoader | None
    valid: StatefulLoader | None
    test: StatefulLoader | None
    eod_id: int | None = None

    def state_dict(self) -> dict:
        return {n: getattr(self, n).state_dict() for n in SPLIT_NAMES if getattr(self, n) is not None}

    def load_state_dict(self, state: dict) -> None:
        for n in SPLIT_NAMES:
            if getattr(self, n) is not None and n in state:
                getattr(self, n).load_state_dict(state[n])

    def close(self) -> None:
        """End the data-loading worker processes of every split (at the end of a run, and when it fails)."""
        for n in SPLIT_NAMES:
            if getattr(self, n) is not None:
                getattr(self, n).close()


def check_data_paths(prefixes: list[str], flag: str = "--data-path") -> None:
    """Raise a one-line DataError naming the first of `prefixes` without its .bin/.idx pair, with the fix for the
    usual causes (a glob, a file name with its extension, an unexpanded ~). Looks only: creates nothing, so a
    wrong path leaves no cache folder behind."""
    for prefix in prefixes:
        if dataset_exists(prefix):
            continue
        missing = " and ".join(p for p in (bin_path(prefix), idx_path(prefix)) if not os.path.isfile(p))
        if prefix.endswith((".bin", ".idx")) and dataset_exists(prefix[:-4]):
            fix = f"a data path is the prefix without .bin/.idx: {flag} {prefix[:-4]}"
        elif prefix.startswith("~") and dataset_exists(os.path.expanduser(prefix)):
            fix = f"~ was not expanded (quoted, or in a config file): {flag} {os.path.expanduser(prefix)}"
        elif any(c in prefix for c in "*?["):
            fix = ("a data path is the prefix of the .bin/.idx pair, so a shell pattern in it matches no file: "
                   "write the prefix out" + ("" if flag != "--data-path" else ", or omit --data-path for the "
                                             "bundled demo corpus"))
        else:
            fix = ("pass the prefix of `megadlms preprocess` output, e.g. data/corpus_text_document for "
                   "data/corpus_text_document.bin/.idx")
        raise DataError(f"{flag} {prefix}: no dataset there ({missing} not found); {fix}")


def _open(prefix: str, tokenizer: Tokenizer, opened: dict[str, IndexedDataset], sft: bool = False
          ) -> IndexedDataset:
    if prefix not in opened:
        chat = is_chat_dataset(prefix)
        if chat and not sft:
            raise DataError(f"{prefix!r} is a chat dataset (loss masks beside it): add --sft to fine-tune on it")
        if sft and not chat:
            raise DataError(f"--sft needs chat datasets but {prefix!r} has no loss masks beside it; preprocess it "
                            "with `megadlms preprocess --chat`, or drop --sft to pre-train on it")
        ds = IndexedDataset(prefix)
        check_tokens(ds, tokenizer.vocab_size, None if sft else tokenizer.eod_id)
        opened[prefix] = ds
    return opened[prefix]


def _build_source(parts: list[tuple[IndexedDataset, int, int, float]], num_samples: int, cfg: DataConfig,
                  cache_dir: Path, name: str, eod_id: int) -> tuple[SampleSource, str] | None:
    """One dataset or a blend of (indexed, doc_start, doc_end, weight); None when no part has documents."""
    parts = [p for p in parts if p[2] > p[1] and p[3] > 0 and int(p[0].document_lengths[p[1]:p[2]].sum()) > 0]
    if not parts:
        return None
    def child(ds: IndexedDataset, a: int, b: int, n: int) -> PackedChatDataset | GPTDataset:
        if cfg.sft:
            return PackedChatDataset(ds, a, b, seq_length=cfg.seq_length, num_samples=n, seed=cfg.seed,
                                     eod_id=eod_id, pad=cfg.sft_pad, truncate=cfg.truncate, name=name,
                                     mask_token_id=cfg.mask_token_id)
        return GPTDataset(ds, a, b, seq_length=cfg.seq_length, num_samples=n, seed=cfg.seed,
                          cache_dir=cache_dir, name=name, mask_token_id=cfg.mask_token_id)
    if len(parts) == 1:
        ds, a, b, _ = parts[0]
        g = child(ds, a, b, num_samples)
        return g, g.order_key
    total = sum(p[3] for p in parts)
    weights = [p[3] / total for p in parts]
    children = [child(ds, a, b, int(np.ceil(w * num_samples * _BLEND_MARGIN)) + 1 if num_samples else 0)
                for (ds, a, b, _), w in zip(parts, weights)]
    size = num_samples if num_samples else sum(len(c) for c in children)
    blend = BlendedDataset(children, weights, size, cache_dir=cache_dir, name=name)
    return blend, blend.order_key


def build_loaders(cfg: DataConfig, tokenizer: Tokenizer, *, dp_rank: int = 0, dp_size: int = 1,
                  require_train: bool = True) -> Loaders:
    """Build the train / valid / test loaders for data-parallel rank `dp_rank` of `dp_size`.

    Sources: `cfg.data_path` (one prefix, several, or 'w1 p1 w2 p2 ...') split into contiguous document ranges
    by `cfg.split`; or `cfg.{train,valid,test}_data_path` used whole; or, with neither, the bundled demo
    corpus. Train covers `cfg.train_samples` samples, valid/test `cfg.eval_samples` (0: one epoch); all
    three loop forever. A prefix without its files raises naming it, before any folder is made; so does an empty
    train split unless `require_train` is False (evaluation reads only the validation split)."""
    if not 0 <= dp_rank < dp_size:
        raise DataError(f"dp_rank {dp_rank} is outside [0, dp_size={dp_size})")
    opened: dict[str, IndexedDataset] = {}
    budgets = {"train": cfg.train_samples, "valid": cfg.eval_samples, "test": cfg.eval_samples}
    per_split = {n: getattr(cfg, f"{n}_data_path") for n in SPLIT_NAMES}
    plans: dict[str, list[tuple[IndexedDataset, int, int, float]]] = {}
    for n in SPLIT_NAMES:  # before any cache folder is made beside them
        check_data_paths(parse_blend(per_split[n])[0], f"--{n}-data-path")
    check_data_paths(parse_blend(cfg.data_path)[0])
    if any(per_split.values()):
        first = next(parse_blend(v)[0][0] for v in per_split.values() if v and parse_blend(v)[0])
        cache_dir = resolve_cache_dir(cfg.data_cache_path, first)
        for n in SPLIT_NAMES:
            prefixes, weights = parse_blend(per_split[n])
            opened_n = [_open(p, tokenizer, opened, cfg.sft) for p in prefixes]
            weights = weights or [float(d.num_tokens) for d in opened_n]
            plans[n] = [(d, 0, d.num_documents, w) for d, w in zip(opened_n, weights)]
    else:
        if cfg.data_path:
            prefixes, weights = parse_blend(cfg.data_path)
            split = cfg.split
            cache_dir = resolve_cache_dir(cfg.data_cache_path, prefixes[0])
        else:
            from .preprocess import bundled_dataset

            prefixes, weights = [bundled_dataset(tokenizer, user_cache_dir())], None
            split = BUNDLED_SPLIT if cfg.split == DEFAULT_SPLIT else cfg.split
            cache_dir = resolve_cache_dir(cfg.data_cache_path, prefixes[0])
        fractions = parse_split(split)
        datasets = [_open(p, tokenizer, opened, cfg.sft) for p in prefixes]
        ranges = [split_ranges(d.num_documents, fractions) for d in datasets]
        for si, n in enumerate(SPLIT_NAMES):
            # Unweighted prefixes are mixed in proportion to their tokens in this split.
            ws = weights or [float(d.document_lengths[r[si][0]:r[si][1]].sum()) for d, r in zip(datasets, ranges)]
            plans[n] = [(d, r[si][0], r[si][1], w) for d, r, w in zip(datasets, ranges, ws)]
    loaders = {}
    for n in SPLIT_NAMES:
        built = _build_source(plans.get(n, []), budgets[n], cfg, cache_dir, n, tokenizer.eod_id)
        loaders[n] = None if built is None else StatefulLoader(
            built[0], micro_batch_size=cfg.micro_batch_size, dp_rank=dp_rank, dp_size=dp_size,
            num_workers=cfg.num_workers, name=n, fingerprint=built[1])
    if loaders["train"] is None and require_train:  # e.g. an empty .bin/.idx, or documents of zero tokens only
        held = ", ".join(f"{d.prefix} ({d.num_documents} documents, {int(d.num_tokens)} tokens)"
                         for d in opened.values())
        raise DataError(f"no training data: the train split of {held or 'the data'} holds no tokens; check the "
                        "preprocessing output (empty input, or an empty --json-keys field) and --split")
    return Loaders(train=loaders["train"], valid=loaders["valid"], test=loaders["test"], eod_id=tokenizer.eod_id)
