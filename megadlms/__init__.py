"""MegaDLMs: train diffusion (and autoregressive) language models in PyTorch, with native FP8."""

from .build import build_model
from .config import ConfigError, TransformerConfig
from .model import TransformerLM
from .presets import PRESETS, load_model_config, preset_config

__version__ = "0.1.0"

__all__ = ["ConfigError", "TransformerConfig", "TransformerLM", "build_model", "PRESETS",
           "load_model_config", "preset_config", "__version__"]
