"""Packed SFT windows: whole conversations of a chat dataset, several per `seq_length` window.

A chat dataset is a Megatron `.bin/.idx` pair of tokens (one document per conversation) plus, beside it,
an indexed dataset of uint8 loss masks with the same documents (`loss_mask_prefix`): 1 on assistant tokens.

`PackedChatDataset` orders the conversations of a document range per epoch with a seeded shuffle and packs
them greedily in that order (next fit): a conversation goes into the current window if it fits, else it
opens the next one; it is never split. A conversation longer than `seq_length` is an error naming it, or,
with `truncate`, cut to its first `seq_length` tokens. Windows are then shuffled within their epoch.

A sample is int64 [3, seq_length + 1]: row 0 tokens, row 1 loss mask, row 2 segment ids (1, 2, ... per
conversation in the window, 0 for padding). The tail of a window is padded with the EOD token:
- pad="eos" (LLaDA): the pads belong to the last conversation's response: they carry loss and are attended;
- pad="ignore": segment 0, no loss, never attended by a conversation.
The extra last slot (seq_length + 1) keeps the pre-training sample shape (inputs and shifted targets); it is
always padding. Everything is a pure function of (document lengths, range, seq_length, seed, epochs, pad,
truncate), so blending, splits, resume and the data-parallel loader treat these samples like GPT samples.
"""

from __future__ import annotations

import os

import numpy as np

from .dataset import INDEX_VERSION, DataError, _hash, _permutation, find_token, mask_token_error
from .indexed import IndexedDataset, dataset_exists

SFT_PADS = ("eos", "ignore")


def loss_mask_prefix(prefix: str | os.PathLike) -> str:
    """Where the loss masks of the chat dataset `prefix` live: `{prefix}_lossmask` (.bin/.idx)."""
    return f"{os.fspath(prefix)}_lossmask"


def is_chat_dataset(prefix: str | os.PathLike) -> bool:
    """True when `prefix` has loss masks beside it (written by `megadlms preprocess --chat`)."""
    return dataset_exists(loss_mask_prefix(prefix))


def open_loss_masks(tokens: IndexedDataset) -> IndexedDataset:
    """The loss-mask dataset of a chat dataset, checked to have the same documents and lengths."""
    masks = IndexedDataset(loss_mask_prefix(tokens.prefix))
    if masks.num_documents != tokens.num_documents or not np.array_equal(masks.document_lengths,
                                                                         tokens.document_lengths):
        raise DataError(f"the loss masks {masks.prefix!r} do not match the documents of {tokens.prefix!r} (different "
                        "counts or lengths): the pair comes from different runs; re-run preprocess --chat")
    return masks


class PackedChatDataset:
    """Packed windows over conversations [doc_start, doc_end) of a chat dataset; see the module docstring.

    `len(ds)` = windows over the epochs needed for `num_samples` (at least one epoch);
    `ds[i]` -> int64 [3, seq_length + 1] (i modulo len(ds)); `MaskTokenInDataError` naming the conversation when
    one holds `mask_token_id` (None: not checked; see `megadlms.data.dataset`).
    """

    def __init__(self, indexed: IndexedDataset, doc_start: int, doc_end: int, *, seq_length: int,
                 num_samples: int, seed: int, eod_id: int, pad: str = "eos", truncate: bool = False,
                 name: str = "train", mask_token_id: int | None = None) -> None:
        if pad not in SFT_PADS:
            raise DataError(f"--sft-pad {pad!r} is not one of {list(SFT_PADS)}")
        if not 0 <= doc_start < doc_end <= indexed.num_documents:
            raise DataError(f"document range [{doc_start}, {doc_end}) is empty or outside the "
                            f"{indexed.num_documents} conversations of {indexed.prefix!r}")
        self.indexed, self.masks = indexed, open_loss_masks(indexed)
        self.doc_start, self.doc_end, self.seq_length, self.seed = doc_start, doc_end, seq_length, seed
        self.eod_id, self.pad, self.truncate, self.name = eod_id, pad, truncate, name
        self.mask_token_id = mask_token_id
        lengths = indexed.document_lengths[doc_start:doc_end].astype(np.int64)
        too_long = np.flatnonzero(lengths > seq_length)
        if too_long.size and not truncate:
            d = int(too_long[0]) + doc_start
            raise DataError(f"conversation {d} of {indexed.prefix!r} has {int(lengths[too_long[0]])} tokens, more "
                            f"than --seq-length {seq_length} ({too_long.size} such conversations in {name}); raise "
                            "--seq-length or pass --truncate to cut them")
        self.lengths = np.minimum(lengths, seq_length)
        self.order_key = _hash({"v": INDEX_VERSION, "sft": 1, "seq_length": seq_length, "seed": seed,
                                "doc_start": doc_start, "doc_end": doc_end, "pad": pad, "truncate": truncate},
                               self.lengths)
        # windows per epoch: pack epochs until there are enough
        self.window_docs: list[np.ndarray] = []  # per window: the document ids in it, in order
        epoch_sizes: list[int] = []
        need = max(int(num_samples), 1)
        e = 0
        while not epoch_sizes or len(self.window_docs) < need:
            windows = self._pack_epoch(e)
            shuffle = _permutation(len(windows), seed, 3, e)
            self.window_docs.extend(windows[j] for j in shuffle)
            epoch_sizes.append(len(windows))
            e += 1
        self.num_epochs = e
        self.key = _hash({"order": self.order_key, "epochs": e})  # what a blend's cached index depends on
        self.cache_stem = f"{os.path.basename(indexed.prefix)}-sft-{name}-{self.key[:24]}"

    def _pack_epoch(self, epoch: int) -> list[np.ndarray]:
        order = _permutation(len(self.lengths), self.seed, 2, epoch)
        lengths = self.lengths[order]
        windows, start, fill = [], 0, 0
        for j, n in enumerate(lengths.tolist()):
            if fill + n > self.seq_length:
                windows.append(order[start:j] + self.doc_start)
                start, fill = j, 0
            fill += n
        windows.append(order[start:] + self.doc_start)
        return windows

    def __len__(self) -> int:
        return len(self.window_docs)

    def __getitem__(self, i: int) -> np.ndarray:
        docs = self.window_docs[int(i) % len(self.window_docs)]
        out = np.zeros((3, self.seq_length + 1), dtype=np.int64)
        out[0] = self.eod_id
        pos = 0
        for s, d in enumerate(docs.tolist(), start=1):
            n = int(self.lengths[d - self.doc_start])
            tokens = self.indexed.document(d, 0, n)
            at = find_token(tokens, self.mask_token_id)
            if at is not None and self.mask_token_id is not None:
                raise mask_token_error(self.indexed.prefix, d, at, self.mask_token_id, "conversation")
            out[0, pos:pos + n] = tokens
            out[1, pos:pos + n] = self.masks.document(d, 0, n)
            out[2, pos:pos + n] = s
            pos += n
        if self.pad == "eos":  # the pads extend the last response (the extra last slot stays padding)
            out[1, pos:self.seq_length] = 1
            out[2, pos:self.seq_length] = len(docs)
        return out

    def __repr__(self) -> str:
        return (f"PackedChatDataset({self.indexed.prefix!r}, {self.name}, docs=[{self.doc_start}, {self.doc_end}), "
                f"windows={len(self)}, epochs={self.num_epochs}, seq_length={self.seq_length}, pad={self.pad})")

