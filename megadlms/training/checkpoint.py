"""Checkpoints through torch.distributed.checkpoint (DCP), written atomically.

Layout of a save folder:
    latest_checkpointed_iteration.txt   the newest complete iteration (written last)
    iter_0000100/
        .metadata, __*_*.distcp       DCP shards: model, optimizer, scheduler, training state
        rank_00000.pt ...             per-rank state: RNG states, mask sampler, data position
        meta.json                     format, iteration, TransformerConfig, run arguments
        tokenizer/                    the tokenizer files, so the folder is self-contained

A save goes to `.tmp_iter_*` and is renamed into place only when every file is written; the
`latest` pointer is replaced after that. A crash at any point leaves either the previous
checkpoint or the new one, never a half one that a resume would trust.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from ..config import TransformerConfig
from ..errors import MegaDLMsError

FORMAT = "megadlms-dcp-1"
LATEST = "latest_checkpointed_iteration.txt"
META = "meta.json"


class CheckpointError(MegaDLMsError, RuntimeError):
    """A checkpoint is missing, incomplete or does not fit the run; the message names it and the fix."""


def iteration_dir(save_dir: str | Path, iteration: int) -> Path:
    return Path(save_dir) / f"iter_{iteration:07d}"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every single-process save/load that it assumes one process: that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(save_dir: str | Path, iteration: int, app_state: dict[str, Any], *,
                    rank_state: dict[str, Any] | None = None, meta: dict[str, Any] | None = None,
                    tokenizer_dir: str | Path | None = None,
                    dcp_save: Callable[..., Any] | None = None) -> Path:
    """Save `app_state` (a DCP state dict, collective across ranks) and this rank's `rank_state`.

    Every rank calls this. `dcp_save(state, checkpoint_id=...)` defaults to `dcp.save`.
    Returns the final iteration folder.
    """
    tmp, final = _begin_save(save_dir, iteration, rank_state)
    with _single_process_quiet():
        (dcp_save or dcp.save)(app_state, checkpoint_id=str(tmp))
    _commit_save(tmp, final, iteration, meta, tokenizer_dir)
    return final


class PendingCheckpoint:
    """A checkpoint being written in the background by `async_save_checkpoint`.

    It is not a checkpoint yet: `wait()` (collective) waits for every rank's write, then renames the
    folder into place and moves the `latest` pointer. Until then a resume does not see it, and a crash
    leaves only a `.tmp_iter_*` folder that the next save deletes.
    """

    def __init__(self, future: Any, tmp: Path, final: Path, iteration: int, meta: dict[str, Any] | None,
                 tokenizer_dir: str | Path | None):
        self.future, self.tmp, self.final, self.iteration = future, tmp, final, iteration
        self.meta, self.tokenizer_dir = meta, tokenizer_dir

    def wait(self) -> Path:
        """Finish the write (re-raising its error) and commit the checkpoint; every rank calls this."""
        self.future.result()
        _commit_save(self.tmp, self.final, self.iteration, self.meta, self.tokenizer_dir)
        return self.final


def async_save_checkpoint(save_dir: str | Path, iteration: int, app_state: dict[str, Any], *,
                          rank_state: dict[str, Any] | None = None, meta: dict[str, Any] | None = None,
                          tokenizer_dir: str | Path | None = None,
                          process_group: dist.ProcessGroup | None = None) -> PendingCheckpoint:
    """Like `save_checkpoint`, but the DCP write runs in a background thread (`dcp.async_save`).

    Returns once `app_state` is copied to host memory (training may then change it). Every rank calls
    this, and later `.wait()` on the result, before the next save and before the process exits.
    process_group: a gloo group for the background write's collectives, which must not share a
    group with the training's own collectives (None: no process group is initialised).
    """
    distributed = dist.is_available() and dist.is_initialized()
    if distributed and process_group is None:
        raise ValueError("async_save_checkpoint needs a gloo process_group of its own when torch.distributed is "
                         "initialised (e.g. torch.distributed.new_group(backend='gloo'))")
    tmp, final = _begin_save(save_dir, iteration, rank_state)
    response = dcp.async_save(app_state, checkpoint_id=str(tmp), process_group=process_group, no_dist=not distributed)
    future = getattr(response, "upload_completion", response)  # AsyncSaveResponse with a staging future
    return PendingCheckpoint(future, tmp, final, iteration, meta, tokenizer_dir)


def _begin_save(save_dir: str | Path, iteration: int, rank_state: dict[str, Any] | None) -> tuple[Path, Path]:
    """Create the temporary folder (deleting ones of crashed saves) and write this rank's state into it."""
    save_dir = Path(save_dir)
    final = iteration_dir(save_dir, iteration)
    tmp = save_dir / f".tmp_{final.name}"
    rank = _rank()
    if rank == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        for stale in save_dir.glob(".tmp_iter_*"):  # left by a crashed save
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    if rank_state is not None:
        torch.save(rank_state, tmp / f"rank_{rank:05d}.pt")
    return tmp, final


def _commit_save(tmp: Path, final: Path, iteration: int, meta: dict[str, Any] | None,
                 tokenizer_dir: str | Path | None) -> None:
    """After every rank wrote into `tmp`: add meta.json and the tokenizer, rename to `final`, move `latest`."""
    _barrier()
    if _rank() == 0:
        if tokenizer_dir is not None:  # the tokenizer files only, not e.g. the weights of an HF folder
            from ..interop.hf import copy_tokenizer_files

            copy_tokenizer_files(tokenizer_dir, tmp / "tokenizer")
        full_meta = {"format": FORMAT, "iteration": iteration,
                     "world_size": dist.get_world_size() if dist.is_initialized() else 1, **(meta or {})}
        _write_atomic(tmp / META, json.dumps(full_meta, indent=2, default=str))
        if final.exists():  # re-saving an iteration: move the old one aside first
            old = final.parent / f".old_{final.name}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _write_atomic(final.parent / LATEST, f"{iteration}\n")
    _barrier()


def find_checkpoint(load_dir: str | Path, iteration: int | None = None) -> Path:
    """The folder of `iteration` (default: the latest complete one) under `load_dir`.

    `load_dir` may also be an iteration folder itself.
    """
    load_dir = Path(load_dir)
    if (load_dir / META).is_file():
        return load_dir
    if iteration is None:
        pointer = load_dir / LATEST
        if not pointer.is_file():
            raise CheckpointError(f"no checkpoint in {load_dir}: {LATEST} is missing (is this a --save folder "
                                  "of a run that saved at least once?)")
        iteration = int(pointer.read_text().strip())
    path = iteration_dir(load_dir, iteration)
    if not (path / META).is_file():
        raise CheckpointError(f"checkpoint {path} is missing or incomplete (no {META}); "
                              f"pick another iteration from {sorted(p.name for p in load_dir.glob('iter_*'))}")
    return path


def read_meta(path: str | Path) -> dict[str, Any]:
    meta = json.loads((Path(path) / META).read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {meta.get('format')!r}; this version reads {FORMAT!r}")
    return meta


def load_app_state(path: str | Path, app_state: dict[str, Any], *, partial: bool = False) -> None:
    """Load a DCP checkpoint into `app_state` in place (collective). `partial`: keys absent are fine."""
    planner = dcp.DefaultLoadPlanner(allow_partial_load=partial)
    with _single_process_quiet():
        dcp.load(app_state, checkpoint_id=str(path), planner=planner)


FP8_STATE_SUFFIXES = (".fp8_amax_history", ".fp8_scale", ".fp8_initialized")


def load_model_state(path: str | Path, app_state: dict[str, Any]) -> list[str]:
    """`load_app_state` for a state whose "model" entry may hold FP8 state (amax histories, scales) the checkpoint
    lacks: a checkpoint saved without FP8, or without FP8 attention, loaded into a run with it. Those tensors keep
    their fresh values (the first step scales from amaxes, as in a new FP8 run); returns their names. Any other
    tensor the checkpoint lacks is an error."""
    saved = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    absent = [k for k in app_state["model"] if f"model.{k}" not in saved]
    other = [k for k in absent if not k.endswith(FP8_STATE_SUFFIXES)]
    if other:
        raise CheckpointError(f"checkpoint {path} has no {other[:3]}{' ...' if len(other) > 3 else ''} "
                              f"({len(other)} tensors of this model missing): it was saved from another "
                              "architecture; load it with the model flags it was trained with")
    load_app_state(path, app_state, partial=bool(absent))
    return absent


def load_rank_state(path: str | Path, rank: int | None = None) -> dict[str, Any] | None:
    """This rank's per-rank state; rank 0's when the checkpoint had fewer ranks (resharded resume)."""
    rank = _rank() if rank is None else rank
    path = Path(path)
    f = path / f"rank_{rank:05d}.pt"
    if not f.is_file():
        f = path / "rank_00000.pt"
    return torch.load(f, weights_only=False) if f.is_file() else None


def save_model_checkpoint(save_dir: str | Path, model: nn.Module, cfg: TransformerConfig, *, iteration: int = 0,
                          tokenizer_dir: str | Path | None = None, args: dict[str, Any] | None = None) -> Path:
    """A weights-only checkpoint (e.g. an imported model) that `megadlms train --load DIR --finetune` takes."""
    return save_checkpoint(save_dir, iteration, {"model": model.state_dict()},
                           meta={"config": cfg.to_dict(), "args": args or {}, "weights_only": True},
                           tokenizer_dir=tokenizer_dir)


def load_model_from_checkpoint(load_dir: str | Path, *, device: torch.device | str = "cpu",
                               iteration: int | None = None) -> tuple[nn.Module, TransformerConfig, dict[str, Any]]:
    """Build the model recorded in a checkpoint and load its weights (single process).

    Returns (model, config, meta); meta['tokenizer_dir'] is the checkpoint's tokenizer folder or None.
    """
    from ..build import build_model

    path = find_checkpoint(load_dir, iteration)
    meta = read_meta(path)
    cfg = TransformerConfig.from_dict(meta["config"])
    model = build_model(cfg, device=device)
    state = {"model": model.state_dict()}
    load_model_state(path, state)
    model.load_state_dict(state["model"])
    tok = path / "tokenizer"
    meta["tokenizer_dir"] = str(tok) if tok.is_dir() else None
    meta["path"] = str(path)
    return model, cfg, meta
