"""Checkpoints through torch.distributed.checkpoint (DCP), written atomically.

Layout of a save folder:
    latest_checkpointed_iteration.txt   the newest complete iteration (written last)
    iter_0000100/
        .metadata, __*_*.distcp       DCP shards: model, optimizer, scheduler, training state
        rank_00000.pt ...             per-rank state: RNG states, mask sampler, data position
        meta.json                     format, iteration, TransformerConfig, run arguments
        tokenizer/                    the tokenizer files, so the folder is self-contained
        crc32_00000.json ...          size and CRC-32 of every file each rank wrote (verified at load)

A save goes to `.tmp_iter_*` and is renamed into place only when every file is written; the
`latest` pointer is replaced after that. A crash at any point leaves either the previous
checkpoint or the new one, never a half one that a resume would trust. A save that fails (a full
disk, no permission, an I/O error) removes its temporary folder on every rank and raises
`CheckpointSaveError`, with `latest` still naming the previous checkpoint.

A load never runs code from the checkpoint: the per-rank state and DCP's non-tensor items are read by
`torch.load(weights_only=True)` (plus the numpy RNG state of earlier versions), DCP's `.metadata` by an
unpickler that admits DCP's metadata classes only (`SafeFileSystemReader`). A file that needs anything else is
refused with a `CheckpointError` naming the file and the global it asked for.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import io
import json
import logging
import os
import pathlib
import pickle
import re
import shutil
import warnings
import zlib
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ..config import TransformerConfig
from ..data.tokenizer import complete_tokenizer_config
from ..errors import MegaDLMsError

if TYPE_CHECKING:
    from ..model import TransformerLM

FORMAT = "megadlms-dcp-1"
LATEST = "latest_checkpointed_iteration.txt"
META = "meta.json"

log = logging.getLogger("megadlms")


class CheckpointError(MegaDLMsError, RuntimeError):
    """A checkpoint is missing, incomplete or does not fit the run; the message names it and the fix."""


class CheckpointSaveError(CheckpointError):
    """A save failed for a reason of the file system (no space, no permission, an I/O error); nothing of it is left
    and `latest` still names the previous checkpoint."""


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
                    dcp_save: Callable[..., Any] | None = None, keep_last: int | None = None) -> Path:
    """Save `app_state` (a DCP state dict, collective across ranks) and this rank's `rank_state`.

    Every rank calls this. `dcp_save(state, checkpoint_id=...)` defaults to `dcp.save`. keep_last: afterwards delete
    all but the newest `keep_last` complete checkpoints. Returns the final iteration folder; raises
    `CheckpointSaveError` (on every rank) when the file system refuses a write.
    """
    tmp, final = _begin_save(save_dir, iteration, rank_state)
    with _cleanup_on_failure(tmp, final):
        with _single_process_quiet():
            (dcp_save or dcp.save)(app_state, checkpoint_id=str(tmp))
    _commit_save(tmp, final, iteration, meta, tokenizer_dir, keep_last)
    return final


class PendingCheckpoint:
    """A checkpoint being written in the background by `async_save_checkpoint`.

    It is not a checkpoint yet: `wait()` (collective) waits for every rank's write, then renames the
    folder into place and moves the `latest` pointer. Until then a resume does not see it, and a crash
    leaves only a `.tmp_iter_*` folder that the next save deletes.
    """

    def __init__(self, future: Any, tmp: Path, final: Path, iteration: int, meta: dict[str, Any] | None,
                 tokenizer_dir: str | Path | None, keep_last: int | None = None):
        self.future, self.tmp, self.final, self.iteration = future, tmp, final, iteration
        self.meta, self.tokenizer_dir, self.keep_last = meta, tokenizer_dir, keep_last

    def wait(self) -> Path:
        """Finish the write (re-raising its error) and commit the checkpoint; every rank calls this."""
        with _cleanup_on_failure(self.tmp, self.final):
            self.future.result()
        _commit_save(self.tmp, self.final, self.iteration, self.meta, self.tokenizer_dir, self.keep_last)
        return self.final


def async_save_checkpoint(save_dir: str | Path, iteration: int, app_state: dict[str, Any], *,
                          rank_state: dict[str, Any] | None = None, meta: dict[str, Any] | None = None,
                          tokenizer_dir: str | Path | None = None,
                          process_group: dist.ProcessGroup | None = None,
                          keep_last: int | None = None) -> PendingCheckpoint:
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
    with _cleanup_on_failure(tmp, final):
        response = dcp.async_save(app_state, checkpoint_id=str(tmp), process_group=process_group,
                                  no_dist=not distributed)
    future = getattr(response, "upload_completion", response)  # AsyncSaveResponse with a staging future
    return PendingCheckpoint(future, tmp, final, iteration, meta, tokenizer_dir, keep_last)


def _any_rank(failed: bool) -> bool:
    """Whether `failed` holds on any rank (collective; a plain bool in one process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return failed
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    flag = torch.tensor([int(failed)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _file_system_cause(e: BaseException) -> OSError | None:
    """The OSError behind `e` (DCP wraps its writers' errors in a CheckpointException), or None for other errors."""
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [e]
    while todo:
        x = todo.pop()
        if x is None or any(x is y for y in seen):
            continue
        seen.append(x)
        if isinstance(x, OSError):
            return x
        todo += [x.__cause__, x.__context__]
        failures = getattr(x, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict):
            for f in failures.values():
                todo.append(f[0] if isinstance(f, tuple) else f)
    return None


def describe_os_error(e: OSError) -> str:
    name = errno.errorcode.get(e.errno, "") if e.errno else ""
    text = e.strerror or str(e)
    hints: dict[int | None, str] = {
        errno.ENOSPC: "free space or point --save elsewhere", errno.EDQUOT: "free space or raise the quota",
        errno.EACCES: "make the folder writable or point --save elsewhere",
        errno.EROFS: "point --save at a writable file system"}
    hint = hints.get(e.errno, "check the file system")
    where = f" ({e.filename})" if e.filename else ""
    return f"{text}{f' [{name}]' if name else ''}{where}; {hint}"


@contextlib.contextmanager
def _cleanup_on_failure(tmp: Path, final: Path) -> Iterator[None]:
    """Agree across ranks whether the block failed; if it did on any rank, remove `tmp` and raise
    `CheckpointSaveError` (a file-system cause) or the error itself (anything else: a bug) on the ranks it hit."""
    error: BaseException | None = None
    try:
        yield
    except (Exception, CheckpointException) as e:  # re-raised below, after every rank knows (DCP's is a BaseException)
        error = e
    if not _any_rank(error is not None):
        return
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    latest = _read_latest(final.parent)
    keeps = f"latest stays at iteration {latest}" if latest is not None else "no earlier checkpoint"
    if error is None:
        raise CheckpointSaveError(f"could not save checkpoint {final}: another rank failed to write its part; {keeps}")
    cause = _file_system_cause(error)
    if cause is None:
        raise error
    raise CheckpointSaveError(f"could not save checkpoint {final}: {describe_os_error(cause)} ({keeps})") from error


def _read_latest(save_dir: Path) -> int | None:
    try:
        return int((save_dir / LATEST).read_text().strip())
    except (OSError, ValueError):
        return None


def _begin_save(save_dir: str | Path, iteration: int, rank_state: dict[str, Any] | None) -> tuple[Path, Path]:
    """Create the temporary folder (deleting ones of crashed saves) and write this rank's state into it."""
    save_dir = Path(save_dir)
    final = iteration_dir(save_dir, iteration)
    tmp = save_dir / f".tmp_{final.name}"
    rank = _rank()
    with _cleanup_on_failure(tmp, final):
        if rank == 0:
            save_dir.mkdir(parents=True, exist_ok=True)
            for stale in save_dir.glob(".tmp_iter_*"):  # left by a crashed save
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
    with _cleanup_on_failure(tmp, final):
        if rank_state is not None:
            with open(tmp / f"rank_{rank:05d}.pt", "wb") as f:  # through a file object: a failed write is an OSError
                torch.save(rank_state, f)
    return tmp, final


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _write_checksums(folder: Path, rank: int, names: list[str]) -> None:
    """Record size and CRC-32 of the files `names` (relative to `folder`) this rank wrote."""
    sums = {n: {"size": (folder / n).stat().st_size, "crc32": _crc32(folder / n)} for n in sorted(names)}
    _write_atomic(folder / f"crc32_{rank:05d}.json", json.dumps(sums, indent=1))


def _files_of_rank(folder: Path, rank: int) -> list[str]:
    """The files of `folder` this rank wrote: its DCP shards and per-rank state (rank 0: also the DCP metadata,
    meta.json and the tokenizer files)."""
    names = [p.name for p in folder.glob(f"__{rank}_*.distcp")] + [p.name for p in folder.glob(f"rank_{rank:05d}.pt")]
    if rank == 0:
        names += [n for n in (".metadata", META) if (folder / n).is_file()]
        tok = folder / "tokenizer"
        if tok.is_dir():
            names += [str(p.relative_to(folder)) for p in tok.rglob("*") if p.is_file()]
    return names


def _commit_save(tmp: Path, final: Path, iteration: int, meta: dict[str, Any] | None,
                 tokenizer_dir: str | Path | None, keep_last: int | None = None) -> None:
    """After every rank wrote into `tmp`: add meta.json and the tokenizer, rename to `final`, move `latest`."""
    rank = _rank()
    with _cleanup_on_failure(tmp, final):
        if rank != 0:
            _write_checksums(tmp, rank, _files_of_rank(tmp, rank))
    with _cleanup_on_failure(tmp, final):
        if rank == 0:
            if tokenizer_dir is not None:  # the tokenizer files only, not e.g. the weights of an HF folder
                from ..interop.hf import copy_tokenizer_files

                copy_tokenizer_files(tokenizer_dir, tmp / "tokenizer")
                # a bare tokenizer.json gets the tokenizer_config.json that makes transformers tokenize as we did
                mask_id = ((meta or {}).get("config") or {}).get("mask_token_id")
                complete_tokenizer_config(tmp / "tokenizer", mask_id=mask_id)
            full_meta = {"format": FORMAT, "iteration": iteration,
                         "world_size": dist.get_world_size() if dist.is_initialized() else 1, **(meta or {})}
            _write_atomic(tmp / META, json.dumps(full_meta, indent=2, default=str))
            _write_checksums(tmp, 0, _files_of_rank(tmp, 0))
            if final.exists():  # re-saving an iteration: move the old one aside first
                old = final.parent / f".old_{final.name}"
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            _write_atomic(final.parent / LATEST, f"{iteration}\n")
    if rank == 0 and keep_last:
        prune_checkpoints(final.parent, keep_last)
    _barrier()


def complete_iterations(save_dir: str | Path) -> list[int]:
    """The iterations under `save_dir` whose folder is complete (has its meta.json), oldest first."""
    its = []
    for p in Path(save_dir).glob("iter_*"):
        m = re.fullmatch(r"iter_(\d+)", p.name)
        if m and (p / META).is_file():
            its.append(int(m.group(1)))
    return sorted(its)


def prune_checkpoints(save_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints, never the one `latest` names; returns the
    deleted folders. Runs after a new checkpoint is complete and `latest` names it."""
    save_dir = Path(save_dir)
    latest = _read_latest(save_dir)
    its = complete_iterations(save_dir)
    doomed = [i for i in its[:max(0, len(its) - keep_last)] if i != latest]
    for i in doomed:
        path = iteration_dir(save_dir, i)
        gone = save_dir / f".del_{path.name}"  # renamed first: a crash mid-delete leaves no half checkpoint
        os.replace(path, gone)
        shutil.rmtree(gone, ignore_errors=True)
    return [iteration_dir(save_dir, i) for i in doomed]


def _listing(load_dir: Path, exclude: int | None = None) -> str:
    its = [i for i in complete_iterations(load_dir) if i != exclude]
    if not its:
        return f"no other complete checkpoint in {load_dir}"
    return (f"complete checkpoints in {load_dir}: {', '.join(map(str, its))}; load one by its number "
            "(--ckpt-step N; generate and convert: --iteration N)")


def find_checkpoint(load_dir: str | Path, iteration: int | None = None) -> Path:
    """The folder of `iteration` (default: the latest complete one) under `load_dir`.

    `load_dir` may also be an iteration folder itself.
    """
    load_dir = Path(load_dir)
    if (load_dir / META).is_file():
        return load_dir
    if not load_dir.is_dir():
        raise CheckpointError(f"no checkpoint folder {load_dir}: it does not exist or is not a folder")
    if iteration is None:
        pointer = load_dir / LATEST
        if not pointer.is_file() and (load_dir / "config.json").is_file():
            raise CheckpointError(f"no checkpoint in {load_dir}: it holds a config.json, as a Hugging Face or "
                                  "`megadlms export` folder does; import a Hugging Face folder with `megadlms convert "
                                  "hf-to-megadlms --hf-model DIR --save CKPT` (generate and eval read it as "
                                  "--hf-model DIR, an export as --fp8-export DIR)")
        if not pointer.is_file():
            raise CheckpointError(f"no checkpoint in {load_dir}: {LATEST} is missing (is this a --save folder "
                                  f"of a run that saved at least once?); {_listing(load_dir)}")
        text = pointer.read_text(errors="replace").strip()
        if not re.fullmatch(r"\d+", text):
            raise CheckpointError(f"{pointer} should hold an iteration number, not {text[:40]!r}; "
                                  f"{_listing(load_dir)}")
        iteration = int(text)
    path = iteration_dir(load_dir, iteration)
    if not (path / META).is_file():
        raise CheckpointError(f"checkpoint {path} is missing or incomplete (no {META}); "
                              f"{_listing(load_dir, iteration)}")
    return path


def _same_folder(a: str | Path, b: str | Path) -> bool:
    a, b = Path(a), Path(b)
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and a.samefile(b))
    except OSError:
        return False


def resume_source(load: str | Path, save: str | Path | None, *, iteration: int | None = None,
                  finetune: bool = False) -> Path | None:
    """The folder `--load` resumes from, or None where the run starts from scratch: `load` names the `--save`
    folder and no checkpoint was written there yet (a requeued job whose first attempt ended before its first
    save; the folder may hold its metrics.jsonl), warned about in one line. A `--load` elsewhere, a `--ckpt-step`,
    `--finetune`, or a folder with a `latest` pointer or an iteration folder is returned: `find_checkpoint` names
    what is missing there."""
    load = Path(load)
    if (save is None or iteration is not None or finetune or not _same_folder(load, save)
            or (load / META).is_file() or (load / LATEST).exists() or any(load.glob("iter_*"))):
        return load
    if _rank() == 0:
        log.warning("no checkpoint in %s yet (--load names the --save folder): starting from scratch", load)
    return None


def read_meta(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: {META} cannot be read ({e}); "
                              f"{_listing(path.parent, _iteration_of(path))}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{path} has format {got!r}; this version reads {FORMAT!r}")
    if not isinstance(meta.get("config", {}), dict):
        raise CheckpointError(f"checkpoint {path}: {META} has no model config; {_listing(path.parent)}")
    return meta


def _iteration_of(path: Path) -> int | None:
    m = re.fullmatch(r"iter_(\d+)", path.name)
    return int(m.group(1)) if m else None


def verify_checkpoint(path: str | Path, files: slice = slice(None)) -> list[str]:
    """The problems of checkpoint folder `path`: files its checksum records name that are missing, of another size
    or of another CRC-32 (empty: it is whole). `files` picks a share of the recorded files (ranks split the work)."""
    path = Path(path)
    records = sorted(path.glob("crc32_*.json"))
    if not records:
        return [] if (path / META).is_file() and (path / ".metadata").is_file() else [
            f"{path} has no {META} or .metadata (not a complete checkpoint)"]
    expected: dict[str, dict[str, int]] = {}
    problems = []
    for rec in records:
        try:
            expected.update(json.loads(rec.read_text()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            problems.append(f"{rec.name} cannot be read ({e})")
    for name in sorted(expected)[files]:
        f, want = path / name, expected[name]
        if not f.is_file():
            problems.append(f"{name} is missing")
        elif f.stat().st_size != want["size"]:
            problems.append(f"{name} has {f.stat().st_size} bytes, {want['size']} were written (truncated?)")
        elif _crc32(f) != want["crc32"]:
            problems.append(f"{name} does not match its checksum (corrupted)")
    return problems


def check_loadable(path: str | Path) -> None:
    """Raise CheckpointError naming the damaged files of `path` (its checksums, each rank a share; collective)."""
    path = Path(path)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    problems = verify_checkpoint(path, slice(_rank(), None, world))
    if _any_rank(bool(problems)):
        what = "; ".join(problems[:3]) if problems else "damaged files (another rank names them)"
        raise CheckpointError(f"checkpoint {path} is damaged: {what}; {_listing(path.parent, _iteration_of(path))}")


# ---------------------------------------------------------------------------------------------- safe reading
_REFUSED = ("which a checkpoint may not contain: refusing to load it (only tensors, numbers, strings and the "
           "trainer's RNG states are read)")


def _refusal(file: str | Path, names: list[str]) -> CheckpointError:
    shown = ", ".join(repr(n) for n in names[:3]) + (" ..." if len(names) > 3 else "")
    return CheckpointError(f"checkpoint file {file} needs {shown}, {_REFUSED}")


@functools.cache
def _numpy_rng_globals() -> tuple[Any, ...]:
    """What the numpy RNG state of checkpoints of earlier versions needs (a uint32 array; numpy 1 and 2 names)."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    rebuild = core.multiarray._reconstruct
    return (np.ndarray, np.dtype, type(np.dtype(np.uint32)), (rebuild, "numpy._core.multiarray._reconstruct"),
            (rebuild, "numpy.core.multiarray._reconstruct"))


def _unsafe_globals(f: str | Path | IO[bytes] | None, error: BaseException) -> list[str]:
    """The globals a weights-only load of `f` refused (read from the pickle, else from torch's message)."""
    names: list[str] = []
    try:
        if f is not None and not isinstance(f, (str, Path)):
            f.seek(0)
        names = torch.serialization.get_unsafe_globals_in_checkpoint(f) if f is not None else []
    except Exception:  # not a readable torch.save archive: only the message can tell
        pass
    if not names:  # torch names the global it refused, or the class it would not build
        m = re.search(r"GLOBAL (\S+)|but got <class '([^']+)'>", str(error))
        names = [m.group(1) or m.group(2)] if m else []
    return names


def _unpickler_reason(error: BaseException) -> str:
    """torch's reason for refusing a weights-only load, on one line, without its advice to load the file unsafely
    (`weights_only=False`) or to allow-list what it refused."""
    text = str(error)
    m = re.search(r"WeightsUnpickler error:\s*(.+?)\s*(Check the documentation|$)", text, re.S)
    reason = " ".join((m.group(1) if m else text).split())
    reason = re.split(r"\s*Please use `?torch\.serialization", reason)[0].rstrip(" .")
    if not m or "weights_only" in reason:
        return "not a torch.save archive of tensors and plain types"
    if reason.startswith("Unsupported operand"):
        return f"not a torch.save archive of tensors and plain types ({reason})"
    return reason


def _load_weights_only(f: str | Path | IO[bytes], shown: str | Path, allow: tuple[Any, ...] = ()) -> Any:
    """`torch.load(f, weights_only=True)` with the globals `allow` admitted; a file that needs any other global is
    refused with a CheckpointError naming `shown` and the global. Other errors (a truncated file) pass unchanged."""
    with torch.serialization.safe_globals(list(allow)):
        try:
            return torch.load(f, weights_only=True)
        except pickle.UnpicklingError as e:
            names = _unsafe_globals(f, e)
            if names:
                raise _refusal(shown, names) from None
            raise pickle.UnpicklingError(_unpickler_reason(e)) from e  # not torch's advice to load it unsafely


@functools.cache
def _dcp_metadata_globals() -> dict[tuple[str, str], Any]:
    """(module, name) -> object of everything DCP's `.metadata` pickle may name: its metadata classes and the torch
    types they hold."""
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint import metadata as md

    names = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
             "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
    allowed: dict[tuple[str, str], Any] = {(md.__name__, n): getattr(md, n) for n in names if hasattr(md, n)}
    allowed[(filesystem.__name__, "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed.update({("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)})
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # a layout by its name
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    for cls in (pathlib.PurePosixPath, pathlib.PosixPath, pathlib.PureWindowsPath, pathlib.WindowsPath):
        allowed[("pathlib", cls.__name__)] = allowed[(cls.__module__, cls.__name__)] = cls  # StorageMeta's path
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `.metadata`: any global outside `_dcp_metadata_globals` is refused (CheckpointError)."""

    def __init__(self, file: IO[bytes], shown: str | Path):
        super().__init__(file)
        self.shown = shown

    def find_class(self, module: str, name: str) -> Any:
        obj = _dcp_metadata_globals().get((module, name))
        if obj is None:
            raise _refusal(self.shown, [f"{module}.{name}"])
        return obj


class SafeFileSystemReader(dcp.FileSystemReader):
    """`dcp.FileSystemReader` whose `.metadata` goes through `_MetadataUnpickler` instead of `pickle.load`; the
    metadata read first is kept for the load that follows."""

    def __init__(self, path: str | os.PathLike[str]):
        super().__init__(path)
        self._metadata: Metadata | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        super().reset(checkpoint_id)
        self._metadata = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank is not None or self._metadata is None:
            file = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")
            with open(file, "rb") as f:
                metadata = _MetadataUnpickler(f, file).load()
            if not isinstance(metadata, Metadata):
                raise CheckpointError(f"checkpoint file {file} holds a {type(metadata).__name__}, not DCP metadata")
            if rank is not None:
                return self._stamp(metadata)
            self._metadata = metadata
        return self._stamp(self._metadata)

    def _stamp(self, metadata: Metadata) -> Metadata:
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """`DefaultLoadPlanner` whose non-tensor items (the iteration counters, the optimizer's hyper-parameters) are read
    with `torch.load(weights_only=True)`, not DCP's `weights_only=False`."""

    def __init__(self, checkpoint: Path, **kwargs: Any):
        super().__init__(**kwargs)
        self.checkpoint = checkpoint

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        info = self.metadata.storage_data.get(read_item.storage_index) if self.metadata is not None else None
        shown = self.checkpoint / info.relative_path if info is not None else self.checkpoint
        obj = _load_weights_only(value, shown)
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _read_metadata(reader: SafeFileSystemReader, path: Path) -> Metadata:
    """`reader.read_metadata()`, or a CheckpointError naming `path` (refused or unreadable)."""
    try:
        return reader.read_metadata()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"checkpoint {path}: its DCP .metadata cannot be read ({_root_text(e)}); "
                              f"{_listing(path.parent, _iteration_of(path))}") from e


def check_safe(path: str | Path) -> None:
    """Read the DCP metadata and the per-rank state of checkpoint folder `path` as a load does (no code of theirs
    runs); CheckpointError when one is refused or cannot be read."""
    path = Path(path)
    _read_metadata(SafeFileSystemReader(str(path)), path)
    for f in sorted(path.glob("rank_*.pt")):
        m = re.fullmatch(r"rank_(\d+)\.pt", f.name)
        if m:
            load_rank_state(path, int(m.group(1)))


def load_app_state(path: str | Path, app_state: dict[str, Any], *, partial: bool = False,
                   reader: SafeFileSystemReader | None = None) -> None:
    """Load a DCP checkpoint into `app_state` in place (collective). `partial`: keys absent are fine. Nothing of the
    checkpoint runs as code (`SafeFileSystemReader`, weights-only non-tensor items). reader: one that already read
    this checkpoint's metadata."""
    path = Path(path)
    if reader is None:  # a refused or unreadable .metadata is named here, not inside DCP's retries
        reader = SafeFileSystemReader(str(path))
        _read_metadata(reader, path)
    planner = _SafeLoadPlanner(path, allow_partial_load=partial)
    try:
        with _single_process_quiet():
            dcp.load(app_state, storage_reader=reader, planner=planner)
    except (Exception, CheckpointException) as e:
        root = _root(e)
        if isinstance(root, CheckpointError):  # a refused item, named by the planner
            raise root from None
        if isinstance(root, pickle.UnpicklingError) and (names := _unsafe_globals(None, root)):
            raise _refusal(f"{path} (a DCP shard)", names) from None
        if not isinstance(root, (OSError, EOFError, ValueError, KeyError, RuntimeError, IndexError,
                                 pickle.UnpicklingError)):
            raise
        raise CheckpointError(f"checkpoint {path} cannot be read ({_root_text(e)}); "
                              f"{_listing(path.parent, _iteration_of(path))}") from e


def _root(e: BaseException) -> BaseException:
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        f = next(iter(failures.values()))
        return _root(f[0] if isinstance(f, tuple) else f)
    return e


def _root_text(e: BaseException) -> str:
    r = _root(e)
    if isinstance(r, pickle.UnpicklingError) and "weights_only" in str(r):  # torch's text: its reason, no advice
        return f"{type(r).__name__}: {_unpickler_reason(r)}"
    text = str(r).strip().splitlines()[0] if str(r).strip() else ""
    return f"{type(r).__name__}: {text[:200]}" if text else type(r).__name__


FP8_STATE_SUFFIXES = (".fp8_amax_history", ".fp8_scale", ".fp8_initialized")


def load_model_state(path: str | Path, app_state: dict[str, Any]) -> list[str]:
    """`load_app_state` for a state whose "model" entry may hold FP8 state (amax histories, scales) the checkpoint
    lacks: a checkpoint saved without FP8, or without FP8 attention, loaded into a run with it. Those tensors keep
    their fresh values (the first step scales from amaxes, as in a new FP8 run); returns their names. Any other
    tensor the checkpoint lacks is an error."""
    check_loadable(path)
    reader = SafeFileSystemReader(str(path))
    saved_meta = _read_metadata(reader, Path(path)).state_dict_metadata
    saved = set(saved_meta)
    for k, t in app_state["model"].items():
        entry = saved_meta.get(f"model.{k}")
        size = getattr(entry, "size", None)
        if size is not None and isinstance(t, torch.Tensor) and tuple(size) != tuple(t.shape):
            raise CheckpointError(f"checkpoint {path} does not fit this model: parameter {k} has shape "
                                  f"{tuple(size)} in the checkpoint and {tuple(t.shape)} here; pass "
                                  "--use-checkpoint-args to take the checkpoint's architecture, or the model flags "
                                  "it was trained with")
    absent = [k for k in app_state["model"] if f"model.{k}" not in saved]
    other = [k for k in absent if not k.endswith(FP8_STATE_SUFFIXES)]
    if other:
        raise CheckpointError(f"checkpoint {path} has no {other[:3]}{' ...' if len(other) > 3 else ''} "
                              f"({len(other)} tensors of this model missing): it was saved from another "
                              "architecture; pass --use-checkpoint-args to take its architecture, or the model "
                              "flags it was trained with")
    load_app_state(path, app_state, partial=bool(absent), reader=reader)
    return absent


def load_rank_state(path: str | Path, rank: int | None = None) -> dict[str, Any] | None:
    """This rank's per-rank state; rank 0's when the checkpoint had fewer ranks (resharded resume)."""
    rank = _rank() if rank is None else rank
    path = Path(path)
    f = path / f"rank_{rank:05d}.pt"
    if not f.is_file():
        f = path / "rank_00000.pt"
    if not f.is_file():
        return None
    try:  # tensors and plain types (RNG states, data position); the numpy RNG state of earlier versions
        return _load_weights_only(f, f, allow=_numpy_rng_globals())
    except CheckpointError:
        raise
    except Exception as e:  # a truncated or foreign file: pickle, zip and EOF errors
        raise CheckpointError(f"checkpoint file {f} cannot be read ({_root_text(e)}); "
                              f"{_listing(path.parent, _iteration_of(path))}") from e


def save_model_checkpoint(save_dir: str | Path, model: nn.Module, cfg: TransformerConfig, *, iteration: int = 0,
                          tokenizer_dir: str | Path | None = None, args: dict[str, Any] | None = None) -> Path:
    """A weights-only checkpoint (e.g. an imported model) that `megadlms train --load DIR --finetune` takes."""
    return save_checkpoint(save_dir, iteration, {"model": model.state_dict()},
                           meta={"config": cfg.to_dict(), "args": args or {}, "weights_only": True},
                           tokenizer_dir=tokenizer_dir)


def load_model_from_checkpoint(load_dir: str | Path, *, device: torch.device | str = "cpu", iteration: int | None = None
                               ) -> tuple[TransformerLM, TransformerConfig, dict[str, Any]]:
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
