"""Parallelism flags (Megatron-LM names): one per `ParallelConfig` setting."""

from __future__ import annotations

import argparse
from typing import Any

from ..settings import add_setting_arguments
from .config import PARALLEL_GROUP, ParallelConfig


def add_distributed_arguments(p: argparse.ArgumentParser) -> None:
    groups: dict[str, Any] = {}
    add_setting_arguments(lambda title: groups.setdefault(title, p.add_argument_group(title)), ParallelConfig,
                          PARALLEL_GROUP)
