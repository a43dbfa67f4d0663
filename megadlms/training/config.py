"""The typed configuration of a training run: `RunConfig`, made of one dataclass per concern.

Built once, from flags (`megadlms.training.args.parse_train_args`), a YAML file of flag values, or directly in
Python; the trainer, the model pipeline and the data loaders read only these objects. Every setting is declared
once, as a field whose metadata (`megadlms.settings.setting`) holds its help text: the command line is generated
from the fields, named after them (`TrainConfig.lr_warmup_iters` -> `--lr-warmup-iters`), and so are the YAML keys
and a checkpoint's record of the run (`to_flat`). A new flag is a new field in one section, nothing else. The
model's architecture fields are TransformerConfig's own (`ModelConfig` holds overrides of them). Each section
validates itself in `__post_init__`; errors name the flag, the value and the fix; how sections combine is the run
plan's (`run_plan`).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from ..config import (
    FP8_FORMATS,
    ConfigError,
    FP8Settings,
    TransformerConfig,
    check_at_least,
    check_choice,
    flag_name,
)
from ..data.args import DataSourceConfig
from ..diffusion.clip_search import CLIP_SEARCH_DELTA, CLIP_SEARCH_WIDTHS
from ..diffusion.objective import DIFFUSION_LOSSES, PMASK_MODES, RUNNING_MODES, ObjectiveConfig
from ..distributed.config import ParallelConfig
from ..lora import TARGETS as LORA_TARGETS
from ..lora import LoraConfig, parse_targets
from ..presets import PRESETS
from ..rl.rewards import REWARDS
from ..settings import setting
from .optim import LR_DECAY_STYLES, WSD_DECAY_STYLES

# the --help groups, in order
MODEL_GROUP = "model"
MOE_GROUP = "mixture of experts (Megatron-Core's flags; docs/moe.md)"
OBJECTIVE_GROUP = "diffusion objective"
TRAIN_GROUP = "training"
FP8_GROUP = "FP8 (Transformer Engine / Megatron-Core semantics)"
LORA_GROUP = "LoRA (adapters on a frozen base; docs/lora.md)"
RL_GROUP = "reinforcement learning and preference optimisation (docs/rl.md)"
EVAL_GROUP = "evaluation, logging, checkpoints"
_MODEL_FIELDS = {f.name for f in dataclasses.fields(TransformerConfig)}


def _layer_freq(text: str) -> int | list[int]:
    """--moe-layer-freq: an int N, or a comma list of 0/1 per layer."""
    import argparse

    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int or a comma list of 0/1, e.g. 1 or 0,1,1,1") from None
    if len(values) == 1 and "," not in text:
        return values[0]
    if not values or any(v not in (0, 1) for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: a per-layer pattern holds only 0 (dense) and 1 (MoE)")
    return values


# the TransformerConfig fields a run can override from the command line (each unset by default: the preset's value)
MODEL_FLAGS: dict[str, dict[str, Any]] = {
    "num_layers": {"help": "transformer layers"},
    "hidden_size": {"help": "model width"},
    "num_attention_heads": {"help": "query heads"},
    "num_query_groups": {"help": "key/value heads (grouped-query attention)"},
    "kv_channels": {"help": "width of one attention head"},
    "ffn_hidden_size": {"help": "the MLP's inner width"},
    "seq_length": {"help": "tokens per training window"},
    "max_position_embeddings": {"help": "positions the model supports (default: at least --seq-length)"},
    "rotary_base": {"help": "RoPE's base (theta)"},
    "norm_epsilon": {"help": "RMSNorm's epsilon"},
    "init_method_std": {"help": "std of the initial weights"},
    "qk_layernorm": {"help": "RMSNorm on each head's queries and keys (Qwen3)"},
    "untie_embeddings_and_output_weights": {"help": "an output layer of its own instead of the input embedding's "
                                                    "weights"},
    "num_moe_experts": {"help": "routed experts per MoE layer (none: dense)", "group": MOE_GROUP},
    "moe_router_topk": {"help": "experts each token is routed to", "group": MOE_GROUP},
    "moe_ffn_hidden_size": {"help": "each expert's inner width", "group": MOE_GROUP},
    "moe_shared_expert_intermediate_size": {"help": "an always-on shared expert of this width", "group": MOE_GROUP},
    "moe_layer_freq": {"help": "N: every Nth layer is MoE; or a 0/1 pattern per layer, e.g. 0,1,1,1 (dense first "
                               "layer)", "type": _layer_freq, "group": MOE_GROUP},
    "moe_router_score_function": {"help": "how the router scores the experts", "choices": ("softmax", "sigmoid"),
                                  "group": MOE_GROUP},
    "moe_router_pre_softmax": {"help": "softmax over all experts before the top-k (else over the k chosen)",
                               "group": MOE_GROUP},
    "moe_router_topk_scaling_factor": {"help": "multiplies the routing weights", "group": MOE_GROUP},
    "moe_aux_loss_coeff": {"help": "weight of the load-balancing loss", "group": MOE_GROUP},
    "moe_z_loss_coeff": {"help": "weight of the router's z-loss (ST-MoE)", "group": MOE_GROUP},
    "moe_router_enable_expert_bias": {"help": "aux-loss-free load balancing: a per-expert bias on the routing "
                                              "scores", "group": MOE_GROUP},
    "moe_router_bias_update_rate": {"help": "the expert bias's step per optimizer step", "group": MOE_GROUP},
}


@dataclass(init=False)
class ModelConfig:
    """Which architecture: a preset name, a Hugging Face config.json (or a folder holding one), and overrides of its
    TransformerConfig fields, given as keywords (`ModelConfig("tiny", num_layers=2)`; `MODEL_FLAGS` are those the
    command line sets). A field not overridden keeps the preset's value; reading it here gives None."""

    model_path: str = setting("tiny", f"a preset name ({', '.join(PRESETS)}), a Hugging Face config.json, or a "
                                      "folder holding one", group=MODEL_GROUP)
    overrides: dict[str, Any] = field(default_factory=dict)  # TransformerConfig field -> value

    def __init__(self, model_path: str = "tiny", overrides: Mapping[str, Any] | None = None, **fields: Any):
        self.model_path = model_path
        self.overrides = {k: v for k, v in {**(overrides or {}), **fields}.items() if v is not None}
        unknown = sorted(set(self.overrides) - _MODEL_FIELDS)
        if unknown:
            raise ConfigError(f"model override {unknown[0]!r} is not a TransformerConfig field")

    def __getattr__(self, name: str) -> Any:
        if name in _MODEL_FIELDS:  # an architecture field: its override, None where the preset's value applies
            return self.__dict__.get("overrides", {}).get(name)
        raise AttributeError(name)

    @classmethod
    def flat_names(cls) -> list[str]:
        """The flag dests of this section: the model path and the model flags."""
        return ["model_path", *MODEL_FLAGS]

    @classmethod
    def from_flat(cls, values: Mapping[str, Any]) -> ModelConfig:
        return cls(**values)

    def to_flat(self) -> dict[str, Any]:
        return {"model_path": self.model_path, **dict.fromkeys(MODEL_FLAGS), **self.overrides}


@dataclass
class DiffusionConfig:
    """The training objective: masked diffusion (difflm-noshift, bidirectional) or autoregressive (vanilla)."""

    model_running_mode: str | None = setting(
        None, "difflm-noshift: masked diffusion; difflm-shift: position i predicts token i + 1 (Dream); vanilla: "
              "autoregressive; bd3lm: block diffusion (default: the mode the model records, else difflm-noshift; "
              "docs/training.md)",
        choices=RUNNING_MODES, group=OBJECTIVE_GROUP)
    attention_anneal_iters: int = setting(
        0, "adapting an AR model: anneal causal attention into bidirectional over this many iterations (each future "
           "key open with probability (i + 1) / N at iteration i; DiffuLLaMA)", group=OBJECTIVE_GROUP)
    mask_token: int | None = setting(None, "mask token id (default: the tokenizer's <|mask|>, else the preset's)",
                                     group=OBJECTIVE_GROUP)
    difflm_eps: float = setting(1e-3, "each token is masked with probability p = (1 - eps) t + eps, t ~ U[0, 1]",
                                group=OBJECTIVE_GROUP)
    difflm_pmask: str = setting("sampled", "the loss's 1/p weight: sampled, the drawn p; actual, the row's masked "
                                           "fraction", choices=PMASK_MODES, group=OBJECTIVE_GROUP)
    difflm_varilen_prob: float = setting(0.01, "share of micro-batches cut to a random length in [2, --seq-length]",
                                         group=OBJECTIVE_GROUP)
    diffusion_loss: str | None = setting(
        None, "subs: [MASK] out of the softmax (MDLM); full-vocab: [MASK] in it, as LLaDA trains (default: the "
              "loss the model records, else subs; docs/training.md)", choices=DIFFUSION_LOSSES,
        group=OBJECTIVE_GROUP)
    block_size: int | None = setting(None, "bd3lm: tokens per block (divides --seq-length)", group=OBJECTIVE_GROUP)
    bd3lm_clip_min: float = setting(1e-3, "bd3lm: training t ~ U[min, max]", group=OBJECTIVE_GROUP)
    bd3lm_clip_max: float = setting(1.0, "bd3lm: (1e-3, 1: the linear schedule)", group=OBJECTIVE_GROUP)
    bd3lm_noise_per: str = setting("block", "bd3lm: one noise level t per block or per sequence",
                                   choices=("block", "sequence"), group=OBJECTIVE_GROUP)
    bd3lm_antithetic: bool = setting(
        True, "bd3lm: t stratified over the global batch x blocks (the paper's antithetic sampling); --no-: "
              "independent draws", group=OBJECTIVE_GROUP)
    bd3lm_resample: bool = setting(
        False, "bd3lm training: redraw a block's mask while its masked fraction is outside [--bd3lm-clip-min, "
               "--bd3lm-clip-max] (the reference's training.resample; a bound left at 1e-3 or 1 is not enforced)",
        group=OBJECTIVE_GROUP)
    bd3lm_clip_search: bool = setting(
        False, "bd3lm: at every validation, train on the candidate clip interval whose per-block loss varies least "
               "(the paper's search; docs/block_diffusion.md)", group=OBJECTIVE_GROUP)
    bd3lm_clip_search_widths: list[float] = setting(
        help="bd3lm clip search: the candidate widths (the paper's 0.5 0.6 0.7 0.8 0.9)",
        default_factory=lambda: list(CLIP_SEARCH_WIDTHS), metavar="W", group=OBJECTIVE_GROUP)
    bd3lm_clip_search_delta: float = setting(
        CLIP_SEARCH_DELTA, "bd3lm clip search: the step between the starts of one width's intervals",
        group=OBJECTIVE_GROUP)
    ignore_bos: bool = setting(
        False, "difflm-noshift and bd3lm: never mask a window's first token, nor count it in validation (for "
               "windows that start with BOS)", group=OBJECTIVE_GROUP)

    def __post_init__(self) -> None:
        if self.model_running_mode is not None:
            check_choice(self, "model_running_mode", RUNNING_MODES)
        check_choice(self, "difflm_pmask", PMASK_MODES)
        if self.diffusion_loss is not None:
            check_choice(self, "diffusion_loss", DIFFUSION_LOSSES)
        check_choice(self, "bd3lm_noise_per", ("block", "sequence"))
        check_at_least(self, {"mask_token": 0, "attention_anneal_iters": 0})

    def running_mode(self, model: dict[str, Any]) -> str:
        """The run's mode: --model-running-mode, else the one the model's config records, else difflm-noshift.
        A flag that contradicts a recorded shifted prediction is an error (the model's head predicts token i + 1)."""
        recorded = ("bd3lm" if model.get("block_size") else
                    "difflm-shift" if model.get("diffusion_shift") else None)
        mode = self.model_running_mode
        if mode is None:
            return recorded or "difflm-noshift"
        if recorded == "difflm-shift" and mode == "difflm-noshift":
            raise ConfigError("--model-running-mode difflm-noshift, but the model predicts token i + 1 at position i "
                              "(diffusion_shift, as Dream does): drop the flag or use difflm-shift")
        return mode

    def objective(self, mode: str, mask_token_id: int | None, loss: str) -> ObjectiveConfig:
        """The objective of a run in `mode` with the model's [MASK] id and its diffusion loss (`TransformerConfig.loss`,
        which `--diffusion-loss` has already set when given)."""
        return ObjectiveConfig(mode=mode, mask_token_id=mask_token_id or 0, eps=self.difflm_eps,
                               pmask=self.difflm_pmask, varilen_prob=self.difflm_varilen_prob,
                               loss=loss, ignore_bos=self.ignore_bos)


@dataclass
class TrainConfig:
    """Optimization, schedule, precision and execution, evaluation and logging."""

    train_iters: int = setting(1000, "optimizer steps", group=TRAIN_GROUP)
    exit_interval: int | None = setting(None, "stop (after saving, if --save) when the iteration is a multiple of this",
                                        group=TRAIN_GROUP)
    exit_duration_in_mins: float | None = setting(
        None, "save (if --save) and stop once the run has trained this many minutes (before a job's wall-time limit)",
        group=TRAIN_GROUP)
    exit_signal_handler: bool = setting(
        True, "on SIGTERM, SIGINT or SIGUSR1 finish the step, save (if --save) and exit 0; a second signal exits at "
              "once", group=TRAIN_GROUP)
    micro_batch_size: int = setting(8, "sequences per forward on each rank", group=TRAIN_GROUP)
    global_batch_size: int | None = setting(None, "default: micro-batch-size x data-parallel size (no accumulation)",
                                            group=TRAIN_GROUP)
    lr: float = setting(3e-4, "peak learning rate", group=TRAIN_GROUP)
    min_lr: float = setting(0.0, "learning rate at the end of the decay", group=TRAIN_GROUP)
    lr_warmup_iters: int = setting(0, "linear warm-up steps", group=TRAIN_GROUP)
    lr_decay_style: str = setting("cosine", "decay after the warm-up", choices=LR_DECAY_STYLES, group=TRAIN_GROUP)
    lr_decay_iters: int | None = setting(None, "default: --train-iters", group=TRAIN_GROUP)
    lr_wsd_decay_iters: int | None = setting(None, "WSD: length of the final decay (default: a tenth of the decay "
                                                   "iterations)", group=TRAIN_GROUP)
    lr_wsd_decay_style: str = setting("linear", "WSD: the final decay's shape", choices=WSD_DECAY_STYLES,
                                      group=TRAIN_GROUP)
    weight_decay: float = setting(0.1, "AdamW's decoupled weight decay", group=TRAIN_GROUP)
    adam_beta1: float = setting(0.9, "AdamW's first-moment decay", group=TRAIN_GROUP)
    adam_beta2: float = setting(0.95, "AdamW's second-moment decay", group=TRAIN_GROUP)
    adam_eps: float = setting(1e-8, "AdamW's epsilon", group=TRAIN_GROUP)
    clip_grad: float = setting(1.0, "clip the gradient norm to this (0 disables clipping)", group=TRAIN_GROUP)
    max_skipped_steps: int = setting(
        10, "stop the run after this many consecutive steps skipped for a non-finite loss or gradient norm (0: never "
            "stop)", group=TRAIN_GROUP)
    seed: int = setting(1234, "seed of the weights' initialisation, the masks and the data order", group=TRAIN_GROUP)
    device: str | None = setting(None, "cuda | cpu (default: cuda when available)", group=TRAIN_GROUP)
    bf16: bool | None = setting(None, "bf16 autocast (default on GPU)", negatable=False, group=TRAIN_GROUP)
    fp32: bool = setting(False, "no autocast, also on GPU", group=TRAIN_GROUP)
    compile: bool | None = setting(None, "torch.compile the model (default: on for CUDA)", group=TRAIN_GROUP)
    recompute_granularity: str | None = setting(None, "activation checkpointing of every transformer layer",
                                                choices=("full",), group=TRAIN_GROUP)
    cuda_graphs: str = setting(
        "auto", "replay the layers' forward and backward from CUDA graphs (auto: in a single CUDA process where "
                "nothing blocks them and nothing is recomputed, eager if the capture fails; on: also under DDP "
                "and with activation checkpointing, a failed capture is an error; docs/training.md)",
        choices=("auto", "on", "off"), consts={"--enable-cuda-graph": "on"},
        group=TRAIN_GROUP)
    loss_chunk_tokens: int | None = setting(
        None, "LM head fused with the loss over chunks of this many tokens, logits only where the loss has weight "
              "(0: plain logits; default: 8192 for vocabularies >= 32768, else 0)",
        group=TRAIN_GROUP)
    eval_interval: int = setting(1000, "validate every this many steps (0: never)", group=EVAL_GROUP)
    eval_iters: int = setting(10, "global batches per validation", group=EVAL_GROUP)
    log_interval: int = setting(10, "log every this many steps", group=EVAL_GROUP)
    tensorboard_dir: str | None = setting(None, "write TensorBoard events here", group=EVAL_GROUP)
    wandb_project: str | None = setting(
        None, "log what TensorBoard gets to this Weights & Biases project (pip install 'megadlms[wandb]'; "
              "WANDB_MODE=offline works without a network)", group=EVAL_GROUP)
    wandb_exp_name: str | None = setting(None, "the W&B run name (default: W&B's)", group=EVAL_GROUP)
    wandb_save_dir: str | None = setting(None, "folder for W&B's files (default: --save, else ./wandb)",
                                         group=EVAL_GROUP)
    # the flag's unset value: on for the demo configuration only (`parse_train_args`)
    generate_sample: bool = setting(False, "print a sample from the trained model at the end (default: on for the "
                                           "demo)", negatable=True, flag_default=None, group=EVAL_GROUP)
    no_progress: bool = setting(False, "no progress bar, even on a terminal", group=EVAL_GROUP)

    def __post_init__(self) -> None:
        # 0 for an interval or count means "never" / "none"
        check_at_least(self, {"train_iters": 1, "micro_batch_size": 1, "global_batch_size": 1, "log_interval": 1,
                              "lr_decay_iters": 1, "lr_warmup_iters": 0, "lr_wsd_decay_iters": 0,
                              "eval_interval": 0, "eval_iters": 0, "exit_interval": 0, "loss_chunk_tokens": 0,
                              "exit_duration_in_mins": 0.0, "max_skipped_steps": 0,
                              "seed": 0, "lr": 0.0, "min_lr": 0.0, "weight_decay": 0.0, "clip_grad": 0.0})
        if self.seed >= 2**32:
            raise ConfigError(f"--seed {self.seed} must be below 2**32 (numpy's seed range)")
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"--{name.replace('_', '-')} {value} must be in [0, 1), e.g. 0.9 / 0.95")
        if not self.adam_eps > 0.0:
            raise ConfigError(f"--adam-eps {self.adam_eps} must be > 0, e.g. 1e-8")
        decay_iters = self.lr_decay_iters or self.train_iters
        if self.lr_warmup_iters > decay_iters:
            raise ConfigError(f"--lr-warmup-iters {self.lr_warmup_iters} exceeds --lr-decay-iters {decay_iters} "
                              f"(default: --train-iters); pass --lr-warmup-iters {decay_iters} or less")
        check_choice(self, "lr_decay_style", LR_DECAY_STYLES)
        check_choice(self, "lr_wsd_decay_style", WSD_DECAY_STYLES)
        check_choice(self, "cuda_graphs", ("auto", "on", "off"))
        if self.recompute_granularity is not None:
            check_choice(self, "recompute_granularity", ("full",))

    def compile_on(self, device: torch.device) -> bool:
        """Whether the layers are compiled: `compile`, or when unset, on for CUDA."""
        return device.type == "cuda" if self.compile is None else self.compile

    def compute_dtype(self, device: torch.device) -> torch.dtype | None:
        """The autocast dtype: bf16 (default on CUDA, --bf16 elsewhere), or None for fp32 (--fp32)."""
        if self.fp32:
            return None
        if self.bf16 or device.type == "cuda":
            return torch.bfloat16
        return None


@dataclass
class FP8Config(FP8Settings):
    """FP8 training (Transformer Engine / Megatron-Core semantics); off while fp8_format is None.

    The model's FP8 settings are `FP8Settings`, the one definition TransformerConfig shares (`model_fields` hands
    them over unchanged); this config adds the training-only ones."""

    fp8_format: str | None = setting(None, "enable FP8: e4m3 everywhere, or hybrid (E4M3 forward, E5M2 gradients)",
                                     choices=FP8_FORMATS, group=FP8_GROUP)
    fp8_stats: bool = setting(
        False, "log FP8 amax / underflow / saturation per tensor role every --log-interval (those steps run "
               "outside the CUDA graphs)", negatable=True, group=FP8_GROUP)
    fp8_param_gather: bool = setting(
        False, "FSDP2 all-gathers the FP8 layers' weights in FP8 (1 byte per element): each rank casts its shard "
               "first (delayed, tensorwise, blockwise; needs a sharding strategy)", group=FP8_GROUP)

    def __post_init__(self) -> None:
        if self.fp8_format is not None:
            check_choice(self, "fp8_format", FP8_FORMATS)
        self.check_fp8_settings(self.fp8_format, lambda name, value: f"{flag_name(name)} {value!r}")

    @property
    def enabled(self) -> bool:
        return self.fp8_format is not None

    def model_fields(self) -> dict[str, Any]:
        """The TransformerConfig FP8 fields for this config: the `FP8Settings` unchanged, FP8 on/off, the format."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(FP8Settings)}
        shared.update(fp8=self.enabled, fp8_format=self.fp8_format or "hybrid")
        return shared


@dataclass
class LoraSettings:
    """LoRA adapters on a frozen base (`megadlms.lora`); off while lora_rank is None. The base is the checkpoint
    `--load` names, or, where `--load` names a LoRA checkpoint, the base that checkpoint records."""

    lora_rank: int | None = setting(None, "train rank-R LoRA adapters on the frozen base that --load names (off by "
                                          "default)", group=LORA_GROUP)
    lora_alpha: float | None = setting(None, "the adapters' scale is alpha / rank (default: alpha = rank)",
                                       group=LORA_GROUP)
    lora_dropout: float = setting(0.0, "dropout on the adapters' input", group=LORA_GROUP)
    lora_targets: str = setting(",".join(LORA_TARGETS), "the linears of each layer that get adapters: a comma list "
                                                        "of q,k,v,o,gate,up,down", group=LORA_GROUP)
    lora_base: str | None = setting(
        None, "how the frozen base's layer weights are stored: fp8 (E4M3 + scale, 1 byte a weight, FP8 GEMMs) or bf16 "
              "(default: fp8 with --fp8-format, else bf16)", choices=("fp8", "bf16"), group=LORA_GROUP)
    lora_base_path: str | None = setting(
        None, "resuming a LoRA checkpoint: the base to put its adapters on (default: the base it records; its "
              "checksum must match)", metavar="DIR", group=LORA_GROUP)

    def __post_init__(self) -> None:
        if self.lora_rank is None:
            given = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(self)
                     if f.name != "lora_rank" and getattr(self, f.name) != f.default]
            if given:
                raise ConfigError(f"{given[0]} is set but LoRA is off; add --lora-rank R (e.g. 16) or drop "
                                  f"{' '.join(given)}")
            return
        if self.lora_base is not None and self.lora_base not in ("fp8", "bf16"):
            raise ConfigError(f"--lora-base {self.lora_base!r} is not one of fp8, bf16")
        self.lora_config(None, torch.bfloat16)  # the rank, alpha, dropout and targets checks

    @property
    def enabled(self) -> bool:
        return self.lora_rank is not None

    def lora_config(self, fp8_format: str | None, compute_dtype: torch.dtype | None) -> LoraConfig:
        """The LoraConfig of a run: an FP8 base by default where the run is FP8; a BF16 base keeps its weights as
        they are in an fp32 run (no autocast to compute a BF16 weight with)."""
        assert self.lora_rank is not None  # enabled
        base = self.lora_base or ("fp8" if fp8_format is not None else "bf16")
        if base == "bf16" and compute_dtype is None:
            base = "keep"
        return LoraConfig(rank=self.lora_rank, alpha=self.lora_alpha, dropout=self.lora_dropout,
                          targets=parse_targets(self.lora_targets), base=base, grad_format=fp8_format or "hybrid")


@dataclass
class RLConfig:
    """Reinforcement learning and preference optimisation (docs/rl.md); off while `rl` is None."""

    rl: str | None = setting(None, "vrpo: LLaDA 1.5's DPO on ELBO estimates over preference pairs; grpo: d1's "
                                   "diffu-GRPO with verifiable rewards (off by default: pre-training or SFT)",
                             choices=("vrpo", "grpo"), group=RL_GROUP)
    rl_data: str | None = setting(None, 'vrpo: {"prompt", "chosen", "rejected"} per line; grpo: {"prompt", ...} with '
                                        'the fields its rewards read (exact_match: "answer")', metavar="FILE.jsonl",
                                  group=RL_GROUP)
    vrpo_samples: int = setting(8, "vrpo: timesteps per ELBO estimate, one mask each, shared by policy and "
                                   "reference", group=RL_GROUP)
    dpo_beta: float = setting(0.1, "vrpo: DPO's beta", group=RL_GROUP)
    rl_kl_beta: float = setting(0.04, "grpo: weight of the KL to the frozen reference", group=RL_GROUP)
    grpo_group_size: int = setting(8, "grpo: completions per prompt (G, at least 2)", group=RL_GROUP)
    grpo_inner_updates: int = setting(1, "grpo: optimizer steps on each batch of rollouts (mu), each with a new "
                                         "prompt mask", group=RL_GROUP)
    grpo_clip_eps: float = setting(0.2, "grpo: ratio clipped to [1 - eps, 1 + eps]", group=RL_GROUP)
    grpo_prompt_mask: float = setting(0.15, "grpo: probability of masking each prompt token in the one-step "
                                            "log-likelihood estimate", group=RL_GROUP)
    rl_reward: str = setting("exact_match", f"grpo: comma list of rewards, NAME or NAME:WEIGHT "
                                            f"({', '.join(sorted(REWARDS))})", group=RL_GROUP)
    rl_gen_length: int = setting(32, "grpo: tokens per completion", group=RL_GROUP)
    rl_block_length: int = setting(32, "grpo: the rollout sampler's block length (divides --rl-gen-length)",
                                   group=RL_GROUP)
    rl_threshold: float = setting(0.9, "grpo: the fast sampler's confidence threshold (parallel decoding)",
                                  group=RL_GROUP)
    rl_temperature: float = setting(0.9, "grpo: sampling temperature of the rollouts", group=RL_GROUP)

    def __post_init__(self) -> None:
        from ..rl import RL_KINDS

        if self.rl is None:
            if self.rl_data is not None:
                raise ConfigError(f"--rl-data {self.rl_data} is set but --rl is not; add --rl vrpo or --rl grpo")
            return
        check_choice(self, "rl", RL_KINDS)
        if self.rl_data is None:
            raise ConfigError(f"--rl {self.rl} needs --rl-data FILE.jsonl (" + (
                '{"prompt", "chosen", "rejected"} per line)' if self.rl == "vrpo" else
                '{"prompt", ...the rewards\' fields} per line)'))
        if self.rl == "grpo" and self.grpo_group_size < 2:
            raise ConfigError(f"--grpo-group-size {self.grpo_group_size}: group-normalised advantages need at least "
                              "2 completions per prompt; use e.g. --grpo-group-size 8")
        check_at_least(self, {"vrpo_samples": 1, "grpo_group_size": 2, "grpo_inner_updates": 1, "rl_gen_length": 1,
                              "rl_block_length": 1})
        if self.rl_gen_length % self.rl_block_length:
            raise ConfigError(f"--rl-block-length {self.rl_block_length} must divide --rl-gen-length "
                              f"{self.rl_gen_length}")
        if not 0.0 <= self.grpo_prompt_mask < 1.0:
            raise ConfigError(f"--grpo-prompt-mask {self.grpo_prompt_mask} must be in [0, 1) (d1: 0.15)")
        if self.dpo_beta <= 0:
            raise ConfigError(f"--dpo-beta {self.dpo_beta} must be positive (e.g. 0.1)")


@dataclass
class CheckpointConfig:
    save: str | None = setting(None, "checkpoint folder", group=EVAL_GROUP)
    save_interval: int | None = setting(None, "save every this many steps (default: only at the end)",
                                        group=EVAL_GROUP)
    async_save: bool = setting(False, "write checkpoints in the background; each one is committed (renamed into "
                                      "place, latest pointer updated) at the next save or at the end of training",
                               group=EVAL_GROUP)
    ckpt_keep_last: int | None = setting(None, "keep only the newest N checkpoints (default: all)", group=EVAL_GROUP)
    ckpt_save_failures_ok: int = setting(0, "go on training after up to N failed saves (a full disk, no "
                                            "permission); 0: stop at the first", group=EVAL_GROUP)
    load: str | None = setting(None, "resume from this checkpoint folder", group=EVAL_GROUP)
    ckpt_step: int | None = setting(None, "load this iteration instead of the latest", group=EVAL_GROUP)
    finetune: bool = setting(False, "load model weights only; fresh optimizer and iteration", group=EVAL_GROUP)
    use_checkpoint_args: bool = setting(False, "take the architecture from the checkpoint given by --load",
                                        group=EVAL_GROUP)

    def __post_init__(self) -> None:
        check_at_least(self, {"save_interval": 0, "ckpt_step": 0, "ckpt_keep_last": 1, "ckpt_save_failures_ok": 0})
        if self.use_checkpoint_args and not self.load:
            raise ConfigError("--use-checkpoint-args needs --load DIR")


@dataclass
class RunConfig:
    """Everything a training run is built from. `megadlms.training.train(RunConfig(...))` trains without flags."""

    model: ModelConfig = field(default_factory=ModelConfig)
    objective: DiffusionConfig = field(default_factory=DiffusionConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    fp8: FP8Config = field(default_factory=FP8Config)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    lora: LoraSettings = field(default_factory=LoraSettings)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataSourceConfig = field(default_factory=DataSourceConfig)
    rl: RLConfig = field(default_factory=RLConfig)

    @classmethod
    def sections(cls) -> dict[str, type]:
        """Section name -> its dataclass."""
        hints = typing.get_type_hints(cls)
        return {f.name: hints[f.name] for f in dataclasses.fields(cls)}

    @classmethod
    def flat_names(cls, kind: type) -> list[str]:
        """The flag dests a section holds: its fields (the model section: its path and `MODEL_FLAGS`)."""
        names = getattr(kind, "flat_names", None)
        return names() if names is not None else [f.name for f in dataclasses.fields(kind)]

    @classmethod
    def section_of(cls) -> dict[str, str]:
        """Field (= flag dest) name -> the section holding it."""
        owner: dict[str, str] = {}
        for section, kind in cls.sections().items():
            for name in cls.flat_names(kind):
                if name in owner:
                    raise TypeError(f"field {name!r} is in both RunConfig.{owner[name]} and .{section}")
                owner[name] = section
        return owner

    @classmethod
    def from_flat(cls, values: Mapping[str, Any]) -> RunConfig:
        """A RunConfig from flag-named values (parsed flags, or a YAML file's keys with dashes or underscores);
        fields not given keep their defaults."""
        return cls().replace(**values)

    def replace(self, **values: Any) -> RunConfig:
        """This configuration with flag-named values changed (`dataclasses.replace` on the sections holding them;
        each section validates itself again)."""
        owner = self.section_of()
        parts: dict[str, dict[str, Any]] = {}
        for key, value in values.items():
            name = str(key).lstrip("-").replace("-", "_")
            if name not in owner:
                raise ConfigError(f"unknown setting {key!r}: not a training flag (keys are flag names, e.g. "
                                  "train-iters)")
            parts.setdefault(owner[name], {})[name] = value
        changed: dict[str, Any] = {}
        for section, given in parts.items():
            current = getattr(self, section)
            if isinstance(current, ModelConfig):
                flat = {**current.to_flat(), **given}
                changed[section] = ModelConfig.from_flat(flat)
            else:
                changed[section] = dataclasses.replace(current, **given)
        return dataclasses.replace(self, **changed)

    def to_flat(self) -> dict[str, Any]:
        """Flag dest -> value, over all sections (the inverse of `from_flat`)."""
        flat: dict[str, Any] = {}
        for section in self.sections():
            part = getattr(self, section)
            flat.update(part.to_flat() if isinstance(part, ModelConfig) else dataclasses.asdict(part))
        return flat
