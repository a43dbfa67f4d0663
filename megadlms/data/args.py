"""Training-data command-line flags (Megatron-LM names) and their mapping to `DataConfig`."""

from __future__ import annotations

import argparse

from .loader import DEFAULT_SPLIT, DataConfig
from .tokenizer import SUPPORTED_TOKENIZER_TYPES


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """Register --data-path, --split, --{train,valid,test}-data-path, --data-cache-path, --tokenizer-type,
    --tokenizer-model and --num-workers."""
    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="dataset prefix(es) without .bin/.idx, or weighted 'w1 prefix1 w2 prefix2 ...'; "
                        "omit for the bundled demo corpus")
    g.add_argument("--split", default=DEFAULT_SPLIT,
                   help="train,valid,test proportions of each --data-path as contiguous document ranges "
                        "(default 969,30,1; the bundled corpus uses 98,1,1 unless this is set)")
    g.add_argument("--train-data-path", nargs="*", default=None, help="training prefix(es), used whole")
    g.add_argument("--valid-data-path", nargs="*", default=None, help="validation prefix(es), used whole")
    g.add_argument("--test-data-path", nargs="*", default=None, help="test prefix(es), used whole")
    g.add_argument("--data-cache-path", default=None,
                   help="folder for cached sample indices (default: 'cache' beside the first data prefix, "
                        "else $MEGADLMS_CACHE or ~/.cache/megadlms)")
    g.add_argument("--tokenizer-type", default="HuggingFaceTokenizer",
                   help=f"tokenizer kind; supported: {', '.join(SUPPORTED_TOKENIZER_TYPES)}")
    g.add_argument("--tokenizer-model", default=None,
                   help="tokenizer.json or a folder holding one (default: the bundled 4096-token BPE)")
    g.add_argument("--num-workers", type=int, default=2, help="DataLoader worker processes per rank")
    g = parser.add_argument_group("supervised fine-tuning (packed chat data)")
    g.add_argument("--sft", action="store_true",
                   help="fine-tune on chat datasets (`megadlms preprocess --chat`): conversations packed into "
                        "--seq-length windows, loss on assistant tokens only, prompts never masked")
    g.add_argument("--sft-pad", choices=("eos", "ignore"), default="eos",
                   help="the tail of a window: eos = EOD tokens trained on as the last response's end (LLaDA); "
                        "ignore = pads carry no loss and are not attended")
    g.add_argument("--truncate", action="store_true",
                   help="cut conversations longer than --seq-length to their first --seq-length tokens (default: "
                        "such a conversation is an error)")
    g.add_argument("--reset-attention-mask", action=argparse.BooleanOptionalAction, default=None,
                   help="document-level attention: a token attends only inside its own document / conversation "
                        "(default: on with --sft; in pre-training documents end at the EOD token)")
    g.add_argument("--reset-position-ids", action=argparse.BooleanOptionalAction, default=None,
                   help="positions restart at 0 at each document / conversation (default: on with --sft)")


def data_config_from_args(args: argparse.Namespace, *, seq_length: int, micro_batch_size: int, seed: int,
                          train_samples: int, eval_samples: int) -> DataConfig:
    """The DataConfig for parsed flags; sizes and seed come from the trainer's own arguments."""
    return DataConfig(data_path=args.data_path or None, split=args.split,
                      train_data_path=args.train_data_path or None, valid_data_path=args.valid_data_path or None,
                      test_data_path=args.test_data_path or None, data_cache_path=args.data_cache_path,
                      seq_length=seq_length, micro_batch_size=micro_batch_size, seed=seed,
                      num_workers=args.num_workers, train_samples=train_samples, eval_samples=eval_samples,
                      sft=args.sft, sft_pad=args.sft_pad, truncate=args.truncate)
