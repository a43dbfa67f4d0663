"""The run plan: what a training run will be, resolved once from its settings and checked before anything is built.

`RunPlan` holds the settings (`RunConfig`), the model's resolved architecture (`resolve_model_config`: a preset or
config file read, nothing built), the world size torchrun gives and the device. From them it answers what the run
is: its precision, objective (running mode), parallel layout, adapters and whether CUDA graphs can replay its
layers. Every rule about what a feature needs and what it cannot run with is declared here once, in `RULES` (and
the CUDA-graph blockers in `GRAPH_BLOCKERS`); `RunPlan.check()` asks them all before the model, the data loaders or
the process groups exist, and reports every clash at once, one line each with the fix. `rules_table()` renders the
same declarations for docs/run_plan.md (`python -m megadlms.training.run_plan` prints it).

A flag that would change nothing in this run (an FP8 setting without `--fp8-format`, an SFT setting without
`--sft`, ...) is a clash too: a value that differs from the flag's default is taken as set by the user.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..config import ConfigError, FP8Settings, TransformerConfig, flag_name
from ..fp8.recipe import param_gather_problem
from ..presets import load_model_config
from . import checkpoint as ckpt
from .config import RunConfig

# the DiffusionConfig fields only the bd3lm mode reads, and those only its clip search reads
BD3LM_FIELDS = ("bd3lm_clip_min", "bd3lm_clip_max", "bd3lm_noise_per", "bd3lm_antithetic", "bd3lm_resample",
                "bd3lm_clip_search", "bd3lm_clip_search_widths", "bd3lm_clip_search_delta")
CLIP_SEARCH_FIELDS = ("bd3lm_clip_search_widths", "bd3lm_clip_search_delta")
# the RLConfig fields each kind alone reads
VRPO_FIELDS = ("vrpo_samples", "dpo_beta")
GRPO_FIELDS = ("rl_kl_beta", "grpo_group_size", "grpo_inner_updates", "grpo_clip_eps", "grpo_prompt_mask",
               "rl_reward", "rl_gen_length", "rl_block_length", "rl_threshold", "rl_temperature")
# the FP8 model settings, which only an FP8 run reads (FP8 attention has a rule of its own; --fp8-stats logs
# nothing without FP8 and is accepted, so one flag list can serve the BF16 and FP8 runs of a comparison)
FP8_ONLY_FIELDS = tuple(f.name for f in dataclasses.fields(FP8Settings) if f.name != "fp8_dot_product_attention")
SFT_ONLY_FIELDS = ("sft_pad", "truncate")
SAVE_ONLY_FIELDS = ("save_interval", "async_save", "ckpt_keep_last", "ckpt_save_failures_ok")
def _given(section: Any, names: tuple[str, ...]) -> list[str]:
    """The fields among `names` whose value differs from the default of `section`'s dataclass."""
    default = type(section)()
    return [n for n in names if getattr(section, n) != getattr(default, n)]


def _flags(section: Any, names: list[str]) -> str:
    """The flags the user set for `names`, as typed: `--flag value`, a switch alone, or the negative of one that
    defaults to on."""
    default, parts = type(section)(), []
    for n in names:
        value = getattr(section, n)
        if value is False and getattr(default, n) is True:
            parts.append("--no-" + flag_name(n)[2:])
        elif value is True:
            parts.append(flag_name(n))
        else:
            shown = " ".join(map(str, value)) if isinstance(value, list) else value
            parts.append(f"{flag_name(n)} {shown}")
    return ", ".join(parts)


def _them(names: list[str]) -> str:
    return "it" if len(names) == 1 else "them"


@dataclass
class RunPlan:
    """A run's settings with the facts they are resolved against: the model's architecture, the world size (the
    processes torchrun starts) and the device type. Nothing here is built."""

    config: RunConfig
    model: TransformerConfig
    world_size: int = 1
    device_type: str = "cpu"
    emulate_graphs: bool = False  # tests on CPU: CUDA-graph replay emulated (MEGADLMS_EMULATE_CUDA_GRAPHS=1)

    @classmethod
    def resolve(cls, config: RunConfig, model: TransformerConfig, world_size: int | None = None,
                device_type: str | None = None) -> RunPlan:
        """The plan of this process's run: by default the world size of the process group the caller has already
        made, else torchrun's WORLD_SIZE (1 without it), and the device `--device` names, else cuda when one is
        visible."""
        if world_size is None and torch.distributed.is_available() and torch.distributed.is_initialized():
            world_size = torch.distributed.get_world_size()
        if world_size is None:
            try:
                world_size = int(os.environ.get("WORLD_SIZE", "1"))
            except ValueError:
                world_size = 1  # init_parallel names the bad value
        if device_type is None:
            device = config.train.device or ("cuda" if torch.cuda.is_available() else "cpu")
            if device != "cpu" and not device.startswith("cuda"):
                raise ConfigError(f"--device {device!r} is not supported; use cuda or cpu")
            device_type = "cuda" if device.startswith("cuda") else device
        emulate = os.environ.get("MEGADLMS_EMULATE_CUDA_GRAPHS") == "1" and device_type != "cuda"
        return cls(config, model, world_size=world_size, device_type=device_type, emulate_graphs=emulate)

    # ---------------------------------------------------------------- what the run is
    @property
    def mode(self) -> str:
        """The running mode the model is built for (`resolve_model_config`)."""
        return self.model.running_mode

    @property
    def tp(self) -> int:
        return self.config.parallel.tensor_model_parallel_size

    @property
    def cp(self) -> int:
        return self.config.parallel.context_parallel_size

    @property
    def pp(self) -> int:
        return self.config.parallel.pipeline_model_parallel_size

    @property
    def ep(self) -> int:
        return self.config.parallel.expert_model_parallel_size

    @property
    def dp_cp(self) -> int:
        """Data- x context-parallel ranks (the ranks FSDP2 shards over)."""
        return max(1, self.world_size // (self.tp * self.pp))

    @property
    def dp(self) -> int:
        return max(1, self.dp_cp // self.cp)

    @property
    def sharded(self) -> bool:
        """Whether the data-parallel ranks shard the model (FSDP2): a sharded strategy over more than one rank."""
        return self.config.parallel.sharding_strategy != "no_shard" and self.dp_cp > 1

    @property
    def fp8(self) -> bool:
        return self.config.fp8.enabled

    @property
    def lora(self) -> bool:
        return self.config.lora.enabled

    @property
    def rl(self) -> str | None:
        return self.config.rl.rl

    @property
    def moe(self) -> bool:
        return self.model.is_moe

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step: --global-batch-size, else one micro-batch per data-parallel rank."""
        t = self.config.train
        return t.global_batch_size or t.micro_batch_size * self.dp

    @property
    def accumulation(self) -> int:
        """Micro-batches each rank accumulates per step."""
        return self.global_batch // (self.config.train.micro_batch_size * self.dp)

    def describe(self) -> str:
        """The plan in one line, for the run's log."""
        t, fp8 = self.config.train, self.config.fp8
        precision = (f"FP8 {fp8.fp8_format}/{fp8.fp8_recipe}" if self.fp8 else
                     "fp32" if t.fp32 else "bf16" if t.bf16 or self.device_type == "cuda" else "fp32")
        objective = (f"RL {self.rl}" if self.rl else "SFT" if self.config.data.sft else "pre-training")
        layout = f"world {self.world_size} (pp {self.pp} x dp {self.dp} x cp {self.cp} x tp {self.tp}, ep {self.ep})"
        lora = f"LoRA rank {self.config.lora.lora_rank}" if self.lora else "no LoRA"
        graphs = "CUDA graphs" if self.layer_graphs() else "no CUDA graphs"
        compiled = "compiled" if t.compile_on(torch.device(self.device_type)) else "eager"
        return (f"{objective} ({self.mode}) | {precision} | {layout} | global batch {self.global_batch} (micro "
                f"{t.micro_batch_size} x accum {self.accumulation} x dp {self.dp}) | {lora} | {compiled}, {graphs}")

    def attention_resets(self) -> bool:
        """Whether the data asks for document-level attention, position resets or annealed attention."""
        d = self.config.data
        return bool(d.sft or d.reset_attention_mask or d.reset_position_ids
                    or self.config.objective.attention_anneal_iters)

    # ---------------------------------------------------------------- CUDA graphs
    def graph_blockers(self) -> list[str]:
        """Why CUDA graphs cannot replay this run's layers (`GRAPH_BLOCKERS`), empty where they can."""
        return [why(self) for _, applies, why in GRAPH_BLOCKERS if applies(self)]

    def layer_graphs(self) -> bool:
        """Whether the layers replay from CUDA graphs: --cuda-graphs on, or auto in a single process, without a
        blocker (`check` refuses on with one)."""
        mode = self.config.train.cuda_graphs
        if mode == "off" or self.graph_blockers():
            return False
        return mode == "on" or self.dp == 1

    # ---------------------------------------------------------------- the check
    def clashes(self) -> list[str]:
        """One line per rule this plan breaks, each naming the flags and values and the fix."""
        return [rule.line(self) for rule in RULES if rule.applies(self)]

    def check(self) -> RunPlan:
        """Raise ConfigError listing every clash (one line each); returns the plan where there is none."""
        lines = self.clashes()
        if len(lines) == 1:
            raise ConfigError(lines[0])
        if lines:
            raise ConfigError(f"{len(lines)} settings do not go together:\n" + "\n".join(f"  {x}" for x in lines))
        return self


@dataclass(frozen=True)
class Rule:
    """One thing a feature needs or cannot run with. `feature` and `clash` name them for the docs table; `applies`
    says whether a plan breaks the rule; `says` spells what is wrong with this run's values; `fix` is what to do
    (`fix_for`: the same, worded for this run's flags, e.g. "drop it" for one)."""

    feature: str
    clash: str
    applies: Callable[[RunPlan], bool]
    says: Callable[[RunPlan], str]
    fix: str
    fix_for: Callable[[RunPlan], str] | None = None

    def line(self, plan: RunPlan) -> str:
        return f"{self.says(plan)}; {self.fix_for(plan) if self.fix_for else self.fix}"


def _rank(p: RunPlan) -> str:
    return f"--lora-rank {p.config.lora.lora_rank}"


def _rl(p: RunPlan) -> str:
    return f"--rl {p.rl}"


def _other_rl_kind(p: RunPlan) -> list[str]:
    """The RL flags set that the run's kind (or a run without --rl) does not read."""
    rl = p.config.rl
    unread = VRPO_FIELDS * (p.rl != "vrpo") + GRPO_FIELDS * (p.rl != "grpo")
    return _given(rl, unread)


def _schedule_problem(p: RunPlan) -> str | None:
    """Why the pipeline schedule cannot run this step's micro-batches (the schedule's own rule,
    `pipeline_parallel.check_micro_batches`), or None; a layer count the stages do not divide is the build's
    size check."""
    if p.pp == 1:
        return None
    from ..distributed.pipeline_parallel import check_micro_batches, virtual_stages

    par = p.config.parallel
    try:
        stages = virtual_stages(p.model.num_layers, p.pp, par.num_layers_per_virtual_pipeline_stage)
    except ConfigError:
        return None
    try:
        check_micro_batches(p.accumulation, p.pp, stages, par.pipeline_schedule,
                            samples_per_micro_batch=p.config.train.micro_batch_size * p.dp)
    except ConfigError as e:
        return str(e)
    return None


def _clip_search_needs(p: RunPlan) -> bool:
    t = p.config.train
    return p.config.objective.bd3lm_clip_search and p.mode == "bd3lm" and (t.eval_iters <= 0 or not t.eval_interval)


RULES: tuple[Rule, ...] = (
    # ---- settings that change nothing in this run
    Rule("FP8 settings (--fp8-recipe, --fp8-margin, ...)", "needs --fp8-format",
         lambda p: not p.fp8 and bool(_given(p.config.fp8, FP8_ONLY_FIELDS)),
         lambda p: f"{_flags(p.config.fp8, _given(p.config.fp8, FP8_ONLY_FIELDS))}: FP8 is off",
         "add --fp8-format hybrid (or e4m3), or drop them",
         lambda p: f"add --fp8-format hybrid (or e4m3), or drop {_them(_given(p.config.fp8, FP8_ONLY_FIELDS))}"),
    Rule("--fp8-dot-product-attention", "needs --fp8-format",
         lambda p: p.config.fp8.fp8_dot_product_attention and not p.fp8,
         lambda p: "--fp8-dot-product-attention runs attention in FP8 inside the FP8 layers",
         "add --fp8-format hybrid (or e4m3), or drop it"),
    Rule("--sft-pad, --truncate", "needs --sft",
         lambda p: not p.config.data.sft and bool(_given(p.config.data, SFT_ONLY_FIELDS)),
         lambda p: f"{_flags(p.config.data, _given(p.config.data, SFT_ONLY_FIELDS))}: only read with --sft "
                   "(packed chat data), which is off",
         "add --sft or drop them", lambda p: f"add --sft or drop {_them(_given(p.config.data, SFT_ONLY_FIELDS))}"),
    Rule("--save-interval, --async-save, --ckpt-keep-last, --ckpt-save-failures-ok", "needs --save",
         lambda p: p.config.checkpoint.save is None and bool(_given(p.config.checkpoint, SAVE_ONLY_FIELDS)),
         lambda p: f"{_flags(p.config.checkpoint, _given(p.config.checkpoint, SAVE_ONLY_FIELDS))}: this run saves "
                   "no checkpoint",
         "add --save DIR or drop them",
         lambda p: f"add --save DIR or drop {_them(_given(p.config.checkpoint, SAVE_ONLY_FIELDS))}"),
    Rule("--vrpo-samples, --dpo-beta / --rl-kl-beta, --grpo-*, --rl-reward, --rl-gen-length, ...",
         "needs --rl vrpo / --rl grpo",
         lambda p: bool(_other_rl_kind(p)),
         lambda p: f"{_flags(p.config.rl, _other_rl_kind(p))}: not read by "
                   f"{'--rl ' + p.rl if p.rl else 'a run without --rl'} (--vrpo-samples and --dpo-beta are "
                   "vrpo's, --rl-kl-beta, --grpo-* and --rl-reward/-gen-length/-block-length/-threshold/-temperature "
                   "grpo's)",
         "drop them or pick the --rl kind they belong to",
         lambda p: f"drop {_them(_other_rl_kind(p))} or pick the --rl kind "
                   f"{'it belongs' if len(_other_rl_kind(p)) == 1 else 'they belong'} to"),
    Rule("--block-size", "needs --model-running-mode bd3lm",
         lambda p: p.config.objective.block_size is not None and p.mode != "bd3lm",
         lambda p: f"--block-size {p.config.objective.block_size} is only used with --model-running-mode bd3lm "
                   f"(this run is {p.mode})",
         "drop it"),
    Rule("--bd3lm-* options", "need --model-running-mode bd3lm",
         lambda p: p.mode != "bd3lm" and bool(_given(p.config.objective, BD3LM_FIELDS)),
         lambda p: f"{_flags(p.config.objective, _given(p.config.objective, BD3LM_FIELDS))}: only used with "
                   f"--model-running-mode bd3lm (this run is {p.mode})",
         "drop them", lambda p: f"drop {_them(_given(p.config.objective, BD3LM_FIELDS))}"),
    Rule("--bd3lm-clip-search-widths, --bd3lm-clip-search-delta", "need --bd3lm-clip-search",
         lambda p: p.mode == "bd3lm" and not p.config.objective.bd3lm_clip_search
         and bool(_given(p.config.objective, CLIP_SEARCH_FIELDS)),
         lambda p: f"{', '.join(flag_name(n) for n in _given(p.config.objective, CLIP_SEARCH_FIELDS))}: the "
                   "candidates of --bd3lm-clip-search, which is off",
         "add --bd3lm-clip-search or drop them",
         lambda p: f"add --bd3lm-clip-search or drop {_them(_given(p.config.objective, CLIP_SEARCH_FIELDS))}"),
    # ---- the objective
    Rule("--model-running-mode bd3lm", "--sft, --reset-attention-mask, --reset-position-ids, "
         "--attention-anneal-iters",
         lambda p: p.mode == "bd3lm" and p.attention_resets(),
         lambda p: "--model-running-mode bd3lm runs under its own block-diffusion attention mask",
         "drop --sft, --reset-attention-mask, --reset-position-ids and --attention-anneal-iters"),
    Rule("--attention-anneal-iters", "--model-running-mode vanilla",
         lambda p: bool(p.config.objective.attention_anneal_iters) and p.mode == "vanilla",
         lambda p: f"--attention-anneal-iters {p.config.objective.attention_anneal_iters} anneals causal attention "
                   "into bidirectional attention",
         "use --model-running-mode difflm-shift or difflm-noshift, not vanilla"),
    Rule("--ignore-bos", "--sft",
         lambda p: p.config.objective.ignore_bos and p.config.data.sft and p.mode != "bd3lm",
         lambda p: "--ignore-bos applies to token windows; --sft never masks prompt tokens",
         "drop it"),
    Rule("--bd3lm-clip-search", "needs validation (--eval-interval, --eval-iters > 0)",
         _clip_search_needs,
         lambda p: f"--bd3lm-clip-search chooses the interval during validation, which this run skips "
                   f"(--eval-interval {p.config.train.eval_interval}, --eval-iters {p.config.train.eval_iters})",
         "give --eval-interval and --eval-iters > 0, or drop --bd3lm-clip-search"),
    Rule("--bd3lm-clip-search", "--pipeline-model-parallel-size > 1",
         lambda p: p.config.objective.bd3lm_clip_search and p.mode == "bd3lm" and p.pp > 1,
         lambda p: f"--bd3lm-clip-search runs whole-model forwards; --pipeline-model-parallel-size {p.pp} splits "
                   "the model",
         "drop one of the two"),
    Rule("--bd3lm-clip-search", "--context-parallel-size > 1",
         lambda p: p.config.objective.bd3lm_clip_search and p.mode == "bd3lm" and p.cp > 1,
         lambda p: f"--bd3lm-clip-search scores whole windows per block; --context-parallel-size {p.cp} splits them",
         "drop one of the two"),
    # ---- reinforcement learning
    Rule("--rl", "--sft", lambda p: p.rl is not None and p.config.data.sft,
         lambda p: f"{_rl(p)} reads its records from --rl-data", "drop --sft"),
    Rule("--rl", "a mode other than difflm-noshift",
         lambda p: p.rl is not None and p.mode != "difflm-noshift",
         lambda p: f"{_rl(p)} trains a masked-diffusion model whose position i predicts token i (difflm-noshift); "
                   f"this run's mode is {p.mode}",
         "use --model-running-mode difflm-noshift"),
    Rule("--rl", "--reset-attention-mask, --reset-position-ids, --attention-anneal-iters",
         lambda p: p.rl is not None and not p.config.data.sft and p.attention_resets(),
         lambda p: f"{_rl(p)} scores one record per row",
         "drop --reset-attention-mask, --reset-position-ids and --attention-anneal-iters"),
    Rule("--rl", "a sharded data-parallel strategy without LoRA",
         lambda p: p.rl is not None and not p.lora and p.config.parallel.sharding_strategy != "no_shard",
         lambda p: f"{_rl(p)} with --data-parallel-sharding-strategy {p.config.parallel.sharding_strategy}: the "
                   "reference would be a copy of sharded weights",
         "add --lora-rank R (the frozen base is the reference) or use no_shard (DDP)"),
    Rule("--rl", "--pipeline-model-parallel-size > 1", lambda p: p.rl is not None and p.pp > 1,
         lambda p: f"{_rl(p)} samples rollouts from the whole model, which --pipeline-model-parallel-size {p.pp} "
                   "splits over ranks", "use data parallelism"),
    # ---- LoRA
    Rule("--lora-rank", "needs --load", lambda p: p.lora and not p.config.checkpoint.load,
         lambda p: f"{_rank(p)} adapts a base model",
         "pass --load BASE (a checkpoint, e.g. written by `megadlms convert hf-to-megadlms`), or --load a LoRA "
         "checkpoint to resume"),
    Rule("--lora-rank", "--fp8-param-gather", lambda p: p.lora and p.config.fp8.fp8_param_gather,
         lambda p: f"{_rank(p)} freezes the base, so --fp8-param-gather has no trained FP8 weights to gather",
         "drop --fp8-param-gather"),
    Rule("--lora-rank", "--no-fp8-wgrad", lambda p: p.lora and p.fp8 and not p.config.fp8.fp8_wgrad,
         lambda p: f"{_rank(p)} freezes the base, whose layers compute no weight gradient", "drop --no-fp8-wgrad"),
    Rule("--lora-rank", "--tensor-model-parallel-size > 1", lambda p: p.lora and p.tp > 1,
         lambda p: f"{_rank(p)} with --tensor-model-parallel-size {p.tp}: LoRA runs with data parallelism only "
                   "(DDP / FSDP2)", "drop tensor parallelism"),
    Rule("--lora-rank", "--pipeline-model-parallel-size > 1", lambda p: p.lora and p.pp > 1,
         lambda p: f"{_rank(p)} with --pipeline-model-parallel-size {p.pp}: LoRA runs with data parallelism only "
                   "(DDP / FSDP2)", "drop pipeline parallelism"),
    # ---- FP8 parameter gather
    Rule("--fp8-param-gather", "needs --fp8-format", lambda p: p.config.fp8.fp8_param_gather and not p.fp8,
         lambda p: "--fp8-param-gather gathers the weights of FP8 layers",
         "add --fp8-format e4m3 (or hybrid) or drop --fp8-param-gather"),
    Rule("--fp8-param-gather", "a recipe without an exact FP8 gather (rowwise, mxfp8)",
         lambda p: p.config.fp8.fp8_param_gather and p.fp8 and param_gather_problem(p.config.fp8.fp8_recipe)
         is not None,
         lambda p: str(param_gather_problem(p.config.fp8.fp8_recipe)).rsplit("; ", 1)[0],
         "drop --fp8-param-gather or pick one of those recipes"),
    Rule("--fp8-param-gather", "--data-parallel-sharding-strategy no_shard",
         lambda p: p.config.fp8.fp8_param_gather and p.config.parallel.sharding_strategy == "no_shard",
         lambda p: "--fp8-param-gather casts the weight shards FSDP2 all-gathers, and --data-parallel-sharding-"
                   "strategy no_shard shards none",
         "add --use-distributed-optimizer or pick optim, optim_grads or optim_grads_params"),
    Rule("--fp8-param-gather", "--tensor-model-parallel-size > 1",
         lambda p: p.config.fp8.fp8_param_gather and p.tp > 1,
         lambda p: f"--fp8-param-gather takes FSDP2 alone, not with --tensor-model-parallel-size {p.tp}",
         "drop one of them"),
    Rule("--fp8-param-gather", "one data-parallel rank",
         lambda p: p.config.fp8.fp8_param_gather and p.fp8 and p.config.parallel.sharding_strategy != "no_shard"
         and p.tp == 1 and p.dp_cp < 2,
         lambda p: "--fp8-param-gather: this run has one data-parallel rank, so FSDP2 gathers nothing",
         "launch more ranks (torchrun --nproc-per-node N) or drop --fp8-param-gather"),
    # ---- parallel layout
    Rule("--expert-model-parallel-size", "a dense model", lambda p: p.ep > 1 and not p.moe,
         lambda p: f"--expert-model-parallel-size {p.ep} shards the experts of an MoE model, and this model is dense",
         "add --num-moe-experts N (a multiple of it) or drop --expert-model-parallel-size"),
    Rule("--expert-model-parallel-size", "--tensor-model-parallel-size > 1", lambda p: p.ep > 1 and p.tp > 1,
         lambda p: f"--expert-model-parallel-size {p.ep} takes data parallelism alone for now, not "
                   f"--tensor-model-parallel-size {p.tp}", "drop one of them"),
    Rule("--expert-model-parallel-size", "--context-parallel-size > 1", lambda p: p.ep > 1 and p.cp > 1,
         lambda p: f"--expert-model-parallel-size {p.ep} takes data parallelism alone for now, not "
                   f"--context-parallel-size {p.cp}", "drop one of them"),
    Rule("--expert-model-parallel-size", "--pipeline-model-parallel-size > 1", lambda p: p.ep > 1 and p.pp > 1,
         lambda p: f"--expert-model-parallel-size {p.ep} takes data parallelism alone for now, not "
                   f"--pipeline-model-parallel-size {p.pp}", "drop one of them"),
    Rule("--tensor-model-parallel-size", "an MoE model", lambda p: p.tp > 1 and p.moe,
         lambda p: f"--tensor-model-parallel-size {p.tp} with an MoE model: tensor parallelism does not shard the "
                   "experts", "use --tensor-model-parallel-size 1 (data parallelism) instead"),
    Rule("--context-parallel-size", "an MoE model", lambda p: p.cp > 1 and p.moe,
         lambda p: f"--context-parallel-size {p.cp} with an MoE model: the router's load-balancing loss and expert "
                   "counts are per-sequence statistics", "use --context-parallel-size 1"),
    Rule("--context-parallel-size", "--fp8-dot-product-attention",
         lambda p: p.cp > 1 and p.fp8 and p.config.fp8.fp8_dot_product_attention,
         lambda p: f"--context-parallel-size {p.cp} with --fp8-dot-product-attention: FP8 attention takes no mask "
                   "over gathered keys", "drop one of them"),
    Rule("--pipeline-model-parallel-size", "an MoE model", lambda p: p.pp > 1 and p.moe,
         lambda p: f"--pipeline-model-parallel-size {p.pp} with an MoE model: the router's statistics are reduced "
                   "per model", "use --pipeline-model-parallel-size 1"),
    Rule("--pipeline-model-parallel-size with --tensor-model-parallel-size", "DDP (no_shard) over > 1 data rank",
         lambda p: p.pp > 1 and p.tp > 1 and p.dp_cp > 1 and p.config.parallel.sharding_strategy == "no_shard",
         lambda p: f"--pipeline-model-parallel-size {p.pp} x --tensor-model-parallel-size {p.tp} over {p.dp_cp} "
                   "data-parallel ranks: DDP takes no tensor-parallel parameters",
         "add --use-distributed-optimizer (FSDP2) or another sharded strategy"),
    Rule("--pipeline-model-parallel-size", "--difflm-varilen-prob > 0",
         lambda p: p.pp > 1 and bool(p.config.objective.difflm_varilen_prob),
         lambda p: f"--pipeline-model-parallel-size {p.pp} runs micro-batches of one shape",
         "add --difflm-varilen-prob 0"),
    Rule("--pipeline-model-parallel-size", "--generate-sample",
         lambda p: p.pp > 1 and p.config.train.generate_sample,
         lambda p: f"--pipeline-model-parallel-size {p.pp}: the model is split over ranks, so it cannot sample at "
                   "the end", "add --no-generate-sample"),
    Rule("--pipeline-model-parallel-size", "fewer micro-batches per step than its schedule runs",
         lambda p: _schedule_problem(p) is not None,
         lambda p: str(_schedule_problem(p)).split("; ", 1)[0],
         "raise --global-batch-size, or use --pipeline-schedule gpipe",
         lambda p: str(_schedule_problem(p)).split("; ", 1)[1]),
    Rule("--num-layers-per-virtual-pipeline-stage", "needs --pipeline-model-parallel-size > 1",
         lambda p: p.config.parallel.num_layers_per_virtual_pipeline_stage is not None and p.pp == 1,
         lambda p: f"--num-layers-per-virtual-pipeline-stage "
                   f"{p.config.parallel.num_layers_per_virtual_pipeline_stage} interleaves the stages of a pipeline",
         "add --pipeline-model-parallel-size 2 or more, or drop it"),
    Rule("--num-layers-per-virtual-pipeline-stage", "--pipeline-schedule gpipe",
         lambda p: p.config.parallel.num_layers_per_virtual_pipeline_stage is not None and p.pp > 1
         and p.config.parallel.pipeline_schedule != "1f1b",
         lambda p: f"--num-layers-per-virtual-pipeline-stage "
                   f"{p.config.parallel.num_layers_per_virtual_pipeline_stage} runs the interleaved 1F1B schedule, "
                   f"not --pipeline-schedule {p.config.parallel.pipeline_schedule}", "use 1f1b"),
    Rule("--overlap-param-gather", "--data-parallel-sharding-strategy no_shard",
         lambda p: p.config.parallel.overlap_param_gather and p.config.parallel.sharding_strategy == "no_shard",
         lambda p: "--overlap-param-gather overlaps the all-gather of sharded parameters, and "
                   "--data-parallel-sharding-strategy no_shard has none",
         "add --use-distributed-optimizer or pick optim, optim_grads or optim_grads_params"),
    Rule("--global-batch-size", "a multiple of --micro-batch-size x data-parallel size",
         lambda p: p.config.train.global_batch_size is not None
         and p.global_batch % (p.config.train.micro_batch_size * p.dp) != 0,
         lambda p: f"--global-batch-size {p.global_batch} is not divisible by --micro-batch-size "
                   f"{p.config.train.micro_batch_size} x data-parallel size {p.dp}",
         "pass a multiple of their product"),
    # ---- CUDA graphs
    Rule("--cuda-graphs on", "any of the CUDA-graph blockers below",
         lambda p: p.config.train.cuda_graphs == "on" and bool(p.graph_blockers()),
         lambda p: f"--cuda-graphs on is not possible here: {'; '.join(p.graph_blockers())}",
         "use --cuda-graphs auto or off"),
)

# what keeps CUDA graphs from replaying the layers: (name for the docs, applies, why for this run); --cuda-graphs
# auto runs the layers eagerly instead, on is refused
GRAPH_BLOCKERS: tuple[tuple[str, Callable[[RunPlan], bool], Callable[[RunPlan], str]], ...] = (
    ("a device other than CUDA", lambda p: p.device_type != "cuda" and not p.emulate_graphs,
     lambda p: f"the device is {p.device_type}, CUDA graphs need a GPU"),
    ("--tensor-model-parallel-size > 1", lambda p: p.tp > 1, lambda p: "tensor parallelism (DTensor parameters)"),
    ("--context-parallel-size > 1", lambda p: p.cp > 1,
     lambda p: "context parallelism (attention all-gathers K/V)"),
    ("--pipeline-model-parallel-size > 1", lambda p: p.pp > 1,
     lambda p: "pipeline parallelism (the schedule runs the layers)"),
    ("--expert-model-parallel-size > 1", lambda p: p.ep > 1,
     lambda p: "expert parallelism (each all-to-all's split sizes are read on the host)"),
    ("a sharded --data-parallel-sharding-strategy", lambda p: p.sharded,
     lambda p: f"sharded data parallelism ({p.config.parallel.sharding_strategy}) gathers weights per use"),
    # with `on` the backward graph holds the recomputed forward too; `auto` leaves a recomputing run (one near the
    # card's memory) eager, since the graphs' memory pool stays reserved for the whole run
    ("--recompute-granularity with --cuda-graphs auto",
     lambda p: p.config.train.recompute_granularity is not None and p.config.train.cuda_graphs == "auto",
     lambda p: "activation checkpointing (--recompute-granularity; --cuda-graphs on captures the recomputation "
               "too)"),
    ("--rl", lambda p: p.rl is not None, lambda p: f"--rl {p.rl} batches change shape from step to step"),
)


# ---------------------------------------------------------------- resolution
def checkpoint_tokenizer(load: str, iteration: int | None) -> str | None:
    """The tokenizer folder saved with the --load checkpoint (its mask token and vocabulary are the model's), or
    None where there is no checkpoint yet (a requeued job) or it was saved without one."""
    try:
        path = ckpt.find_checkpoint(load, iteration)
    except ckpt.CheckpointError:
        return None
    tok = path / "tokenizer"
    return str(tok) if tok.is_dir() else None


def resolve_model_config(config: RunConfig, vocab_size: int | None, mask_id: int | None) -> TransformerConfig:
    """The TransformerConfig of a run: the preset / HF config with the model overrides (or, with
    use_checkpoint_args, the checkpoint's architecture), the objective's attention mask, the FP8 settings, the
    mask token (the flag's, else the tokenizer's, else the model config's) and the diffusion loss (the flag's, else
    the model config's). Reads files; builds nothing."""
    from ..diffusion import bd3lm

    ck = config.checkpoint
    if ck.use_checkpoint_args:
        assert ck.load is not None  # CheckpointConfig requires --load with --use-checkpoint-args
        base = ckpt.read_meta(ckpt.find_checkpoint(ck.load, ck.ckpt_step))["config"]
        arch = dict(config.model.overrides)
        # the window length is the run's choice (within the positions the model has); the architecture is the
        # checkpoint's, and a flag that says otherwise is an error rather than silently dropped
        if "seq_length" in arch:
            base["seq_length"] = arch.pop("seq_length")
            base["max_position_embeddings"] = max(base.get("max_position_embeddings") or 0, base["seq_length"])
        arch.pop("max_position_embeddings", None)
        differ = {k: v for k, v in arch.items() if base.get(k) != v}
        if differ:
            flags = ", ".join(f"--{k.replace('_', '-')} {v} (the checkpoint has {base.get(k)})"
                              for k, v in differ.items())
            raise ConfigError(f"--use-checkpoint-args takes the architecture from {ck.load}, but {flags}: drop those "
                              "flags, or leave out --use-checkpoint-args to build the architecture from the flags")
    else:
        base = load_model_config(config.model.model_path, tokenizer_vocab_size=vocab_size).to_dict()
        arch = dict(config.model.overrides)
        if "seq_length" in arch and "max_position_embeddings" not in arch:
            arch["max_position_embeddings"] = max(base["max_position_embeddings"], arch["seq_length"])
        base.update(arch)
    obj = config.objective
    mode = obj.running_mode(base)
    cfg_dict = {**base, "attn_mask_type": "causal" if mode == "vanilla" else "bidirectional",
                **config.fp8.model_fields(), "diffusion_shift": mode == "difflm-shift"}
    # block diffusion: the block size is part of the model (its sampler and exports need it); a --block-size in
    # another mode is the plan's clash to report
    if mode == "bd3lm":
        if obj.block_size is None and base.get("block_size") is None:
            raise ConfigError("--model-running-mode bd3lm needs --block-size B (a divisor of --seq-length, e.g. 4)")
        if obj.block_size is not None:
            cfg_dict["block_size"] = obj.block_size
    else:
        cfg_dict["block_size"] = None
    mask = obj.mask_token
    if mask is None:
        mask = mask_id if mask_id is not None else cfg_dict.get("mask_token_id")
    if mode != "vanilla" and mask is None:
        raise ConfigError("no mask token: pass --mask-token ID (the tokenizer has no <|mask|> and the preset none)")
    cfg_dict["mask_token_id"] = mask
    if obj.diffusion_loss is not None:  # the flag wins, and the checkpoint records the loss it trained with
        cfg_dict["diffusion_loss"] = obj.diffusion_loss
    if mode == "bd3lm":  # the flag-named errors before the config's own
        bd3lm.Bd3lmConfig(block_size=cfg_dict["block_size"], seq_length=cfg_dict["seq_length"],
                          clip_min=obj.bd3lm_clip_min, clip_max=obj.bd3lm_clip_max, noise_per=obj.bd3lm_noise_per)
    cfg = TransformerConfig.from_dict(cfg_dict)
    if vocab_size is not None and vocab_size > cfg.vocab_size:
        raise ConfigError(f"the tokenizer has {vocab_size} tokens but the model's vocab_size is {cfg.vocab_size}; "
                          "use a tokenizer that fits the model or a model with a larger vocabulary")
    return cfg


def run_tokenizer(config: RunConfig) -> Any:
    """The run's tokenizer: --tokenizer-model, else the one saved with the --load checkpoint, else the bundled one."""
    import logging

    from ..data import load_tokenizer

    data = config.data
    tokenizer_model = data.tokenizer_model
    if tokenizer_model is None and config.checkpoint.load:
        tokenizer_model = checkpoint_tokenizer(config.checkpoint.load, config.checkpoint.ckpt_step)
        if tokenizer_model is not None and os.environ.get("RANK", "0") == "0":
            logging.getLogger("megadlms").info(
                "tokenizer: the one saved with the checkpoint, %s (--tokenizer-model picks another)", tokenizer_model)
    return load_tokenizer(tokenizer_model, tokenizer_type=data.tokenizer_type)


def plan_run(config: RunConfig, tokenizer: Any = None) -> RunPlan:
    """The checked plan of `config` (ConfigError listing every clash): the model's architecture resolved with the
    run's tokenizer (loaded where not given), nothing built."""
    tok = tokenizer if tokenizer is not None else run_tokenizer(config)
    model = resolve_model_config(config, tok.vocab_size, tok.mask_id)
    return RunPlan.resolve(config, model).check()


# ---------------------------------------------------------------- the docs table
def rules_table() -> str:
    """The markdown tables of docs/run_plan.md: every rule, and the CUDA-graph blockers."""
    rows = ["| Feature | Needs, or cannot run with | Fix |", "| --- | --- | --- |"]
    rows += [f"| {r.feature} | {r.clash} | {r.fix} |" for r in RULES]
    rows += ["", "CUDA graphs (`--cuda-graphs auto` runs the layers eagerly, `on` is refused) with any of:", ""]
    rows += [f"- {name}" for name, _, _ in GRAPH_BLOCKERS]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(rules_table(), end="")
