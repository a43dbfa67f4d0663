"""Masked-diffusion objective and samplers."""

from .objective import (BatchNoise, MaskSampler, ObjectiveConfig, chunked_weighted_cross_entropy, mask_tokens,
                        prepare_batch, weighted_cross_entropy)

__all__ = ["BatchNoise", "MaskSampler", "ObjectiveConfig", "chunked_weighted_cross_entropy", "mask_tokens",
           "prepare_batch", "weighted_cross_entropy"]
