"""Reading and writing safetensors files: a damaged file is one clear error, a written one readable by others.

safetensors (0.8) writes through a private temporary file, so the result is mode 0600 whatever the umask: an
export that another user (a serving process, a colleague) should read would refuse them. `save_safetensors` gives
the file the mode `open()` would have given it (0666 less the umask). Its reader raises its own `SafetensorError`
on a truncated or foreign file, with no file name: `open_safetensors` and `load_safetensors` name the file.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from .errors import MegaDLMsError

__all__ = ["SafetensorsFileError", "load_safetensors", "open_safetensors", "save_safetensors"]

_LFS_POINTER = b"version https://git-lfs"


class SafetensorsFileError(MegaDLMsError, ValueError):
    """A .safetensors file cannot be read (truncated, damaged, not safetensors); the message names it."""


def _unreadable(path: str | Path, error: Exception) -> SafetensorsFileError:
    try:
        with open(path, "rb") as fh:
            head = fh.read(len(_LFS_POINTER))
    except OSError:  # the file went away or cannot be opened: the reader's own reason says enough
        head = b""
    if head == _LFS_POINTER:
        return SafetensorsFileError(f"{path} is a Git LFS pointer, not the weights: run `git lfs pull` in its "
                                    "repository (or download the file itself)")
    reason = str(error).removeprefix("Error while deserializing header: ")
    return SafetensorsFileError(f"{path} is not a complete safetensors file ({reason}): it is truncated or "
                                "damaged; copy or download it again")


@contextmanager
def open_safetensors(path: str | Path, device: str = "cpu") -> Iterator[Any]:
    """`safetensors.safe_open(path, framework="pt", device=device)`; its errors, on opening or reading a tensor,
    become one `SafetensorsFileError` naming the file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device=device) as f:
            yield f
    except SafetensorError as e:
        raise _unreadable(path, e) from None


def load_safetensors(path: str | Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """`safetensors.torch.load_file(path, device)`, a damaged file named in a `SafetensorsFileError`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device=device)
    except SafetensorError as e:
        raise _unreadable(path, e) from None


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None
                     ) -> None:
    """safetensors.torch.save_file(tensors, path, metadata), then the file's mode set to 0666 less the umask."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """The process's umask, read without changing it where Linux tells it (/proc/self/status)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:  # no procfs: set and restore it (os.umask only sets)
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask
