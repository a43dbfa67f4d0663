"""`megadlms preprocess`: tokenize jsonl into Megatron .bin/.idx files (flags: `megadlms.data.preprocess`)."""

from __future__ import annotations

from ..data.preprocess import add_arguments, run

__all__ = ["add_arguments", "run"]
