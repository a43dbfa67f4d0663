"""The typed configuration of a training run: `RunConfig`, made of one dataclass per concern.

Built once, from flags (`megadlms.training.args.parse_train_args`), a YAML file of flag values, or directly in
Python; the trainer, the model pipeline and the data loaders read only these objects. Every field is named after
its flag's dest (`--lr-warmup-iters` -> `TrainConfig.lr_warmup_iters`), so flags map onto fields by name: a new
flag needs a field of the same name in one section, nothing else. Each section validates itself in
`__post_init__`; errors name the flag, the value and the fix.
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
from .optim import LR_DECAY_STYLES, WSD_DECAY_STYLES

_MODEL_FIELDS = {f.name for f in dataclasses.fields(TransformerConfig)}


@dataclass
class ModelConfig:
    """Which architecture: a preset name, a Hugging Face config.json (or a folder holding one), and overrides.

    Every other field is a TransformerConfig field of the same name; None keeps the preset's value."""

    model_path: str = "tiny"
    num_layers: int | None = None
    hidden_size: int | None = None
    num_attention_heads: int | None = None
    num_query_groups: int | None = None
    kv_channels: int | None = None
    ffn_hidden_size: int | None = None
    seq_length: int | None = None
    max_position_embeddings: int | None = None
    rotary_base: float | None = None
    norm_epsilon: float | None = None
    init_method_std: float | None = None
    qk_layernorm: bool | None = None
    untie_embeddings_and_output_weights: bool | None = None
    # mixture of experts (Megatron-Core's flags; megadlms.moe)
    num_moe_experts: int | None = None
    moe_router_topk: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_layer_freq: int | list[int] | None = None
    moe_router_score_function: str | None = None
    moe_router_pre_softmax: bool | None = None
    moe_router_topk_scaling_factor: float | None = None
    moe_aux_loss_coeff: float | None = None
    moe_z_loss_coeff: float | None = None
    moe_router_enable_expert_bias: bool | None = None
    moe_router_bias_update_rate: float | None = None

    def overrides(self) -> dict[str, Any]:
        """The TransformerConfig fields this config sets (those not None)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name in _MODEL_FIELDS and getattr(self, f.name) is not None}


@dataclass
class DiffusionConfig:
    """The training objective: masked diffusion (difflm-noshift, bidirectional) or autoregressive (vanilla)."""

    # None: the mode the model records (difflm-shift for a shifted model such as Dream, bd3lm for a block-diffusion
    # checkpoint), else difflm-noshift
    model_running_mode: str | None = None
    mask_token: int | None = None  # None: the tokenizer's <|mask|>, else the model config's
    difflm_eps: float = 1e-3
    difflm_pmask: str = "sampled"
    difflm_varilen_prob: float = 0.01
    # the diffusion modes' cross-entropy: subs (MDLM / BD3-LM: [MASK] out of the softmax) or full-vocab (LLaDA's);
    # None: the one the model records (full-vocab for LLaDA and Dream), else subs
    diffusion_loss: str | None = None
    attention_anneal_iters: int = 0  # AR -> DLM: causal attention annealed into bidirectional over this many steps
    block_size: int | None = None  # bd3lm: tokens per block (divides seq_length)
    bd3lm_clip_min: float = 1e-3  # bd3lm: the clipped noise schedule's range of t
    bd3lm_clip_max: float = 1.0
    bd3lm_noise_per: str = "block"  # bd3lm: one t per "block" or per "sequence"
    bd3lm_antithetic: bool = True  # bd3lm: t stratified over the global batch x blocks (the paper's)
    ignore_bos: bool = False  # difflm-noshift / bd3lm: never mask position 0; validation leaves it out
    bd3lm_resample: bool = False  # bd3lm: redraw blocks whose masked fraction falls outside the clip
    bd3lm_clip_search: bool = False  # bd3lm: validation adopts the clip interval of lowest loss variance
    # bd3lm: the candidate intervals' widths
    bd3lm_clip_search_widths: list[float] = field(default_factory=lambda: list(CLIP_SEARCH_WIDTHS))
    bd3lm_clip_search_delta: float = CLIP_SEARCH_DELTA  # bd3lm: the step between one width's interval starts

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

    train_iters: int = 1000
    exit_interval: int | None = None  # stop (after saving) at a multiple of this
    micro_batch_size: int = 8
    global_batch_size: int | None = None  # None: micro_batch_size x data-parallel size
    lr: float = 3e-4
    min_lr: float = 0.0
    lr_warmup_iters: int = 0
    lr_decay_style: str = "cosine"
    lr_decay_iters: int | None = None  # None: train_iters
    lr_wsd_decay_iters: int | None = None  # None: a tenth of the decay iterations
    lr_wsd_decay_style: str = "linear"
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # 0: no clipping
    seed: int = 1234
    device: str | None = None  # None: cuda when available
    bf16: bool | None = None  # bf16 autocast; None: on for CUDA
    fp32: bool = False  # no autocast, also on CUDA
    compile: bool | None = None  # torch.compile the layers; None: on for CUDA
    recompute_granularity: str | None = None  # "full": activation checkpointing of every layer
    cuda_graphs: str = "auto"
    loss_chunk_tokens: int | None = None  # None: 8192 for vocabularies >= 32768 tokens, else 0 (plain logits)
    eval_interval: int = 1000
    eval_iters: int = 10
    log_interval: int = 10
    tensorboard_dir: str | None = None
    generate_sample: bool = False  # print a sample at the end
    no_progress: bool = False
    wandb_project: str | None = None  # log the metrics to Weights & Biases too (the wandb extra)
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None
    exit_signal_handler: bool = True  # SIGTERM / SIGINT / SIGUSR1: finish the step, save, exit 0
    exit_duration_in_mins: float | None = None  # save and stop after this many minutes
    max_skipped_steps: int = 10  # stop after this many consecutive steps skipped for a non-finite loss/gradient

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

    fp8_format: str | None = None  # "e4m3" | "hybrid" (E4M3 forward, E5M2 gradients)
    fp8_stats: bool = False  # log amax / underflow / saturation per tensor role every log interval
    fp8_param_gather: bool = False  # FSDP2 all-gathers the FP8 layers' weights in FP8 (fp8.integrations.param_gather)

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

    lora_rank: int | None = None
    lora_alpha: float | None = None  # None: the rank (a scale of 1)
    lora_dropout: float = 0.0
    lora_targets: str = ",".join(LORA_TARGETS)
    lora_base: str | None = None  # "fp8" | "bf16"; None: fp8 with --fp8-format, else bf16
    lora_base_path: str | None = None  # resuming: the base to put the adapters on (default: the one recorded)

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

    rl: str | None = None  # "vrpo" (LLaDA 1.5) or "grpo" (d1's diffu-GRPO)
    rl_data: str | None = None  # jsonl: preference pairs (vrpo) or prompts with the rewards' fields (grpo)
    vrpo_samples: int = 8  # vrpo: timesteps (one mask each) per ELBO estimate
    dpo_beta: float = 0.1  # vrpo: DPO's beta
    rl_kl_beta: float = 0.04  # grpo: weight of the KL to the reference
    grpo_group_size: int = 8  # grpo: completions per prompt (G)
    grpo_inner_updates: int = 1  # grpo: optimizer steps per batch of rollouts (mu)
    grpo_clip_eps: float = 0.2  # grpo: the ratio is clipped to [1 - eps, 1 + eps]
    grpo_prompt_mask: float = 0.15  # grpo: each prompt token is masked with this probability in the estimate
    rl_reward: str = "exact_match"  # grpo: comma list of rewards, each NAME or NAME:WEIGHT
    rl_gen_length: int = 32  # grpo: completion tokens per rollout
    rl_block_length: int = 32  # grpo: the sampler's block length (divides --rl-gen-length)
    rl_threshold: float = 0.9  # grpo: the fast sampler's confidence threshold
    rl_temperature: float = 0.9  # grpo: sampling temperature of the rollouts

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
    save: str | None = None  # checkpoint folder
    save_interval: int | None = None  # None: only at the end
    load: str | None = None  # resume from this folder
    ckpt_step: int | None = None  # load this iteration instead of the latest
    finetune: bool = False  # model weights only: fresh optimizer and iteration
    use_checkpoint_args: bool = False  # the architecture of the checkpoint given by `load`
    async_save: bool = False  # write in the background; committed at the next save or the end
    ckpt_keep_last: int | None = None  # keep only the newest N checkpoints (None: all)
    ckpt_save_failures_ok: int = 0  # go on training after up to N failed saves

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
    def section_of(cls) -> dict[str, str]:
        """Field (= flag dest) name -> the section holding it."""
        owner: dict[str, str] = {}
        for section, kind in cls.sections().items():
            for f in dataclasses.fields(kind):
                if f.name in owner:
                    raise TypeError(f"field {f.name!r} is in both RunConfig.{owner[f.name]} and .{section}")
                owner[f.name] = section
        return owner

    @classmethod
    def from_flat(cls, values: Mapping[str, Any]) -> RunConfig:
        """A RunConfig from flag-named values (parsed flags, or a YAML file's keys with dashes or underscores);
        fields not given keep their defaults."""
        owner = cls.section_of()
        parts: dict[str, dict[str, Any]] = {name: {} for name in cls.sections()}
        for key, value in values.items():
            name = str(key).lstrip("-").replace("-", "_")
            if name not in owner:
                raise ConfigError(f"unknown setting {key!r}: not a training flag (keys are flag names, e.g. "
                                  "train-iters)")
            parts[owner[name]][name] = value
        return cls(**{name: kind(**parts[name]) for name, kind in cls.sections().items()})

    def to_flat(self) -> dict[str, Any]:
        """Flag dest -> value, over all sections (the inverse of `from_flat`)."""
        return {k: v for section in self.sections() for k, v in dataclasses.asdict(getattr(self, section)).items()}
