"""The training loop: build everything from the arguments, then step, log, evaluate and checkpoint.

One iteration = one global batch = micro-batches x data-parallel ranks, with gradient
accumulation over the micro-batches of this rank. Masking noise is drawn per global batch
(`MaskSampler`) and sliced by each rank, so the run does not depend on how it is split.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..config import ConfigError, TransformerConfig
from ..diffusion.objective import (
    MaskSampler,
    ObjectiveConfig,
    chunked_weighted_cross_entropy,
    prepare_batch,
    weighted_cross_entropy,
)
from ..distributed.data_parallel import grad_sync_context
from ..distributed.init import ParallelContext, destroy_parallel, init_parallel
from ..distributed.parallelize import compute_dtype, parallelize_model
from ..model import build_model
from ..presets import load_model_config
from . import checkpoint as ckpt
from .cuda_graphs import LayerGraphs
from .metrics import MetricSinks, bf16_peak_tflops, format_log_line, memory_gib, throughput
from .optim import LRSchedule, allocate_optimizer_state, build_optimizer, clip_grad_norm, set_lr
from .triton_adamw import StreamingAdamW

log = logging.getLogger("megadlms")


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)  # logged metrics of this process's run


def model_config_from_args(args: argparse.Namespace, vocab_size: int | None, mask_id: int | None) -> TransformerConfig:
    """The TransformerConfig for `args`: preset / HF config, flag overrides, objective and FP8 settings."""
    if args.use_checkpoint_args:
        if not args.load:
            raise ConfigError("--use-checkpoint-args needs --load DIR")
        base = TransformerConfig.from_dict(ckpt.read_meta(ckpt.find_checkpoint(args.load, args.ckpt_step))["config"])
        overrides: dict[str, Any] = {}
    else:
        base = None
        overrides = {k: getattr(args, k) for k in (
            "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
            "seq_length", "max_position_embeddings", "rotary_base", "norm_epsilon", "init_method_std",
            "qk_layernorm", "untie_embeddings_and_output_weights") if getattr(args, k) is not None}
        if args.model_path == "tiny" and vocab_size is not None:
            overrides["vocab_size"] = vocab_size  # the tiny preset takes the tokenizer's vocabulary
        if "seq_length" in overrides and "max_position_embeddings" not in overrides:
            overrides["max_position_embeddings"] = None  # re-derived below if the preset's is too small
    overrides["attn_mask_type"] = "bidirectional" if args.model_running_mode == "difflm-noshift" else "causal"
    overrides.update(
        fp8=args.fp8_format is not None, fp8_format=args.fp8_format or "hybrid", fp8_recipe=args.fp8_recipe,
        fp8_margin=args.fp8_margin, fp8_amax_history_len=args.fp8_amax_history_len,
        fp8_amax_compute_algo=args.fp8_amax_compute_algo, fp8_wgrad=args.fp8_wgrad,
        activation_func_fp8_input_store=args.activation_func_fp8_input_store,
        fp8_fuse_projections=args.fp8_fuse_projections, fp8_fuse_mlp=args.fp8_fuse_mlp,
        fp8_fprop_fast_accum=args.fp8_fprop_fast_accum, fp8_dot_product_attention=args.fp8_dot_product_attention,
        num_layers_at_start_in_bf16=args.num_layers_at_start_in_bf16 if args.first_last_layers_bf16 else 0,
        num_layers_at_end_in_bf16=args.num_layers_at_end_in_bf16 if args.first_last_layers_bf16 else 0)
    if base is None:
        preset = load_model_config(args.model_path).to_dict()
        if overrides.get("max_position_embeddings", 0) is None:
            overrides["max_position_embeddings"] = max(preset["max_position_embeddings"], overrides["seq_length"])
        cfg_dict = {**preset, **overrides}
    else:
        cfg_dict = {**base.to_dict(), **overrides}
    mask = args.mask_token if args.mask_token is not None else (mask_id if mask_id is not None
                                                                else cfg_dict.get("mask_token_id"))
    if args.model_running_mode == "difflm-noshift" and mask is None:
        raise ConfigError("no mask token: pass --mask-token ID (the tokenizer has no <|mask|> and the preset none)")
    cfg_dict["mask_token_id"] = mask
    cfg = TransformerConfig.from_dict(cfg_dict)
    if vocab_size is not None and vocab_size > cfg.vocab_size:
        raise ConfigError(f"the tokenizer has {vocab_size} tokens but the model's vocab_size is {cfg.vocab_size}; "
                         "use a tokenizer that fits the model or a model with a larger vocabulary")
    return cfg


class _HostCount:
    """count_nonzero of a tensor for the host. On CUDA it is copied to pinned memory behind the work queued
    so far: made before the forward is queued and read after it, the count is there long before the host asks,
    so reading it does not wait for the forward (as a `nonzero()` after the forward would: the GPU
    would then sit idle until the host has queued the next kernels).
    """

    def __init__(self, t: torch.Tensor):
        self._ready = None
        if not t.is_cuda:  # nothing runs ahead on the CPU
            self._host = torch.count_nonzero(t)
            return
        self._host = torch.empty((), dtype=torch.int64, pin_memory=True)
        self._host.copy_(torch.count_nonzero(t), non_blocking=True)
        self._ready = torch.cuda.Event()
        self._ready.record()

    def get(self) -> int:
        if self._ready is not None:
            self._ready.synchronize()
        return int(self._host)


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _rng_state(device: torch.device) -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


class Trainer:
    """Owns the model, optimizer, schedule, data and objective of one run."""

    def __init__(self, args: argparse.Namespace, ctx: ParallelContext, cfg: TransformerConfig, model: nn.Module,
                 loaders: Any, tokenizer: Any | None = None):
        self.args, self.ctx, self.cfg, self.model = args, ctx, cfg, model
        self.loaders, self.tokenizer = loaders, tokenizer
        self.device = ctx.device
        self.mbs = args.micro_batch_size
        self.global_batch = args.global_batch_size or self.mbs * ctx.dp_size
        if self.global_batch % (self.mbs * ctx.dp_size):
            raise ConfigError(f"--global-batch-size {self.global_batch} is not divisible by --micro-batch-size "
                             f"{self.mbs} x data-parallel size {ctx.dp_size}")
        self.accum = self.global_batch // (self.mbs * ctx.dp_size)
        self.objective = ObjectiveConfig(mode=args.model_running_mode, mask_token_id=cfg.mask_token_id or 0,
                                         eps=args.difflm_eps, pmask=args.difflm_pmask,
                                         varilen_prob=args.difflm_varilen_prob)
        self.sampler = MaskSampler(args.seed + 1, device=self.device)
        self.optimizer = build_optimizer(model, lr=args.lr, weight_decay=args.weight_decay,
                                         betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)
        allocate_optimizer_state(self.optimizer)  # before any activation: the state gets segments of its own
        if cfg.fp8 and isinstance(self.optimizer, StreamingAdamW):
            # current scaling: each weight's amax comes out of the optimizer's update, not a pass before its cast
            # (a checkpoint's load refreshes them: Float8Linear.load_state_dict)
            from ..fp8 import attach_weight_amaxes

            self.optimizer.publish_amaxes(attach_weight_amaxes(model))
        self.schedule = LRSchedule(lr=args.lr, min_lr=args.min_lr, warmup_iters=args.lr_warmup_iters,
                                   decay_iters=args.lr_decay_iters or args.train_iters, decay_style=args.lr_decay_style,
                                   wsd_decay_iters=args.lr_wsd_decay_iters or max(1, (args.lr_decay_iters
                                                                                     or args.train_iters) // 10),
                                   wsd_decay_style=args.lr_wsd_decay_style)
        self.autocast_dtype = compute_dtype(args, self.device)  # bf16, or None for fp32
        self.state = TrainState()
        self.flops_per_token = cfg.flops_per_token(cfg.seq_length)
        self.peak = bf16_peak_tflops(self.device)
        self.sinks = MetricSinks(args.tensorboard_dir, args.save or args.tensorboard_dir, enabled=ctx.is_main)
        self.fp8 = bool(cfg.fp8)
        # the Float8Linears whose weight cache is off for training and back on for evaluation (same weights)
        self._fp8_uncached: list[nn.Module] = []
        if self.fp8 and self.accum == 1:
            # no later micro-batch of the step reads a cached FP8 weight: each layer's lives from its forward to its
            # backward (which also makes its transpose), not through the optimizer step until the next forward
            from ..fp8 import fp8_modules

            self._fp8_uncached = [m for m in fp8_modules(model) if m.cache_weight]  # not FSDP's (off for good)
            for m in self._fp8_uncached:
                m.cache_weight = False
        # large vocabularies: the fused, masked-rows-only LM head + loss (the [tokens, V] logits dominate memory)
        chunk = getattr(args, "loss_chunk_tokens", None)
        self.loss_chunk_tokens = (8192 if cfg.vocab_size >= 32768 else 0) if chunk is None else chunk
        self.layer_graphs = self._layer_graphs()
        self._train_iter: Iterator[torch.Tensor] | None = None
        self._pending_save: ckpt.PendingCheckpoint | None = None  # --async-save: the write in flight
        self._async_group: dist.ProcessGroup | None = None
        self.data_wait_s = 0.0

    @property
    def base_model(self) -> nn.Module:
        """The TransformerLM itself (under DDP, the wrapped module)."""
        return self.model.module if hasattr(self.model, "module") else self.model

    def _layer_graphs(self) -> LayerGraphs | None:
        """CUDA graphs of the layers (--cuda-graphs), or None where they are off or cannot apply."""
        mode = getattr(self.args, "cuda_graphs", "off")
        if mode == "off":
            return None
        # tests on CPU: the same replay logic with EmulatedGraph standing in for CUDA graphs
        emulate = os.environ.get("MEGADLMS_EMULATE_CUDA_GRAPHS") == "1" and self.device.type != "cuda"
        blockers = []
        if self.device.type != "cuda" and not emulate:
            blockers.append(f"the device is {self.device.type}, CUDA graphs need a GPU")
        if self.ctx.tp_size > 1:
            blockers.append("tensor parallelism (DTensor parameters)")
        if self.ctx.dp_strategy not in ("none", "no_shard"):
            blockers.append(f"sharded data parallelism ({self.ctx.dp_strategy}) gathers weights per use")
        if getattr(self.args, "recompute_granularity", None):
            blockers.append("activation checkpointing (--recompute-granularity) re-runs the forward in backward")
        if mode == "on" and blockers:
            raise ConfigError(f"--cuda-graphs on is not possible here: {'; '.join(blockers)}. "
                             "Use --cuda-graphs auto or off.")
        if blockers or (mode == "auto" and self.ctx.dp_size > 1):
            return None
        # with accumulation the FP8 weights are cast once per step outside the graphs, not on every replay
        return LayerGraphs(self.base_model, emulate=emulate, strict=mode == "on", fp8_weights_per_step=self.accum > 1)

    # ----------------------------------------------------------------- precision
    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    # ----------------------------------------------------------------- step
    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor,
              rows: _HostCount | None = None) -> torch.Tensor:
        with self._autocast():
            if self.loss_chunk_tokens:
                hidden = self.model(inputs, output_hidden=True)
                return chunked_weighted_cross_entropy(hidden, self._output_weight(), targets, weights,
                                                      self.loss_chunk_tokens,
                                                      num_rows=rows.get() if rows is not None else None)
            return weighted_cross_entropy(self.model(inputs), targets, weights)

    def _output_weight(self) -> torch.Tensor:
        w = self.base_model.output_weight
        # tensor parallel: the weight is vocabulary-sharded; gather it (every TP rank computes the whole loss)
        return w.full_tensor() if isinstance(w, DTensor) else w

    def _micro_batches(self, it: Iterator[torch.Tensor], noise, count: int):
        """Yield ((inputs, targets, weights), length, rows) for this rank's `count` micro-batches of one global
        batch; rows: with the fused LM head, the number of weighted tokens on its way to the host, so that the
        loss can select them without a device sync after the forward."""
        dp, r = self.ctx.dp_size, self.ctx.dp_rank
        for m in range(count):
            t0 = time.perf_counter()
            sample = next(it)
            self.data_wait_s += time.perf_counter() - t0  # host time blocked on the loader
            sample = sample.to(self.device, non_blocking=True)
            rows = slice(m * dp * self.mbs + r * self.mbs, m * dp * self.mbs + (r + 1) * self.mbs)
            length = int(noise.lengths[m])
            batch = prepare_batch(sample, (noise.t[rows], noise.u[rows]), length, self.objective)
            counted = _HostCount(batch[2]) if self.loss_chunk_tokens else None
            yield batch, length, counted

    def train_step(self) -> dict[str, Any]:
        model, opt = self.model, self.optimizer
        it = self.state.iteration
        lr = self.schedule(it)
        # FP8 telemetry is recorded (on device) only in the iteration that ends a log interval
        collect = self.fp8 and self.args.fp8_stats and ((it + 1) % self.args.log_interval == 0
                                                        or it + 1 == self.args.train_iters)
        if collect:
            from ..fp8 import enable_fp8_stats

            enable_fp8_stats(model, True)
        set_lr(opt, lr)
        noise = self.sampler.draw(self.global_batch, self.cfg.seq_length, self.accum, self.objective.varilen_prob)
        loss_sum = torch.zeros((), device=self.device)
        tokens = 0
        for m, ((inputs, targets, weights), length, rows) in enumerate(
                self._micro_batches(self._train_iter, noise, self.accum)):
            with self._grad_sync(last=m == self.accum - 1), self._compile_stance(length):
                loss = self._loss(inputs, targets, weights, rows)
                (loss / self.accum).backward()
            loss_sum += loss.detach()
            tokens += length * self.mbs * self.ctx.dp_size
        if collect:
            enable_fp8_stats(model, False)
        grad_norm = self._clip_grads()
        opt.step()  # applies the clipping (see optim.clip_grad_norm)
        opt.zero_grad(set_to_none=True)
        if self.fp8:
            from ..fp8 import fp8_step

            fp8_step(model, self._amax_group())
        if self.layer_graphs is not None:
            self.layer_graphs.arm()  # after one step: compiled code and FP8 delayed scales exist
        self.state.iteration += 1
        self.state.consumed_samples += self.global_batch
        self.state.consumed_tokens += tokens
        return {"loss": loss_sum / self.accum, "grad_norm": grad_norm, "lr": lr, "tokens": tokens}

    def _compile_stance(self, length: int) -> contextlib.AbstractContextManager:
        """Tensor-parallel compiled layers run only at the full sequence length; a cut (varilen) micro-batch runs
        eagerly, since DTensor graphs with dynamic shapes recompile for every length or fail to compile."""
        if self.args.compile and self.ctx.tp_size > 1 and length != self.cfg.seq_length:
            return torch.compiler.set_stance("force_eager")
        return contextlib.nullcontext()

    def _grad_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """Whether this micro-batch reduces gradients (and keeps gathered weights), per sharding strategy."""
        return grad_sync_context(self.model, self.ctx.dp_strategy, last)

    def _clip_grads(self) -> torch.Tensor:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.args.clip_grad if self.args.clip_grad > 0 else float("inf")
        norm = clip_grad_norm(self.optimizer, params, max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def _amax_group(self) -> dist.ProcessGroup | None:
        if not self.ctx.distributed:
            return None
        if getattr(self.args, "tp_only_amax_red", False):
            return self.ctx.tp_group
        return dist.group.WORLD  # data-parallel x tensor-parallel: every rank uses the same scales

    # ----------------------------------------------------------------- eval
    @torch.no_grad()
    def evaluate(self) -> float | None:
        loader = self.loaders.valid
        if loader is None or self.args.eval_iters <= 0:
            return None
        self.model.eval()
        loader.load_state_dict({"consumed_samples": 0})  # the same batches every evaluation
        it = iter(loader)
        sampler = MaskSampler(self.args.seed + 2, device=self.device)  # the same masks every evaluation
        total = torch.zeros((), device=self.device)
        n = 0
        with self._fp8_eval_weights():  # every batch sees the same weights: cast them once
            for _ in range(self.args.eval_iters):
                noise = sampler.draw(self.global_batch, self.cfg.seq_length, self.accum, 0.0)
                for (inputs, targets, weights), _, rows in self._micro_batches(it, noise, self.accum):
                    total += self._loss(inputs, targets, weights, rows)
                    n += 1
        if self.ctx.distributed:
            dist.all_reduce(total, group=self.ctx.dp_group)
            n *= self.ctx.dp_size
        self.model.train()
        return (total / max(n, 1)).item()

    def _fp8_eval_weights(self) -> contextlib.AbstractContextManager:
        if not self._fp8_uncached:
            return contextlib.nullcontext()
        from ..fp8 import fp8_weight_caching

        return fp8_weight_caching(self.model, self._fp8_uncached)

    # ----------------------------------------------------------------- checkpoints
    def _dcp_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.optimizer)
        return {"model": msd, "optimizer": osd,
                "train": {"iteration": self.state.iteration, "consumed_samples": self.state.consumed_samples,
                          "consumed_tokens": self.state.consumed_tokens}}

    def save(self) -> Path:
        rank_state = {"rng": _rng_state(self.device), "mask_sampler": self.sampler.state_dict(),
                      "data": self.loaders.train.state_dict()}
        meta = {"config": self.cfg.to_dict(), "args": vars(self.args)}
        tok_dir = getattr(self.tokenizer, "source_dir", None)
        self.finish_save()  # one checkpoint in flight at a time
        if getattr(self.args, "async_save", False):
            if self.ctx.distributed and self._async_group is None:  # the background write's own collectives
                self._async_group = dist.new_group(backend="gloo")
            self._pending_save = ckpt.async_save_checkpoint(
                self.args.save, self.state.iteration, self._dcp_state(), rank_state=rank_state, meta=meta,
                tokenizer_dir=tok_dir, process_group=self._async_group)
            log.info("writing checkpoint %s in the background", self._pending_save.final)
            return self._pending_save.final
        path = ckpt.save_checkpoint(self.args.save, self.state.iteration, self._dcp_state(), rank_state=rank_state,
                                    meta=meta, tokenizer_dir=tok_dir)
        log.info("saved checkpoint %s", path)
        return path

    def finish_save(self) -> None:
        """Wait for a background checkpoint write (--async-save) and commit it; a no-op when none is in flight."""
        if self._pending_save is not None:
            pending, self._pending_save = self._pending_save, None
            log.info("saved checkpoint %s", pending.wait())

    @staticmethod
    def _log_fresh_fp8_state(path: Path, fresh: list[str]) -> None:
        if fresh:
            log.warning("checkpoint %s has no FP8 state for %d tensors (saved without these FP8 flags): their amax "
                        "histories and scales start fresh, as in a new FP8 run", path, len(fresh))

    def load(self, load_dir: str, iteration: int | None = None, finetune: bool = False) -> None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict, set_state_dict

        path = ckpt.find_checkpoint(load_dir, iteration)
        meta = ckpt.read_meta(path)
        if finetune or meta.get("weights_only"):
            state = {"model": get_model_state_dict(self.model)}
            self._log_fresh_fp8_state(path, ckpt.load_model_state(path, state))
            set_model_state_dict(self.model, state["model"])
            log.info("loaded model weights from %s (fresh optimizer, iteration 0)", path)
            return
        state = self._dcp_state()
        self._log_fresh_fp8_state(path, ckpt.load_model_state(path, state))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        train = state["train"]
        self.state.iteration = int(train["iteration"])
        self.state.consumed_samples = int(train["consumed_samples"])
        self.state.consumed_tokens = int(train["consumed_tokens"])
        rank_state = ckpt.load_rank_state(path) or {}
        # the data position is global (samples consumed by all ranks), so it holds for any number of ranks
        self.loaders.train.load_state_dict({**rank_state.get("data", {}),
                                            "consumed_samples": self.state.consumed_samples})
        if rank_state:
            _set_rng_state(rank_state["rng"], self.device)
            self.sampler.load_state_dict(rank_state["mask_sampler"])
        log.info("resumed from %s at iteration %d", path, self.state.iteration)

    # ----------------------------------------------------------------- loop
    def run(self) -> TrainState:
        args, ctx = self.args, self.ctx
        self.model.train()
        self._train_iter = iter(self.loaders.train)
        bar = None
        if ctx.is_main and not args.no_progress and sys.stderr.isatty():
            from tqdm import tqdm

            bar = tqdm(total=args.train_iters, initial=self.state.iteration, unit="it", dynamic_ncols=True)
        if args.eval_interval and self.state.iteration == 0:  # the starting point of the validation curve
            self._log_eval(bar)
        window_t0, window_tokens, window_loss, window_n = time.perf_counter(), 0, None, 0
        last_saved = None
        while self.state.iteration < args.train_iters:
            step = self.train_step()
            window_tokens += step["tokens"]
            window_loss = step["loss"] if window_loss is None else window_loss + step["loss"]
            window_n += 1
            if bar is not None:
                bar.update(1)
            it = self.state.iteration
            if it % args.log_interval == 0 or it == args.train_iters:
                self._log(step, window_loss / window_n, window_tokens, time.perf_counter() - window_t0, bar)
                window_t0, window_tokens, window_loss, window_n = time.perf_counter(), 0, None, 0
                self.data_wait_s = 0.0
            paused = time.perf_counter()  # evaluation and saving do not count towards throughput
            if args.eval_interval and it % args.eval_interval == 0 and it < args.train_iters:
                wait = self.data_wait_s
                self._log_eval(bar)
                self.data_wait_s = wait
            if args.save and args.save_interval and it % args.save_interval == 0:
                self.save()
                last_saved = it
            window_t0 += time.perf_counter() - paused
            if args.exit_interval and it % args.exit_interval == 0:
                break
        if bar is not None:
            bar.close()
        if args.eval_iters > 0 and self.state.iteration >= args.train_iters:
            self._log_eval(None)
        if args.save and last_saved != self.state.iteration:
            self.save()
        self.finish_save()
        self.sinks.close()
        return self.state

    def _log(self, step: dict[str, Any], loss: torch.Tensor, tokens: int, seconds: float, bar: Any) -> None:
        if self.ctx.distributed:  # the loss of the global batch, not of rank 0's share
            dist.all_reduce(loss, group=self.ctx.dp_group)
            loss = loss / self.ctx.dp_size
        loss_value = loss.item()
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"loss is {loss_value} at iteration {self.state.iteration}; lower --lr, "
                                     "raise --lr-warmup-iters or check the data")
        m = {"iteration": self.state.iteration, "loss": loss_value, "lr": step["lr"],
             "grad_norm": float(step["grad_norm"]), "consumed_samples": self.state.consumed_samples,
             **throughput(tokens, seconds, self.flops_per_token, self.ctx.world_size, self.peak),
             "memory_gib": memory_gib(self.device), "data_wait_share": self.data_wait_s / max(seconds, 1e-9)}
        if self.fp8 and self.args.fp8_stats:
            from ..fp8 import fp8_stats

            m.update({f"fp8/{k}": v for k, v in fp8_stats(self.model).items()})
        self.state.history.append(m)
        if self.ctx.is_main:
            line = format_log_line(m, self.args.train_iters)
            (bar.write if bar is not None else print)(line)
            self.sinks.write(self.state.iteration, m)

    def _log_eval(self, bar: Any) -> None:
        loss = self.evaluate()
        if loss is None:
            return
        m = {"iteration": self.state.iteration, "loss": loss}
        self.state.history.append({"eval_loss": loss, "iteration": self.state.iteration})
        if self.ctx.is_main:
            ppl = math.exp(min(loss, 50))  # the loss is an upper bound on the NLL, so this bounds the perplexity
            line = f"validation at iter {self.state.iteration} | loss {loss:.4f} | ELBO ppl {ppl:.2f}"
            (bar.write if bar is not None else print)(line)
            self.sinks.write(self.state.iteration, m, prefix="valid")


def setup(args: argparse.Namespace) -> Trainer:
    """Everything a run needs, built from the arguments (also used by benchmarks and tests)."""
    from ..data import build_loaders, load_tokenizer
    from ..data.args import data_config_from_args

    ctx = init_parallel(args.device, args.tensor_model_parallel_size, args.distributed_backend)
    if not ctx.is_main:
        logging.getLogger("megadlms").setLevel(logging.WARNING)
    _seed_all(args.seed)
    tokenizer = load_tokenizer(args.tokenizer_model, tokenizer_type=args.tokenizer_type)
    cfg = model_config_from_args(args, tokenizer.vocab_size, tokenizer.mask_id)
    if cfg.fp8:
        from ..fp8 import check_fp8_support
        from ..fp8.hardware import fp8_backend_note

        check_fp8_support(ctx.device)
        note = fp8_backend_note(ctx.device)
        if note and ctx.is_main:
            log.warning(note)
        if cfg.fp8_dot_product_attention and ctx.is_main:
            how = "cuDNN's FP8 flash attention" if ctx.device.type == "cuda" else "emulated on the CPU (for tests)"
            log.warning("FP8 attention (--fp8-dot-product-attention): %s; it lowers model quality against FP8 "
                        "linears alone (docs/fp8.md)", how)
    if args.compile is None:
        args.compile = ctx.device.type == "cuda"
    model = build_model(cfg, device=ctx.device)
    model = parallelize_model(model, ctx, args)
    global_batch = args.global_batch_size or args.micro_batch_size * ctx.dp_size
    n_evals = (args.train_iters // args.eval_interval + 1) if args.eval_interval else 1
    data_cfg = data_config_from_args(args, seq_length=cfg.seq_length, micro_batch_size=args.micro_batch_size,
                                     seed=args.seed, train_samples=args.train_iters * global_batch,
                                     eval_samples=args.eval_iters * global_batch * n_evals)
    if ctx.distributed and not ctx.is_main:  # rank 0 tokenizes / indexes into the caches first, the others reuse them
        dist.barrier()
    loaders = build_loaders(data_cfg, tokenizer, dp_rank=ctx.dp_rank, dp_size=ctx.dp_size)
    if ctx.distributed and ctx.is_main:
        dist.barrier()
    trainer = Trainer(args, ctx, cfg, model, loaders, tokenizer)
    if ctx.is_main:
        n_params = sum(p.numel() for p in model.parameters())
        log.info("model %s: %.1fM parameters, %d layers, hidden %d, seq %d, %s attention%s | device %s%s | "
                 "world %d (dp %d x tp %d) | global batch %d (micro %d x accum %d x dp %d)",
                 args.model_path, n_params / 1e6, cfg.num_layers, cfg.hidden_size, cfg.seq_length,
                 cfg.attn_mask_type, f" | FP8 {cfg.fp8_format}/{cfg.fp8_recipe}" if cfg.fp8 else "",
                 ctx.device, ", CUDA graphs" if trainer.layer_graphs is not None else "", ctx.world_size,
                 ctx.dp_size, ctx.tp_size, trainer.global_batch, trainer.mbs, trainer.accum, ctx.dp_size)
    if args.load:
        trainer.load(args.load, args.ckpt_step, finetune=args.finetune)
    return trainer


def train(args: argparse.Namespace) -> TrainState:
    trainer = setup(args)
    state = trainer.run()
    if args.generate_sample or (args.generate_sample is None and args.config and args.config.endswith("demo.yaml")):
        print_sample(trainer)  # on every rank: the forward of a sharded model is collective
    destroy_parallel()
    return state


def print_sample(trainer: Trainer, prompt: str = "Once upon a time,", gen_length: int = 48,
                 block_length: int = 8) -> None:
    """Finish the demo with a sample from the trained DLM: LLaDA's sampler, one token per step, low-confidence
    remasking inside short blocks (a small model's text stays coherent when it is decoded nearly left to right)."""
    from ..diffusion.sampler import generate

    tok, cfg = trainer.tokenizer, trainer.cfg
    model = trainer.base_model
    model.eval()
    ids = tok.encode(prompt)
    # eager: the sampler's shapes differ from training's (a compiled model would recompile for them)
    with torch.no_grad(), trainer._autocast(), torch.compiler.set_stance("force_eager"):
        if cfg.causal:
            from ..generate.ar import ar_generate

            out = ar_generate(model, [ids], max_new_tokens=gen_length, eos_id=tok.eod_id)[0]
        else:
            out = generate(model, [ids], mask_id=cfg.mask_token_id, gen_length=gen_length, block_length=block_length,
                           steps=gen_length, eos_id=tok.eod_id)[0]
    if trainer.ctx.is_main:
        print(f"\nsample> {prompt}{tok.decode(out)}\n")
