"""The flags that name a model to load, shared by the commands that run one (`generate`, `eval`)."""

from __future__ import annotations

import argparse


def add_model_source(g: argparse._ArgumentGroup) -> None:
    """--load | --hf-model | --fp8-export (one required), --iteration, --tokenizer and --device into group `g`."""
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--load", metavar="DIR", help="a megadlms checkpoint folder (as written by `megadlms train`)")
    src.add_argument("--hf-model", metavar="DIR", help="a Hugging Face model folder (e.g. `megadlms convert` output)")
    src.add_argument("--fp8-export", metavar="DIR", help="a model exported with FP8 weights (`megadlms export`)")
    g.add_argument("--iteration", type=int, default=None, help="with --load: this iteration (default: the latest)")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the one stored with the model)")
    g.add_argument("--device", default="auto",
                   help="auto (a CUDA device if available; under torchrun `eval` takes cuda:LOCAL_RANK), cpu, cuda, "
                        "cuda:N")
