"""The jsonl records of RL runs and their resumable loader.

- preference pairs (`--rl vrpo`): one object a line, {"prompt": str, "chosen": str, "rejected": str}; the
  responses are scored after the prompt, each followed by the tokenizer's EOD token;
- prompts (`--rl grpo`): {"prompt": str, ...} plus the fields the rewards read (e.g. "answer" for exact_match).

The text is used as it is (render a chat template into "prompt" beforehand if the model expects one).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import MegaDLMsError
from ..jsonl import read_jsonl

PAIR_FIELDS = ("prompt", "chosen", "rejected")


class RecordError(MegaDLMsError, ValueError):
    """A record of an RL data file lacks a field or has one of the wrong type; the message names FILE:LINE."""


@dataclass
class Record:
    """One tokenized record: where it came from, its token ids and its raw fields (for the rewards)."""

    where: str  # "FILE:LINE"
    prompt: list[int]
    chosen: list[int] = field(default_factory=list)  # pairs only (EOD-terminated)
    rejected: list[int] = field(default_factory=list)
    fields: dict[str, Any] = field(default_factory=dict)


def _text(rec: dict[str, Any], name: str, where: str, fix: str) -> str:
    if name not in rec:
        raise RecordError(f"{where} has no {name!r} field (it has {sorted(rec)}); {fix}")
    if not isinstance(rec[name], str) or not rec[name]:
        raise RecordError(f"{where}: {name!r} must be a non-empty string, got {rec[name]!r:.60}")
    return rec[name]


def read_pairs(path: str | Path, tokenizer: Any) -> list[Record]:
    """Preference pairs of `path`; RecordError naming the record for a missing or empty field."""
    fix = 'each line needs {"prompt": ..., "chosen": ..., "rejected": ...}'
    out = []
    for n, rec in read_jsonl(path):
        where = f"{path}:{n}"
        prompt, chosen, rejected = (_text(rec, k, where, fix) for k in PAIR_FIELDS)
        eod = [tokenizer.eod_id] if tokenizer.eod_id is not None else []
        out.append(Record(where, tokenizer.encode(prompt), tokenizer.encode(chosen) + eod,
                          tokenizer.encode(rejected) + eod, rec))
    if not out:
        raise RecordError(f"{path} holds no records; {fix}")
    return out


def read_prompts(path: str | Path, tokenizer: Any, required: Sequence[str] = ()) -> list[Record]:
    """Prompts of `path`; `required`: the fields the run's rewards read (RecordError names the record and the
    reward that needs the missing field)."""
    out = []
    for n, rec in read_jsonl(path):
        where = f"{path}:{n}"
        prompt = _text(rec, "prompt", where, 'each line needs {"prompt": ...} and the fields its rewards read')
        for name in required:
            if name not in rec:
                raise RecordError(f"{where} has no {name!r} field, which its reward reads (--rl-reward); add it to "
                                  "every record or pick a reward that does not need it")
        out.append(Record(where, tokenizer.encode(prompt), fields=rec))
    if not out:
        raise RecordError(f"{path} holds no records; write one JSON object with a \"prompt\" per line")
    return out


class RecordLoader:
    """Micro-batches of records for one data-parallel rank, endlessly, in a seeded order reshuffled every epoch.

    Global micro-batch g holds records [g * (mbs * dp) ...]: rank r takes its mbs of them. The position (global
    micro-batches read) is the state, so a resumed run reads the same records next."""

    def __init__(self, records: list[Record], *, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0):
        self.records, self.mbs, self.seed = records, micro_batch_size, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.read = 0  # global micro-batches handed out

    def _order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.records), generator=g).tolist()

    def __iter__(self) -> Iterator[list[Record]]:
        n = len(self.records)
        orders: dict[int, list[int]] = {}
        while True:
            start = (self.read * self.dp_size + self.dp_rank) * self.mbs
            batch = []
            for i in range(start, start + self.mbs):
                epoch, pos = divmod(i, n)
                if epoch not in orders:
                    orders = {epoch: self._order(epoch)}
                batch.append(self.records[orders[epoch][pos]])
            self.read += 1
            yield batch

    def state_dict(self) -> dict:
        return {"records_read": self.read}

    def load_state_dict(self, state: dict) -> None:
        self.read = int(state.get("records_read", self.read))  # the trainer's consumed_samples is not ours

    def close(self) -> None:
        pass


@dataclass
class RecordLoaders:
    """The trainer's view of an RL run's data: a train loader, no validation split."""

    train: RecordLoader
    valid: None = None
    test: None = None
    eod_id: int | None = None

    def state_dict(self) -> dict:
        return {"train": self.train.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.train.load_state_dict(state.get("train", {}))

    def close(self) -> None:
        pass


def build_record_loaders(rl: Any, tokenizer: Any, *, micro_batch_size: int, seed: int, dp_rank: int = 0,
                         dp_size: int = 1) -> RecordLoaders:
    """The loaders of an RL run (`RLConfig` rl): pairs for vrpo, prompts checked against the rewards' fields for
    grpo."""
    if rl.rl == "vrpo":
        records = read_pairs(rl.rl_data, tokenizer)
    else:
        from .rewards import RewardSet

        records = read_prompts(rl.rl_data, tokenizer, RewardSet.parse(rl.rl_reward).fields())
    return RecordLoaders(RecordLoader(records, micro_batch_size=micro_batch_size, dp_rank=dp_rank, dp_size=dp_size,
                                      seed=seed), eod_id=tokenizer.eod_id)
