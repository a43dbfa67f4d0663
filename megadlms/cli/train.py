"""`megadlms train` (and `pretrain_difflm.py`): Megatron-style flags or a YAML file -> a training run.

The flags are defined in `megadlms.training.args`; this module only parses them and starts the run.
"""

from __future__ import annotations

import argparse
from typing import Sequence

from ..training.args import add_train_arguments, parse_train_args
from ..training.config import RunConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Pre-train or fine-tune a diffusion (or AR) language model."
    add_train_arguments(parser)


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str]) -> RunConfig:
    """The run's configuration: the flags over `--config FILE.yaml` defaults (no flags: the bundled demo)."""
    return parse_train_args(argv, parser=parser)


def run(config: RunConfig) -> int:
    from ..training.failure import exit_promptly_on_failure
    from ..training.trainer import train

    with exit_promptly_on_failure():  # this process ends with the run: nothing may keep it alive after a failure
        train(config)
    return 0
