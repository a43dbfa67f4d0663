"""Independent references for the FP8 tests: quantization through `ml_dtypes` (not torch's casts)
and float64 GEMMs."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

ML = {torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn, torch.float8_e5m2: ml_dtypes.float8_e5m2}
FMAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def ref_scale(amax: np.ndarray, fp8_dtype: torch.dtype, margin: int = 0) -> np.ndarray:
    """(fp8_max / amax) / 2**margin in float32; 1.0 where amax is 0 (as for a fresh all-zero tensor)."""
    amax = np.asarray(amax, dtype=np.float32)
    with np.errstate(divide="ignore"):
        s = (np.float32(FMAX[fp8_dtype]) / amax) / np.float32(2.0 ** margin)
    return np.where(amax > 0, s, np.float32(1.0)).astype(np.float32)


def ref_quantize(x: np.ndarray, scale: np.ndarray, fp8_dtype: torch.dtype) -> np.ndarray:
    """clip(x * scale) cast with ml_dtypes (round to nearest even); returns the fp8 values as float64."""
    fmax = np.float32(FMAX[fp8_dtype])
    y = np.clip(np.asarray(x, np.float32) * np.asarray(scale, np.float32), -fmax, fmax)
    return y.astype(ML[fp8_dtype]).astype(np.float64)


def ref_fake_quant(x: torch.Tensor, fp8_dtype: torch.dtype, axis: int | None = None) -> np.ndarray:
    """Current-scaling quantize-dequantize of a 2-D tensor in float64: per tensor (axis None), one scale
    per row (axis=1: amax over each row) or per column (axis=0)."""
    xn = x.detach().float().numpy()
    amax = np.abs(xn).max() if axis is None else np.abs(xn).max(axis=axis, keepdims=True)
    scale = ref_scale(amax, fp8_dtype)
    scale_inv = (np.float32(1.0) / scale).astype(np.float32)
    return ref_quantize(xn, scale, fp8_dtype) * scale_inv.astype(np.float64)


def rel(a: torch.Tensor | np.ndarray, ref: torch.Tensor | np.ndarray) -> float:
    a = torch.as_tensor(a).detach().double()
    ref = torch.as_tensor(ref).detach().double()
    return float((a - ref).norm() / ref.norm())


def amax_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank of the amax-reduction test: 4 FP8 layers see rank-dependent data, then fp8_step
    reduces their amaxes over gloo. Saves the local amaxes before and the state after."""
    import os

    import torch.distributed as dist

    from megadlms.fp8 import DelayedScaling, Float8Linear, fp8_autocast, fp8_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)  # same weights on every rank
        model = torch.nn.Sequential(*[Float8Linear(32, 32, recipe=DelayedScaling(amax_history_len=2))
                                      for _ in range(4)])
        torch.manual_seed(100 + rank)  # different data per rank
        x = torch.randn(9, 32, requires_grad=True) * (1 + 3 * rank)
        with fp8_autocast():
            y = model(x)
        (y * torch.randn_like(y) * (4 - 3 * rank)).sum().backward()
        amax = torch.cat([m.fp8_amax_history[0].clone() for m in model])
        torch.save({"amax": amax}, os.path.join(out_dir, f"before_{rank}.pt"))
        calls = []
        real = dist.all_reduce
        dist.all_reduce = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
        try:
            fp8_step(model)
        finally:
            dist.all_reduce = real
        torch.save({"history1": torch.cat([m.fp8_amax_history[1] for m in model]),
                    "scale": torch.cat([m.fp8_scale for m in model]), "collectives": len(calls)},
                   os.path.join(out_dir, f"after_{rank}.pt"))
        dist.barrier()  # no rank tears gloo down while a peer still talks to it
    finally:
        dist.destroy_process_group()


def sgd_step(model: torch.nn.Module, tokens: torch.Tensor, lr: float = 1e-2) -> tuple[torch.Tensor, dict]:
    """One plain SGD step on the mean log-partition of the logits, then `fp8_step`: (logits, gradients by name)."""
    from megadlms.fp8 import fp8_step

    logits = model(tokens)
    logits.float().logsumexp(-1).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
                p.grad = None
    fp8_step(model)
    return logits.detach(), grads
