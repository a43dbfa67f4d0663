"""`megadlms <command>`: train | preprocess | generate | convert | export | fp8-check | ckpt | eval | plot.

Each command lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`
(train takes the Megatron-style flags of `megadlms.training.args`); this file only dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Sequence

from .errors import report_errors

COMMANDS = {
    "preprocess": ("megadlms.data.preprocess", "tokenize jsonl into Megatron .bin/.idx files"),
    "generate": ("megadlms.generate.cli", "sample text from a trained model"),
    "convert": ("megadlms.interop.convert", "convert checkpoints to and from Hugging Face"),
    "export": ("megadlms.fp8.export", "export inference weights (BF16 or FP8) as safetensors"),
    "fp8-check": ("megadlms.fp8.check", "check FP8 support of this device and run one FP8 GEMM"),
    "ckpt": ("megadlms.training.ckpt_command", "check checkpoint folders against their checksums (ckpt verify DIR)"),
    "eval": ("megadlms.eval.cli", "evaluate: lm-evaluation-harness tasks, or the validation ELBO (--ppl)"),
    "plot": ("megadlms.eval.plot", "draw training curves (loss, validation ELBO, tokens/s, FP8) of runs"),
}


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")


def train_main(argv: Sequence[str] | None, prog: str = "megadlms train") -> int:
    from .training.args import parse_train_args
    from .training.trainer import train

    def run() -> None:
        train(parse_train_args(argv, prog=prog))

    setup_logging()
    return report_errors(prog, run)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "megadlms {train,%s} [flags]   (megadlms COMMAND --help for a command's flags)" % ",".join(COMMANDS)
    if not argv:  # the embedded default: train the demo
        return train_main([])
    command, rest = argv[0], argv[1:]
    if command in ("-h", "--help"):
        print(usage + "\n\n  train        pre-train or fine-tune a diffusion (or AR) LM; no flags: the demo")
        for name, (_, doc) in COMMANDS.items():
            print(f"  {name:<12} {doc}")
        return 0
    if command == "train":
        return train_main(rest)
    if command not in COMMANDS:
        print(f"megadlms: unknown command {command!r}\nusage: {usage}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    parser = argparse.ArgumentParser(prog=f"megadlms {command}", description=COMMANDS[command][1])
    module.add_arguments(parser)
    setup_logging()
    return report_errors(parser.prog, lambda: module.run(parser.parse_args(rest)))


if __name__ == "__main__":
    sys.exit(main())
