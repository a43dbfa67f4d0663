"""megadlms.fp8.hardware: which devices run FP8, and the error for those that do not."""

from __future__ import annotations

import pytest
import torch

from megadlms.fp8 import FP8UnsupportedError, check_fp8_support, fp8_backend_note


def _fake_gpu(monkeypatch, capability, name):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_old_gpu_error_names_gpu_capability_and_families(monkeypatch):
    _fake_gpu(monkeypatch, (8, 0), "NVIDIA A100-SXM4-80GB")
    with pytest.raises(FP8UnsupportedError) as e:
        check_fp8_support("cuda:0")
    msg = str(e.value)
    for part in ("NVIDIA A100-SXM4-80GB", "8.0", ">= 8.9", "Ada", "Hopper (9.0)", "Blackwell (10.x / 12.x)", "BF16"):
        assert part in msg


@pytest.mark.parametrize("capability", [(8, 9), (9, 0), (10, 0), (12, 0)])
def test_supported_gpus(monkeypatch, capability):
    _fake_gpu(monkeypatch, capability, "GPU")
    check_fp8_support(torch.device("cuda", 0))


def test_cpu_and_other_devices():
    check_fp8_support("cpu")
    assert "CPU" in fp8_backend_note("cpu") and fp8_backend_note("cuda:0") is None
    with pytest.raises(FP8UnsupportedError, match="'mps'"):
        check_fp8_support("mps")
