"""Parallelism flags (Megatron-LM names): one per `ParallelConfig` setting."""

from __future__ import annotations

import argparse

from ..settings import add_setting_arguments, parser_groups
from .config import PARALLEL_GROUP, ParallelConfig


def add_distributed_arguments(p: argparse.ArgumentParser) -> None:
    add_setting_arguments(parser_groups(p), ParallelConfig, PARALLEL_GROUP)
