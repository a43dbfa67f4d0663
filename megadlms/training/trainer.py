"""The training loop: build everything from a `RunConfig`, then step, log, evaluate and checkpoint.

One iteration = one global batch = micro-batches x data-parallel ranks, with gradient
accumulation over the micro-batches of this rank. Masking noise is drawn per global batch
(`MaskSampler`) and sliced by each rank, so the run does not depend on how it is split.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, cast

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..config import TransformerConfig
from ..diffusion import bd3lm
from ..diffusion.objective import MaskSampler
from ..distributed.data_parallel import grad_sync_context
from ..distributed.init import ParallelContext, destroy_parallel, init_parallel
from ..distributed.parallelize import build_parallel_model
from ..fp8.frozen import count_parameters
from ..lora import describe_memory
from . import checkpoint as ckpt
from .config import RunConfig
from .cuda_graphs import LayerGraphs
from .divergence import DivergenceGuard, check_finite_state
from .documents import AttentionPlan
from .hooks import ArmLayerGraphs, Fp8Hook, Hooks, MoeHook
from .lora_run import plan_lora
from .metrics import (
    MetricSinks,
    WandbConfig,
    bf16_peak_tflops,
    format_eval_line,
    format_log_line,
    memory_gib,
    throughput,
)
from .objectives import Batch, Objective, Sharding, build_objective
from .optim import LRSchedule, allocate_optimizer_state, build_optimizer, set_lr
from .plugins import objective_plugins
from .preemption import RunControl
from .run_plan import RunPlan, plan_run, run_tokenizer
from .save_folder import check_save_folder
from .step_runner import PlainRunner, StepRunner, StepTotals

if TYPE_CHECKING:
    from ..distributed.pipeline_parallel import RankStages
    from ..model import TransformerLM

log = logging.getLogger("megadlms")


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)  # logged metrics of this process's run


def _attention_plan(config: RunConfig, cfg: TransformerConfig, eod_id: int | None,
                    device: torch.device) -> AttentionPlan:
    """The AttentionPlan of the run: document-level attention and position resets default on with --sft."""
    sft = config.data.sft
    reset_mask, reset_pos = config.data.reset_attention_mask, config.data.reset_position_ids
    anneal = config.objective.attention_anneal_iters  # bd3lm and vanilla refuse it (`run_plan`)
    return AttentionPlan(reset_attention_mask=sft if reset_mask is None else reset_mask,
                         reset_position_ids=sft if reset_pos is None else reset_pos, anneal_iters=anneal,
                         causal=cfg.causal, eod_id=eod_id, seed=config.train.seed + 3, device=device)


def _objective(config: RunConfig, model_config: TransformerConfig, attention: AttentionPlan, ctx: ParallelContext,
               device: torch.device, compiled: bool, loss_chunk_tokens: int, on_data_wait, *,
               autocast=None, tokenizer: Any = None) -> Objective:
    """The run's objective (`megadlms.training.objectives`, RL's in `megadlms.training.rl_objectives`)."""
    obj = config.objective
    mode = model_config.running_mode  # the mode `resolve_model_config` built the model for
    if config.rl.rl is not None:
        from .rl_objectives import build_rl_objective

        return build_rl_objective(config.rl, mode, model_config, attention,
                                  Sharding(config.train.micro_batch_size, ctx.dp_rank, ctx.dp_size,
                                           ctx.dp_group if ctx.distributed else None),
                                  autocast=autocast, tokenizer=tokenizer, eps=obj.difflm_eps,
                                  diffusion_loss=model_config.loss, flex=False,
                                  loss_chunk_tokens=0, on_data_wait=on_data_wait)
    bd3lm_config = None
    if mode == "bd3lm":  # a missing block size is reported by Bd3lmConfig, naming the flag
        bd3lm_config = bd3lm.Bd3lmConfig(
            block_size=model_config.block_size, seq_length=model_config.seq_length,  # type: ignore[arg-type]
            mask_token_id=model_config.mask_token_id,  # type: ignore[arg-type]
            clip_min=obj.bd3lm_clip_min, clip_max=obj.bd3lm_clip_max, noise_per=obj.bd3lm_noise_per,
            eval_eps=obj.difflm_eps, loss=model_config.loss, antithetic=obj.bd3lm_antithetic,
            ignore_bos=obj.ignore_bos, resample=obj.bd3lm_resample, clip_search=obj.bd3lm_clip_search,
            search_widths=tuple(obj.bd3lm_clip_search_widths), search_delta=obj.bd3lm_clip_search_delta)
    sharding = Sharding(config.train.micro_batch_size, ctx.dp_rank, ctx.dp_size,
                        ctx.dp_group if ctx.distributed else None, cp_rank=ctx.cp_rank, cp_size=ctx.cp_size)
    # FlexAttention's block-sparse kernel where the layers are compiled on the GPU, else a dense bool mask
    objective = obj.objective(mode, model_config.mask_token_id, model_config.loss)
    return build_objective(objective, model_config, attention, sharding, sft=config.data.sft,
                           bd3lm_config=bd3lm_config, flex=device.type == "cuda" and compiled,
                           loss_chunk_tokens=loss_chunk_tokens, on_data_wait=on_data_wait)


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _rng_state(device: torch.device) -> dict[str, Any]:
    name, keys, *rest = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state())
    # plain types (numpy's array as a list) for the weights-only load
    state = {"python": random.getstate(), "numpy": (name, keys.tolist(), *rest), "torch": torch.get_rng_state()}
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

    def __init__(self, run_config: RunConfig, ctx: ParallelContext, model_config: TransformerConfig,
                 model: nn.Module, loaders: Any, tokenizer: Any | None = None, plan: RunPlan | None = None):
        """run_config: the run's settings; model_config: the model's architecture (`resolve_model_config`); model:
        built by `build_parallel_model`; loaders: `megadlms.data.build_loaders`'s; plan: the checked run plan
        (default: resolved here for `ctx`'s world and device)."""
        self.run_config, self.ctx, self.model_config, self.model = run_config, ctx, model_config, model
        self.loaders, self.tokenizer = loaders, tokenizer
        self.device = ctx.device
        if plan is None or (plan.world_size, plan.device_type) != (ctx.world_size, self.device.type):
            plan = RunPlan.resolve(run_config, model_config, world_size=ctx.world_size,
                                   device_type=self.device.type).check()
        self.plan = plan
        train_cfg = run_config.train
        self.compiled = train_cfg.compile_on(self.device)
        self.mbs = train_cfg.micro_batch_size
        self.global_batch = self.plan.global_batch  # a multiple of micro-batch x data-parallel size (the plan's rule)
        self.accum = self.plan.accumulation
        self.sampler = MaskSampler(train_cfg.seed + 1, device=self.device)
        self.attention = _attention_plan(run_config, model_config, getattr(loaders, "eod_id", None), self.device)
        # large vocabularies: the fused, masked-rows-only LM head + loss (the [tokens, V] logits dominate memory)
        chunk = train_cfg.loss_chunk_tokens
        self.loss_chunk_tokens = (8192 if model_config.vocab_size >= 32768 else 0) if chunk is None else chunk
        self.data_wait_s = 0.0
        self.objective = _objective(run_config, model_config, self.attention, ctx, self.device, self.compiled,
                                    self.loss_chunk_tokens, self._count_data_wait, autocast=self._autocast,
                                    tokenizer=tokenizer)
        self.optimizer = build_optimizer(model, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay,
                                         betas=(train_cfg.adam_beta1, train_cfg.adam_beta2), eps=train_cfg.adam_eps)
        allocate_optimizer_state(self.optimizer)  # before any activation: the state gets segments of its own
        decay_iters = train_cfg.lr_decay_iters or train_cfg.train_iters
        self.schedule = LRSchedule(lr=train_cfg.lr, min_lr=train_cfg.min_lr, warmup_iters=train_cfg.lr_warmup_iters,
                                   decay_iters=decay_iters,
                                   decay_style=train_cfg.lr_decay_style,
                                   wsd_decay_iters=train_cfg.lr_wsd_decay_iters or max(1, decay_iters // 10),
                                   wsd_decay_style=train_cfg.lr_wsd_decay_style)
        self.autocast_dtype = train_cfg.compute_dtype(self.device)  # bf16, or None for fp32
        self.state = TrainState()
        self.peak = bf16_peak_tflops(self.device)
        self.sinks = MetricSinks(train_cfg.tensorboard_dir, run_config.checkpoint.save or train_cfg.tensorboard_dir,
                                 enabled=ctx.is_main,
                                 wandb=WandbConfig.from_run(run_config))
        # what FP8, MoE and CUDA graphs add to the step, attached once; the loop calls them without naming them
        self.hooks = Hooks()
        if model_config.fp8:
            self.hooks.attach(Fp8Hook(model, amax_group=self._amax_group(), stats=run_config.fp8.fp8_stats,
                                      micro_steps=self.accum, optimizer=self.optimizer))
        if model_config.is_moe:
            self.hooks.attach(MoeHook(model, dist.group.WORLD if ctx.distributed else None))
        self.layer_graphs = self._layer_graphs()
        if self.layer_graphs is not None:
            self.hooks.attach(ArmLayerGraphs(self.layer_graphs))
        objective_hooks, self.validation_plugins = objective_plugins(self.objective, self.base_model,
                                                                     seed=train_cfg.seed + 5)
        for hook in [*objective_hooks, *self.validation_plugins]:
            self.hooks.attach(hook)
        self.runner = self._step_runner()  # the whole model here, or a pipeline schedule over its stages
        # what makes the step's micro-batches, chosen once: the objective's, or RL's rollout, score and batches
        self.step_batches: Callable[[Iterator[Any], int], Iterator[Batch]] = self._objective_batches
        if run_config.rl.rl is not None:
            from .rl_loop import RLStep

            self.step_batches = RLStep(self.objective, self.sampler, self.global_batch, self.accum, self.device)
        self._train_iter: Iterator[Any] | None = None  # the loader's samples: token windows, or RL records
        self._pending_save: ckpt.PendingCheckpoint | None = None  # --async-save: the write in flight
        self._async_group: dist.ProcessGroup | None = None
        # non-finite steps skipped on the device; preemption signals and the wall-time limit (their own modules)
        self.guard = DivergenceGuard(self.optimizer, self.device, train_cfg.max_skipped_steps,
                                     dist.group.WORLD if ctx.distributed else None)
        self.control = RunControl(self.device, distributed=ctx.distributed,
                                  handle_signals=train_cfg.exit_signal_handler,
                                  exit_duration_mins=train_cfg.exit_duration_in_mins, guard=self.guard)
        self.save_failures = 0
        self.validation_metrics: dict[str, float] = {}  # what the last validation adopted (objective's own)

    @property
    def base_model(self) -> TransformerLM:
        """The TransformerLM itself (under DDP, the wrapped module)."""
        return cast("TransformerLM", self.model.module if hasattr(self.model, "module") else self.model)

    def _layer_graphs(self) -> LayerGraphs | None:
        """CUDA graphs of the layers (--cuda-graphs), or None where they are off or cannot apply."""
        mode = self.run_config.train.cuda_graphs
        if mode == "off":
            return None
        plan = self.plan
        if not plan.layer_graphs():  # `--cuda-graphs on` with a blocker was refused before the build
            blockers = plan.graph_blockers()
            if blockers and self.ctx.is_main and self.device.type == "cuda":
                log.info("CUDA graphs off: %s", "; ".join(blockers))
            return None
        # with accumulation the FP8 weights are cast once per step outside the graphs, not on every replay
        return LayerGraphs(self.base_model, emulate=plan.emulate_graphs, strict=mode == "on",
                           fp8_weights_per_step=self.accum > 1)

    def _step_runner(self) -> StepRunner:
        if self.ctx.pp_size == 1:
            full = self.model_config.seq_length if self.compiled and self.ctx.tp_size > 1 else None
            return PlainRunner(self.model, self._loss, self._grad_sync, self.device, eager_unless_length=full)
        from .pipeline_step import PipelineRunner

        # varying shapes, the final sample and too few micro-batches are refused before the build (`run_plan`)
        assert self.ctx.pp_group is not None  # a mesh with a pp dimension
        model = cast("RankStages", self.model)
        return PipelineRunner(model, self.objective, self.ctx.pp_group,
                              self.device, self.accum, self.run_config.parallel.pipeline_schedule,
                              self.autocast_dtype or torch.float32, autocast=self._autocast)

    # ----------------------------------------------------------------- precision
    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    # ----------------------------------------------------------------- step
    def _loss(self, batch: Batch) -> torch.Tensor:
        with self._autocast():
            return self.objective.loss(self.model, batch, self._output_weight)

    def _output_weight(self) -> torch.Tensor:
        w = self.base_model.output_weight
        # tensor parallel: the weight is vocabulary-sharded; gather it (every TP rank computes the whole loss)
        return w.full_tensor() if isinstance(w, DTensor) else w

    def _count_data_wait(self, seconds: float) -> None:
        self.data_wait_s += seconds

    def train_step(self) -> dict[str, Any]:
        opt = self.optimizer
        it = self.state.iteration
        lr = self.schedule(it)
        train_cfg = self.run_config.train
        self.hooks.begin_step(logged=(it + 1) % train_cfg.log_interval == 0 or it + 1 == train_cfg.train_iters)
        set_lr(opt, lr)
        train_iter = self._train_iter
        assert train_iter is not None  # set when `run` starts
        step = self.runner.train(self.step_batches(train_iter, it), self.accum)
        loss_sum = step.loss_sum
        grad_norm = self._clip_grads()
        self.guard.step(loss_sum, grad_norm)  # opt.step(), skipped on a non-finite loss or gradient norm
        opt.zero_grad(set_to_none=True)
        self.hooks.after_optimizer_step()
        self.state.iteration += 1
        self.state.consumed_samples += self.global_batch
        self.state.consumed_tokens += step.tokens
        return {"loss": self.guard.finite_loss(loss_sum / self.accum), "grad_norm": grad_norm, "lr": lr,
                "tokens": step.tokens, "flops": step.flops}

    def _objective_batches(self, train_iter: Iterator[torch.Tensor], iteration: int) -> Iterator[Batch]:
        """This rank's micro-batches of the step: the global batch's noise, then the loader's samples made into
        the objective's batches."""
        noise = self.objective.draw_noise(self.sampler, self.global_batch, self.accum)
        self.attention.begin_step(iteration, self.model_config.seq_length)
        return self.objective.micro_batches(train_iter, noise, self.accum, self.device)

    def _grad_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """Whether this micro-batch reduces gradients (and keeps gathered weights), per sharding strategy."""
        return grad_sync_context(self.model, self.ctx.dp_strategy, last)

    def _clip_grads(self) -> torch.Tensor:
        clip = self.run_config.train.clip_grad
        return self.runner.clip_grads(self.optimizer, clip if clip > 0 else float("inf"))

    def _amax_group(self) -> dist.ProcessGroup | None:
        if not self.ctx.distributed:
            return None
        if self.run_config.parallel.tp_only_amax_red:
            return self.ctx.tp_group
        if self.ctx.pp_size > 1:  # each stage's layers are on the ranks of its pipeline rank alone
            return self.ctx.stage_group
        return dist.group.WORLD  # data-parallel x tensor-parallel: every rank uses the same scales

    # ----------------------------------------------------------------- eval
    @torch.no_grad()
    def evaluate(self) -> float | None:
        """The validation loss: the objective's loss over --eval-iters global batches of the validation split,
        the same batches and noise at every evaluation, at the final attention (after any annealing)."""
        loader = self.loaders.valid
        eval_iters = self.run_config.train.eval_iters
        if loader is None or eval_iters <= 0:
            return None
        self.model.eval()
        loader.load_state_dict({"consumed_samples": 0})  # the same batches every evaluation
        it = iter(loader)
        sampler = MaskSampler(self.run_config.train.seed + 2, device=self.device)  # the same masks every evaluation
        totals = StepTotals(torch.zeros((), device=self.device), 0)
        plugins = self.validation_plugins  # they see each batch's loader samples too
        with self.hooks.evaluation():
            for i in range(eval_iters):
                noise = self.objective.draw_noise(sampler, self.global_batch, self.accum, evaluation=True)
                self.attention.begin_step(self.run_config.train.train_iters, self.model_config.seq_length)
                samples = [next(it).to(self.device) for _ in range(self.accum)] if plugins else None
                batches = self.objective.micro_batches(it if samples is None else iter(samples), noise, self.accum,
                                                       self.device)
                self.runner.evaluate(batches, totals)
                if samples is not None:
                    with self._autocast():
                        for plugin in plugins:
                            plugin.observe(self.model, samples, i, self._output_weight)
        total, n = totals.loss_sum, totals.micro_batches
        if self.ctx.distributed:
            dist.all_reduce(total, group=self.ctx.dp_cp_group)
            n *= self.ctx.dp_cp_size
        self.validation_metrics = {}  # what the plug-ins adopted, e.g. BD3-LM's clip interval for training
        for plugin in plugins:
            self.validation_metrics.update(plugin.finish())
        self.model.train()
        return (total / max(n, 1)).item()

    # ----------------------------------------------------------------- checkpoints
    def _dcp_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.optimizer, options=self._state_options())
        return {"model": msd, "optimizer": osd,
                "train": {"iteration": self.state.iteration, "consumed_samples": self.state.consumed_samples,
                          "consumed_tokens": self.state.consumed_tokens}}

    def _state_options(self) -> Any:
        """Frozen parameters (a LoRA run's base, which its own checkpoint holds) are left out of checkpoints."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        frozen = any(not p.requires_grad for p in self.model.parameters())
        return StateDictOptions(ignore_frozen_params=True, strict=False) if frozen else None

    def save(self) -> Path | None:
        """Save a checkpoint (collective); None when it failed and --ckpt-save-failures-ok lets the run go on."""
        check_finite_state(self.model, self.optimizer, self.state.iteration,
                           dist.group.WORLD if self.ctx.distributed else None)
        try:
            return self._save()
        except ckpt.CheckpointSaveError as e:
            self.save_failures += 1
            allowed = self.run_config.checkpoint.ckpt_save_failures_ok
            if self.save_failures > allowed:
                raise
            log.warning("%s; training goes on (failed save %d of the %d --ckpt-save-failures-ok allows)",
                        e, self.save_failures, allowed)
            return None

    def _save(self) -> Path:
        rank_state = {"rng": _rng_state(self.device), "mask_sampler": self.sampler.state_dict(),
                      "data": self.loaders.train.state_dict(), "attention": self.attention.state_dict(),
                      "objective": self.hooks.state_dict()}  # the hooks' state under its first name
        meta = {"config": self.model_config.to_dict(), "args": self.run_config.to_flat()}
        tok_dir = getattr(self.tokenizer, "source_dir", None)
        self.finish_save()  # one checkpoint in flight at a time
        save_dir, keep_last = self.run_config.checkpoint.save, self.run_config.checkpoint.ckpt_keep_last
        assert save_dir is not None  # called only with --save
        if self.run_config.checkpoint.async_save:
            if self.ctx.distributed and self._async_group is None:  # the background write's own collectives
                self._async_group = dist.new_group(backend="gloo")
            self._pending_save = ckpt.async_save_checkpoint(
                save_dir, self.state.iteration, self._dcp_state(), rank_state=rank_state, meta=meta,
                tokenizer_dir=tok_dir, process_group=self._async_group, keep_last=keep_last)
            log.info("writing checkpoint %s in the background", self._pending_save.final)
            return self._pending_save.final
        path = ckpt.save_checkpoint(save_dir, self.state.iteration, self._dcp_state(), rank_state=rank_state,
                                    meta=meta, tokenizer_dir=tok_dir, keep_last=keep_last)
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
            state: dict[str, Any] = {"model": get_model_state_dict(self.model)}
            self._log_fresh_fp8_state(path, ckpt.load_model_state(path, state))
            set_model_state_dict(self.model, state["model"])
            log.info("loaded model weights from %s (fresh optimizer, iteration 0)", path)
            return
        state = self._dcp_state()
        self._log_fresh_fp8_state(path, ckpt.load_model_state(path, state))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=self._state_options())
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
            if "attention" in rank_state:
                self.attention.load_state_dict(rank_state["attention"])
            self.hooks.load_state_dict(rank_state.get("objective", {}))
        log.info("resumed from %s at iteration %d", path, self.state.iteration)

    # ----------------------------------------------------------------- loop
    def run(self) -> TrainState:
        train_cfg, save, ctx = self.run_config.train, self.run_config.checkpoint, self.ctx
        self.model.train()
        self._train_iter = iter(self.loaders.train)
        bar = None
        if ctx.is_main and not train_cfg.no_progress and sys.stderr.isatty():
            from tqdm import tqdm

            bar = tqdm(total=train_cfg.train_iters, initial=self.state.iteration, unit="it", dynamic_ncols=True)
        if train_cfg.eval_interval and self.state.iteration == 0:  # the starting point of the validation curve
            self._log_eval(bar)
        window_t0, window_tokens, window_flops, window_loss, window_n = time.perf_counter(), 0, 0.0, None, 0
        last_saved = None
        self.control.install()  # SIGTERM / SIGINT / SIGUSR1: finish the step, save, exit 0
        while self.state.iteration < train_cfg.train_iters:
            step = self.train_step()
            window_tokens += step["tokens"]
            window_flops += step["flops"]
            window_loss = step["loss"] if window_loss is None else window_loss + step["loss"]
            window_n += 1
            if bar is not None:
                bar.update(1)
            it = self.state.iteration
            if it % train_cfg.log_interval == 0 or it == train_cfg.train_iters:
                if self.device.type == "cuda":  # the window's time includes its queued GPU work (one sync per log)
                    torch.cuda.synchronize(self.device)
                self._log(step, window_loss, window_n, window_tokens, window_flops, time.perf_counter() - window_t0,
                          bar)
                window_t0, window_tokens, window_flops, window_loss, window_n = time.perf_counter(), 0, 0.0, None, 0
                self.data_wait_s = 0.0
            paused = time.perf_counter()  # evaluation and saving do not count towards throughput
            if train_cfg.eval_interval and it % train_cfg.eval_interval == 0 and it < train_cfg.train_iters:
                wait = self.data_wait_s
                self._log_eval(bar)
                self.data_wait_s = wait
            if save.save and save.save_interval and it % save.save_interval == 0:
                if self.save() is not None:
                    last_saved = it
            window_t0 += time.perf_counter() - paused
            if train_cfg.exit_interval and it % train_cfg.exit_interval == 0:
                break
            if self.control.after_step(it):  # a stop signal or the time limit, agreed by every rank
                break
        self.control.uninstall()
        if bar is not None:
            bar.close()
        if train_cfg.eval_iters > 0 and self.state.iteration >= train_cfg.train_iters and not self.control.reason:
            self._log_eval(None)
        if save.save and last_saved != self.state.iteration and self.save() is not None:
            last_saved = self.state.iteration
        self.finish_save()
        self.sinks.close()
        self.control.report(self.state.iteration, save.save, last_saved == self.state.iteration, ctx.is_main)
        return self.state

    def _log(self, step: dict[str, Any], loss_sum: torch.Tensor, steps: int, tokens: int, flops: float,
             seconds: float, bar: Any) -> None:
        skipped = self.guard.end_window(self.state.iteration)  # raises after --max-skipped-steps in a row
        loss = loss_sum / max(steps - skipped, 1)  # the mean over the steps not skipped
        if self.ctx.distributed:  # the loss of the global batch, not of rank 0's share (nor of its positions)
            dist.all_reduce(loss, group=self.ctx.dp_cp_group)
            loss = loss / self.ctx.dp_cp_size
        loss_value = loss.item() if skipped < steps else float("nan")
        m = {"iteration": self.state.iteration, "loss": loss_value, "lr": step["lr"],
             "grad_norm": float(step["grad_norm"]), "consumed_samples": self.state.consumed_samples,
             **throughput(tokens, seconds, flops, self.ctx.world_size, self.peak),
             "memory_gib": memory_gib(self.device), "data_wait_share": self.data_wait_s / max(seconds, 1e-9)}
        if skipped:
            m["skipped_steps"] = skipped
        m.update(self.hooks.metrics())  # e.g. FP8 telemetry, tokens per expert, RL's rewards and KL
        self.state.history.append(m)
        if self.ctx.is_main:
            line = format_log_line(m, self.run_config.train.train_iters)
            (bar.write if bar is not None else print)(line)
            self.sinks.write(self.state.iteration, m)

    def _log_eval(self, bar: Any) -> None:
        loss = self.evaluate()
        if loss is None:
            return
        m = {"iteration": self.state.iteration, "loss": loss, **self.validation_metrics}
        self.state.history.append({"eval_loss": loss, "iteration": self.state.iteration, **self.validation_metrics})
        if self.ctx.is_main:
            # AR: the exact NLL and perplexity; diffusion: the bound, and which loss and first-token rule make it
            line = (format_eval_line(self.state.iteration, loss, bound=self.objective.bound)
                    + f" | {self.objective.validation_note()}")
            (bar.write if bar is not None else print)(line)
            self.sinks.write(self.state.iteration, m, prefix="valid")


def setup(config: RunConfig) -> Trainer:
    """Everything a run needs, built from its configuration (also used by benchmarks and tests)."""
    from ..data import build_loaders

    train_cfg, data = config.train, config.data
    # the plan first: every clash of the settings is reported before a process group, model or loader exists
    tokenizer = run_tokenizer(config)
    plan = plan_run(config, tokenizer)
    cfg = plan.model
    if os.environ.get("RANK", "0") == "0":
        log.info("run plan: %s", plan.describe())
    ctx = init_parallel(train_cfg.device, config.parallel.tensor_model_parallel_size,
                        config.parallel.distributed_backend, cp_size=config.parallel.context_parallel_size,
                        pp_size=config.parallel.pipeline_model_parallel_size,
                        ep_size=config.parallel.expert_model_parallel_size)
    if not ctx.is_main:
        logging.getLogger("megadlms").setLevel(logging.WARNING)
    check_save_folder(config)  # another run's --save folder is refused before anything is built
    _seed_all(train_cfg.seed)
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
    lora = plan_lora(config, train_cfg.compute_dtype(ctx.device))  # --lora-rank: adapters on the base --load names
    if lora is not None:
        cfg = lora.record(cfg)
    model = build_parallel_model(cfg, ctx, config.parallel,
                                 activation_checkpointing=train_cfg.recompute_granularity == "full",
                                 compile=train_cfg.compile_on(ctx.device),
                                 param_dtype=train_cfg.compute_dtype(ctx.device),
                                 fp8_param_gather=config.fp8.fp8_param_gather,
                                 lora=lora.config if lora else None, load_base=lora.load_base if lora else None)
    global_batch = train_cfg.global_batch_size or train_cfg.micro_batch_size * ctx.dp_size
    n_evals = (train_cfg.train_iters // train_cfg.eval_interval + 1) if train_cfg.eval_interval else 1
    data_cfg = data.loader_config(seq_length=cfg.seq_length, micro_batch_size=train_cfg.micro_batch_size,
                                  seed=train_cfg.seed,
                                  train_samples=train_cfg.train_iters * global_batch,
                                  eval_samples=train_cfg.eval_iters * global_batch * n_evals)
    if cfg.running_mode != "vanilla":  # diffusion: a sample holding the [MASK] id stops the run naming its document
        data_cfg.mask_token_id = cfg.mask_token_id
    if ctx.distributed and not ctx.is_main:  # rank 0 tokenizes / indexes into the caches first, the others reuse them
        dist.barrier()
    loaders: Any
    if config.rl.rl is not None:  # RL: records of --rl-data instead of token windows
        from ..rl.data import build_record_loaders

        loaders = build_record_loaders(config.rl, tokenizer, micro_batch_size=train_cfg.micro_batch_size,
                                       seed=train_cfg.seed, dp_rank=ctx.dp_rank, dp_size=ctx.dp_size)
    else:
        loaders = build_loaders(data_cfg, tokenizer, dp_rank=ctx.dp_rank, dp_size=ctx.dp_size)
    if ctx.distributed and ctx.is_main:
        dist.barrier()
    trainer = Trainer(config, ctx, cfg, model, loaders, tokenizer, plan=plan)
    n_params = _count_parameters(model, ctx)
    if ctx.is_main:
        log.info("model %s: %.1fM parameters, %d layers, hidden %d, seq %d, %s attention (%s)%s | device %s%s | "
                 "world %d (pp %d x dp %d x cp %d x tp %d) | global batch %d (micro %d x accum %d x dp %d)",
                 config.checkpoint.load if config.checkpoint.use_checkpoint_args else config.model.model_path,
                 n_params / 1e6, cfg.num_layers, cfg.hidden_size, cfg.seq_length,
                 cfg.attn_mask_type + (f" block-diffusion (blocks of {cfg.block_size})" if cfg.block_size else ""),
                 trainer.objective.attention_kernel(ctx.device),
                 f" | FP8 {cfg.fp8_format}/{cfg.fp8_recipe}" if cfg.fp8 else "",
                 ctx.device, ", CUDA graphs" if trainer.layer_graphs is not None else "", ctx.world_size,
                 ctx.pp_size, ctx.dp_size, ctx.cp_size, ctx.tp_size, trainer.global_batch, trainer.mbs, trainer.accum,
                 ctx.dp_size)
        if lora is not None:
            log.info("%s | base %s", describe_memory(trainer.base_model, lora.config), lora.base)
    ck = config.checkpoint
    load = ckpt.resume_source(ck.load, ck.save, iteration=ck.ckpt_step, finetune=ck.finetune) if ck.load else None
    if lora is not None:  # the base is in the model already; a LoRA checkpoint's adapters are resumed
        load = lora.resume
    if load is not None:  # None also where --load is the --save folder without a checkpoint yet (a requeued job)
        trainer.load(str(load), ck.ckpt_step, finetune=ck.finetune)
    return trainer


def _count_parameters(model: nn.Module, ctx: ParallelContext) -> int:
    """The whole model's parameters (a sharded one counted whole, a frozen FP8 LoRA base by its weights); under
    pipeline parallelism the sum over the stages, a tied embedding once (collective over the pipeline's ranks)."""
    if ctx.pp_size == 1:
        return count_parameters(model)
    from ..distributed.pipeline_parallel import count_stage_parameters

    assert ctx.pp_group is not None  # a mesh with a pp dimension
    return count_stage_parameters(cast("RankStages", model), ctx.pp_group)


def train(config: RunConfig) -> TrainState:
    """Train from `config` (from flags: `megadlms.training.args.parse_train_args`); returns the final state."""
    from .failure import handled_failures  # on an error: the loader's workers and the process group end at once

    with handled_failures(config) as run:
        trainer = run.watch(setup(config))
        try:
            state = trainer.run()
        finally:
            trainer.control.uninstall()  # the signal handlers, also when the run stopped on an error
        if config.train.generate_sample and not trainer.control.reason:  # a run stopped by a signal exits at once
            print_sample(trainer)  # on every rank: the forward of a sharded model is collective
        destroy_parallel()
    return state


def print_sample(trainer: Trainer, prompt: str = "Once upon a time,", gen_length: int = 48,
                 block_length: int = 6) -> None:
    """Finish the demo with a sample from the trained DLM: LLaDA's sampler, one token per step, low-confidence
    remasking inside short blocks (a small model's text stays coherent when it is decoded nearly left to right;
    blocks of one token, plain left to right, repeat words more often than blocks of 4 to 8)."""
    from ..diffusion.sampler import generate

    tok, cfg = trainer.tokenizer, trainer.model_config
    assert tok is not None  # a run that samples has a tokenizer
    model = trainer.base_model
    model.eval()
    ids = tok.encode(prompt)
    # eager: the sampler's shapes differ from training's (a compiled model would recompile for them)
    with torch.no_grad(), trainer._autocast(), torch.compiler.set_stance("force_eager"):
        if cfg.causal:
            from ..generate.ar import ar_generate

            out = ar_generate(model, [ids], max_new_tokens=gen_length, eos_id=tok.eod_id)[0]
        elif cfg.block_size is not None:
            from ..diffusion.bd3lm_sampler import bd3lm_generate

            out = bd3lm_generate(model, [ids], max_new_tokens=gen_length, eos_id=tok.eod_id)[0]
        else:
            out = generate(model, [ids], mask_id=cfg.mask_token_id, gen_length=gen_length, block_length=block_length,
                           steps=gen_length, eos_id=tok.eod_id)[0]
    if trainer.ctx.is_main:
        print(f"\nsample> {prompt}{tok.decode(out)}\n")
