"""megadlms.cli.fp8_check: the `fp8-check` command on the CPU and on an unsupported GPU."""

from __future__ import annotations

import argparse

import torch

from megadlms.cli import fp8_check as check


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    check.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_cpu_check_reports_error_and_passes(capsys):
    assert check.run(_args("--device", "cpu", "--size", "64", "48", "128")) == 0
    out = capsys.readouterr().out
    assert "device: cpu" in out and "FP8 supported: yes" in out and "OK" in out
    assert "FP8 attention (--fp8-dot-product-attention): emulated on the CPU" in out
    err = float(out.split("torch.float32 out): ")[1].split()[0])
    assert 0.01 < err < check.MAX_REL_ERROR  # a real E4M3 error: neither zero nor broken


def test_unsupported_gpu_exits_1(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Tesla V100-SXM2-32GB")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert check.run(_args("--device", "cuda:0")) == 1
    out = capsys.readouterr().out
    assert "FP8 supported: no" in out and "Tesla V100" in out and "7.0" in out


def test_fp8_attention_line_on_gpus(monkeypatch):
    """Hopper without the cuDNN frontend: FP8 attention is reported unavailable with the install command; an Ada GPU
    (FP8 GEMMs, no cuDNN FP8 attention) is told its capability is too low."""
    import builtins

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    real_import = builtins.__import__

    def no_cudnn(name, *a, **k):
        if name == "cudnn":
            raise ImportError("No module named 'cudnn'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_cudnn)
    line = check.describe_fp8_attention(torch.device("cuda", 0))
    assert line.startswith("FP8 attention (--fp8-dot-product-attention): no") and "nvidia-cudnn-frontend" in line
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 9))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA L40S")
    line = check.describe_fp8_attention(torch.device("cuda", 0))
    assert "compute capability >= 9.0" in line and "L40S" in line and "8.9" in line


def test_recipes_line_names_what_each_gpu_runs(monkeypatch, capsys):
    """CPU: every recipe (the finer-scaled GEMMs emulated); Hopper: all but mxfp8, whose line names the recipes that
    run there; Blackwell: all but blockwise."""
    from megadlms.fp8.formats.blockwise import check_blockwise_gemm_support
    from megadlms.fp8.formats.mx import check_mx_gemm_support

    assert check.describe_recipes(torch.device("cpu")).startswith(
        "FP8 recipes (--fp8-recipe): delayed, tensorwise, rowwise, blockwise, mxfp8 (blockwise and mxfp8 GEMMs "
        "emulated on the CPU")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    for capability, runs, missing in (((9, 0), "delayed, tensorwise, rowwise, blockwise", "mxfp8"),
                                      ((10, 0), "delayed, tensorwise, rowwise, mxfp8", "blockwise")):
        check_blockwise_gemm_support.cache_clear()
        check_mx_gemm_support.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None, c=capability: c)
        lines = check.describe_recipes(torch.device("cuda", 0)).splitlines()
        assert lines[0] == f"FP8 recipes (--fp8-recipe): {runs}" and len(lines) == 2
        assert lines[1].startswith(f"  {missing}: no (--fp8-recipe {missing} ")
    assert "use --fp8-recipe delayed, tensorwise, rowwise or mxfp8" in lines[1]  # blockwise on Blackwell
    check_blockwise_gemm_support.cache_clear()
    check_mx_gemm_support.cache_clear()
