"""The diffusion [MASK] id among a corpus's tokens: `train` and `eval --ppl` stop in one line naming the data file,
the document and the fix, where they once trained on infinite losses until "training diverged ... lower --lr"."""

from __future__ import annotations

import numpy as np
import pytest

from megadlms import cli
from megadlms.data import load_tokenizer
from megadlms.data.indexed import IndexedDatasetBuilder

from .conftest import TINY

MASKED_DOC = 17


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """Random ids of the bundled tokenizer (none special), each document ending in EOD; token 9 of document 17 is
    the mask id (1)."""
    tok = load_tokenizer()
    prefix = str(tmp_path_factory.mktemp("masked") / "rand_text_document")
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix, np.uint16) as b:
        for d in range(24):
            doc = rng.integers(3, tok.vocab_size, 40)
            doc[-1] = tok.eod_id
            if d == MASKED_DOC:
                doc[9] = tok.mask_id
            b.add_document(doc)
    return prefix


def _error_line(err: str) -> str:
    lines = [x for x in err.splitlines() if "error:" in x]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_train_stops_at_the_first_batch_holding_the_mask_id(corpus, tmp_path, capsys):
    argv = ["train", *TINY, "--train-iters", "40", "--data-path", corpus, "--split", "1,0,0",
            "--data-cache-path", str(tmp_path / "cache"), "--num-workers", "1"]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    line = _error_line(err)
    assert line.startswith(f"megadlms train: error: {corpus}.bin: document {MASKED_DOC} (counting from 0) holds the "
                           "mask token id 1 (at its token 9)")
    assert "--mask-token" in line and "diverged" not in out + err and "skipped" not in out
    # an autoregressive run has no [MASK]: the same corpus trains
    assert cli.main([*argv, "--model-running-mode", "vanilla", "--train-iters", "3"]) == 0, capsys.readouterr().err


def test_eval_ppl_refuses_a_window_holding_the_mask_id(corpus, tmp_path, capsys):
    from tests.eval.conftest import save_tiny

    save_tiny(tmp_path / "ck", seq_length=16)
    argv = ["eval", "--ppl", "--load", str(tmp_path / "ck"), "--data-path", corpus, "--split", "0,1,0",
            "--eval-samples", "40", "--device", "cpu", "--output-path", str(tmp_path / "out"),
            "--data-cache-path", str(tmp_path / "cache")]
    assert cli.main(argv) == 2
    line = _error_line(capsys.readouterr().err)
    assert line.startswith(f"megadlms eval: error: {corpus}.bin: document {MASKED_DOC} (counting from 0) holds the "
                           "mask token id 1 (at its token 9)")
