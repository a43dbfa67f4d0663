"""`megadlms plot RUN_DIR [RUN_DIR ...] --output curves.png`: training curves of runs, side by side.

    megadlms plot runs/fp8 runs/bf16 --output curves.png --title "FP8 vs BF16"
"""

from __future__ import annotations

import argparse
import sys

from ..eval.plot import plot_runs


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders holding metrics.jsonl (or the files)")
    p.add_argument("--output", default="curves.png", help="image file to write (png, pdf, svg)")
    p.add_argument("--labels", default=None, help="comma-separated names for the runs (default: folder names)")
    p.add_argument("--title", default=None)
    return p


def run(args: argparse.Namespace) -> int:
    labels = [s.strip() for s in args.labels.split(",")] if args.labels else None
    out = plot_runs(args.runs, args.output, labels, args.title)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`megadlms plot ARGV`, with its one-line errors."""
    from . import run_command

    return run_command("plot", sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
