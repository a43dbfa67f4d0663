"""`megadlms export`: write a checkpoint's weights as an inference export (BF16, or FP8 linears + scales)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..fp8.export import CONFIG, SCALINGS, export_model
from ..training.checkpoint import load_model_from_checkpoint


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--load", required=True, help="a MegaDLMs checkpoint (a --save folder or one iter_* folder)")
    parser.add_argument("--save", required=True, help="output folder")
    parser.add_argument("--fp8", action="store_true", help="store the FP8 linears' weights as float8_e4m3fn + scales")
    parser.add_argument("--fp8-scaling", choices=SCALINGS, default="tensor",
                        help="one scale per weight tensor (default) or per output channel")
    parser.add_argument("--ckpt-step", type=int, default=None, help="iteration to export (default: the latest)")


def run(args: argparse.Namespace) -> int:
    model, cfg, meta = load_model_from_checkpoint(args.load, device="cpu", iteration=args.ckpt_step)
    info = export_model(model, cfg, args.save, fp8=args.fp8, scaling=args.fp8_scaling,
                        tokenizer_dir=meta.get("tokenizer_dir"))
    mib = 1024 ** 2
    kind = f"FP8 E4M3 linears ({info['fp8_tensors']}, per-{args.fp8_scaling} scales), BF16 rest" if args.fp8 \
        else "BF16"
    print(f"wrote {info['path']}: {info['bytes'] / mib:.1f} MiB ({kind})")
    print(f"a BF16 export: {info['bf16_bytes'] / mib:.1f} MiB; this export is "
          f"{info['bytes'] / info['bf16_bytes']:.2f}x of it")
    note = "" if meta.get("tokenizer_dir") else " (the checkpoint has no tokenizer)"
    print(f"config: {Path(args.save) / CONFIG}{note}")
    return 0
