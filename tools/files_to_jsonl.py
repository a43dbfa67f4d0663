#!/usr/bin/env python
"""Make a jsonl corpus (one {"text": ...} per file) from the text files under some folders.

For a real-text corpus where no corpus can be downloaded: e.g. the Python sources of an installed
environment are hundreds of MB of human-written code and docstrings. Files are taken in sorted path
order (reproducible), decoded as UTF-8 (others skipped), exact duplicates dropped, until --max-mb.

    python tools/files_to_jsonl.py /usr/lib/python3.12 "$(python -c 'import site; print(site.getsitepackages()[0])')" \
        --ext .py --max-mb 200 --output /tmp/code.jsonl
    megadlms preprocess --input /tmp/code.jsonl --output-prefix /tmp/code --workers 16
    # then train with --data-path /tmp/code_text_document
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path


def iter_files(roots: list[Path], exts: tuple[str, ...]) -> list[Path]:
    files: set[Path] = set()
    for root in roots:
        if root.is_file():
            files.add(root.resolve())
            continue
        if not root.is_dir():
            raise SystemExit(f"{root} is neither a file nor a folder")
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            files.update((Path(dirpath) / f).resolve() for f in filenames if f.endswith(exts))
    return sorted(files)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("roots", nargs="+", type=Path, help="folders (walked recursively) or files")
    p.add_argument("--ext", nargs="+", default=[".py"], help="file name endings to take (default: .py)")
    p.add_argument("--max-mb", type=float, default=200.0, help="stop after this many MB of text")
    p.add_argument("--max-file-kb", type=float, default=512.0, help="skip larger files (generated code, data)")
    p.add_argument("--min-chars", type=int, default=200, help="skip shorter files")
    p.add_argument("--output", type=Path, required=True, help="the .jsonl to write")
    a = p.parse_args(argv)
    budget = int(a.max_mb * 1e6)
    seen: set[bytes] = set()
    n = total = skipped = 0
    tmp = a.output.with_name(a.output.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as out:
        for path in iter_files(a.roots, tuple(a.ext)):
            try:
                if path.stat().st_size > a.max_file_kb * 1024:
                    skipped += 1
                    continue
                text = path.read_bytes().decode("utf-8")
            except (OSError, UnicodeDecodeError):
                skipped += 1
                continue
            digest = hashlib.sha1(text.encode()).digest()
            if len(text) < a.min_chars or digest in seen:
                skipped += 1
                continue
            seen.add(digest)
            out.write(json.dumps({"text": text}) + "\n")
            n += 1
            total += len(text.encode())
            if total >= budget:
                break
    os.replace(tmp, a.output)  # a complete file or none
    print(f"{a.output}: {n} files, {total / 1e6:.1f} MB of text ({skipped} skipped: too large, short, "
          "duplicate or not UTF-8)", file=sys.stderr)
    return 0 if n else 1


if __name__ == "__main__":
    sys.exit(main())
