"""Why the GPU waits in a training step, BF16 beside FP8: for each run, the step time, the GPU's busy time (the
union of its kernels in one profiled step, CUDA activity only, so the host is not slowed by recording its ops), the
idle rest, and the host-side causes that can leave the GPU idle, counted over the timed steps:

    syncs        synchronising calls per step (torch.cuda.set_sync_debug_mode: .item(), host reads, ...)
    retries      the caching allocator's retries per step: a cudaMalloc failed, every cached block was freed
                 (synchronising the device) and the allocation tried again - a near-full card
    mallocs      cudaMalloc / cudaFree calls per step (none once the cache is warm)

Idle time without syncs, retries or mallocs is the host launching too slowly (Python and launch overhead per
kernel): compiling the layers or replaying them from CUDA graphs removes it.

Workloads:
    recompute           the trainer as `megadlms train` builds it: LLaDA-8B with --layers layers, micro-batch 1,
                        full activation recompute, on a synthetic corpus (layers compiled, no CUDA graphs)
    recompute-graphs    the same with --cuda-graphs on (the recomputation captured in the backward graph)
    lora                rank-64 LoRA on all linears of LLaDA-8B, base in BF16 or FP8: the eager step of
                        benchmarks/lora_memory.py
    lora-compiled       the same with each layer compiled
    lora-graphs         the same with the layers compiled and replayed from CUDA graphs, as the trainer runs LoRA
                        on one GPU by default
Each run is its own process (fresh memory); --alloc-conf repeats every run with PYTORCH_CUDA_ALLOC_CONF set (e.g.
expandable segments, against fragmentation).

    python benchmarks/host_gaps.py                                   # every workload, bf16 and fp8
    python benchmarks/host_gaps.py --workloads recompute --alloc-conf expandable_segments:True
    python benchmarks/host_gaps.py --smoke                           # tiny shapes on the CPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

WORKLOADS = ("recompute", "recompute-graphs", "lora", "lora-compiled", "lora-graphs")
PRECISIONS = ("bf16", "fp8")
MEMORY_COUNTERS = {"retries": "num_alloc_retries", "mallocs": "num_device_alloc", "frees": "num_device_free"}


def gpu_busy_ms(trace: Path) -> float:
    """The time at least one kernel, memcpy or memset ran in a torch.profiler Chrome trace, in ms (the union of
    their intervals, as benchmarks/trace_gaps.py finds them)."""
    from trace_gaps import GPU_CATS, busy_intervals, load

    return sum(end - start for start, end, _ in busy_intervals([e for e in load(trace) if e.get("cat") in GPU_CATS])
               ) / 1e3


def trainer_step(spec: dict):
    """(the trainer's step, returning its loss tensor; the count of its layers' graph replays) for the `recompute`
    workloads."""
    from benchmarks.train_throughput import build_trainer

    flags = ["--model-path", spec["preset"], "--recompute-granularity", "full"]
    flags += ["--cuda-graphs", "on"] if spec["workload"] == "recompute-graphs" else []
    flags += ["--fp8-format", "hybrid"] if spec["precision"] == "fp8" else []
    flags += ["--num-layers", str(spec["layers"])] if spec["layers"] else []
    trainer = build_trainer(flags, spec["seq"], spec["batch"], 1, spec["data"], spec["device"], spec["extra"])
    graphs = trainer.layer_graphs
    return (lambda: trainer.train_step()["loss"]), (lambda: graphs.num_replays if graphs is not None else 0)


def lora_step(spec: dict):
    """(one LoRA training step of benchmarks/lora_memory.py, random base weights, base in spec's precision; the count
    of its layers' graph replays)."""
    import torch
    import torch.nn.functional as F

    from megadlms.build import construct_model
    from megadlms.distributed.parallelize import apply_compile
    from megadlms.lora import LoraConfig, apply_lora
    from megadlms.presets import load_model_config
    from megadlms.training.cuda_graphs import LayerGraphs
    from megadlms.training.optim import build_optimizer

    device = torch.device(spec["device"])
    seq = spec["seq"]
    overrides = {"seq_length": seq, "max_position_embeddings": max(seq, 64)}
    if spec["layers"]:
        overrides["num_layers"] = spec["layers"]
    cfg = load_model_config(spec["preset"], tokenizer_vocab_size=32000, **overrides)
    torch.manual_seed(0)
    model = apply_lora(construct_model(cfg, device=device),
                       LoraConfig(rank=spec["rank"], alpha=2 * spec["rank"], base=spec["precision"]))
    if spec["workload"] == "lora-compiled" or (spec["workload"] == "lora-graphs" and device.type == "cuda"):
        apply_compile(model)
    graphs = None
    if spec["workload"] == "lora-graphs":  # emulated on the CPU; captured after the first step, as the trainer does
        graphs = LayerGraphs(model, emulate=device.type != "cuda", strict=True)
    opt = build_optimizer(model, lr=1e-4, weight_decay=0.0, betas=(0.9, 0.95))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (spec["batch"], seq), device=device)

    def step():
        with autocast:
            hidden = model(ids, output_hidden=True)
        loss = torch.zeros((), device=device)
        for h, t in zip(hidden.reshape(-1, cfg.hidden_size).split(1024), ids.reshape(-1).split(1024)):
            with autocast:
                logits = model.logits(h)
            loss = loss + F.cross_entropy(logits.float(), t, reduction="sum")
        loss = loss / ids.numel()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if graphs is not None:
            graphs.arm()
        return loss.detach()

    return step, lambda: graphs.num_replays if graphs is not None else 0


def count_syncs(step) -> int:
    """The synchronising calls of one step (CUDA's sync debug mode)."""
    from host_sync_probe import sync_calls

    return sum(sync_calls(step).values())


def worker(spec: dict) -> dict:
    """One run: warm-up, timed steps (with the allocator's counters), one sync-counted step, one profiled step."""
    import math

    import torch
    from torch.profiler import ProfilerActivity, profile

    step, replays = (trainer_step if spec["workload"].startswith("recompute") else lora_step)(spec)
    cuda = spec["device"] == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(spec["warmup"]):
        step()
    sync()
    stats0 = torch.cuda.memory_stats() if cuda else {}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    losses = [step() for _ in range(spec["steps"])]
    sync()
    ms = (time.perf_counter() - t0) / spec["steps"] * 1e3
    values = torch.stack(losses).float().tolist()
    if not all(math.isfinite(v) for v in values):
        raise SystemExit(f"{spec['name']}: non-finite loss in the timed steps {values}")
    stats1 = torch.cuda.memory_stats() if cuda else {}
    res = {"name": spec["name"], "ms_per_step": ms, "loss": sum(values) / len(values),
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
           "reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else float("nan"),
           **{k: (stats1.get(v, 0) - stats0.get(v, 0)) / spec["steps"] for k, v in MEMORY_COUNTERS.items()}}
    res["syncs"] = count_syncs(step) if cuda else float("nan")
    sync()
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        step()
        sync()
        wall = (time.perf_counter() - t0) * 1e3
    res["profiled_ms"] = wall
    res["replays"] = replays()
    res["busy_ms"] = res["idle_ms"] = float("nan")
    if cuda:
        with tempfile.TemporaryDirectory() as tmp:
            trace = Path(tmp) / "step.json"
            prof.export_chrome_trace(str(trace))
            res["busy_ms"] = gpu_busy_ms(trace)
        res["idle_ms"] = wall - res["busy_ms"]
    return res


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated: {', '.join(WORKLOADS)}")
    p.add_argument("--precisions", default=",".join(PRECISIONS))
    p.add_argument("--preset", default="llada-8b")
    p.add_argument("--layers", type=int, default=16, help="the recompute workload's layers (0: the preset's)")
    p.add_argument("--lora-layers", type=int, default=0, help="the LoRA workloads' layers (0: the preset's)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--alloc-conf", default=None, help="PYTORCH_CUDA_ALLOC_CONF for a second pass of every run")
    p.add_argument("--extra", default="", help="more `megadlms train` flags for the recompute workload")
    p.add_argument("--timeout", type=int, default=400, help="seconds per run")
    p.add_argument("--smoke", action="store_true", help="the tiny preset on the CPU, in this process")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    bad = sorted(set(a.workloads.split(",")) - set(WORKLOADS)) + sorted(set(a.precisions.split(",")) - set(PRECISIONS))
    if bad:
        p.error(f"unknown workload or precision {bad}; workloads: {', '.join(WORKLOADS)}; precisions: "
                f"{', '.join(PRECISIONS)}")
    return a


def run(spec: dict, alloc_conf: str | None, timeout: int) -> dict:
    """`worker(spec)` in a fresh process (PYTORCH_CUDA_ALLOC_CONF=alloc_conf when given); its result or its error."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    if alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    try:
        p = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"name": spec["name"], "error": f"timed out after {timeout} s"}
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"name": spec["name"], "error": f"rc={p.returncode}: {tail[0][:200]}"}
    return json.loads(line[len("RESULT "):])


def main() -> None:
    from megadlms.triton_setup import use_torch_ptxas

    use_torch_ptxas()  # as the megadlms commands do: the FP8 Triton kernels compile with torch's ptxas
    a = parse_args()
    if a.worker:
        print("RESULT " + json.dumps(worker(json.loads(a.worker))), flush=True)
        return
    if a.smoke:
        a.preset, a.layers, a.lora_layers, a.seq, a.rank, a.warmup, a.steps = "tiny", 2, 2, 64, 4, 1, 1
    device = "cpu" if a.smoke else "cuda"
    print(f"host gaps | {a.preset} | seq {a.seq} x micro-batch {a.batch} | {device}")
    print(f"{'run':34s} {'ms/step':>8s} {'busy ms':>8s} {'idle ms':>8s} {'syncs':>6s} {'retries':>8s} "
          f"{'mallocs':>8s} {'frees':>6s} {'peak GiB':>9s} {'rsv GiB':>8s} {'replays':>8s}")
    from benchmarks.train_throughput import write_corpus

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "synthetic_text_document"
        write_corpus(data, 128000, (a.warmup + a.steps + 4) * a.batch * (a.seq + 1) * 2)
        for conf in [None] + ([a.alloc_conf] if a.alloc_conf else []):
            for w in a.workloads.split(","):
                for prec in a.precisions.split(","):
                    name = f"{w}/{prec}" + (f" [{conf}]" if conf else "")
                    extra = a.extra.split() + (["--bf16", "--num-workers", "0", "--hidden-size", "32",
                                                "--ffn-hidden-size", "64", "--num-attention-heads", "2",
                                                "--num-query-groups", "1", "--kv-channels", "16"] if a.smoke else [])
                    spec = {"name": name, "workload": w, "precision": prec, "preset": a.preset, "seq": a.seq,
                            "batch": a.batch, "rank": a.rank, "warmup": a.warmup, "steps": a.steps,
                            "layers": a.layers if w.startswith("recompute") else a.lora_layers, "data": str(data),
                            "extra": extra, "device": device}
                    r = worker(spec) if a.smoke else run(spec, conf, a.timeout)
                    if "error" in r:
                        print(f"{name:34s} ERROR {r['error']}", flush=True)
                        continue
                    print(f"{name:34s} {r['ms_per_step']:8.1f} {r['busy_ms']:8.1f} {r['idle_ms']:8.1f} "
                          f"{r['syncs']:6.0f} {r['retries']:8.1f} {r['mallocs']:8.1f} {r['frees']:6.1f} "
                          f"{r['peak_gib']:9.2f} {r['reserved_gib']:8.2f} {r['replays']:8d}", flush=True)
    print("busy: the union of one profiled step's kernels; idle: that step's wall time less busy; syncs: in one "
          "step; retries, mallocs, frees: per timed step; replays: of the layers' CUDA graphs, over the run")


if __name__ == "__main__":
    main()
