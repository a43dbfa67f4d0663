"""`megadlms <command>`: the command-line front end. Commands sit on top of the library, one module each.

A command module exposes `add_arguments(parser)` and `run(args) -> int | None`, and may expose
`parse_args(parser, argv)` for parsing of its own (train: `--config FILE.yaml` defaults). Adding a
command is one line in `COMMANDS`; modules are imported only when their command runs, so `--help`
stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Sequence

from ..errors import report_errors
from ..triton_setup import use_torch_ptxas

# name -> (module, one-line description)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("megadlms.cli.train", "pre-train or fine-tune a diffusion (or AR) LM; no flags: the demo"),
    "preprocess": ("megadlms.cli.preprocess", "tokenize jsonl into Megatron .bin/.idx files"),
    "generate": ("megadlms.cli.generate", "sample text from a trained model"),
    "convert": ("megadlms.cli.convert", "convert checkpoints to and from Hugging Face"),
    "export": ("megadlms.cli.export", "export inference weights (BF16 or FP8) as safetensors"),
    "fp8-check": ("megadlms.cli.fp8_check", "check FP8 support of this device and run one FP8 GEMM"),
    "ckpt": ("megadlms.cli.ckpt", "check checkpoint folders against their checksums (ckpt verify DIR)"),
    "eval": ("megadlms.cli.eval", "evaluate: lm-evaluation-harness tasks, or the validation ELBO (--ppl)"),
    "plot": ("megadlms.cli.plot", "draw training curves (loss, validation ELBO, tokens/s, FP8) of runs"),
}


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")


def run_command(name: str, argv: Sequence[str], prog: str | None = None) -> int:
    """Parse `argv` with command `name`'s flags and run it; a bad value prints one line (exit status 2)."""
    module_name, description = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=prog or f"megadlms {name}", description=description)
    module.add_arguments(parser)
    parse = getattr(module, "parse_args", None)

    def go() -> int | None:
        args = parse(parser, list(argv)) if parse is not None else parser.parse_args(list(argv))
        use_torch_ptxas()  # the FP8 Triton kernels compile with torch's ptxas (TRITON_PTXAS_PATH chooses another)
        return module.run(args)

    setup_logging()
    return report_errors(parser.prog, go)


def train_main(argv: Sequence[str] | None, prog: str = "megadlms train") -> int:
    """`megadlms train ARGV` (also `pretrain_difflm.py`)."""
    return run_command("train", list(argv or []), prog=prog)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "megadlms {%s} [flags]   (megadlms COMMAND --help for a command's flags)" % ",".join(COMMANDS)
    if not argv or argv[0] in ("-h", "--help"):  # a bare `megadlms` prints this too: it starts no run
        print(usage + "\n")
        for name, (_, doc) in COMMANDS.items():
            print(f"  {name:<12} {doc}")
        print("\n`megadlms train` with no flags trains the demo (`make demo`)")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"megadlms: unknown command {command!r}\nusage: {usage}", file=sys.stderr)
        return 2
    return run_command(command, rest)


if __name__ == "__main__":
    sys.exit(main())
