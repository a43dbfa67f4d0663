"""Median milliseconds of a callable, as the benchmark scripts time their kernels (imported by the scripts in
this folder: CUDA events on a GPU, the wall clock elsewhere)."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def median_ms(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 3) -> float:
    """Median milliseconds of fn() over `iters` runs after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
