"""Hugging Face interop: import Qwen3 / Qwen2 / Llama folders, export to the stock architectures."""

from .hf import (
    DEFAULT_MAX_SHARD_SIZE,
    SUPPORTED_ARCHITECTURES,
    InteropError,
    hf_architecture,
    hf_config_to_megadlms,
    hf_state_dict_to_megadlms,
    load_hf_model,
    load_hf_state_dict,
    make_bidirectional,
    megadlms_config_to_hf,
    megadlms_state_dict_to_hf,
    save_hf_model,
    save_safetensors_sharded,
    set_causal,
)
from .verify import DEFAULT_TOLERANCE, VerifyResult, compare_models, verification_batch, verify_against_folder

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "DEFAULT_TOLERANCE", "SUPPORTED_ARCHITECTURES", "InteropError", "VerifyResult",
           "compare_models", "hf_architecture", "hf_config_to_megadlms", "hf_state_dict_to_megadlms",
           "load_hf_model", "load_hf_state_dict", "make_bidirectional", "megadlms_config_to_hf",
           "megadlms_state_dict_to_hf", "save_hf_model", "save_safetensors_sharded", "set_causal",
           "verification_batch", "verify_against_folder"]
