"""Training-data command-line flags (Megatron-LM names), `DataSourceConfig` (their dests as fields) and its
mapping to the loader's `DataConfig`."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from ..config import ConfigError
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


@dataclass
class DataSourceConfig:
    """Where a run's tokens come from: dataset prefixes and split, tokenizer, index cache, loader workers.
    No data path: the bundled demo corpus."""

    data_path: list[str] | None = None  # prefixes, or "w1 prefix1 w2 prefix2 ..." tokens
    split: str = DEFAULT_SPLIT
    train_data_path: list[str] | None = None
    valid_data_path: list[str] | None = None
    test_data_path: list[str] | None = None
    data_cache_path: str | None = None
    tokenizer_type: str = "HuggingFaceTokenizer"
    tokenizer_model: str | None = None  # None: the bundled 4096-token BPE
    num_workers: int = 2
    sft: bool = False  # packed chat data (`megadlms preprocess --chat`), loss on assistant tokens
    sft_pad: str = "eos"  # a window's tail: "eos" (trained on) | "ignore" (no loss, not attended)
    truncate: bool = False  # cut conversations longer than seq_length instead of an error
    reset_attention_mask: bool | None = None  # document-level attention; None: on with sft
    reset_position_ids: bool | None = None  # positions restart per document; None: on with sft

    def __post_init__(self) -> None:
        if self.num_workers < 0:
            raise ConfigError(f"--num-workers {self.num_workers} must be >= 0")
        if self.sft_pad not in ("eos", "ignore"):
            raise ConfigError(f"--sft-pad {self.sft_pad!r} must be eos or ignore")

    def loader_config(self, *, seq_length: int, micro_batch_size: int, seed: int, train_samples: int,
                      eval_samples: int) -> DataConfig:
        """The loaders' DataConfig; sizes and seed come from the run's model and training settings."""
        return DataConfig(data_path=self.data_path or None, split=self.split,
                          train_data_path=self.train_data_path or None, valid_data_path=self.valid_data_path or None,
                          test_data_path=self.test_data_path or None, data_cache_path=self.data_cache_path,
                          seq_length=seq_length, micro_batch_size=micro_batch_size, seed=seed,
                          num_workers=self.num_workers, train_samples=train_samples, eval_samples=eval_samples,
                          sft=self.sft, sft_pad=self.sft_pad, truncate=self.truncate)


def data_config_from_args(args: argparse.Namespace, **sizes: int) -> DataConfig:
    """The DataConfig for flags parsed by `add_data_arguments`; `sizes`: as `DataSourceConfig.loader_config`'s."""
    source = DataSourceConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DataSourceConfig)})
    return source.loader_config(**sizes)
