"""JSON-lines files (one JSON object per line), read with errors that name the file and the line.

Used for prompt files (`megadlms generate --prompt-file`) and run metrics (`metrics.jsonl`, `megadlms plot`).
The corpus preprocessor reads its input in parallel chunks and decodes each line with `decode_json_line`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import MegaDLMsError


class JSONLinesError(MegaDLMsError, ValueError):
    """A line of a JSON-lines file is not a JSON object; the message names the file and the line."""


def decode_json_line(raw: bytes) -> Any:
    """The JSON value of one line (bytes, with or without its line break); ValueError naming what is wrong with a
    line that is not UTF-8 JSON."""
    try:
        text = raw.rstrip(b"\r\n").decode("utf-8")  # without the line break, JSON error columns are true
    except UnicodeDecodeError as e:
        raise ValueError(f"not valid UTF-8 (byte {e.start}) near {raw[e.start:e.start + 4]!r}; save the file as "
                         "UTF-8") from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from e


def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number from 1, record) for every non-blank line of `path`, read lazily.

    A line that is not UTF-8, not JSON or not a JSON object raises `JSONLinesError` ("FILE:LINE is not valid
    JSON (...)"); a missing file raises FileNotFoundError, which the command line reports as one line.
    """
    path = Path(path)
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                rec = decode_json_line(raw)
            except ValueError as e:
                text = "" if isinstance(e.__cause__, UnicodeDecodeError) else (
                    f": {raw[:80].decode('utf-8', 'replace').rstrip()!r}")
                raise JSONLinesError(f"{path}:{n} is {e}{text}") from e
            if not isinstance(rec, dict):
                raise JSONLinesError(f"{path}:{n} is a JSON {type(rec).__name__}, expected an object "
                                     "{\"key\": value, ...} on each line")
            yield n, rec
