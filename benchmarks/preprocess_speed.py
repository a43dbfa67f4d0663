#!/usr/bin/env python
"""Preprocessing throughput (MB/s of input text) for 1 and 2 workers; prints a table.

Makes a ~50 MB jsonl in a temporary folder from two kinds of text: the demo-corpus generator (small
vocabulary: the per-word id cache almost always hits) and Zipf-distributed pseudo-words from a 200k-word
lexicon (many cache misses, closer to web text). Each is tokenized with the bundled tokenizer (word-cache
path) and with a GPT-2-style regex byte-level BPE trained on the fly (the plain `tokenizers` path, as for
Qwen/Llama tokenizers).

Columns: MB/s is wall-clock throughput; MB/cpu-s divides by the CPU seconds of the main process plus its
workers, i.e. the throughput of one fully used core (what one worker delivers on an idle machine; it is
unaffected by other load on a shared machine).

    python benchmarks/preprocess_speed.py [--mb 50] [--workers 1 2]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from make_demo_corpus import make_document  # noqa: E402
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402
from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: E402

from megadlms.data.indexed import IndexedDataset  # noqa: E402
from megadlms.data.preprocess import preprocess_jsonl  # noqa: E402
from megadlms.data.tokenizer import EOD_TOKEN, Tokenizer, load_tokenizer  # noqa: E402


def story_lines(target_bytes: int, seed: int) -> list[str]:
    r = random.Random(seed)
    out, size = [], 0
    while size < target_bytes:
        line = json.dumps({"text": make_document(r)})
        out.append(line)
        size += len(line) + 1
    return out


def zipf_lines(target_bytes: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    lexicon = ["".join(rng.choice(letters, size=rng.integers(2, 11))) for _ in range(200_000)]
    out, size = [], 0
    while size < target_bytes:
        n = int(rng.integers(50, 400))
        ids = np.minimum(rng.zipf(1.15, size=n), len(lexicon)) - 1
        words = [lexicon[i] for i in ids]
        text = " ".join(words).capitalize() + "."
        line = json.dumps({"text": text})
        out.append(line)
        size += len(line) + 1
    return out


def regex_tokenizer(sample: list[str]) -> Tokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2 regex split
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator((json.loads(x)["text"] for x in sample), trainers.BpeTrainer(
        vocab_size=4096, special_tokens=[EOD_TOKEN], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return Tokenizer(tok, eod_token=EOD_TOKEN)


def cpu_seconds() -> float:
    """User+system CPU of this process and its finished children (the pool workers, once joined)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=50.0, help="size of each generated jsonl in MB")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    a = p.parse_args()
    target = int(a.mb * 1e6)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        texts = {"stories": story_lines(target, 1), "zipf words": zipf_lines(target, 2)}
        tokenizers = {"bundled (word cache)": load_tokenizer(None),
                      "gpt2-regex BPE (library)": regex_tokenizer(texts["stories"][:3000] + texts["zipf words"][:3000])}
        for tname, lines in texts.items():
            path = Path(d) / f"{tname.replace(' ', '_')}.jsonl"
            path.write_text("\n".join(lines) + "\n")
            for kname, tok in tokenizers.items():
                outputs = []
                for w in a.workers:
                    cpu0 = cpu_seconds()
                    st = preprocess_jsonl(path, Path(d) / f"out_{w}", tok, append_eod=True, workers=w, progress=False)
                    cpu = cpu_seconds() - cpu0
                    outputs.append(Path(st.outputs["text"] + ".bin").read_bytes())
                    rows.append((tname, kname, w, st.input_bytes / 1e6, st.seconds, st.mb_per_s,
                                 st.input_bytes / 1e6 / cpu, st.documents / st.seconds, st.tokens["text"]))
                    IndexedDataset(st.outputs["text"])  # the output must validate
                assert all(o == outputs[0] for o in outputs), "outputs differ between worker counts"
    print(f"{'text':<11} {'tokenizer':<26} {'workers':>7} {'MB':>6} {'s':>7} {'MB/s':>7} {'MB/cpu-s':>8} "
          f"{'docs/s':>9} {'tokens':>11}")
    for t, k, w, mb, s, rate, per_cpu, dps, ntok in rows:
        print(f"{t:<11} {k:<26} {w:>7} {mb:>6.1f} {s:>7.2f} {rate:>7.2f} {per_cpu:>8.2f} {dps:>9,.0f} {ntok:>11,}")


if __name__ == "__main__":
    main()
