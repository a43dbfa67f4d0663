#!/usr/bin/env python
"""Train the bundled byte-level BPE tokenizer (vocab 4096) on the bundled demo corpus.

Special tokens come first, so their ids are fixed: <|endoftext|> = 0 (end of document, EOD),
<|mask|> = 1 (the diffusion mask token), <|pad|> = 2. The result is written as
megadlms/assets/tokenizer/{tokenizer.json, tokenizer_config.json, special_tokens_map.json}, which
`transformers.AutoTokenizer.from_pretrained` loads.

    python tools/train_demo_tokenizer.py                 # after tools/make_demo_corpus.py
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megadlms.data import tokenizer as mtok  # noqa: E402

ASSETS = ROOT / "megadlms" / "assets"


def texts(path: Path):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, default=ASSETS / "demo_corpus.jsonl.gz")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--output", type=Path, default=ASSETS / "tokenizer")
    a = p.parse_args()

    tok = Tokenizer(models.BPE())
    # Byte-level BPE (every byte is representable, so no unknown token). Words are split at single spaces,
    # each space kept at the front of the next word; a plain string split is ~2x faster than GPT-2's regex
    # and lets `Tokenizer.encode` cache ids per word exactly.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(" ", behavior="merged_with_next"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=a.vocab_size, min_frequency=2,
                                  special_tokens=[mtok.EOD_TOKEN, mtok.MASK_TOKEN, mtok.PAD_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts(a.corpus), trainer=trainer)
    a.output.mkdir(parents=True, exist_ok=True)
    staging = a.output / "tokenizer.json"
    tok.save(str(staging))
    # Rewrite through the package class so the config files are exactly what `Tokenizer.save` writes.
    mtok.Tokenizer.from_file(staging, eod_token=mtok.EOD_TOKEN, mask_token=mtok.MASK_TOKEN,
                             pad_token=mtok.PAD_TOKEN).save(a.output)
    print(f"wrote {a.output}: vocab {tok.get_vocab_size()}")


if __name__ == "__main__":
    main()
