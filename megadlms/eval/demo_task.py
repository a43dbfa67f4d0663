"""A local multiple-choice task from the held-out documents of the bundled demo corpus.

Each item: the first `context_words` words of a test-split document (the corpus is split 98/1/1 by documents
as `megadlms train` splits it, so a model trained on the demo never saw these documents), the true next
`continuation_words` words, and distractors: the same words of other held-out documents. Chance accuracy is
1 / choices.

    python -m megadlms.eval.demo_task --output-dir tasks/
    megadlms eval --load runs/demo --tasks demo_heldout_mc --include-path tasks/
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
from pathlib import Path
from typing import Any

from ..config import ConfigError
from ..data.dataset import parse_split, split_ranges
from ..data.loader import BUNDLED_SPLIT
from ..data.preprocess import BUNDLED_CORPUS

TASK = "demo_heldout_mc"


def heldout_documents(split: str = BUNDLED_SPLIT) -> list[str]:
    """The texts of the bundled corpus's test split (contiguous document range, as the trainer splits it)."""
    with gzip.open(BUNDLED_CORPUS, "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    start, end = split_ranges(len(texts), parse_split(split))[2]
    return texts[start:end]


def make_items(texts: list[str], *, choices: int = 4, context_words: int = 16, continuation_words: int = 6,
               seed: int = 0, limit: int | None = None) -> list[dict[str, Any]]:
    """Items {"context", "choices", "label"}: the true continuation at a random position among `choices`."""
    if choices < 2:
        raise ConfigError(f"--choices {choices} must be >= 2")
    need = context_words + continuation_words
    docs = [t.split() for t in texts if len(t.split()) >= need]
    if len(docs) < choices:
        raise ConfigError(f"only {len(docs)} held-out documents have {need} words; lower the word counts")
    rng = random.Random(seed)
    items = []
    for i, words in enumerate(docs[:limit]):
        true = " " + " ".join(words[context_words:need])
        others = [j for j in range(len(docs)) if j != i]
        picks = []
        for j in rng.sample(others, len(others)):
            alt = " " + " ".join(docs[j][context_words:need])
            if alt != true and alt not in picks:
                picks.append(alt)
            if len(picks) == choices - 1:
                break
        label = rng.randrange(choices)
        picks.insert(label, true)
        items.append({"context": " ".join(words[:context_words]), "choices": picks, "label": label})
    return items


def write_task(output_dir: str | Path, items: list[dict[str, Any]], name: str = TASK) -> Path:
    """Write `{name}.jsonl` and the harness YAML `{name}.yaml` (reading that jsonl) into `output_dir`."""
    out = Path(output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    data = out / f"{name}.jsonl"
    data.write_text("".join(json.dumps(it) + "\n" for it in items))
    spec = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{context}}",
            "doc_to_choice": "{{choices}}", "doc_to_target": "{{label}}", "metric_list": [{"metric": "acc"}]}
    path = out / f"{name}.yaml"
    path.write_text(json.dumps(spec, indent=2) + "\n")  # JSON is YAML
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megadlms.eval.demo_task", description=__doc__.split("\n")[0])
    p.add_argument("--output-dir", required=True)
    p.add_argument("--choices", type=int, default=4)
    p.add_argument("--context-words", type=int, default=16)
    p.add_argument("--continuation-words", type=int, default=6)
    p.add_argument("--limit", type=int, default=None, help="items (default: every held-out document)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    items = make_items(heldout_documents(), choices=args.choices, context_words=args.context_words,
                       continuation_words=args.continuation_words, seed=args.seed, limit=args.limit)
    path = write_task(args.output_dir, items)
    print(f"wrote {len(items)} items ({args.choices} choices, chance {1 / args.choices:.0%}): {path}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
