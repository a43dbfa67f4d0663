"""A small scorable instruction set: reverse a list of digits ("Reverse: 4 7 1" -> "1 7 4"), 3-5 digits by default.

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


def example(rng: random.Random, min_digits: int = 3, max_digits: int = 5) -> tuple[str, str]:
    digits = [str(rng.randrange(10)) for _ in range(rng.randint(min_digits, max_digits))]
    return "Reverse: " + " ".join(digits), " ".join(reversed(digits))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--train", type=int, default=4000)
    p.add_argument("--heldout", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-digits", type=int, default=3, help="shortest digit list (default 3)")
    p.add_argument("--max-digits", type=int, default=5, help="longest digit list (default 5)")
    args = p.parse_args(argv)
    if not 1 <= args.min_digits <= args.max_digits:
        p.error(f"--min-digits {args.min_digits} / --max-digits {args.max_digits}: need 1 <= min <= max")
    distinct = sum(10**n for n in range(args.min_digits, args.max_digits + 1))
    if args.heldout >= distinct:
        p.error(f"--heldout {args.heldout}: only {distinct} distinct lists of {args.min_digits}-{args.max_digits} "
                "digits exist; hold out fewer or allow longer lists")
    rng = random.Random(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    heldout: dict[str, str] = {}
    while len(heldout) < args.heldout:
        q, a = example(rng, args.min_digits, args.max_digits)
        heldout[q] = a
    train = []
    while len(train) < args.train:
        q, a = example(rng, args.min_digits, args.max_digits)
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
