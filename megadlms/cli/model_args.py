"""The flags that name a model to load, shared by the commands that run one (`generate`, `eval`)."""

from __future__ import annotations

import argparse


def add_model_source(g: argparse._ArgumentGroup) -> None:
    """--load | --hf-model | --fp8-export (one required), --ckpt-step, --tokenizer-model, --tokenizer-type and
    --device into group `g`."""
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--load", metavar="DIR", help="a megadlms checkpoint folder (as written by `megadlms train`)")
    src.add_argument("--hf-model", metavar="DIR", help="a Hugging Face model folder (e.g. `megadlms convert` output)")
    src.add_argument("--fp8-export", metavar="DIR", help="a model exported with FP8 weights (`megadlms export`)")
    g.add_argument("--ckpt-step", "--iteration", dest="iteration", type=int, default=None,
                   help="with --load: this iteration (default: the latest); --iteration is the same flag")
    add_tokenizer_arguments(g, "default: the one stored with the model")
    g.add_argument("--device", default="auto",
                   help="auto (a CUDA device if available; under torchrun `eval` takes cuda:LOCAL_RANK), cpu, cuda, "
                        "cuda:N")


def add_tokenizer_arguments(g: argparse._ActionsContainer, default: str) -> None:
    """--tokenizer-model (alias --tokenizer) and --tokenizer-type, as `train` and `preprocess` name them."""
    g.add_argument("--tokenizer-model", "--tokenizer", dest="tokenizer_model", metavar="PATH", default=None,
                   help=f"tokenizer.json or a folder holding one ({default}); --tokenizer is the same flag")
    g.add_argument("--tokenizer-type", default=None,
                   help="tokenizer kind, as in `train` and `preprocess`; supported: HuggingFaceTokenizer (the default)")


def check_tokenizer_type(args: argparse.Namespace) -> None:
    """A --tokenizer-type other than HuggingFaceTokenizer is refused with the message `train` gives."""
    if args.tokenizer_type is not None:
        from ..data.tokenizer import check_tokenizer_type as check

        check(args.tokenizer_type)
