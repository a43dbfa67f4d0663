"""Where the GPU waits: idle gaps in a torch.profiler Chrome trace, and the host work behind them.

Reads a trace written by `train_throughput.py --trace` (or any torch.profiler trace with CPU and CUDA
activity), finds the intervals in which no kernel, memcpy or memset runs on the GPU, and charges each
gap longer than --min-us to the host operation that launched the GPU work ending it (the innermost CPU
op enclosing that launch, and the outermost, e.g. a compiled region or an autograd node). Blocking
runtime calls (stream/event/device synchronisations, synchronous copies) are listed with their total
time: each one drains the GPU queue, and the GPU then waits for the host to refill it.

    python benchmarks/trace_gaps.py runs/train/trace_qwen3-1.7b_fp8.json.gz
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import defaultdict
from pathlib import Path

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
SYNC_CALLS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"}


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def busy_intervals(gpu: list[dict]) -> list[tuple[float, float, dict]]:
    """GPU events sorted by start, merged where they overlap: (start, end, the first event of the run)."""
    out: list[tuple[float, float, dict]] = []
    for e in sorted(gpu, key=lambda e: e["ts"]):
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        if out and start <= out[-1][1]:
            s, t, first = out[-1]
            out[-1] = (s, max(t, end), first)
        else:
            out.append((start, end, e))
    return out


class HostOps:
    """CPU ops per thread, to find the ops that enclose a point in time."""

    def __init__(self, cpu: list[dict]):
        self.by_tid: dict = defaultdict(list)
        for e in cpu:
            self.by_tid[e.get("tid")].append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"]))
        for ops in self.by_tid.values():
            ops.sort()
        self.starts = {tid: [o[0] for o in ops] for tid, ops in self.by_tid.items()}

    def enclosing(self, tid, t: float) -> list[str]:
        """Names of the ops on thread tid running at time t, outermost first."""
        ops = self.by_tid.get(tid, [])
        i = bisect.bisect_right(self.starts.get(tid, []), t)
        return [name for s, end, name in ops[:i] if end >= t]


def analyse(events: list[dict], min_us: float) -> dict:
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    cpu = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "python_function")]
    if not gpu:
        raise SystemExit("the trace has no GPU events (was it recorded with ProfilerActivity.CUDA on a GPU?)")
    launch_by_corr = {e["args"]["correlation"]: e for e in runtime if "correlation" in e.get("args", {})}
    host = HostOps(cpu)
    runs = busy_intervals(gpu)
    busy = sum(t - s for s, t, _ in runs)
    span = runs[-1][1] - runs[0][0]
    inner: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    outer: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    gaps = []
    for (_, prev_end, _), (start, _, first) in zip(runs, runs[1:]):
        gap = start - prev_end
        if gap < min_us:
            continue
        launch = launch_by_corr.get(first.get("args", {}).get("correlation"))
        names = host.enclosing(launch.get("tid"), float(launch["ts"])) if launch else []
        key_in = names[-1] if names else (launch["name"] if launch else "?")
        key_out = names[0] if names else key_in
        for table, key in ((inner, key_in), (outer, key_out)):
            table[key][0] += gap
            table[key][1] += 1
        # what the launching thread was doing when the queue ran dry: the host work the GPU waited for
        busy_with = host.enclosing(launch.get("tid"), prev_end) if launch else []
        gaps.append((gap, first["name"][:80], key_in, (prev_end - runs[0][0]) / 1e3, " > ".join(busy_with[-3:])))
    syncs: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in runtime:
        if e["name"] in SYNC_CALLS:
            syncs[e["name"]][0] += float(e["dur"])
            syncs[e["name"]][1] += 1
    return {"span_us": span, "busy_us": busy, "gap_us": sum(g[0] for g in gaps), "n_gaps": len(gaps),
            "inner": inner, "outer": outer, "syncs": syncs, "largest": sorted(gaps, reverse=True)[:16]}


def report(r: dict, top: int) -> None:
    print(f"GPU timeline {r['span_us'] / 1e3:.1f} ms: busy {r['busy_us'] / 1e3:.1f} ms, idle "
          f"{(r['span_us'] - r['busy_us']) / 1e3:.1f} ms, of which {r['gap_us'] / 1e3:.1f} ms in {r['n_gaps']} gaps "
          "over the threshold")
    for title, table in (("host op launching the work after the gap (innermost)", r["inner"]),
                         ("... outermost op around that launch", r["outer"])):
        print(f"\n{title}\n{'ms':>9} {'gaps':>6}  op")
        for name, (us, n) in sorted(table.items(), key=lambda kv: -kv[1][0])[:top]:
            print(f"{us / 1e3:9.2f} {n:6d}  {name[:100]}")
    print(f"\nblocking runtime calls\n{'ms':>9} {'calls':>6}  call")
    for name, (us, n) in sorted(r["syncs"].items(), key=lambda kv: -kv[1][0]):
        print(f"{us / 1e3:9.2f} {n:6d}  {name}")
    print("\nlargest gaps (us; ms into the timeline; kernel after the gap <- host op launching it; host ops running "
          "when the GPU went idle)")
    for gap, kernel, op, at_ms, busy_with in r["largest"]:
        print(f"{gap:9.1f} {at_ms:8.1f}  {kernel}  <- {op[:60]}\n{'':19}idle while: {busy_with[:160] or '?'}")


def main() -> None:
    from megadlms.triton_setup import use_torch_ptxas

    use_torch_ptxas()  # as the megadlms commands do: the FP8 Triton kernels compile with torch's ptxas
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace", type=Path, help="Chrome trace (.json or .json.gz)")
    p.add_argument("--min-us", type=float, default=5.0, help="ignore shorter gaps (kernel-to-kernel latency)")
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args()
    report(analyse(load(a.trace), a.min_us), a.top)


if __name__ == "__main__":
    main()
