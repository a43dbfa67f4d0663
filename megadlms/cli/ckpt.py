"""`megadlms ckpt verify DIR`: check a checkpoint folder offline against the checksums recorded at save, and read
its DCP metadata and per-rank state as a load does (a file that would run code is refused).

DIR is a --save folder (every iteration in it, and its `latest` pointer) or one iteration folder. Exit status 0
when everything named is whole, 1 when something is damaged, 2 for a folder that holds no checkpoint.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..training import checkpoint as ckpt


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="{verify}")
    v = sub.add_parser("verify", help="check every file of a checkpoint folder against its recorded checksums")
    v.add_argument("dir", help="a --save folder or one iteration folder (iter_NNNNNNN)")


def _check_one(path: Path) -> list[str]:
    problems = ckpt.verify_checkpoint(path)
    if not problems:
        try:
            ckpt.read_meta(path)
            ckpt.check_safe(path)  # its DCP metadata and per-rank state read as a load reads them
        except ckpt.CheckpointError as e:
            problems.append(str(e))
    return problems


def run(args: argparse.Namespace) -> int:
    root = Path(args.dir)
    if not root.is_dir():
        raise ckpt.CheckpointError(f"no checkpoint folder {root}: it does not exist or is not a folder")
    if (root / ckpt.META).is_file() or (root / ".metadata").is_file():
        folders = [root]
    else:
        folders = sorted(p for p in root.glob("iter_*") if p.is_dir())
        if not folders:
            raise ckpt.CheckpointError(f"{root} holds no checkpoint (no iter_* folders, no {ckpt.META})")
    damaged = 0
    for folder in folders:
        problems = _check_one(folder)
        records = list(folder.glob("crc32_*.json"))
        n = sum(len(json.loads(r.read_text())) for r in records) if records and not problems else 0
        if problems:
            damaged += 1
            print(f"{folder.name}: DAMAGED: {'; '.join(problems)}")
        elif not records:
            print(f"{folder.name}: complete, but no checksums recorded (saved by an older version)")
        else:
            print(f"{folder.name}: ok ({n} files match their checksums)")
    pointer_bad = False
    if folders[0] is not root:
        try:
            latest = ckpt.find_checkpoint(root)
            pointer_bad = bool(_check_one(latest))
            print(f"{ckpt.LATEST}: {latest.name}{' (DAMAGED)' if pointer_bad else ''}")
        except ckpt.CheckpointError as e:
            pointer_bad = True
            print(f"{ckpt.LATEST}: {e}")
    print(f"{len(folders) - damaged} of {len(folders)} checkpoint folders whole")
    return 1 if damaged or pointer_bad else 0
