"""Packed SFT across data-parallel ranks: the loss is the mean over the global batch's conversations, so two DDP
ranks train exactly as one process that accumulates the same micro-batches."""

import numpy as np

from megadlms.data.indexed import IndexedDatasetBuilder
from megadlms.data.sft import loss_mask_prefix

from .launch import TINY, launch, train_losses


def _chat_data(folder):
    prefix = str(folder / "c_chat_document")
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix, np.uint16) as t, IndexedDatasetBuilder(loss_mask_prefix(prefix), np.uint8) as m:
        for _ in range(80):
            n, plen = int(rng.integers(4, 14)), int(rng.integers(2, 4))  # uneven lengths: uneven packing
            t.add_document(rng.integers(3, 4000, n))
            m.add_document((np.arange(n) >= plen).astype(np.uint8))
    return prefix


def test_ddp_sft_matches_one_process(tmp_path):
    common = TINY + ["--sft", "--data-path", _chat_data(tmp_path), "--split", "100,0,0", "--micro-batch-size", "1",
                     "--train-iters", "3", "--sft-pad", "ignore"]
    launch(1, common + ["--save", str(tmp_path / "one")])
    launch(2, common + ["--save", str(tmp_path / "two"), "--distributed-backend", "gloo"],
           rerun_after_native_crash=True, clean_before_rerun=[tmp_path / "two"])
    one, two = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert len(one) == 3
    np.testing.assert_allclose(two, one, rtol=1e-5)
