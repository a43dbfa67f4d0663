"""Data pipeline: tokenizer, Megatron indexed datasets, preprocessing, GPT-style samples, resumable loaders."""

from .args import add_data_arguments, data_config_from_args
from .chat import ChatError, ChatRenderer
from .dataset import BlendedDataset, DataError, GPTDataset, blending_indices, parse_blend, parse_split, split_ranges
from .indexed import IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError, optimal_dtype
from .loader import DataConfig, Loaders, StatefulLoader, build_loaders
from .preprocess import PreprocessError, bundled_dataset, preprocess_jsonl
from .sft import PackedChatDataset, is_chat_dataset, loss_mask_prefix
from .tokenizer import Tokenizer, TokenizerError, default_tokenizer_path, load_tokenizer

__all__ = ["Tokenizer", "TokenizerError", "load_tokenizer", "default_tokenizer_path", "DataConfig", "Loaders",
           "StatefulLoader", "build_loaders", "add_data_arguments", "data_config_from_args", "IndexedDataset",
           "IndexedDatasetBuilder", "IndexedDatasetError", "optimal_dtype", "GPTDataset", "BlendedDataset",
           "DataError", "blending_indices", "parse_blend", "parse_split", "split_ranges", "preprocess_jsonl",
           "PreprocessError", "bundled_dataset", "ChatError", "ChatRenderer", "PackedChatDataset",
           "is_chat_dataset", "loss_mask_prefix"]
