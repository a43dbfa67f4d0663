"""Verifiable rewards: a registry of name -> (function, the record fields it reads).

A reward function takes (completion text, record fields) and returns a float. `--rl-reward exact_match,format:0.5`
sums the named rewards with their weights (default 1). A reward that raises scores 0 for that completion and is
counted (`RewardSet.failures`), not a crash.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..config import ConfigError

log = logging.getLogger("megadlms")

RewardFn = Callable[[str, dict[str, Any]], float]

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)
_FORMAT = re.compile(r"^\s*<reasoning>.*?</reasoning>\s*<answer>.*?</answer>\s*$", re.S)


def _normalise(text: str) -> str:
    text = text.strip().rstrip(".").replace(",", "") if re.fullmatch(r"[\d,.\-\s]+", text.strip()) else text.strip()
    return " ".join(text.split())


def extract_answer(completion: str) -> str:
    """The final answer of a completion: the last \\boxed{...}, else the last <answer>...</answer>, else what follows
    the last '####', else the first line."""
    for pattern in (_BOXED, _ANSWER_TAG):
        found = pattern.findall(completion)
        if found:
            return _normalise(found[-1])
    if "####" in completion:
        return _normalise(completion.rsplit("####", 1)[1])
    return _normalise(completion.strip().split("\n", 1)[0] if completion.strip() else "")


def exact_match(completion: str, record: dict[str, Any]) -> float:
    """1.0 where the extracted answer equals the record's "answer" (whitespace and number commas normalised)."""
    return float(extract_answer(completion) == _normalise(str(record["answer"])))


def position_match(completion: str, record: dict[str, Any]) -> float:
    """Partial credit: the share of the answer's whitespace-separated items that the extracted answer has at the
    same place, over the longer of the two (so extra items cost too)."""
    got, want = extract_answer(completion).split(), _normalise(str(record["answer"])).split()
    return sum(a == b for a, b in zip(got, want)) / max(len(got), len(want), 1)


def format_reward(completion: str, record: dict[str, Any]) -> float:
    """1.0 for a completion of the form <reasoning>...</reasoning><answer>...</answer> (d1's strict format)."""
    return float(bool(_FORMAT.match(completion)))


_CODE_BLOCK = re.compile(r"```(?:python)?\n(.*?)```", re.S)


def code_tests(completion: str, record: dict[str, Any]) -> float:
    """1.0 where the completion's program (its last ```python block, else the whole text) passes the record's
    "tests" (Python asserts) in the sandboxed runner (`megadlms.rl.code_runner`), within 5 s."""
    from .code_runner import run_program

    blocks = _CODE_BLOCK.findall(completion)
    return float(run_program(blocks[-1] if blocks else completion, str(record["tests"])).passed)


REWARDS: dict[str, tuple[RewardFn, tuple[str, ...]]] = {
    "code_tests": (code_tests, ("tests",)),
    "exact_match": (exact_match, ("answer",)),
    "position_match": (position_match, ("answer",)),
    "format": (format_reward, ()),
}


@dataclass
class RewardSet:
    """The weighted sum of the rewards `spec` names ("exact_match,format:0.5")."""

    terms: list[tuple[str, RewardFn, float]]
    failures: int = 0  # completions whose reward raised (scored 0)
    last: dict[str, float] = field(default_factory=dict)  # each term's mean (unweighted) in the last call

    @classmethod
    def parse(cls, spec: str) -> RewardSet:
        terms = []
        for part in (p.strip() for p in spec.split(",") if p.strip()):
            name, _, weight = part.partition(":")
            if name not in REWARDS:
                raise ConfigError(f"--rl-reward {spec!r}: unknown reward {name!r}; known rewards: "
                                  f"{', '.join(sorted(REWARDS))}")
            try:
                w = float(weight) if weight else 1.0
            except ValueError:
                raise ConfigError(f"--rl-reward {spec!r}: the weight of {name!r} is {weight!r}, not a number "
                                  "(write NAME:WEIGHT, e.g. format:0.5)") from None
            terms.append((name, REWARDS[name][0], w))
        if not terms:
            raise ConfigError("--rl-reward is empty; name at least one reward, e.g. exact_match")
        return cls(terms)

    def fields(self) -> tuple[str, ...]:
        """The record fields the rewards read."""
        return tuple(dict.fromkeys(f for name, _, _ in self.terms for f in REWARDS[name][1]))

    def __call__(self, completions: Sequence[str], records: Sequence[dict[str, Any]],
                 where: Sequence[str] | None = None) -> list[float]:
        """The weighted sum per completion of its record's fields; where: each record's "FILE:LINE", for the
        warning of a reward that raises."""
        out = []
        sums = dict.fromkeys((name for name, _, _ in self.terms), 0.0)
        for i, (text, rec) in enumerate(zip(completions, records)):
            total = 0.0
            for name, fn, w in self.terms:
                try:
                    score = float(fn(text, rec))
                except Exception as e:  # noqa: BLE001 (any user reward may fail; it scores 0 and is counted)
                    self.failures += 1
                    log.warning("reward %s raised %s: %s on a completion of %s (scored 0; %d failures so far); fix "
                                "the reward or the record", name, type(e).__name__, e,
                                where[i] if where is not None else f"record {i} of the batch", self.failures)
                    continue
                total += w * score
                sums[name] += score
            out.append(total)
        self.last = {name: v / max(len(out), 1) for name, v in sums.items()}
        return out
