"""`megadlms export`: write a checkpoint's weights as an inference export (BF16, or FP8 linears + scales), in our
layout or as a Hugging Face folder."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..fp8.export import CONFIG, SCALINGS, export_hf, export_model, scaling_of
from ..training.checkpoint import load_model_from_checkpoint


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--load", required=True, help="a MegaDLMs checkpoint (a --save folder or one iter_* folder)")
    parser.add_argument("--save", required=True, help="output folder")
    parser.add_argument("--fp8", action="store_true", help="store the FP8 linears' weights as float8_e4m3fn + scales")
    parser.add_argument("--fp8-scaling", choices=SCALINGS, default=None,
                        help="one scale per weight tensor, per output channel, or per 128x128 block (DeepSeek-V3's "
                             "weight_scale_inv layout); default: block for a checkpoint trained with --fp8-recipe "
                             "blockwise and for --hf, else tensor")
    parser.add_argument("--hf", action="store_true",
                        help="write a Hugging Face folder (transformers' names and config.json); with --fp8 the "
                             "block-scaled weights carry transformers' fine-grained FP8 quantization_config")
    parser.add_argument("--ckpt-step", "--iteration", dest="ckpt_step", type=int, default=None,
                        help="iteration to export (default: the latest); --iteration is the same flag")


def run(args: argparse.Namespace) -> int:
    model, cfg, meta = load_model_from_checkpoint(args.load, device="cpu", iteration=args.ckpt_step)
    scaling = args.fp8_scaling or ("block" if args.hf else scaling_of(cfg))
    write = export_hf if args.hf else export_model
    info = write(model, cfg, args.save, fp8=args.fp8, scaling=scaling, tokenizer_dir=meta.get("tokenizer_dir"))
    mib = 1024 ** 2
    kind = f"FP8 E4M3 linears ({info['fp8_tensors']}, per-{scaling} scales), BF16 rest" if args.fp8 else "BF16"
    where = "a Hugging Face folder" if args.hf else "an export folder"
    print(f"wrote {info['path']}: {info['bytes'] / mib:.1f} MiB ({kind}; {where})")
    print(f"a BF16 export: {info['bf16_bytes'] / mib:.1f} MiB; this export is "
          f"{info['bytes'] / info['bf16_bytes']:.2f}x of it")
    note = "" if meta.get("tokenizer_dir") else " (the checkpoint has no tokenizer)"
    print(f"config: {Path(args.save) / CONFIG}{note}")
    return 0
