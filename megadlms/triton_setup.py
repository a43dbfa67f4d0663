"""How this process's Triton kernels compile: with torch's own ptxas, opt-in (`use_torch_ptxas`).

The `megadlms` commands call `use_torch_ptxas` at start; a program that runs the FP8 layers (or the Triton AdamW)
on a GPU calls it before their first use. The library itself never sets the environment.
"""

from __future__ import annotations

import importlib.util
import os

__all__ = ["torch_ptxas", "use_torch_ptxas"]


def _torch_dir() -> str | None:
    """torch's package folder, found without importing torch (the commands call this before they import it)."""
    spec = importlib.util.find_spec("torch")
    return os.path.dirname(spec.origin) if spec is not None and spec.origin else None


def torch_ptxas() -> str | None:
    """The ptxas that ships with torch (CUDA builds), or None."""
    folder = _torch_dir()
    path = os.path.join(folder, "bin", "ptxas") if folder else None
    return path if path and os.path.isfile(path) and os.access(path, os.X_OK) else None


def use_torch_ptxas() -> None:
    """Compile this process's Triton kernels with torch's own ptxas, as torch.compile does, unless one is chosen
    already (TRITON_PTXAS_PATH): sets TRITON_PTXAS_PATH to it (nothing where torch ships none, e.g. CPU builds).

    The ptxas Triton 3.6 bundles for Hopper (CUDA 12.8) miscompiles kernels that store an FP8 tile and its
    transpose (`benchmarks/fp8_store_check.py`); torch.compile points TRITON_PTXAS_PATH at torch's ptxas when it
    first compiles a kernel, so without a choice made up front the ptxas of the FP8 kernels depends on whether
    inductor compiled something before them. Their first-call checks guard either way (a kernel that disagrees
    gives way to the torch path); with torch's ptxas the fast formulations are the ones that pass."""
    if os.environ.get("TRITON_PTXAS_PATH"):
        return
    path = torch_ptxas()
    if path is not None:
        os.environ["TRITON_PTXAS_PATH"] = path
