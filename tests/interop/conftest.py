"""Fixtures of the interop tests: saved HF folders of each supported family."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from .helpers import FAMILIES, make_hf_model, write_tokenizer


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """family -> a saved HF folder with tokenizer; qwen2 is saved sharded (several safetensors + index)."""
    out = {}
    for i, family in enumerate(FAMILIES):
        d = tmp_path_factory.mktemp(f"hf_{family}")
        model = make_hf_model(family, seed=i)
        model.save_pretrained(str(d), max_shard_size="20KB" if family == "qwen2" else "5GB")
        write_tokenizer(d)
        out[family] = d
    return out


@pytest.fixture
def hf_copy(hf_dirs, tmp_path):
    """A writable copy of a saved HF folder (for corruption tests)."""
    count = iter(range(100))

    def copy(family: str) -> Path:
        dst = tmp_path / f"copy_{family}_{next(count)}"
        shutil.copytree(hf_dirs[family], dst)
        return dst
    return copy
