"""A run's `--save` folder belongs to that run: a run with another configuration may not write into it.

Megatron-LM's convention is kept: `--load DIR --save DIR` resumes the run in DIR (its flags may change, e.g. a
longer `--train-iters`). A run that does not resume from DIR and whose settings differ from those recorded in
DIR's latest checkpoint is refused before anything is built, in one line naming the differences and the fix; a
run of the same settings starts over there (its `metrics.jsonl` goes on; `megadlms plot` keeps the newest
record of each iteration).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from ..config import ConfigError, flag_name
from . import checkpoint as ckpt
from .config import RunConfig

log = logging.getLogger(__name__)

# settings of how a run is watched, stored, scheduled or placed, not of what it trains: they may differ
WATCH_AND_PLACEMENT = frozenset({
    "exit_interval", "log_interval", "tensorboard_dir", "generate_sample", "no_progress", "wandb_project",
    "wandb_exp_name", "wandb_save_dir", "exit_signal_handler", "exit_duration_in_mins", "max_skipped_steps",
    "fp8_stats", "save", "save_interval", "async_save", "ckpt_keep_last", "ckpt_save_failures_ok", "num_workers",
    "data_cache_path", "device", "compile", "cuda_graphs", "distributed_backend", "overlap_grad_reduce",
    "overlap_param_gather",
})


def _same_folder(a: str | Path, b: str | Path) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def _holds_checkpoints(folder: Path) -> bool:
    return (folder / ckpt.LATEST).exists() or any(p.is_dir() for p in folder.glob("iter_*"))


def differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(setting, recorded value, this run's value) for each setting of what a run trains that differs; settings
    one side does not know (another version's) are left out."""
    current = json.loads(json.dumps(current, default=str))  # as the checkpoint's meta.json stores them
    return [(k, recorded[k], current[k]) for k in current
            if k in recorded and k not in WATCH_AND_PLACEMENT and recorded[k] != current[k]]


def check_save_folder(config: RunConfig) -> None:
    """Refuse a run whose `--save` folder holds the checkpoints of a run with other settings, unless this run
    resumes from it (`--load` names it, without `--finetune`); say in one line when nothing will be kept."""
    ck = config.checkpoint
    if ck.save is None:
        log.info("no --save folder: this run keeps no checkpoint (add --save DIR to keep the trained model)")
        return
    folder = Path(ck.save)
    if not folder.is_dir() or not _holds_checkpoints(folder):
        return
    if ck.load is not None and not ck.finetune and _same_folder(ck.load, folder):
        return  # a resume of the run in this folder
    fix = f"save this run to a new folder (--save {folder}_2), or resume that run with --load {folder}"
    try:
        latest = ckpt.find_checkpoint(folder)
        meta = ckpt.read_meta(latest)
    except ckpt.CheckpointError as e:
        raise ConfigError(f"--save {folder} holds checkpoints that cannot be read ({e}); {fix}") from None
    recorded = meta.get("args")
    if isinstance(recorded, dict) and recorded.get("load") and _same_folder(recorded["load"], folder):
        recorded = {**recorded, "load": None}  # its latest part resumed the run: the run itself started without
    where = f"--save {folder} holds another run's checkpoints (the latest at iteration {meta.get('iteration')})"
    if not isinstance(recorded, dict):
        raise ConfigError(f"{where}, which record no training settings; {fix}")
    diff = differences(recorded, config.to_flat())
    if diff:
        shown = ", ".join(f"{flag_name(k)} {there} there, {here} here" for k, there, here in diff[:3])
        more = f" and {len(diff) - 3} more" if len(diff) > 3 else ""
        raise ConfigError(f"{where}; this run differs in {shown}{more}: {fix}")
    log.info("%s holds an earlier run of these settings (iteration %s): starting it over (--load %s resumes it "
             "instead)", folder, meta.get("iteration"), folder)
