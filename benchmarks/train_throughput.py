"""Training throughput of the real trainer (`megadlms.training.trainer.setup` with command-line args):
the DLM loss, AdamW, LR schedule and the Megatron-format data loader, BF16 vs FP8, one GPU.

Each configuration runs in its own process (fresh memory, one failure does not stop the rest):
warm-up steps (compilation), then timed `train_step()`s between device synchronisations.
Prints tokens/s, model TFLOP/s (6*N_matmul + 12*L*S*H_attn per token), MFU against the dense
BF16 peak (989 TFLOP/s on H100/H200; FP8 runs report the BF16-equivalent figure) and the peak
memory of the timed steps. `--hf-peer` also runs benchmarks/hf_peer.py (the Hugging Face
transformers baseline) in the same command and prints our speed-ups over it.

The data is a synthetic Megatron corpus (.bin/.idx of random token ids) written to a temporary
folder, with the ordinary ids of the bundled tokenizer (the one the trainer loads; never its special
ids: a mask id among the targets makes the loss non-finite and the step is skipped). Every timed step
must have a finite loss and a taken optimizer step, or the configuration fails. Varying-length batches
are off (--difflm-varilen-prob 0) so that every timed step has the same shape.

    python benchmarks/train_throughput.py --hf-peer        # on a GPU: the full table
    python benchmarks/train_throughput.py --smoke          # the tiny preset on the CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> (flags for `megadlms train`, description)
CONFIGS: dict[str, list[str]] = {
    "qwen3-1.7b/bf16": ["--model-path", "qwen3-1.7b"],
    "qwen3-1.7b/fp8": ["--model-path", "qwen3-1.7b", "--fp8-format", "hybrid"],
    "llama3-8b-8L/bf16": ["--model-path", "llama3-8b", "--num-layers", "8"],
    "llama3-8b-8L/fp8": ["--model-path", "llama3-8b", "--num-layers", "8", "--fp8-format", "hybrid"],
    # more of the 8B model's layers, so that the BF16 embedding and 128k-vocabulary LM head (half of the 8-layer
    # model's parameters) weigh less: closer to the real 8B's mix of FP8 and BF16 work
    "llama3-8b-16L/bf16": ["--model-path", "llama3-8b", "--num-layers", "16"],
    "llama3-8b-16L/fp8": ["--model-path", "llama3-8b", "--num-layers", "16", "--fp8-format", "hybrid"],
    # LLaDA-MoE-7B-A1B cut to 4 of its 16 layers (all MoE: 64 experts, top-8), so that the fp32 weights, gradients
    # and AdamW states (2.3B parameters) fit one 80 GB GPU with the activations; MFU counts the active parameters;
    # FP8 under current scaling, which the expert GEMMs take (delayed scaling is refused for experts)
    "llada-moe-7b-a1b-4L/bf16": ["--model-path", "llada-moe-7b-a1b", "--num-layers", "4", "--moe-layer-freq", "1"],
    "llada-moe-7b-a1b-4L/fp8": ["--model-path", "llada-moe-7b-a1b", "--num-layers", "4", "--moe-layer-freq", "1",
                                "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "tiny/bf16": ["--model-path", "tiny"],
    "tiny/fp8": ["--model-path", "tiny", "--fp8-format", "hybrid"],
}


# "<config>+<variant>": the configuration with these flags added
VARIANTS: dict[str, list[str]] = {"": [], "nographs": ["--cuda-graphs", "off"], "nomlpfuse": ["--no-fp8-fuse-mlp"],
                                  "fp8attn": ["--fp8-dot-product-attention"],
                                  "tensorwise": ["--fp8-recipe", "tensorwise"],
                                  "rowwise": ["--fp8-recipe", "rowwise"],
                                  "blockwise": ["--fp8-recipe", "blockwise", "--fp8-format", "e4m3"],
                                  "mxfp8": ["--fp8-recipe", "mxfp8", "--fp8-format", "e4m3"]}


def config_of(flags: list[str], seq: int):
    """The `TransformerConfig` a configuration's flags build (for its memory estimate)."""
    from megadlms.presets import load_model_config
    from megadlms.training.config import _layer_freq

    opts = dict(zip(flags[::2], flags[1::2]))
    over: dict = {"num_layers": int(opts["--num-layers"])} if "--num-layers" in opts else {}
    if "--moe-layer-freq" in opts:  # a cut MoE model names its layers' pattern anew
        over["moe_layer_freq"] = _layer_freq(opts["--moe-layer-freq"])
    return load_model_config(opts["--model-path"], seq_length=seq, **over)


def micro_batch_for(name: str, flags: list[str], a: argparse.Namespace, free: float | None,
                    caps: dict[str, int]) -> int:
    """--batch, or less where the memory estimate says it does not fit the free memory, or where a run of the same
    model ran out of memory at more (BF16 and FP8 of one model run the same micro-batch where both fit)."""
    from memory_fit import fitting_micro_batch

    model = name.split("/")[0]
    want = min(a.batch, caps.get(model, a.batch))
    if model not in caps:  # one estimate per model, BF16 and FP8 alike (FP8's caches are a small share)
        caps[model] = fitting_micro_batch(config_of(flags, a.seq), a.seq, want, free, fp8=True)
    return min(want, caps[model])


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="qwen3-1.7b/bf16,qwen3-1.7b/fp8,llama3-8b-8L/bf16,llama3-8b-8L/fp8")
    p.add_argument("--batch", type=int, default=4,
                   help="micro-batch size (sequences); on a GPU, less where the memory estimate or an out-of-memory "
                        "run says it does not fit (benchmarks/memory_fit.py)")
    p.add_argument("--accum", type=int, default=1,
                   help="micro-batches per optimizer step (gradient accumulation): the optimizer step and gradient "
                        "clipping are paid once per this many micro-batches, as in pre-training at a real global "
                        "batch size")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--extra", default="", help="more `megadlms train` flags for every configuration")
    p.add_argument("--hf-peer", action="store_true", help="also run benchmarks/hf_peer.py (same batch and seq)")
    p.add_argument("--hf-peer-steps", type=int, default=6)
    p.add_argument("--smoke", action="store_true", help="tiny preset on the CPU, 2 steps")
    p.add_argument("--timeout", type=int, default=400, help="seconds per configuration")
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for logs and the JSON results")
    p.add_argument("--profile", action="store_true",
                   help="after the timed steps, profile 2 steps and print GPU time per kernel class")
    p.add_argument("--top-kernels", type=int, default=0,
                   help="with --profile: also print the N longest kernels per step of each configuration")
    p.add_argument("--trace", action="store_true",
                   help="write a gzipped Chrome trace (host + GPU) of one step per configuration to --out")
    p.add_argument("--memory-sites", type=int, default=0,
                   help="record allocations during the warm-up (it captures the CUDA graphs) and print the N source "
                        "lines holding most of the graph pool at its peak")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.smoke:
        # a narrow model on one short sequence per micro-batch: the CPU's FP8 GEMM (torch._scaled_mm) is slow, and
        # its time grows with every dimension
        a.configs, a.batch, a.seq, a.warmup, a.steps = "tiny/bf16,tiny/fp8", 1, 32, 1, 2
        a.extra = ("--hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 2 --num-query-groups 1 "
                   f"--kv-channels 16 {a.extra}").strip()
    return a


def special_ids(tok) -> set[int]:
    """The tokenizer's special ids: EOD, mask and pad as resolved, and every added token marked special."""
    ids = {i for i in (tok.eod_id, tok.mask_id, tok.pad_id) if i is not None}
    added = getattr(tok.backend, "get_added_tokens_decoder", dict)()
    return ids | {int(i) for i, t in added.items() if getattr(t, "special", False)}


def ordinary_ids(vocab: int):
    """int32 [n]: the bundled tokenizer's ids below `vocab` that are not special (what a synthetic document may
    hold: a mask id among the targets makes the loss non-finite, a pad or EOD id changes the batch's documents)."""
    import numpy as np

    from megadlms.data import load_tokenizer

    tok = load_tokenizer()  # the bundled tokenizer, as the trainer loads it: ids must lie in its vocabulary
    ids = np.arange(min(vocab, tok.vocab_size), dtype=np.int32)
    return ids[~np.isin(ids, sorted(special_ids(tok)))]


def write_corpus(prefix: Path, vocab: int, n_tokens: int, seed: int = 0) -> None:
    """A Megatron indexed dataset of random documents (100..6000 ordinary token ids below `vocab`, then the EOD
    token)."""
    import numpy as np

    from megadlms.data import IndexedDatasetBuilder, load_tokenizer

    eod, pool = load_tokenizer().eod_id, ordinary_ids(vocab)
    rng = np.random.default_rng(seed)
    with IndexedDatasetBuilder(prefix, np.int32) as b:
        done = 0
        while done < n_tokens:
            n = int(rng.integers(100, 6000))
            doc = np.append(rng.choice(pool, n), np.int32(eod)).astype(np.int32)
            b.add_document(doc)
            done += n + 1


def check_timed_steps(name: str, losses: list[float], skipped: int) -> None:
    """Exit with one line unless every timed step had a finite loss and took its optimizer step: the timings of
    skipped steps (no optimizer update) are not those of training."""
    bad = [i for i, v in enumerate(losses) if not math.isfinite(v)]
    if bad or skipped:
        raise SystemExit(f"{name}: {skipped} of {len(losses)} timed steps skipped, non-finite loss at steps {bad} "
                         f"(losses {[round(v, 3) for v in losses]}): the data or the configuration gives non-finite "
                         "losses; a timing of skipped steps is not a training step's")


def build_trainer(flags: list[str], seq: int, batch: int, accum: int, data: str | Path, device: str | None = None,
                  extra: list[str] | None = None):
    """The trainer `megadlms train` builds from `flags` (model, precision) on the corpus `data`, with the schedule,
    evaluation and logging out of the way of timing, ready for `train_step()`."""
    from megadlms.training.args import parse_train_args
    from megadlms.training.trainer import setup

    argv = flags + ["--seq-length", str(seq), "--micro-batch-size", str(batch), "--global-batch-size",
                    str(batch * accum), "--data-path", str(data), "--train-iters", "100000", "--lr", "1e-4",
                    "--lr-warmup-iters", "10", "--eval-iters", "0", "--eval-interval", "0",
                    "--log-interval", "100000", "--difflm-varilen-prob", "0", "--no-progress"]
    if device:
        argv += ["--device", device]
    trainer = setup(parse_train_args(argv + (extra or [])))
    trainer.model.train()
    trainer._train_iter = iter(trainer.loaders.train)
    return trainer


def worker(spec: dict) -> None:
    """One configuration: setup() from flags, warm-up, timed steps; prints one RESULT line."""
    import torch

    t0 = time.perf_counter()
    trainer = build_trainer(spec["flags"], spec["seq"], spec["batch"], spec.get("accum", 1), spec["data"],
                            spec.get("device"), spec.get("extra", []))
    cuda = trainer.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    setup_s = time.perf_counter() - t0
    if cuda and spec.get("memory_sites"):
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=1_000_000)
    t0 = time.perf_counter()
    for _ in range(spec["warmup"]):
        trainer.train_step()
    sync()
    warmup_s = time.perf_counter() - t0
    sites = None
    if cuda and spec.get("memory_sites"):
        sites = graph_pool_peak_sites(torch.cuda.memory._snapshot(), spec["memory_sites"])
        torch.cuda.memory._record_memory_history(enabled=None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    tokens, losses = 0, []
    # where a step's time goes beyond its kernels: the GPU time between step boundaries (events, no sync), the
    # host time of each train_step call, and Python's garbage collector
    events = [torch.cuda.Event(enable_timing=True) for _ in range(spec["steps"] + 1)] if cuda else []
    host_ms, gc_ms = [], [0.0]
    gc_start = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            gc_ms[0] += (time.perf_counter() - gc_start[0]) * 1e3

    gc.callbacks.append(on_gc)
    trainer.data_wait_s = 0.0
    skipped_before = float(trainer.guard.window_skipped)
    t0 = time.perf_counter()
    for i in range(spec["steps"]):
        if events:
            events[i].record()
        h0 = time.perf_counter()
        step = trainer.train_step()
        host_ms.append((time.perf_counter() - h0) * 1e3)
        tokens += step["tokens"]
        losses.append(step["loss"])
    if events:
        events[-1].record()
    sync()
    dt = time.perf_counter() - t0
    gc.callbacks.remove(on_gc)
    gpu_step_ms = [a.elapsed_time(b) for a, b in zip(events, events[1:])]
    step_losses = torch.stack(losses).float().tolist()
    check_timed_steps(spec["name"], step_losses, int(float(trainer.guard.window_skipped) - skipped_before))
    loss = sum(step_losses) / len(step_losses)
    tok_s = tokens / dt
    mc = trainer.model_config
    fpt = mc.flops_per_token(mc.seq_length)
    res = {"config": spec["name"], "batch": spec["batch"], "accum": trainer.accum, "tokens_per_s": tok_s,
           "ms_per_step": dt / spec["steps"] * 1e3,
           "tflops": tok_s * fpt / 1e12, "mfu": tok_s * fpt / 989e12, "loss": loss,
           "step_losses": step_losses,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
           # what the process holds: with CUDA graphs the activations live in the graphs' pool, reserved but not
           # "allocated" between replays, so the allocated peak alone would flatter them
           "reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else float("nan"),
           "setup_s": setup_s, "warmup_s": warmup_s, "gpu_step_ms": gpu_step_ms, "host_step_ms": host_ms,
           "gc_ms": gc_ms[0], "data_wait_ms": trainer.data_wait_s * 1e3,
           "params_m": sum(p.numel() for p in trainer.model.parameters()) / 1e6,
           "loss_chunk_tokens": trainer.loss_chunk_tokens, "compile": trainer.compiled,
           "fp8": f"{mc.fp8_format}/{mc.fp8_recipe}" if mc.fp8 else "off",
           "cuda_graphs": trainer.layer_graphs is not None and trainer.layer_graphs.num_replays > 0}
    if cuda:
        res["memory"] = memory_breakdown()
    res["fp8_kernels"] = fp8_kernel_choices()
    if sites is not None:
        res["graph_pool_peak_sites"] = sites
    if spec.get("profile") and cuda:
        res["profile_ms"], res["top_kernels"] = profile_steps(trainer, 2, spec.get("top_kernels", 0))
    if spec.get("trace") and spec.get("out"):
        res["trace"] = trace_step(trainer, Path(spec["out"]) / f"trace_{spec['name'].replace('/', '_')}.json.gz")
    print("RESULT " + json.dumps(res), flush=True)


def fp8_kernel_choices() -> dict[str, str]:
    """Whether each FP8 Triton kernel variant passed its first-call check (in the one formulation training runs; a
    variant that failed runs the torch path, or the unfused MLP), why not, and the ptxas that compiled them."""
    from megadlms.fp8.kernels import triton_cast, triton_swiglu

    st = triton_swiglu._state
    out = {f"swiglu {k}": f"formulation {triton_swiglu.production_formulation(k[0])[0]}" if ok else "off"
           for k, ok in st["checked"].items()}
    for k, problems in st["rejected"].items():
        out[f"swiglu {k}"] += ": " + "; ".join(problems)
    for k, ok in triton_cast._state["checked"].items():
        if k[3]:  # with q^T
            out[f"cast {k}"] = f"formulation {triton_cast.production_formulation()[0]}" if ok else "off"
    out["TRITON_PTXAS_PATH"] = str(os.environ.get("TRITON_PTXAS_PATH"))
    return out


def memory_breakdown() -> dict[str, float]:
    """Where the reserved memory lies after the timed steps (GiB): the default pool and the CUDA graphs' private
    pools (reserved, and allocated to live tensors), with the allocator's peaks of requested and of active bytes
    (live tensors, rounded to blocks) and of inactive split blocks (cached pieces of segments: fragmentation)."""
    import torch

    pools: dict[str, list[float]] = {}
    for seg in torch.cuda.memory_snapshot():
        kind = "default" if tuple(seg.get("segment_pool_id", (0, 0))) == (0, 0) else "graphs"
        total, used = pools.setdefault(kind, [0.0, 0.0])
        pools[kind] = [total + seg["total_size"] / 2**30, used + seg["allocated_size"] / 2**30]
    stats = torch.cuda.memory_stats()
    out = {f"{kind} {what}": round(v, 2) for kind, (t, u) in pools.items() for what, v in (("reserved", t),
                                                                                         ("allocated", u))}
    for key, name in (("requested_bytes.all.peak", "requested peak"), ("active_bytes.all.peak", "active peak"),
                      ("inactive_split_bytes.all.peak", "inactive split peak")):
        out[name] = round(stats.get(key, 0) / 2**30, 2)
    out["alloc retries"] = stats.get("num_alloc_retries", 0)
    return out


def graph_pool_peak_sites(snapshot: dict, top: int) -> dict:
    """From a memory snapshot with allocation history (warm-up steps, which include the CUDA-graph capture): the
    largest sum of live allocations in the graphs' private pools, and what was live then, by the innermost
    MegaDLMs / benchmark source line that allocated it (GiB, allocations). Where a graph pool's size comes from."""
    final = {(s["address"], s["total_size"]) for s in snapshot["segments"]
             if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)}
    events = snapshot["device_traces"][0] if snapshot["device_traces"] else []

    def site(frames: list) -> str:
        """The innermost MegaDLMs line, else the innermost Python line (compiled backward code, autograd)."""
        ours = [f for f in frames if "megadlms" in f.get("filename", "") or "benchmarks" in f.get("filename", "")]
        py = [f for f in frames if f.get("filename", "").endswith(".py")]
        for f in ours or py:
            where = f["filename"].split("megadlms/")[-1] if ours else f["filename"].split("/")[-1]
            return f"{where}:{f.get('line')} {f.get('name')}"
        return "(no Python frame)"

    # the mapping of each final graph-pool segment: the last segment_alloc at its address (an address may have
    # held a default-pool segment before, freed by empty_cache, whose allocations are not the pool's)
    last_map: dict[int, int] = {}
    for i, ev in enumerate(events):
        if ev["action"] == "segment_alloc":
            last_map[ev["addr"]] = i
        elif ev["action"] == "segment_free":
            last_map.pop(ev["addr"], None)
    pool_maps = {i for addr, i in last_map.items() if (addr, events[i]["size"]) in final}

    def replay(stop: int | None) -> tuple[int, int, dict[int, dict]]:
        """Live graph-pool allocations over the events (up to index `stop`): (peak bytes, its index, live then)."""
        import bisect

        segs: list[tuple[int, int]] = []  # graph-pool segments mapped so far: (start, end), sorted
        live: dict[int, dict] = {}
        total = peak = peak_at = 0
        for i, ev in enumerate(events[:stop]):
            action, addr = ev["action"], ev["addr"]
            if action == "segment_alloc" and i in pool_maps:
                bisect.insort(segs, (addr, addr + ev["size"]))
            elif action == "alloc":
                j = bisect.bisect_right(segs, (addr, float("inf"))) - 1
                if j >= 0 and addr < segs[j][1]:
                    live[addr] = ev
                    total += ev["size"]
                    if total > peak:
                        peak, peak_at = total, i + 1
            elif action in ("free_requested", "free_completed") and addr in live:
                total -= live.pop(addr)["size"]
        return peak, peak_at, live

    peak, peak_at, _ = replay(None)
    _, _, at_peak = replay(peak_at)
    by_site: dict[str, list[float]] = {}
    for ev in at_peak.values():
        acc = by_site.setdefault(site(ev.get("frames", [])), [0.0, 0])
        acc[0] += ev["size"] / 2**30
        acc[1] += 1
    rows = sorted(by_site.items(), key=lambda kv: -kv[1][0])[:top]
    return {"peak_gib": round(peak / 2**30, 2), "sites": [[round(g, 3), int(n), w] for w, (g, n) in rows]}


def trace_step(trainer, path: Path) -> str:
    """One train step under torch.profiler (host and GPU activity), saved as a gzipped Chrome trace: where
    the GPU waits, and on which host code (open it in chrome://tracing or https://ui.perfetto.dev)."""
    import gzip
    import shutil

    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        trainer.train_step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    raw = path.with_suffix("")  # .json
    prof.export_chrome_trace(str(raw))
    with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    return str(path)


def profile_steps(trainer, n: int, top: int = 0) -> tuple[dict[str, float], list]:
    """GPU kernel time per step by kernel class over n train steps, plus the step's wall time and the
    time the GPU ran no kernel ('idle': host-bound gaps, syncs); and the `top` longest kernels as
    (ms per step, calls per step, class, name) rows."""
    import torch
    from fp8_block import kernel_time_by_class  # the kernel classes of the block benchmark
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            trainer.train_step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3 / n
    by, rows = kernel_time_by_class(prof, n)
    busy = sum(by.values())
    return ({**{k: round(v, 2) for k, v in sorted(by.items(), key=lambda kv: -kv[1])},
             "kernels total": round(busy, 2), "idle": round(max(0.0, wall - busy), 2),
             "wall (profiled)": round(wall, 2)},
            [[round(ms, 3), calls, cls, name] for ms, calls, cls, name in rows[:top]])


def run_logged(cmd: list[str], log: Path | None, timeout: int) -> tuple[int, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        text, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        text, rc = text + f"\nTIMEOUT after {timeout} s", 124
    if log is not None:  # one log for all runs (the files that come back from a GPU machine are few)
        with open(log, "a") as f:
            f.write(f"===== {' '.join(cmd[:2])} {cmd[-1][:200]}\n{text}\n")
    return rc, text


def main() -> None:
    from megadlms.triton_setup import use_torch_ptxas

    use_torch_ptxas()  # as the megadlms commands do: the FP8 Triton kernels compile with torch's ptxas
    a = parse_args()
    if a.worker:
        worker(json.loads(a.worker))
        return
    if a.hf_peer and a.accum != 1:
        raise SystemExit(f"--hf-peer with --accum {a.accum}: the peer script makes an optimizer step every "
                         "micro-batch, so the comparison holds only at --accum 1; run the peer comparison in its own "
                         "command")
    out = Path(a.out) if a.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    import torch

    print(json.dumps({"torch": torch.__version__,
                      "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not a.smoke else "cpu",
                      "batch": a.batch, "accum": a.accum, "seq": a.seq, "steps": a.steps, "warmup": a.warmup}),
          flush=True)
    results: list[dict] = []
    peer = None
    if a.hf_peer and not a.smoke:
        log = out / "runs.log" if out else None
        rc, text = run_logged([sys.executable, str(ROOT / "benchmarks" / "hf_peer.py"), "--batch", str(a.batch),
                               "--seq", str(a.seq), "--steps", str(a.hf_peer_steps)], log, a.timeout)
        m = re.search(r"hf_peer .*?(\d+) ms/step (\d+) tok/s (\d+) TFLOP/s MFU ([\d.]+)% peak_mem ([\d.]+) GiB", text)
        if m:
            peer = {"config": "hf_peer (transformers)", "ms_per_step": float(m.group(1)),
                    "tokens_per_s": float(m.group(2)), "tflops": float(m.group(3)), "mfu": float(m.group(4)) / 100,
                    "peak_gib": float(m.group(5))}
            results.append(peer)
            print(text.strip().splitlines()[-1], flush=True)
        else:
            print(f"hf_peer FAILED rc={rc}\n" + "\n".join(text.strip().splitlines()[-10:]), flush=True)
    from memory_fit import free_bytes

    free = None if a.smoke else free_bytes()
    caps: dict[str, int] = {}  # micro-batch per model: the estimate's, lowered by runs out of memory
    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "synthetic_text_document"
        write_corpus(prefix, vocab=128000,
                     n_tokens=(a.warmup + a.steps + 2) * a.accum * a.batch * (a.seq + 1) * 2)
        for name in [c for c in a.configs.split(",") if c]:
            base, _, variant = name.partition("+")  # the same configuration with one switch turned off
            if variant not in VARIANTS:
                raise SystemExit(f"unknown variant +{variant} in {name!r}; variants: {', '.join(VARIANTS)}")
            flags = CONFIGS[base] + VARIANTS[variant]
            batch = micro_batch_for(name, CONFIGS[base], a, free, caps)
            spec = {"name": name, "flags": flags, "seq": a.seq, "batch": batch, "accum": a.accum,
                    "data": str(prefix),
                    "warmup": a.warmup, "steps": a.steps, "extra": a.extra.split() if a.extra else [],
                    "profile": a.profile, "top_kernels": a.top_kernels, "trace": a.trace,
                    "memory_sites": a.memory_sites,
                    "out": str(out) if out else None}
            if a.smoke:
                spec["device"] = "cpu"
            t0 = time.time()
            log = out / "runs.log" if out else None
            rc, text = run_logged([sys.executable, __file__, "--worker", json.dumps(spec)], log, a.timeout)
            while rc and "out of memory" in text.lower() and spec["batch"] > 1:  # the estimate was short
                spec["batch"] = caps[name.split("/")[0]] = spec["batch"] // 2
                print(f"{name}: out of memory; again at micro-batch {spec['batch']}", flush=True)
                rc, text = run_logged([sys.executable, __file__, "--worker", json.dumps(spec)], log, a.timeout)
            m = re.search(r"^RESULT (.*)$", text, re.M)
            if m:
                r = json.loads(m.group(1))
                print(f"{name}: loss {r['loss']:.3f}, {r['tokens_per_s']:.0f} tok/s, MFU {r['mfu'] * 100:.1f}%, "
                      f"peak {r['peak_gib']:.1f} GiB "
                      f"(reserved {r.get('reserved_gib', float('nan')):.1f}) "
                      f"(setup {r['setup_s']:.0f} s, warm-up {r['warmup_s']:.0f} s, wall {time.time() - t0:.0f} s)",
                      flush=True)
            else:
                tail = "\n".join(text.strip().splitlines()[-15:])
                print(f"{name}: FAILED rc={rc}\n{tail}", flush=True)
                r = {"config": name, "error": f"rc={rc}: {text.strip().splitlines()[-1][:200] if text.strip() else ''}"}
            results.append(r)
    if out is not None:
        (out / "train_throughput.json").write_text(json.dumps(results, indent=1))

    by = {r["config"]: r for r in results if "error" not in r}
    print(f"\ntrain throughput | S={a.seq} | {a.accum} micro-batch(es) per optimizer step "
          f"| {a.steps} timed steps after {a.warmup} warm-up")
    print(f"{'config':24s} {'B':>2s} {'acc':>3s} {'ms/step':>8s} {'tok/s':>8s} {'TFLOP/s':>8s} {'MFU':>6s} "
          f"{'peak GiB':>9s} {'rsv GiB':>8s} {'vs bf16':>8s} {'vs hf':>6s} {'graphs':>6s}")
    for r in results:
        if "error" in r:
            print(f"{r['config']:24s} ERROR {r['error']}")
            continue
        bf_name = r["config"].replace("/fp8", "/bf16")
        bf = by.get(bf_name) or by.get(bf_name.split("+")[0])  # the same variant's BF16 run, else the plain one
        vs_bf = r["tokens_per_s"] / bf["tokens_per_s"] if bf and "/fp8" in r["config"] else float("nan")
        same_arch = peer and r["config"].startswith("qwen3-1.7b")
        vs_hf = r["tokens_per_s"] / peer["tokens_per_s"] if same_arch else float("nan")
        reserved = r.get("reserved_gib", float("nan"))
        print(f"{r['config']:24s} {r.get('batch', a.batch):2d} {r.get('accum', 1):3d} {r['ms_per_step']:8.0f} "
              f"{r['tokens_per_s']:8.0f} {r['tflops']:8.0f} {r['mfu'] * 100:5.1f}% {r['peak_gib']:9.1f} "
              f"{reserved:8.1f} {vs_bf:8.3f} {vs_hf:6.2f} {'yes' if r.get('cuda_graphs') else 'no':>6s}")
    for r in results:
        for key, choice in (r.get("fp8_kernels", {}) if "/fp8" in r["config"] else {}).items():
            print(f"FP8 kernels, {r['config']}: {key}: {choice}")
    for r in results:
        if "error" not in r:
            r["step_time"] = step_time_breakdown(r)
    print_by_config(results, "step_time", "where the timed steps' time goes (ms per step)", "", 1, float("nan"))
    print_by_config(results, "memory", "memory after the timed steps (GiB; peaks over the timed steps)", "", 2,
                    float("nan"))
    for r in results:
        if r.get("graph_pool_peak_sites"):
            g = r["graph_pool_peak_sites"]
            print(f"\ngraph pool at its peak in the capture, {r['config']}: {g['peak_gib']:.2f} GiB live "
                  "(GiB, allocations, source line)")
            for gib, n, where in g["sites"]:
                print(f"{gib:8.3f} {n:5d}  {where}")
    print_by_config(results, "profile_ms", "GPU ms per step by kernel class (torch.profiler, 2 steps)", "class", 1,
                    0.0)
    for r in results:
        if r.get("top_kernels"):
            print(f"\nlongest kernels per step, {r['config']} (ms, calls, class, name)")
            for ms, calls, cls, name in r["top_kernels"]:
                print(f"{ms:8.2f} {calls:5d}  {cls:28s} {name}")


def step_time_breakdown(r: dict) -> dict[str, float]:
    """The timed steps' wall time against the GPU time between step starts (CUDA events, no sync: a step's
    kernels plus the GPU's idle time up to the next step) and the host time of each train_step call; with the
    garbage collector's and the data loader's share."""
    gpu, host, n = r.get("gpu_step_ms") or [], r.get("host_step_ms") or [], max(len(r.get("host_step_ms") or []), 1)
    out = {"wall per step": r["ms_per_step"], "host per train_step (mean)": sum(host) / n if host else float("nan"),
           "host per train_step (max)": max(host, default=float("nan")),
           "gc over the timed steps / step": r.get("gc_ms", float("nan")) / n,
           "data loader wait / step": r.get("data_wait_ms", float("nan")) / n}
    if gpu:
        out.update({"GPU between step starts (min)": min(gpu),
                    "GPU between step starts (median)": sorted(gpu)[len(gpu) // 2],
                    "GPU between step starts (max)": max(gpu)})
    return out


def print_by_config(results: list[dict], field: str, title: str, corner: str, digits: int, missing: float) -> None:
    """A table of the dicts `r[field]` of the results that have one: a row per key, a column per configuration."""
    rows = [r for r in results if r.get(field)]
    if not rows:
        return
    keys = list(dict.fromkeys(k for r in rows for k in r[field]))
    print(f"\n{title}")
    print(f"{corner:30s}" + "".join(f"{r['config']:>20s}" for r in rows))
    for k in keys:
        print(f"{k:30s}" + "".join(f"{r[field].get(k, missing):20.{digits}f}" for r in rows))


if __name__ == "__main__":
    main()
