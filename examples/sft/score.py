"""Scores of `megadlms generate --output-file` completions against their "answer" field: exact match, answers of
the right length (as many digits as the answer), and the share of answer digits right in place."""

from __future__ import annotations

import json
import sys


def scores(path: str) -> dict[str, float]:
    records = [json.loads(line) for line in open(path) if line.strip()]
    exact = length = right = total = 0
    for r in records:
        got, want = r["completion"].split(), r["answer"].split()
        exact += got == want
        length += len(got) == len(want)
        right += sum(g == w for g, w in zip(got, want))
        total += len(want)
    n = max(len(records), 1)
    return {"n": len(records), "exact_match": exact / n, "right_length": length / n, "digits": right / max(total, 1)}


def exact_match(path: str) -> tuple[int, int]:
    s = scores(path)
    return round(s["exact_match"] * s["n"]), s["n"]


if __name__ == "__main__":
    print(f"{'file':<40} {'n':>4} {'exact match':>12} {'right length':>13} {'digits in place':>16}")
    for path in sys.argv[1:]:
        s = scores(path)
        print(f"{path:<40} {s['n']:>4} {100 * s['exact_match']:>11.1f}% {100 * s['right_length']:>12.1f}% "
              f"{100 * s['digits']:>15.1f}%")
