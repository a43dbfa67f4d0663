"""Throughput accounting (tokens/s, TFLOP/s, MFU), memory, and metric sinks (TensorBoard, W&B, jsonl)."""

from __future__ import annotations

import json
import math
import resource
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import import_extra

# Dense BF16 tensor-core peak (TFLOP/s) by device-name substring, most specific first.
# MFU is always reported against the BF16 peak; with FP8 on this is the BF16-equivalent MFU.
BF16_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H800", 989.0),
    ("GH200", 989.0), ("B200", 2250.0), ("B300", 2250.0), ("GB200", 2500.0), ("H20", 148.0),
    ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0),
    ("RTX 6000 Ada", 364.0), ("RTX 4090", 165.0), ("A10", 125.0),
)


def bf16_peak_tflops(device: torch.device) -> float | None:
    """The device's dense BF16 peak, or None (CPU, unknown GPU: MFU is then reported as n/a)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in BF16_PEAK_TFLOPS:
        if key in name:
            return peak
    return None


def memory_gib(device: torch.device) -> float:
    """Peak device memory (CUDA) or peak resident memory of the process (CPU), in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def throughput(tokens: int, seconds: float, flops: float, world_size: int,
               peak_tflops: float | None) -> dict[str, float | None]:
    """tokens, flops: global tokens and training FLOPs in `seconds`. TFLOP/s and MFU are per device."""
    tok_s = tokens / seconds
    tflops = flops / seconds / world_size / 1e12
    return {"tokens_per_s": tok_s, "tflops_per_device": tflops,
            "mfu": tflops / peak_tflops if peak_tflops else None}


def format_log_line(m: dict[str, Any], train_iters: int) -> str:
    parts = [f"iter {m['iteration']:>6}/{train_iters}", f"loss {m['loss']:.4f}", f"lr {m['lr']:.3e}",
             f"grad_norm {m['grad_norm']:.3f}", f"{m['tokens_per_s']:,.0f} tok/s",
             f"{m['tflops_per_device']:.3g} TFLOP/s/dev",
             f"MFU {m['mfu'] * 100:.1f}%" if m.get("mfu") is not None else "MFU n/a",
             f"mem {m['memory_gib']:.2f} GiB"]
    if m.get("skipped_steps"):  # steps whose loss or gradient norm was not finite: the optimizer left them out
        parts.append(f"skipped {m['skipped_steps']}")
    if "data_wait_share" in m:  # share of the interval the host spent blocked on the data loader
        parts.append(f"data {m['data_wait_share'] * 100:.1f}%")
    if "moe/cv_max" in m:  # routing balance: the worst MoE layer's spread of tokens over experts
        parts.append(f"moe cv_max={m['moe/cv_max']:.3g}" + (f" aux={m['moe/aux_loss']:.4g}" if "moe/aux_loss" in m
                                                             else ""))
    rl = {k: v for k, v in m.items() if k.startswith("rl/")}
    if rl:  # RL objectives: rewards, KL, clip fraction, rollout tokens/s; VRPO: the DPO margin and accuracy
        parts.append("rl " + " ".join(f"{k[3:]}={v:.4g}" for k, v in sorted(rl.items())))
    fp8 = {k: v for k, v in m.items() if k.startswith("fp8/")}
    if fp8:
        parts.append("fp8 " + " ".join(f"{k[4:]}={v:.3g}" for k, v in sorted(fp8.items())))
    return " | ".join(parts)


def format_eval_line(iteration: int, loss: float, bound: bool) -> str:
    """The validation line. bound: the loss is an upper bound on the NLL (masked and block diffusion: the ELBO /
    NELBO), so exp(loss) bounds the perplexity from above and is labelled "ELBO ppl"; else (autoregressive) the
    loss is the exact NLL and exp(loss) the perplexity itself, "ppl"."""
    ppl = math.exp(min(loss, 50))  # capped: an early loss can overflow exp
    return f"validation at iter {iteration} | loss {loss:.4f} | {'ELBO ppl' if bound else 'ppl'} {ppl:.2f}"


@dataclass
class WandbConfig:
    """Weights & Biases logging (Megatron's flag names); off without a project. WANDB_MODE=offline writes the run
    to `save_dir` for a later `wandb sync`."""

    project: str | None = None
    exp_name: str | None = None
    save_dir: str | None = None
    run_config: dict[str, Any] = field(default_factory=dict)  # recorded with the run (the run's arguments)

    @classmethod
    def from_run(cls, config: Any) -> WandbConfig:
        """From a RunConfig: its flag-named settings are the W&B run's config."""
        flat = config.to_flat()
        run_config = {k: v for k, v in flat.items() if isinstance(v, (str, int, float, bool, type(None)))}
        return cls(flat["wandb_project"], flat["wandb_exp_name"], flat["wandb_save_dir"] or flat["save"], run_config)


def start_wandb(cfg: WandbConfig) -> Any:
    """A started wandb run for `cfg` (None when cfg.project is None)."""
    if cfg.project is None:
        return None
    wandb = import_extra("wandb", "wandb", "--wandb-project")
    save_dir = Path(cfg.save_dir or ".")
    save_dir.mkdir(parents=True, exist_ok=True)
    return wandb.init(project=cfg.project, name=cfg.exp_name, dir=str(save_dir), config=cfg.run_config)


class MetricSinks:
    """TensorBoard (if a dir is given), W&B (if a project is given) and an append-only metrics.jsonl (if a dir
    is given); rank 0 only. TensorBoard and W&B get the same scalars, named `{prefix}/{key}`."""

    def __init__(self, tensorboard_dir: str | None, jsonl_dir: str | None, enabled: bool = True,
                 wandb: WandbConfig | None = None):
        self.tb = None
        self.jsonl = None
        self.wandb = None
        if not enabled:
            return
        self.wandb = start_wandb(wandb or WandbConfig())
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(tensorboard_dir)
        if jsonl_dir:
            Path(jsonl_dir).mkdir(parents=True, exist_ok=True)
            self.jsonl = open(Path(jsonl_dir) / "metrics.jsonl", "a")

    def write(self, step: int, metrics: dict[str, Any], prefix: str = "train") -> None:
        scalars = {f"{prefix}/{k}": v for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "iteration"}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"split": prefix, **metrics}) + "\n")
            self.jsonl.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
        if self.jsonl is not None:
            self.jsonl.close()
