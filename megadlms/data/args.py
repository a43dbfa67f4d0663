"""`DataSourceConfig`: a training run's data settings, each field also its command-line flag (Megatron-LM names;
`megadlms.settings`), and its mapping to the loader's `DataConfig`."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from ..config import ConfigError
from ..settings import add_setting_arguments, parser_groups, setting
from .loader import DEFAULT_SPLIT, DataConfig
from .tokenizer import SUPPORTED_TOKENIZER_TYPES

DATA_GROUP = "data"
SFT_GROUP = "supervised fine-tuning (packed chat data)"


@dataclass
class DataSourceConfig:
    """Where a run's tokens come from: dataset prefixes and split, tokenizer, index cache, loader workers.
    No data path: the bundled demo corpus."""

    data_path: list[str] | None = setting(
        None, "dataset prefix(es) without .bin/.idx, or weighted 'w1 prefix1 w2 prefix2 ...'; omit for the bundled "
              "demo corpus", group=DATA_GROUP)
    split: str = setting(DEFAULT_SPLIT, "train,valid,test proportions of each --data-path as contiguous document "
                                        "ranges (the bundled corpus uses 98,1,1 unless this is set)", group=DATA_GROUP)
    train_data_path: list[str] | None = setting(None, "training prefix(es), used whole", group=DATA_GROUP)
    valid_data_path: list[str] | None = setting(None, "validation prefix(es), used whole", group=DATA_GROUP)
    test_data_path: list[str] | None = setting(None, "test prefix(es), used whole", group=DATA_GROUP)
    data_cache_path: str | None = setting(
        None, "folder for cached sample indices (default: 'cache' beside the first data prefix, else $MEGADLMS_CACHE "
              "or ~/.cache/megadlms)", group=DATA_GROUP)
    tokenizer_type: str = setting("HuggingFaceTokenizer",
                                  f"tokenizer kind; supported: {', '.join(SUPPORTED_TOKENIZER_TYPES)}",
                                  group=DATA_GROUP)
    tokenizer_model: str | None = setting(None, "tokenizer.json or a folder holding one (default: the bundled "
                                                "4096-token BPE)", group=DATA_GROUP)
    num_workers: int = setting(2, "DataLoader worker processes per rank", group=DATA_GROUP)
    sft: bool = setting(False, "fine-tune on chat datasets (`megadlms preprocess --chat`): conversations packed "
                               "into --seq-length windows, loss on assistant tokens only, prompts never masked",
                        group=SFT_GROUP)
    sft_pad: str = setting("eos", "the tail of a window: eos = EOD tokens trained on as the last response's end "
                                  "(LLaDA); ignore = pads carry no loss and are not attended",
                           choices=("eos", "ignore"), group=SFT_GROUP)
    truncate: bool = setting(False, "cut conversations longer than --seq-length to their first --seq-length tokens "
                                    "(default: such a conversation is an error)", group=SFT_GROUP)
    reset_attention_mask: bool | None = setting(
        None, "document-level attention: a token attends only inside its own document / conversation (default: on "
              "with --sft; in pre-training documents end at the EOD token)", group=SFT_GROUP)
    reset_position_ids: bool | None = setting(None, "positions restart at 0 at each document / conversation "
                                                    "(default: on with --sft)", group=SFT_GROUP)

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


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the data and SFT flags: one per `DataSourceConfig` setting."""
    add_setting_arguments(parser_groups(parser), DataSourceConfig, DATA_GROUP)


def data_config_from_args(args: argparse.Namespace, **sizes: int) -> DataConfig:
    """The DataConfig for flags parsed from `DataSourceConfig`'s settings; `sizes`: as
    `DataSourceConfig.loader_config`'s."""
    source = DataSourceConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DataSourceConfig)})
    return source.loader_config(**sizes)
