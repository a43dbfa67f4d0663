"""Exact-match accuracy of `megadlms generate --output-file` completions against their "answer" field."""

from __future__ import annotations

import json
import sys


def exact_match(path: str) -> tuple[int, int]:
    records = [json.loads(line) for line in open(path) if line.strip()]
    hits = sum(r["completion"].strip() == r["answer"].strip() for r in records)
    return hits, len(records)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        hits, n = exact_match(path)
        print(f"{path}: exact match {hits}/{n} = {100.0 * hits / max(n, 1):.1f}%")
