"""benchmarks/trace_gaps.py on a small hand-made Chrome trace (the format torch.profiler writes)."""

import gzip
import json
import runpy
from pathlib import Path

TOOL = runpy.run_path(str(Path(__file__).resolve().parents[1] / "benchmarks" / "trace_gaps.py"))


def _x(name, cat, ts, dur, tid=1, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 0, "tid": tid, "args": args}


def test_gaps_are_charged_to_the_launching_host_op_and_syncs_are_listed(tmp_path, capsys):
    events = [
        # host: a compiled region launching kernel 1; a sync; then an FP8 layer launching kernel 2 late
        _x("CompiledFunction", "cpu_op", 0, 100),
        _x("aten::mm", "cpu_op", 10, 5),
        _x("cudaLaunchKernel", "cuda_runtime", 11, 2, correlation=1),
        _x("cudaStreamSynchronize", "cuda_runtime", 120, 80),
        _x("Float8LinearFn", "cpu_op", 300, 200),
        _x("cast_transpose_kernel", "cpu_op", 350, 20),
        _x("cudaLaunchKernel", "cuda_runtime", 360, 3, correlation=2),
        _x("cudaLaunchKernel", "cuda_runtime", 365, 3, correlation=3),
        # GPU: kernel 1 at 20-50, overlapping memcpy 40-60, a gap to 400, kernels 2 and 3 back to back
        _x("gemm_1", "kernel", 20, 30, tid=7, correlation=1),
        _x("Memcpy DtoH", "gpu_memcpy", 40, 20, tid=8),
        _x("cast_kernel", "kernel", 400, 10, tid=7, correlation=2),
        _x("gemm_2", "kernel", 410, 40, tid=7, correlation=3),
        {"ph": "i", "name": "marker", "ts": 5},  # not a complete event: ignored
    ]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    r = TOOL["analyse"](TOOL["load"](path), min_us=5)
    assert r["span_us"] == 430 and r["busy_us"] == 40 + 50 and r["n_gaps"] == 1 and r["gap_us"] == 340
    assert dict(r["inner"]) == {"cast_transpose_kernel": [340.0, 1]}
    assert dict(r["outer"]) == {"Float8LinearFn": [340.0, 1]}
    assert dict(r["syncs"]) == {"cudaStreamSynchronize": [80.0, 1]}
    # the gap opens 0.04 ms into the timeline, while the launching thread is still inside the compiled region
    assert r["largest"] == [(340.0, "cast_kernel", "cast_transpose_kernel", 0.04, "CompiledFunction")]
    TOOL["report"](r, top=5)
    out = capsys.readouterr().out
    assert "busy 0.1 ms, idle 0.3 ms" in out and "0.34      1  cast_transpose_kernel" in out
    assert "idle while: CompiledFunction" in out
