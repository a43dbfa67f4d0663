"""`TransformerConfig`: the architecture and precision of a model, with Megatron-Core field names.

One dataclass, validated in `__post_init__`: every error names the field, the value and the fix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import MegaDLMsError
from .settings import flag_name, setting

ATTN_MASK_TYPES = ("bidirectional", "causal")
FP8_FORMATS = ("e4m3", "hybrid")
FP8_AMAX_ALGOS = ("max", "most_recent")
MOE_SCORE_FUNCTIONS = ("softmax", "sigmoid")
DIFFUSION_LOSSES = ("subs", "full-vocab")  # subs: MDLM's, [MASK] out of the softmax; full-vocab: LLaDA's
DEFAULT_DIFFUSION_LOSS = "subs"


class ConfigError(MegaDLMsError, ValueError):
    """A configuration value is invalid; the message says which, why, and what to use instead."""


def _recipe_names() -> tuple[str, ...]:
    """The --fp8-recipe choices (asked when a parser is built: the recipes import this module)."""
    from .fp8.recipe import RECIPE_NAMES

    return RECIPE_NAMES


@dataclass
class FP8Settings:
    """The FP8 settings of a model, defined once, with Megatron-Core's names and defaults (Transformer Engine
    semantics): `TransformerConfig` has them, and so has the trainer's `FP8Config` (its flags), which hands them
    over unchanged. Whether FP8 is on and its format are each config's own (`TransformerConfig.fp8` /
    `fp8_format`; `FP8Config.fp8_format`, None for off). The `DelayedScaling` dataclass keeps Transformer Engine's
    own defaults (history 1024, 'max') as the Python API TE users know; `recipe_from_config` builds it from these."""

    fp8_recipe: str = setting("delayed", "scaling: delayed / tensorwise (per tensor), rowwise, blockwise (1x128 "
                                         "tiles, 128x128 weight blocks; Hopper, e4m3), mxfp8 (32-element E8M0 blocks; "
                                         "Blackwell, e4m3)", choices=_recipe_names)
    fp8_margin: int = setting(0, "scales divided by 2**margin (headroom above the amax)")
    # Megatron's defaults (TE's DelayedScaling uses 1024, "max")
    fp8_amax_history_len: int = setting(1, "delayed scaling: steps of amax history")
    fp8_amax_compute_algo: str = setting("most_recent", "delayed scaling: the scale's amax, the history's max or its "
                                                        "most recent", choices=FP8_AMAX_ALGOS)
    fp8_wgrad: bool = setting(True, "the weight-gradient GEMM in FP8 (--no-fp8-wgrad: in BF16)")
    # megadlms.fp8.grouped.EXPERTS_FP8_WGRAD: off, the FP8 grouped weight-gradient GEMM being the slower one on Hopper
    fp8_experts_wgrad: bool = setting(False, "the MoE experts' weight-gradient GEMMs in FP8 too (with --fp8-wgrad; "
                                             "default: in BF16, faster on Hopper: docs/moe.md)")
    activation_func_fp8_input_store: bool = setting(False, "save the SwiGLU input for backward in FP8")
    # megadlms.fp8.fusions.fused_linear
    fp8_fuse_projections: bool = setting(True, "run q/k/v and gate/up as one FP8 GEMM each (same parameters and "
                                               "checkpoints)")
    fp8_fuse_mlp: bool = setting(True, "run the FP8 MLP as one function with the SwiGLU fused into its FP8 casts "
                                       "(delayed and tensorwise scaling)")  # megadlms.fp8.fusions.fused_mlp
    # Hopper fast accumulation in the forward GEMM (TE's and torchao's default)
    fp8_fprop_fast_accum: bool = setting(True, "fast accumulation in the forward FP8 GEMM (off: full-precision "
                                               "accumulation, slower)")
    # the FP8 layers' attention in FP8 too (Megatron's --fp8-dot-product-attention); inert without fp8
    fp8_dot_product_attention: bool = setting(
        False, "attention in FP8 too: cuDNN's FP8 flash attention (Hopper or newer; needs the nvidia-cudnn-frontend "
               "package), delayed scaling; a little faster, but it lowers model quality (docs/fp8.md)")
    fp8_pow2_scales: bool = setting(False, "blockwise: scales rounded down to powers of two (dequantisation is exact)")
    # Megatron's --first-last-layers-bf16: keep num_layers_at_{start,end}_in_bf16 layers in BF16 (`bf16_edges`)
    first_last_layers_bf16: bool = setting(False, "keep the first/last transformer layers in BF16 (counts below)")
    num_layers_at_start_in_bf16: int = setting(1, "with --first-last-layers-bf16: first layers kept in BF16")
    num_layers_at_end_in_bf16: int = setting(1, "with --first-last-layers-bf16: last layers kept in BF16")

    def bf16_edges(self) -> tuple[int, int]:
        """(layers at the start, layers at the end) kept in BF16: the counts with first_last_layers_bf16, else none."""
        if not self.first_last_layers_bf16:
            return 0, 0
        return self.num_layers_at_start_in_bf16, self.num_layers_at_end_in_bf16

    def check_fp8_settings(self, fp8_format: str | None, label: Callable[[str, Any], str]) -> None:
        """Raise ConfigError (one line) for an invalid FP8 setting; `label(name, value)` spells the setting as its
        config does (a field, `name=value`, or a flag, `--name value`). fp8_format: the format, None when FP8 is
        off (the recipe rules are then not asked)."""
        from .fp8.recipe import RECIPE_NAMES, attention_problem, format_problem  # the recipes' rules, asked

        for name, choices in (("fp8_recipe", RECIPE_NAMES), ("fp8_amax_compute_algo", FP8_AMAX_ALGOS)):
            value = getattr(self, name)
            if value not in choices:
                raise ConfigError(f"{label(name, value)} is not one of {list(choices)}")
        for name, low in (("fp8_margin", 0), ("fp8_amax_history_len", 1), ("num_layers_at_start_in_bf16", 0),
                          ("num_layers_at_end_in_bf16", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"{label(name, value)} must be an integer")
            if value < low:
                raise ConfigError(f"{label(name, value)} must be >= {low}")
        if fp8_format is None:
            return
        problem = format_problem(self.fp8_recipe, fp8_format, self.fp8_pow2_scales)
        if problem is None and self.fp8_dot_product_attention:
            problem = attention_problem(self.fp8_recipe)
        if problem:
            raise ConfigError(problem)


@dataclass
class TransformerConfig(FP8Settings):
    # --- architecture (Megatron-Core names) ---
    num_layers: int = 2
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: int | None = None  # GQA groups (KV heads); None = num_attention_heads
    kv_channels: int | None = None  # head dim; None = hidden_size // num_attention_heads
    ffn_hidden_size: int | None = None  # None = 4 * hidden_size
    vocab_size: int = 1024
    seq_length: int = 256
    max_position_embeddings: int | None = None  # None = seq_length
    rotary_base: float = 10000.0
    norm_epsilon: float = 1e-6
    qk_layernorm: bool = False
    add_qkv_bias: bool = False  # Qwen2 / Qwen2.5
    untie_embeddings_and_output_weights: bool = False  # Megatron default: tied
    init_method_std: float = 0.02
    attn_mask_type: str = "bidirectional"  # DLM: bidirectional; AR (vanilla): causal
    mask_token_id: int | None = None  # the diffusion [MASK] id, recorded for export / sampling
    block_size: int | None = None  # block diffusion (BD3-LM): tokens per block; None for other models
    diffusion_shift: bool = False  # difflm-shift (Dream): the logits at position i predict token i + 1
    # the diffusion cross-entropy the model is trained and scored with (DIFFUSION_LOSSES): full-vocab for LLaDA and
    # Dream, which were trained with it; None: the project default, subs (`loss`)
    diffusion_loss: str | None = None

    # --- mixture of experts (Megatron-Core names; megadlms.moe). num_moe_experts None: a dense model ---
    num_moe_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None  # each routed expert's FFN width; None = ffn_hidden_size
    moe_shared_expert_intermediate_size: int | None = None  # an always-on shared expert of this width; None: none
    moe_layer_freq: int | list[int] = 1  # N: every Nth layer (0, N, 2N, ...) is MoE; or a 0/1 pattern per layer
    moe_router_score_function: str = "softmax"  # softmax | sigmoid (DeepSeek-V3)
    moe_router_pre_softmax: bool = False  # softmax over all experts before top-k (else over the k chosen)
    moe_router_topk_scaling_factor: float | None = None  # multiplies the routing weights
    moe_aux_loss_coeff: float = 0.0  # Switch/GShard load-balancing loss, added to the training loss
    moe_z_loss_coeff: float | None = None  # router z-loss (ST-MoE)
    moe_router_enable_expert_bias: bool = False  # DeepSeek-V3 aux-loss-free balancing (a bias on the selection)
    moe_router_bias_update_rate: float = 1e-3  # the expert bias's step per optimizer step

    # --- FP8 (Transformer Engine / Megatron-Core semantics): on/off and the format here, the rest `FP8Settings` ---
    fp8: bool | str = False  # True, or Megatron's string form "e4m3" | "hybrid"
    fp8_format: str = "hybrid"

    # free-form provenance (e.g. the HF architecture a config came from); not validated
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Megatron's string form: fp8="e4m3" | "hybrid" means fp8=True with that format.
        if isinstance(self.fp8, str):
            _choice("fp8", self.fp8, FP8_FORMATS, "or pass fp8=True with fp8_format=...")
            self.fp8_format, self.fp8 = self.fp8, True
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                     "ffn_hidden_size", "vocab_size", "seq_length", "max_position_embeddings"):
            _positive(name, getattr(self, name))
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads}; set kv_channels (the head dim) explicitly or "
                    "choose a hidden_size that is a multiple of the head count")
            self.kv_channels = self.hidden_size // self.num_attention_heads
        _positive("kv_channels", self.kv_channels)
        if self.kv_channels % 2:
            raise ConfigError(f"kv_channels={self.kv_channels} must be even for rotary embeddings")
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_query_groups={self.num_query_groups}; use a group count that divides "
                "the head count (e.g. 1, 2, 4, 8)")
        if self.seq_length > self.max_position_embeddings:
            raise ConfigError(
                f"seq_length={self.seq_length} exceeds max_position_embeddings="
                f"{self.max_position_embeddings}; raise max_position_embeddings or shorten seq_length")
        if self.norm_epsilon <= 0:
            raise ConfigError(f"norm_epsilon={self.norm_epsilon} must be > 0 (e.g. 1e-6)")
        if self.rotary_base <= 0:
            raise ConfigError(f"rotary_base={self.rotary_base} must be > 0 (e.g. 10000 or 1e6)")
        if self.init_method_std <= 0:
            raise ConfigError(f"init_method_std={self.init_method_std} must be > 0 (e.g. 0.02)")
        _choice("attn_mask_type", self.attn_mask_type, ATTN_MASK_TYPES)
        if self.diffusion_loss is not None:
            _choice("diffusion_loss", self.diffusion_loss, DIFFUSION_LOSSES, "or None for the default, subs")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(
                f"mask_token_id={self.mask_token_id} is outside the vocabulary [0, {self.vocab_size}); "
                "use a token id of the tokenizer (e.g. its <|mask|> token) or enlarge vocab_size")
        if self.block_size is not None and (self.block_size <= 0 or self.seq_length % self.block_size):
            raise ConfigError(f"block_size={self.block_size} must be a positive divisor of "
                              f"seq_length={self.seq_length}")
        _choice("fp8_format", self.fp8_format, FP8_FORMATS)
        self.check_fp8_settings(self.fp8_format if self.fp8 else None, lambda name, value: f"{name}={value!r}")
        _check_moe(self)
        start, end = self.bf16_edges()
        if start + end > self.num_layers:
            raise ConfigError(
                f"num_layers_at_start_in_bf16 + num_layers_at_end_in_bf16 = {start + end} exceeds "
                f"num_layers={self.num_layers} (first_last_layers_bf16=True); keep fewer layers in BF16")

    # The fields that default to None, as __post_init__ filled them in
    @property
    def head_dim(self) -> int:
        assert self.kv_channels is not None  # filled in by __post_init__
        return self.kv_channels

    @property
    def query_groups(self) -> int:
        assert self.num_query_groups is not None
        return self.num_query_groups

    @property
    def ffn_dim(self) -> int:
        assert self.ffn_hidden_size is not None
        return self.ffn_hidden_size

    @property
    def max_positions(self) -> int:
        assert self.max_position_embeddings is not None
        return self.max_position_embeddings

    @property
    def causal(self) -> bool:
        return self.attn_mask_type == "causal"

    @property
    def running_mode(self) -> str:
        """The `--model-running-mode` this architecture computes: bd3lm (a block size), vanilla (causal),
        difflm-shift (position i predicts token i + 1) or difflm-noshift."""
        if self.block_size is not None:
            return "bd3lm"
        if self.causal:
            return "vanilla"
        return "difflm-shift" if self.diffusion_shift else "difflm-noshift"

    @property
    def loss(self) -> str:
        """The diffusion cross-entropy the model records (`diffusion_loss`), else the default, subs."""
        return self.diffusion_loss or DEFAULT_DIFFUSION_LOSS

    @property
    def is_moe(self) -> bool:
        return self.num_moe_experts is not None

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether transformer layer `layer_idx` has an MoE block instead of a dense MLP (`moe_layer_freq`)."""
        if self.num_moe_experts is None:
            return False
        freq = self.moe_layer_freq
        return bool(freq[layer_idx]) if isinstance(freq, list) else layer_idx % freq == 0

    def num_matmul_params(self) -> int:
        """Parameters that take part in matmuls per token (FLOPs accounting): all linears plus the LM head; an MoE
        layer counts its router, the top-k routed experts and the shared expert (the active parameters)."""
        h, d, f, groups = self.hidden_size, self.head_dim, self.ffn_hidden_size, self.num_query_groups
        assert f is not None and groups is not None  # filled in by __post_init__
        q, kv = self.num_attention_heads * d, groups * d
        mlp = 0
        for i in range(self.num_layers):
            if not self.is_moe_layer(i):
                mlp += 3 * h * f
                continue
            assert self.num_moe_experts is not None and self.moe_ffn_hidden_size is not None
            mlp += h * self.num_moe_experts + self.moe_router_topk * 3 * h * self.moe_ffn_hidden_size
            mlp += 3 * h * (self.moe_shared_expert_intermediate_size or 0)
        return self.num_layers * (h * (q + 2 * kv) + q * h) + mlp + self.vocab_size * h

    def flops_per_token(self, seq_length: int | None = None) -> float:
        """Training FLOPs per token: 6*N_matmul + attention (12*L*S*H_attn bidirectional, 6*... causal)."""
        s = seq_length or self.seq_length
        attn = (6 if self.causal else 12) * self.num_layers * s * self.num_attention_heads * self.head_dim
        return 6.0 * self.num_matmul_params() + attn

    def attention_flops_per_pair(self) -> float:
        """Training FLOPs of attention per (query, key) pair attended: 12*L*H_attn (QK^T and PV, forward and
        backward). A bidirectional row of S tokens attends S^2 pairs, a causal one S(S+1)/2."""
        return 12.0 * self.num_layers * self.num_attention_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TransformerConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"unknown TransformerConfig fields {unknown}; known fields: {sorted(names)}")
        if "first_last_layers_bf16" not in d:  # saved before the switch: its counts were the layers kept in BF16
            start, end = d.get("num_layers_at_start_in_bf16", 0), d.get("num_layers_at_end_in_bf16", 0)
            d = {**d, "first_last_layers_bf16": bool(start or end), "num_layers_at_start_in_bf16": start,
                 "num_layers_at_end_in_bf16": end}
        return cls(**d)

    def replace(self, **changes: Any) -> TransformerConfig:
        return dataclasses.replace(self, **changes)


def _check_moe(cfg: TransformerConfig) -> None:
    """The MoE fields (Megatron-Core's names), each error one line naming the field, the value and the fix."""
    e = cfg.num_moe_experts
    if e is None:
        return
    _positive("num_moe_experts", e)
    _positive("moe_router_topk", cfg.moe_router_topk)
    if cfg.moe_router_topk > e:
        raise ConfigError(f"moe_router_topk={cfg.moe_router_topk} exceeds num_moe_experts={e}; route each token to "
                          f"at most {e} experts (e.g. --moe-router-topk {min(2, e)})")
    if cfg.moe_ffn_hidden_size is None:
        cfg.moe_ffn_hidden_size = cfg.ffn_hidden_size
    _positive("moe_ffn_hidden_size", int(cfg.moe_ffn_hidden_size or 0))
    if cfg.moe_shared_expert_intermediate_size is not None:
        _positive("moe_shared_expert_intermediate_size", cfg.moe_shared_expert_intermediate_size)
    freq = cfg.moe_layer_freq
    if isinstance(freq, list):
        if len(freq) != cfg.num_layers or any(v not in (0, 1) for v in freq):
            raise ConfigError(f"moe_layer_freq={freq} must be a 0/1 pattern with one entry per layer "
                              f"(num_layers={cfg.num_layers}), e.g. [0] + [1] * {cfg.num_layers - 1} for a dense "
                              "first layer")
    elif not isinstance(freq, int) or isinstance(freq, bool) or freq <= 0:
        raise ConfigError(f"moe_layer_freq={freq!r} must be a positive integer (every Nth layer is MoE) or a 0/1 "
                          "list per layer")
    _choice("moe_router_score_function", cfg.moe_router_score_function, MOE_SCORE_FUNCTIONS)
    if cfg.moe_router_pre_softmax and cfg.moe_router_score_function != "softmax":
        raise ConfigError("moe_router_pre_softmax=True applies to moe_router_score_function='softmax', got "
                          f"{cfg.moe_router_score_function!r}; drop moe_router_pre_softmax")
    if cfg.moe_router_topk_scaling_factor is not None and not cfg.moe_router_topk_scaling_factor > 0:
        raise ConfigError(f"moe_router_topk_scaling_factor={cfg.moe_router_topk_scaling_factor} must be > 0 "
                          "(or None for no scaling)")
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate"):
        v = getattr(cfg, name)
        if v is not None and not v >= 0:
            raise ConfigError(f"{name}={v} must be >= 0")
    if cfg.moe_router_enable_expert_bias and cfg.moe_router_score_function != "sigmoid":
        raise ConfigError("moe_router_enable_expert_bias=True (DeepSeek-V3's aux-loss-free balancing) takes "
                          f"moe_router_score_function='sigmoid', got {cfg.moe_router_score_function!r}")
    from .fp8.recipe import experts_problem

    problem = experts_problem(cfg.fp8_recipe) if cfg.fp8 else None
    if problem:
        raise ConfigError(problem)


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name}={value!r} must be a positive integer")


def _choice(name: str, value: str, choices: tuple[str, ...], hint: str = "") -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not one of {list(choices)} {hint}".rstrip())


def check_at_least(obj: Any, lows: dict[str, int | float]) -> None:
    """ConfigError naming the flag, the value and the bound for the first field of `obj` below its bound
    (None is "unset" and passes; `not >=` also catches nan)."""
    for name, low in lows.items():
        value = getattr(obj, name)
        if value is not None and not value >= low:
            raise ConfigError(f"{flag_name(name)} {value} must be >= {low}")


def check_choice(obj: Any, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(obj, name)
    if value not in choices:
        raise ConfigError(f"{flag_name(name)} {value!r} is not one of {list(choices)}")
