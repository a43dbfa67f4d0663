"""Writing a safetensors file readable as the process's other files are.

safetensors (0.8) writes through a private temporary file, so the result is mode 0600 whatever the umask: an
export that another user (a serving process, a colleague) should read would refuse them. `save_safetensors` gives
the file the mode `open()` would have given it (0666 less the umask).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

__all__ = ["save_safetensors"]


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
