"""Which devices run FP8: CUDA GPUs of compute capability >= 8.9, and the CPU (reference path)."""

from __future__ import annotations

import torch

from ..errors import MegaDLMsError

SUPPORTED_FAMILIES = "Ada Lovelace (8.9), Hopper (9.0), Blackwell (10.x / 12.x)"


class FP8UnsupportedError(MegaDLMsError, RuntimeError):
    """The device cannot run the FP8 GEMMs; the message names the device and what to do."""


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def check_fp8_support(device: torch.device | str | int) -> None:
    """Raise FP8UnsupportedError unless FP8 GEMMs can run on `device`.

    CUDA: needs compute capability >= 8.9 (FP8 tensor cores). CPU: supported, the FP8 GEMMs run as
    dequantization + fp32 matmul (`gemm.cpu_scaled_mm`, checked against `torch._scaled_mm`; for tests and debugging).
    """
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if dev.type == "cpu" or dev.type == "meta":
        return
    if dev.type != "cuda":
        raise FP8UnsupportedError(f"FP8 is not supported on device type {dev.type!r}; use a CUDA GPU of compute "
                                  f"capability >= 8.9 ({SUPPORTED_FAMILIES}), the CPU, or turn FP8 off")
    if getattr(torch.version, "hip", None):
        raise FP8UnsupportedError("FP8 on ROCm is not supported by this FP8 engine (it uses the OCP "
                                  "float8_e4m3fn / float8_e5m2 formats and cuBLASLt); turn FP8 off")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(index)
        raise FP8UnsupportedError(
            f"FP8 needs a GPU of compute capability >= 8.9, but cuda:{index} is {name} with compute capability "
            f"{major}.{minor}. Supported families: {SUPPORTED_FAMILIES}. Train in BF16 instead (drop --fp8-format "
            "/ set fp8=False) or use a supported GPU.")


def fp8_backend_note(device: torch.device | str) -> str | None:
    """A one-line note for the training log about how FP8 runs on `device`, or None when there is nothing to say."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return ("FP8 on CPU: the FP8 GEMMs run as dequantization + fp32 matmul (the arithmetic of torch._scaled_mm, "
                "checked against it on first use); use it for tests and debugging")
    return None
