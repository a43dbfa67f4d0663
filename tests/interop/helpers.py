"""Helpers of the interop tests: tiny random Qwen3 / Qwen2 / Llama models and a small tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

transformers.utils.logging.disable_progress_bar()

VOCAB = 100  # embedding rows
TOKENIZER_IDS = 90  # tokenizer ids: rows 90..99 are vocabulary padding
MASK_ID = 1  # "<|mask|>" in the test tokenizer

_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=None,
               eos_token_id=0, pad_token_id=2)

# family -> (config class, model class, extra config). Qwen3: head_dim 16 != hidden/heads; Llama: a large rope base.
FAMILIES = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=16, tie_word_embeddings=True, rope_theta=1e6)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=False)),
    "llama": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False, rope_theta=500000.0, head_dim=8)),
}


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random values everywhere (norm weights around 1, non-zero biases) so that a wrong mapping shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.15 * noise)
    return model


def write_tokenizer(folder: Path, n_ids: int = TOKENIZER_IDS) -> Path:
    """A word-level tokenizer with `n_ids` ids (0 EOD, 1 mask, 2 pad), saved as transformers saves it."""
    vocab = {"<|endoftext|>": 0, "<|mask|>": 1, "<|pad|>": 2, **{f"w{i}": i for i in range(3, n_ids)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|pad|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>",
                            mask_token="<|mask|>").save_pretrained(str(folder))
    return folder


def make_hf_model(family: str, seed: int = 0):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**_COMMON, **extra))
    return randomize_(model, seed).eval()


def load_transformers(path: Path, causal: bool):
    """transformers' model of `path`, fp32 SDPA, switched to causal or bidirectional attention."""
    from megadlms.interop import set_causal

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                              attn_implementation="sdpa")
    return set_causal(model, causal).eval()
