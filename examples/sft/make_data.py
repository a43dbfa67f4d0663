"""A small scorable instruction set: reverse a list of 3-5 digits ("Reverse: 4 7 1" -> "1 7 4").

Writes, into --out:
  train.jsonl            {"prompt", "response"} records for `megadlms preprocess --chat`
  heldout.jsonl          {"prompt", "answer"} records whose digit lists never occur in train.jsonl
  heldout_prompts.jsonl  the held-out prompts rendered with PROMPT_TEMPLATE, for `megadlms generate --prompt-file`
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

PROMPT_TEMPLATE = "Q: {prompt}\nA: "


def example(rng: random.Random) -> tuple[str, str]:
    digits = [str(rng.randrange(10)) for _ in range(rng.randint(3, 5))]
    return "Reverse: " + " ".join(digits), " ".join(reversed(digits))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--train", type=int, default=4000)
    p.add_argument("--heldout", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    heldout: dict[str, str] = {}
    while len(heldout) < args.heldout:
        q, a = example(rng)
        heldout[q] = a
    train = []
    while len(train) < args.train:
        q, a = example(rng)
        if q not in heldout:
            train.append({"prompt": q, "response": a})
    with open(out / "train.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in train)
    with open(out / "heldout.jsonl", "w") as f:
        f.writelines(json.dumps({"prompt": q, "answer": a}) + "\n" for q, a in heldout.items())
    with open(out / "heldout_prompts.jsonl", "w") as f:
        f.writelines(json.dumps({"prompt": PROMPT_TEMPLATE.format(prompt=q), "answer": a}) + "\n"
                     for q, a in heldout.items())
    print(f"{len(train)} training and {len(heldout)} held-out examples in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
