"""Masked-diffusion and block-diffusion (BD3-LM) objectives and samplers."""

from .bd3lm_sampler import bd3lm_generate, bd3lm_generate_tokens
from .dream_sampler import dream_generate, dream_generate_tokens
from .fast_sampler import fast_generate, fast_generate_tokens
from .kv_cache import AppendCache, BlockCache, DualCache, PrefixCache
from .objective import (
    BatchNoise,
    MaskSampler,
    ObjectiveConfig,
    chunked_weighted_cross_entropy,
    mask_tokens,
    prepare_batch,
    weighted_cross_entropy,
)
from .sampler import generate, generate_tokens, get_num_transfer_tokens

__all__ = ["BatchNoise", "MaskSampler", "ObjectiveConfig", "chunked_weighted_cross_entropy", "mask_tokens",
           "prepare_batch", "weighted_cross_entropy", "fast_generate", "fast_generate_tokens", "AppendCache",
           "BlockCache", "DualCache", "PrefixCache", "generate", "generate_tokens", "get_num_transfer_tokens",
           "bd3lm_generate", "bd3lm_generate_tokens", "dream_generate", "dream_generate_tokens"]
