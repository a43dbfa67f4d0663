"""Shared fixtures of the data tests: synthetic corpora whose tokens say where they came from."""

from __future__ import annotations

import numpy as np
import pytest

from megadlms.data.indexed import IndexedDatasetBuilder

STRIDE = 1000  # token = base + document * STRIDE + position (positions < STRIDE)


def doc_tokens(doc: int, length: int, base: int = 0) -> np.ndarray:
    return base + doc * STRIDE + np.arange(length, dtype=np.int64)


@pytest.fixture
def make_corpus(tmp_path):
    """make_corpus(name, lengths, base=0) -> prefix of an int32 dataset; document d has lengths[d] tokens
    base + d*STRIDE + [0, 1, ...]."""

    def make(name: str, lengths, base: int = 0) -> str:
        prefix = str(tmp_path / name)
        with IndexedDatasetBuilder(prefix, np.int32) as b:
            for d, n in enumerate(lengths):
                b.add_document(doc_tokens(d, int(n), base))
        return prefix

    return make
