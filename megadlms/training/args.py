"""Command-line flags of `megadlms train` / `pretrain_difflm.py`, with Megatron-LM names.

A thin skin: the flags build the `RunConfig` the Python API takes (each flag's dest is the name of a field
in one of its sections, `megadlms.training.config`); no logic hides here. `--config FILE.yaml` supplies
defaults (keys = flag names, dashes or underscores); flags given on the command line win. Without `--config`
the bundled demo config (megadlms/assets/demo.yaml) supplies them, unless a flag names a model, tokenizer or
data of your own (`OWN_RUN_DESTS`: `--model-path`, `--use-checkpoint-args`, `--tokenizer-model`, `--data-path`,
`--train/valid/test-data-path`): then the flags' own defaults do.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
from importlib import resources
from typing import Any, Sequence

import yaml

from ..config import FP8_AMAX_ALGOS, FP8_FORMATS, ConfigError, FP8Settings
from ..diffusion.clip_search import CLIP_SEARCH_DELTA, CLIP_SEARCH_WIDTHS
from ..diffusion.objective import DIFFUSION_LOSSES, PMASK_MODES, RUNNING_MODES
from ..fp8.recipe import RECIPE_NAMES
from ..lora import TARGETS as LORA_TARGETS
from ..presets import PRESETS
from ..rl.rewards import REWARDS
from .config import RunConfig
from .optim import LR_DECAY_STYLES, WSD_DECAY_STYLES

DEMO_CONFIG = "demo.yaml"
DEMO_CONFIG_NAME = "megadlms/assets/demo.yaml"  # as messages name it
# flags naming a model, tokenizer or data of the user's own: with any of them a run without --config starts from the
# flags' defaults instead of the demo configuration
OWN_RUN_DESTS = ("model_path", "use_checkpoint_args", "tokenizer_model", "data_path", "train_data_path",
                 "valid_data_path", "test_data_path")
DEMO_RULE = (f"Without --config, the run starts from the demo configuration ({DEMO_CONFIG_NAME}) and the flags "
             "given override it, unless one of them names a model, tokenizer or data of your own (--model-path, "
             "--use-checkpoint-args, --tokenizer-model, --data-path, --train/valid/test-data-path): then the "
             "defaults shown here apply.")

log = logging.getLogger(__name__)


def _layer_freq(text: str) -> int | list[int]:
    """--moe-layer-freq: an int N, or a comma list of 0/1 per layer."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int or a comma list of 0/1, e.g. 1 or 0,1,1,1") from None
    if len(values) == 1 and "," not in text:
        return values[0]
    if not values or any(v not in (0, 1) for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: a per-layer pattern holds only 0 (dense) and 1 (MoE)")
    return values


class TrainHelpFormatter(argparse.HelpFormatter):
    """`--help` with each default shown once, where there is one: never "(default: None)" or "(default: False)",
    and not again where the help text already speaks of the default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default in (None, False, argparse.SUPPRESS) or not action.option_strings
        if "%(default)" in text:  # BooleanOptionalAction's own suffix (Python < 3.14)
            return text.replace(" (default: %(default)s)", "") if unset else text
        if unset or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


# argument placeholders in --help: by kind of value (the dest in capitals, argparse's own, doubles each long flag)
METAVARS = {"save": "DIR", "load": "DIR", "tensorboard_dir": "DIR", "wandb_save_dir": "DIR",
            "data_cache_path": "DIR", "lora_base_path": "DIR", "data_path": "PREFIX", "train_data_path": "PREFIX",
            "valid_data_path": "PREFIX", "test_data_path": "PREFIX", "tokenizer_model": "PATH",
            "model_path": "NAME|PATH", "device": "DEVICE", "rl_reward": "NAME[:W],...",
            "lora_targets": "q,k,v,...", "moe_layer_freq": "N|0,1,..", "split": "A,B,C"}


def _short_metavars(p: argparse.ArgumentParser) -> None:
    """Placeholders that say the kind of value (N, X, DIR, ...) instead of the dest in capitals."""
    for action in p._actions:
        if not action.option_strings or action.nargs == 0 or action.metavar is not None or action.choices:
            continue
        kind = "N" if action.type is int else "X" if action.type is float else "VALUE"
        action.metavar = METAVARS.get(action.dest, kind)


def add_train_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.formatter_class = TrainHelpFormatter
    p.usage = "%(prog)s [-h] [--config FILE.yaml] [--FLAG VALUE ...]"
    p.epilog = DEMO_RULE
    p.add_argument("--config", metavar="FILE.yaml", help="YAML file of flag values (keys = flag names)")

    g = p.add_argument_group("model")
    g.add_argument("--model-path", default="tiny",
                   help=f"a preset name ({', '.join(PRESETS)}), a Hugging Face config.json, or a folder holding one")
    g.description = "The architecture: a preset or config file, and flags that override its values."
    for flag, typ, text in (
            ("--num-layers", int, "transformer layers"), ("--hidden-size", int, "model width"),
            ("--num-attention-heads", int, "query heads"),
            ("--num-query-groups", int, "key/value heads (grouped-query attention)"),
            ("--kv-channels", int, "width of one attention head"),
            ("--ffn-hidden-size", int, "the MLP's inner width"),
            ("--seq-length", int, "tokens per training window"),
            ("--max-position-embeddings", int, "positions the model supports (default: at least --seq-length)"),
            ("--rotary-base", float, "RoPE's base (theta)"), ("--norm-epsilon", float, "RMSNorm's epsilon"),
            ("--init-method-std", float, "std of the initial weights")):
        g.add_argument(flag, type=typ, default=None, help=text)
    g.add_argument("--qk-layernorm", action=argparse.BooleanOptionalAction, default=None,
                   help="RMSNorm on each head's queries and keys (Qwen3)")
    g.add_argument("--untie-embeddings-and-output-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="an output layer of its own instead of the input embedding's weights")

    g = p.add_argument_group("mixture of experts (Megatron-Core's flags; docs/moe.md)")
    g.add_argument("--num-moe-experts", type=int, default=None, help="routed experts per MoE layer (none: dense)")
    for flag, typ, text in (
            ("--moe-router-topk", int, "experts each token is routed to"),
            ("--moe-ffn-hidden-size", int, "each expert's inner width"),
            ("--moe-shared-expert-intermediate-size", int, "an always-on shared expert of this width"),
            ("--moe-router-topk-scaling-factor", float, "multiplies the routing weights"),
            ("--moe-aux-loss-coeff", float, "weight of the load-balancing loss"),
            ("--moe-z-loss-coeff", float, "weight of the router's z-loss (ST-MoE)"),
            ("--moe-router-bias-update-rate", float, "the expert bias's step per optimizer step")):
        g.add_argument(flag, type=typ, default=None, help=text)
    g.add_argument("--moe-layer-freq", type=_layer_freq, default=None,
                   help="N: every Nth layer is MoE; or a 0/1 pattern per layer, e.g. 0,1,1,1 (dense first layer)")
    g.add_argument("--moe-router-score-function", choices=("softmax", "sigmoid"), default=None,
                   help="how the router scores the experts")
    g.add_argument("--moe-router-pre-softmax", action=argparse.BooleanOptionalAction, default=None,
                   help="softmax over all experts before the top-k (else over the k chosen)")
    g.add_argument("--moe-router-enable-expert-bias", action=argparse.BooleanOptionalAction, default=None,
                   help="aux-loss-free load balancing: a per-expert bias on the routing scores")

    g = p.add_argument_group("diffusion objective")
    g.add_argument("--model-running-mode", choices=RUNNING_MODES, default=None,
                   help="default: the mode the model records (difflm-shift for Dream, bd3lm for a block-diffusion "
                        "checkpoint), else difflm-noshift. difflm-noshift: masked diffusion, bidirectional; "
                        "difflm-shift: masked diffusion whose "
                        "logits at position i predict token i + 1 (Dream; keeps an AR model's head alignment); "
                        "vanilla: autoregressive, causal; "
                        "bd3lm: block diffusion (blocks of --block-size, AR across blocks)")
    g.add_argument("--attention-anneal-iters", type=int, default=0,
                   help="adapting an AR model: anneal causal attention into bidirectional over this many "
                        "iterations (each future key open with probability (i + 1) / N at iteration i; DiffuLLaMA)")
    g.add_argument("--mask-token", type=int, default=None,
                   help="mask token id (default: the tokenizer's <|mask|>, else the preset's)")
    g.add_argument("--difflm-eps", type=float, default=1e-3,
                   help="each token is masked with probability p = (1 - eps) t + eps, t ~ U[0, 1]")
    g.add_argument("--difflm-pmask", choices=PMASK_MODES, default="sampled",
                   help="the loss's 1/p weight: sampled, the drawn p; actual, the row's masked fraction")
    g.add_argument("--difflm-varilen-prob", type=float, default=0.01,
                   help="share of micro-batches cut to a random length in [2, --seq-length]")
    g.add_argument("--diffusion-loss", choices=DIFFUSION_LOSSES, default=None,
                   help="the diffusion modes' cross-entropy (pre-training, SFT, bd3lm). subs: MDLM's SUBS "
                        "parameterisation, the [MASK] logit is -inf before the softmax (the bound of the model the "
                        "sampler draws from); full-vocab: [MASK] stays in the softmax, as LLaDA trains. Default: "
                        "the one the model records (full-vocab for LLaDA, LLaDA-MoE and Dream), else subs")
    # block diffusion (--model-running-mode bd3lm; megadlms.diffusion.bd3lm)
    g.add_argument("--block-size", type=int, default=None, help="bd3lm: tokens per block (divides --seq-length)")
    g.add_argument("--bd3lm-clip-min", type=float, default=1e-3, help="bd3lm: training t ~ U[min, max]")
    g.add_argument("--bd3lm-clip-max", type=float, default=1.0, help="bd3lm: (1e-3, 1: the linear schedule)")
    g.add_argument("--bd3lm-noise-per", choices=("block", "sequence"), default="block",
                   help="bd3lm: one noise level t per block or per sequence")
    g.add_argument("--bd3lm-antithetic", action=argparse.BooleanOptionalAction, default=True,
                   help="bd3lm: stratify t over the global batch x blocks, the k-th of n levels in the k-th of n "
                        "equal parts of its range (the paper's antithetic sampling; lower-variance losses); "
                        "--no-bd3lm-antithetic: independent draws")
    g.add_argument("--bd3lm-resample", action="store_true", default=False,
                   help="bd3lm training: redraw a block's mask while its masked fraction is outside [--bd3lm-clip-min, "
                        "--bd3lm-clip-max] (the reference's training.resample; a bound left at 1e-3 or 1 is not "
                        "enforced)")
    g.add_argument("--bd3lm-clip-search", action="store_true", default=False,
                   help="bd3lm: at every validation, score each candidate clip interval (the linear schedule and "
                        "the intervals of --bd3lm-clip-search-widths) by the variance of its per-block training "
                        "loss on the validation batches, and train on the lowest (the paper's search; costs one "
                        "forward per candidate and validation micro-batch, on up to 100 batches)")
    g.add_argument("--bd3lm-clip-search-widths", type=float, nargs="+", default=list(CLIP_SEARCH_WIDTHS),
                   metavar="W", help="bd3lm clip search: the candidate widths (the paper's 0.5 0.6 0.7 0.8 0.9)")
    g.add_argument("--bd3lm-clip-search-delta", type=float, default=CLIP_SEARCH_DELTA,
                   help="bd3lm clip search: the step between the starts of one width's intervals")
    g.add_argument("--ignore-bos", action="store_true", default=False,
                   help="difflm-noshift and bd3lm: never mask the first token of a window and leave it out of the "
                        "validation loss's denominator (MDLM / BD3-LM's ignore_bos, for data whose windows start "
                        "with BOS)")

    g = p.add_argument_group("training")
    g.add_argument("--train-iters", type=int, default=1000, help="optimizer steps")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (after saving, if --save) when the iteration is a multiple of this")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save (if --save) and stop once the run has trained this many minutes (before a job's "
                        "wall-time limit)")
    g.add_argument("--exit-signal-handler", action=argparse.BooleanOptionalAction, default=True,
                   help="on SIGTERM, SIGINT or SIGUSR1 finish the step, save (if --save) and exit 0; a second "
                        "signal exits at once")
    g.add_argument("--micro-batch-size", type=int, default=8, help="sequences per forward on each rank")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="default: micro-batch-size x data-parallel size (no accumulation)")
    g.add_argument("--lr", type=float, default=3e-4, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=0.0, help="learning rate at the end of the decay")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="linear warm-up steps")
    g.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="cosine", help="decay after the warm-up")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None, help="WSD: length of the final decay")
    g.add_argument("--lr-wsd-decay-style", choices=WSD_DECAY_STYLES, default="linear",
                   help="WSD: the final decay's shape")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW's decoupled weight decay")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="AdamW's first-moment decay")
    g.add_argument("--adam-beta2", type=float, default=0.95, help="AdamW's second-moment decay")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW's epsilon")
    g.add_argument("--clip-grad", type=float, default=1.0, help="0 disables clipping")
    g.add_argument("--max-skipped-steps", type=int, default=10,
                   help="stop the run after this many consecutive steps skipped for a non-finite loss or gradient "
                        "norm (0: never stop)")
    g.add_argument("--seed", type=int, default=1234,
                   help="seed of the weights' initialisation, the masks and the data order")
    g.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    g.add_argument("--bf16", action="store_true", default=None, help="bf16 autocast (default on GPU)")
    g.add_argument("--fp32", action="store_true", help="no autocast, also on GPU")
    g.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the model (default: on for CUDA)")
    g.add_argument("--recompute-granularity", choices=("full",), default=None,
                   help="activation checkpointing of every transformer layer")
    g.add_argument("--cuda-graphs", choices=("auto", "on", "off"), default="auto",
                   help="replay the transformer layers' training forward and backward from CUDA graphs, so the "
                        "host issues two graph launches per micro-batch instead of every kernel (auto: on for a "
                        "single CUDA process without activation checkpointing, eager layers if the capture fails; "
                        "on: also under DDP, a failed capture is an error)")
    g.add_argument("--enable-cuda-graph", dest="cuda_graphs", action="store_const", const="on",
                   help="same as --cuda-graphs on")
    g.add_argument("--loss-chunk-tokens", type=int, default=None,
                   help="fuse the LM head with the loss over chunks of this many tokens, computing logits only "
                        "where the loss has weight (0: plain logits; default: 8192 when the vocabulary has "
                        ">= 32768 tokens, else 0)")

    g = p.add_argument_group("FP8 (Transformer Engine / Megatron-Core semantics)")
    g.add_argument("--fp8-format", choices=FP8_FORMATS, default=None,
                   help="enable FP8: e4m3 everywhere, or hybrid (E4M3 forward, E5M2 gradients)")
    g.add_argument("--fp8-hybrid", action="store_true", help="same as --fp8-format hybrid")
    fp8 = FP8Settings()  # the FP8 settings' one set of defaults
    g.add_argument("--fp8-recipe", choices=RECIPE_NAMES, default=fp8.fp8_recipe,
                   help="scaling: delayed / tensorwise (per tensor), rowwise, blockwise (1x128 tiles, 128x128 "
                        "weight blocks; Hopper, e4m3), mxfp8 (32-element E8M0 blocks; Blackwell, e4m3)")
    g.add_argument("--fp8-pow2-scales", action="store_true",
                   help="blockwise: scales rounded down to powers of two (dequantisation is exact)")
    g.add_argument("--fp8-margin", type=int, default=fp8.fp8_margin,
                   help="scales divided by 2**margin (headroom above the amax)")
    g.add_argument("--fp8-amax-history-len", type=int, default=fp8.fp8_amax_history_len,
                   help="delayed scaling: steps of amax history")
    g.add_argument("--fp8-amax-compute-algo", choices=FP8_AMAX_ALGOS, default=fp8.fp8_amax_compute_algo,
                   help="delayed scaling: the scale's amax, the history's max or its most recent")
    g.add_argument("--fp8-wgrad", action=argparse.BooleanOptionalAction, default=fp8.fp8_wgrad,
                   help="the weight-gradient GEMM in FP8 (--no-fp8-wgrad: in BF16)")
    g.add_argument("--activation-func-fp8-input-store", action="store_true",
                   help="save the SwiGLU input for backward in FP8")
    g.add_argument("--fp8-fuse-projections", action=argparse.BooleanOptionalAction, default=fp8.fp8_fuse_projections,
                   help="run q/k/v and gate/up as one FP8 GEMM each (same parameters and checkpoints)")
    g.add_argument("--fp8-fuse-mlp", action=argparse.BooleanOptionalAction, default=fp8.fp8_fuse_mlp,
                   help="run the FP8 MLP as one function with the SwiGLU fused into its FP8 casts (delayed and "
                        "tensorwise scaling)")
    g.add_argument("--fp8-fprop-fast-accum", action=argparse.BooleanOptionalAction, default=fp8.fp8_fprop_fast_accum,
                   help="fast accumulation in the forward FP8 GEMM (off: full-precision accumulation, slower)")
    g.add_argument("--fp8-dot-product-attention", action="store_true",
                   help="attention in FP8 too: cuDNN's FP8 flash attention (Hopper or newer; needs the "
                        "nvidia-cudnn-frontend package), delayed scaling; a little faster, but it lowers model "
                        "quality (docs/fp8.md)")
    g.add_argument("--fp8-param-gather", action="store_true",
                   help="FSDP2 all-gathers the FP8 layers' weights in FP8 (1 byte per element): each rank casts its "
                        "shard first (delayed, tensorwise, blockwise; needs a sharding strategy)")
    g.add_argument("--first-last-layers-bf16", action="store_true",
                   help="keep the first/last transformer layers in BF16 (counts below)")
    g.add_argument("--num-layers-at-start-in-bf16", type=int, default=fp8.num_layers_at_start_in_bf16,
                   help="with --first-last-layers-bf16: first layers kept in BF16")
    g.add_argument("--num-layers-at-end-in-bf16", type=int, default=fp8.num_layers_at_end_in_bf16,
                   help="with --first-last-layers-bf16: last layers kept in BF16")
    g.add_argument("--fp8-stats", action=argparse.BooleanOptionalAction, default=False,
                   help="log FP8 amax / underflow / saturation per tensor role every --log-interval; the steps it "
                        "records run their layers outside the CUDA graphs (eagerly: slower, and with their "
                        "activations allocated beside the graphs' memory pool)")

    g = p.add_argument_group("LoRA (adapters on a frozen base; docs/lora.md)")
    g.add_argument("--lora-rank", type=int, default=None,
                   help="train rank-R LoRA adapters on the frozen base that --load names (off by default)")
    g.add_argument("--lora-alpha", type=float, default=None, help="the adapters' scale is alpha / rank (default: "
                   "alpha = rank)")
    g.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the adapters' input")
    g.add_argument("--lora-targets", default=",".join(LORA_TARGETS),
                   help="the linears of each layer that get adapters: a comma list of q,k,v,o,gate,up,down")
    g.add_argument("--lora-base", choices=("fp8", "bf16"), default=None,
                   help="how the frozen base's layer weights are stored: fp8 (E4M3 + scale, 1 byte a weight, FP8 "
                        "GEMMs) or bf16 (default: fp8 with --fp8-format, else bf16)")
    g.add_argument("--lora-base-path", default=None, metavar="DIR",
                   help="resuming a LoRA checkpoint: the base to put its adapters on (default: the base it records; "
                        "its checksum must match)")

    g = p.add_argument_group("reinforcement learning and preference optimisation (docs/rl.md)")
    g.add_argument("--rl", choices=("vrpo", "grpo"), default=None,
                   help="vrpo: LLaDA 1.5's DPO on ELBO estimates over preference pairs; grpo: d1's diffu-GRPO with "
                        "verifiable rewards (off by default: pre-training or SFT)")
    g.add_argument("--rl-data", default=None, metavar="FILE.jsonl",
                   help='vrpo: {"prompt", "chosen", "rejected"} per line; grpo: {"prompt", ...} with the fields '
                        "its rewards read (exact_match: \"answer\")")
    g.add_argument("--vrpo-samples", type=int, default=8,
                   help="vrpo: timesteps per ELBO estimate, one mask each, shared by policy and reference")
    g.add_argument("--dpo-beta", type=float, default=0.1, help="vrpo: DPO's beta")
    g.add_argument("--rl-kl-beta", type=float, default=0.04, help="grpo: weight of the KL to the frozen reference")
    g.add_argument("--grpo-group-size", type=int, default=8, help="grpo: completions per prompt (G, at least 2)")
    g.add_argument("--grpo-inner-updates", type=int, default=1,
                   help="grpo: optimizer steps on each batch of rollouts (mu), each with a new prompt mask")
    g.add_argument("--grpo-clip-eps", type=float, default=0.2, help="grpo: ratio clipped to [1 - eps, 1 + eps]")
    g.add_argument("--grpo-prompt-mask", type=float, default=0.15,
                   help="grpo: probability of masking each prompt token in the one-step log-likelihood estimate")
    g.add_argument("--rl-reward", default="exact_match",
                   help=f"grpo: comma list of rewards, NAME or NAME:WEIGHT ({', '.join(sorted(REWARDS))})")
    g.add_argument("--rl-gen-length", type=int, default=32, help="grpo: tokens per completion")
    g.add_argument("--rl-block-length", type=int, default=32, help="grpo: the rollout sampler's block length")
    g.add_argument("--rl-threshold", type=float, default=0.9,
                   help="grpo: the fast sampler's confidence threshold (parallel decoding)")
    g.add_argument("--rl-temperature", type=float, default=0.9, help="grpo: sampling temperature of the rollouts")

    g = p.add_argument_group("evaluation, logging, checkpoints")
    g.add_argument("--eval-interval", type=int, default=1000, help="validate every this many steps (0: never)")
    g.add_argument("--eval-iters", type=int, default=10, help="global batches per validation")
    g.add_argument("--log-interval", type=int, default=10, help="log every this many steps")
    g.add_argument("--tensorboard-dir", default=None, help="write TensorBoard events here")
    g.add_argument("--wandb-project", default=None, help="log what TensorBoard gets to this Weights & Biases "
                   "project (pip install 'megadlms[wandb]'; WANDB_MODE=offline works without a network)")
    g.add_argument("--wandb-exp-name", default=None, help="the W&B run name (default: W&B's)")
    g.add_argument("--wandb-save-dir", default=None, help="folder for W&B's files (default: --save, else ./wandb)")
    g.add_argument("--save", default=None, help="checkpoint folder")
    g.add_argument("--save-interval", type=int, default=None, help="default: only at the end")
    g.add_argument("--ckpt-keep-last", type=int, default=None,
                   help="keep only the newest N checkpoints (default: all)")
    g.add_argument("--ckpt-save-failures-ok", type=int, default=0,
                   help="go on training after up to N failed saves (a full disk, no permission); 0: stop at the "
                        "first")
    g.add_argument("--load", default=None, help="resume from this checkpoint folder")
    g.add_argument("--ckpt-step", type=int, default=None, help="load this iteration instead of the latest")
    g.add_argument("--finetune", action="store_true", help="load model weights only; fresh optimizer and iteration")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the architecture from the checkpoint given by --load")
    g.add_argument("--generate-sample", action=argparse.BooleanOptionalAction, default=None,
                   help="print a sample from the trained model at the end (default: on for the demo)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar, even on a terminal")

    from ..data.args import add_data_arguments
    from ..distributed.args import add_distributed_arguments

    add_data_arguments(p)
    add_distributed_arguments(p)
    _short_metavars(p)
    return p


def build_parser(prog: str = "megadlms train") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Pre-train or fine-tune a diffusion (or AR) language model.")
    return add_train_arguments(p)


def apply_yaml_defaults(p: argparse.ArgumentParser, path: str) -> None:
    """Set parser defaults from a YAML file whose keys are flag names."""
    try:
        with open(path) as f:
            values = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--config {path}: not a text file (YAML expected)") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"--config {path} is not valid YAML{where}: {problem}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values, got {type(values).__name__}")
    actions = {a.dest: a for a in p._actions}
    defaults = {}
    for key, value in values.items():
        dest = str(key).lstrip("-").replace("-", "_")
        if dest not in actions:
            raise ConfigError(f"--config {path}: unknown key {key!r} (keys are flag names, e.g. train-iters)")
        _check_yaml_value(path, key, value, actions[dest])
        kind = actions[dest].type
        if kind in (int, float) and isinstance(value, (int, float)):
            value = int(value) if kind is int else float(value)  # 3.0 for an int flag is 3; argparse converts strings
        defaults[dest] = value
    p.set_defaults(**defaults)


def _check_yaml_value(path: str, key: Any, value: Any, action: argparse.Action) -> None:
    """A YAML value of the flag's type (strings are converted by argparse as on the command line)."""
    if value is None or isinstance(value, str):
        return
    if isinstance(value, list) and action.nargs in ("+", "*"):  # a list flag (--data-path A B): each item checked
        for item in value:
            _check_yaml_value(path, key, item, action)
        return
    typ = action.type
    bad = isinstance(value, (list, dict)) or (typ in (int, float) and (isinstance(value, bool) or not isinstance(
        value, (int, float)))) or (typ is int and isinstance(value, float) and not value.is_integer())
    if bad:
        raise ConfigError(f"--config {path}: {key}: {value!r} is not a valid {getattr(typ, '__name__', 'value')} "
                          f"for --{action.dest.replace('_', '-')}")
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"--config {path}: {key}: {value!r} is not one of {list(action.choices)}")


# dests that steer parsing and are no RunConfig field
PARSE_ONLY = ("help", "config", "fp8_hybrid")


def run_config_from_args(args: argparse.Namespace) -> RunConfig:
    """The RunConfig of parsed flags: each dest goes to the section field of the same name."""
    return RunConfig.from_flat({k: v for k, v in vars(args).items() if k not in PARSE_ONLY})


def names_own_run(p: argparse.ArgumentParser, argv: Sequence[str]) -> bool:
    """Whether `argv` gives one of the OWN_RUN_DESTS flags (also abbreviated or as --flag=value)."""
    unset = object()
    saved = {d: p.get_default(d) for d in OWN_RUN_DESTS}
    p.set_defaults(**{d: unset for d in OWN_RUN_DESTS})
    try:
        given, _ = p.parse_known_args(list(argv))
    finally:
        p.set_defaults(**saved)
    return any(getattr(given, d) is not unset for d in OWN_RUN_DESTS)


def parse_train_args(argv: Sequence[str] | None, prog: str = "megadlms train",
                     parser: argparse.ArgumentParser | None = None) -> RunConfig:
    """Parse the flags of `megadlms train` over defaults from `--config FILE.yaml`, else from the demo
    configuration unless a flag names a model, tokenizer or data of the user's own (`OWN_RUN_DESTS`); logs which.

    parser: one that `add_train_arguments` has filled (default: a new one named `prog`)."""
    p = parser if parser is not None else build_parser(prog)
    argv = list(argv or [])
    config = None
    if "--config" in argv:
        config = argv[argv.index("--config") + 1]
    elif any(a.startswith("--config=") for a in argv):
        config = next(a.split("=", 1)[1] for a in argv if a.startswith("--config="))
    elif not {"-h", "--help"} & set(argv) and not names_own_run(p, argv):  # the demo, with the flags on top
        config = str(resources.files("megadlms.assets") / DEMO_CONFIG)
    if config:
        apply_yaml_defaults(p, config)
    args = p.parse_args(argv)
    if args.fp8_hybrid:
        if args.fp8_format not in (None, "hybrid"):
            p.error(f"--fp8-hybrid conflicts with --fp8-format {args.fp8_format}; pass one of them")
        args.fp8_format = "hybrid"
    if args.generate_sample is None:  # on for the demo
        args.generate_sample = bool(config and config.endswith(DEMO_CONFIG))
    try:
        run_config = run_config_from_args(args)
    except ConfigError as e:
        raise _blame_config_file(e, argv, config) from None
    if os.environ.get("RANK", "0") == "0":  # under torchrun, once
        log.info("configuration: %s", describe_configuration(argv, config))
    return run_config


def _blame_config_file(e: ConfigError, argv: Sequence[str], config: str | None) -> ConfigError:
    """`e`, naming the config file (or the demo configuration) when the flag its message starts with came from there."""
    flag = str(e).split(" ", 1)[0]
    if config is None or not flag.startswith("--") or any(a == flag or a.startswith(flag + "=") for a in argv):
        return e
    demo = config == str(resources.files("megadlms.assets") / DEMO_CONFIG)
    where = f"the demo configuration, {DEMO_CONFIG_NAME}," if demo else config
    return ConfigError(f"{e} ({where} sets {flag})")


def describe_configuration(argv: Sequence[str], config: str | None) -> str:
    """Where a run's settings come from, for its first log line."""
    if config is None:
        return f"the flags' defaults with your flags on top (`--help` lists the defaults): {shlex.join(argv)}"
    demo = config == str(resources.files("megadlms.assets") / DEMO_CONFIG)
    what = f"the demo configuration ({DEMO_CONFIG_NAME})" if demo else config
    others = [a for a in argv if a != "--config" and a != config and not a.startswith("--config=")]
    return f"{what} with your flags on top: {shlex.join(others)}" if others else what
