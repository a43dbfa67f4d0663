"""Where a training step's time goes, BF16 beside FP8, per workload: one step of the real trainer under
torch.profiler, its GPU kernel time by category (GEMMs, attention, FP8 casts, norms/elementwise, optimizer, LM head
+ loss, other) and the GPU's idle time (host gaps), with tokens/s and peak memory of timed steps before it, and the
ceiling the BF16 breakdown implies: the step time if FP8 ran the layers' GEMMs at twice BF16's rate and cost
nothing else (what FP8 cannot touch bounds the gain).

Each (workload, precision) runs in its own process (fresh memory): setup from `megadlms train` flags, warm-up steps
(compilation, CUDA-graph capture), timed steps between synchronisations (each must have a finite loss and a taken
optimizer step), then one profiled step. Kernels are charged to the LM head + loss, the optimizer (gradient clip
and update) or the FP8 scale/weight step by the host code that launched them; the rest by kernel name.

    python benchmarks/step_breakdown.py                                  # every workload, BF16 and FP8
    python benchmarks/step_breakdown.py --workloads sft,llada-sft --out runs/breakdown
    python benchmarks/step_breakdown.py --smoke                          # the tiny preset on the CPU

Workloads (seq 4096 on a GPU): pretrain (qwen3-0.6b x 4 on a synthetic corpus), trainer (qwen3-1.7b x 4),
sft (packed SFT of qwen3-0.6b x 4 on the reverse-digits chat set), llada-sft (LLaDA-8B packed SFT x 1 with full
recompute, as many layers as the free memory holds, or --llada-layers), lora (rank-64 LoRA on all linears of
LLaDA-8B x 1, base in BF16 or FP8).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from train_throughput import build_trainer, check_timed_steps, run_logged, write_corpus  # noqa: E402

# workload -> (flags, data: "synthetic" or "sft")
WORKLOADS: dict[str, tuple[list[str], str]] = {
    "pretrain": (["--model-path", "qwen3-0.6b", "--micro-batch-size", "4"], "synthetic"),
    "trainer": (["--model-path", "qwen3-1.7b", "--micro-batch-size", "4"], "synthetic"),
    "sft": (["--model-path", "qwen3-0.6b", "--micro-batch-size", "4", "--sft"], "sft"),
    "llada-sft": (["--model-path", "llada-8b", "--micro-batch-size", "1", "--sft", "--recompute-granularity", "full"],
                  "sft"),
    # benchmarks/lora_memory.py's step (the trainer's LoRA needs a checkpoint to adapt)
    "lora": (["--model-path", "llada-8b", "--micro-batch-size", "1", "--lora-rank", "64"], "synthetic"),
}
PRECISIONS = {"bf16": [], "fp8": ["--fp8-format", "hybrid"]}
LORA_BASE = {"bf16": ["--lora-base", "bf16"], "fp8": ["--lora-base", "fp8"]}

# host scopes whose kernels are charged to them whatever their names (see `scoped`)
SCOPES = ("lm head + loss", "optimizer", "fp8 scales + weight casts")
KERNEL_CATEGORIES = (  # first match wins; lower-case substrings of kernel (GPU) or op (CPU) names
    # compiled FlexAttention runs as Inductor template kernels (triton_tem_*), the only templates without autotuning
    ("attention", ("fmha", "flash", "attention", "cudnn", "sdpa", "mha", "flex", "triton_tem_")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "sm90_", "sm100_", "cublas", "scaled_mm", "wgmma", "aten::mm",
              "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul")),
    ("fp8 casts", ("cast", "quant", "amax", "absmax", "clone_t", "float8", "fp8")),
    ("norms + elementwise", ("triton", "elementwise", "vectorized", "reduce", "norm", "copy", "fill", "cat", "index",
                             "aten::")),
)
CATEGORIES = ("gemm", "attention", "fp8 casts", "norms + elementwise") + SCOPES + ("other",)


def category(name: str, scope: str | None) -> str:
    """The category of a kernel (or CPU op) `name` launched under the host `scope` (one of SCOPES, or None)."""
    if scope is not None:
        return scope
    k = name.lower()
    for cat, keys in KERNEL_CATEGORIES:
        if any(s in k for s in keys):
            return cat
    return "other"


def breakdown(items: list[tuple[str, str | None, float]], wall_ms: float) -> dict[str, float]:
    """(name, scope, ms) of one step's kernels -> ms per category, their sum ("kernels") and the step's wall time
    less the kernels ("idle (host gaps)": the GPU ran nothing; kernels on one stream do not overlap)."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    for name, scope, ms in items:
        out[category(name, scope)] += ms
    busy = sum(out.values())
    out["kernels"] = busy
    out["idle (host gaps)"] = max(0.0, wall_ms - busy)
    out["step (profiled)"] = wall_ms
    return out


def ceiling(b: dict[str, float], gemm_speedup: float = 2.0) -> dict[str, float]:
    """From a BF16 breakdown: the share of the step FP8 cannot touch (all but the layers' GEMMs), and the speed-up
    if those GEMMs ran `gemm_speedup` times faster with nothing else changed (Amdahl)."""
    step = b["step (profiled)"] or 1.0
    gemm = b["gemm"]
    return {"untouched share": 1.0 - gemm / step, "ceiling": step / (step - gemm + gemm / gemm_speedup)}


@contextlib.contextmanager
def scoped(trainer):
    """Host scopes (torch.profiler ranges) around the LM head + loss, the optimizer and the FP8 step, so that their
    kernels can be charged to them."""
    import torch

    import megadlms.fp8 as fp8
    import megadlms.training.objectives as objectives

    def wrap(fn, label):
        def inner(*args, **kwargs):
            with torch.profiler.record_function(label):
                return fn(*args, **kwargs)
        return inner

    patches = [(objectives, n, "lm head + loss") for n in ("chunked_weighted_cross_entropy", "weighted_cross_entropy")
               if hasattr(objectives, n)]
    patches += [(trainer, "_clip_grads", "optimizer"), (trainer.guard, "step", "optimizer"),
                (fp8, "fp8_step", "fp8 scales + weight casts")]
    saved = [(obj, n, getattr(obj, n)) for obj, n, _ in patches]
    for obj, n, label in patches:
        setattr(obj, n, wrap(getattr(obj, n), label))
    try:
        yield
    finally:
        for obj, n, fn in saved:
            setattr(obj, n, fn)


def scope_of(event) -> str | None:
    """The innermost of SCOPES enclosing a profiler event (its own name included), or None."""
    while event is not None:
        if event.name in SCOPES:
            return event.name
        event = event.cpu_parent
    return None


def profiled_items(prof, cuda: bool) -> list[tuple[str, str | None, float]]:
    """(name, scope, ms) per kernel of a profile: each GPU kernel with the scope of the host op that launched it
    (None where no op claims it, e.g. a CUDA-graph replay outside any range); on the CPU the ops' own (self) times
    stand for kernels."""
    events = prof.events()
    if cuda:
        by_id = {e.id: e for e in events if "CUDA" not in str(e.device_type)}
        items = [(e.name, scope_of(by_id.get(getattr(e, "linked_correlation_id", 0))),
                  (e.time_range.end - e.time_range.start) / 1e3)
                 for e in events if "CUDA" in str(e.device_type)]
        if items:
            return items
        # a torch whose event list holds no kernels of their own: the kernels' totals by name, without scopes
        return [(e.key, None, e.device_time_total / 1e3) for e in prof.key_averages()
                if "CUDA" in str(e.device_type) and e.device_time_total > 0]
    return [(e.name, scope_of(e), e.self_cpu_time_total / 1e3) for e in events
            if e.name not in SCOPES and not e.name.startswith("ProfilerStep")]


def trainer_run(spec: dict):
    """(step, skipped, scopes, layers): the trainer's step (loss tensor, tokens), its count of skipped steps so far,
    the host scopes of its phases, and its layer count."""
    trainer = build_trainer(spec["flags"], spec["seq"], spec["batch"], 1, spec["data"], spec.get("device"),
                            spec["extra"])

    def step():
        out = trainer.train_step()
        return out["loss"], out["tokens"]

    return step, lambda: float(trainer.guard.window_skipped), scoped(trainer), trainer.model_config.num_layers


def lora_run(spec: dict):
    """As `trainer_run`, for benchmarks/lora_memory.py's LoRA step (random base weights: the trainer's LoRA adapts a
    checkpoint given by --load), with its base stored in spec's precision."""
    from lora_memory import build_step

    opts = dict(zip(spec["flags"][::2], spec["flags"][1::2]))
    args = argparse.Namespace(preset=opts["--model-path"], layers=None, seq=spec["seq"], mbs=spec["batch"],
                              rank=int(opts["--lora-rank"]), base=opts["--lora-base"], build_on_cpu=False,
                              recompute=False, compile=False, device=spec.get("device") or "cuda")
    lora_step, _ = build_step(args)

    def step():
        return lora_step(), spec["batch"] * spec["seq"]

    return step, lambda: 0.0, contextlib.nullcontext(), None


def worker(spec: dict) -> None:
    """One (workload, precision): setup, warm-up, timed steps, one profiled step; prints one RESULT line."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step, skipped, scopes, layers = (lora_run if spec["workload"] == "lora" else trainer_run)(spec)
    cuda = torch.cuda.is_available() and spec.get("device") != "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(spec["warmup"]):
        step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    skipped_before = skipped()
    t0 = time.perf_counter()
    steps = [step() for _ in range(spec["steps"])]
    sync()
    dt = time.perf_counter() - t0
    losses = torch.stack([loss for loss, _ in steps]).float().tolist()
    check_timed_steps(spec["name"], losses, int(skipped() - skipped_before))
    res = {"name": spec["name"], "tokens_per_s": sum(n for _, n in steps) / dt,
           "ms_per_step": dt / len(steps) * 1e3, "loss": sum(losses) / len(losses),
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
           "reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else float("nan"),
           "layers": layers, "batch": spec["batch"]}
    if not spec.get("profile", True):
        print("RESULT " + json.dumps(res), flush=True)
        return
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with scopes, profile(activities=acts) as prof:
        t0 = time.perf_counter()
        step()
        sync()
        wall = (time.perf_counter() - t0) * 1e3
    res["breakdown"] = breakdown(profiled_items(prof, cuda), wall)
    print("RESULT " + json.dumps(res), flush=True)


def sft_data(folder: Path, examples: int) -> str:
    """The reverse-digits chat set (examples/sft), preprocessed once under `folder`; returns its prefix."""
    prefix = folder / "reverse_chat_document"
    if not Path(f"{prefix}.idx").exists():
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, str(ROOT / "examples" / "sft" / "make_data.py"), "--out", str(folder),
                        "--train", str(examples)], check=True, capture_output=True)
        from megadlms.data.preprocess import main as preprocess

        if preprocess(["--chat", "--input", str(folder / "train.jsonl"), "--output-prefix",
                       str(folder / "reverse"), "--prompt-template", "Q: {prompt}\nA: ", "--no-progress"]) != 0:
            raise SystemExit(f"preprocessing the SFT set under {folder} failed")
    return str(prefix)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated: {', '.join(WORKLOADS)}")
    p.add_argument("--precisions", default="bf16,fp8")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--llada-layers", type=int, default=None,
                   help="llada-sft's layers (default: as many as the free memory holds, at most 32)")
    p.add_argument("--extra", default="", help="more `megadlms train` flags for every run")
    p.add_argument("--sft-work", default="/tmp/megadlms_sft_paths/data", help="where the SFT set is built once")
    p.add_argument("--timeout", type=int, default=400, help="seconds per run")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for all runs: a run that would start later is left out (its row says so), and no "
                        "run goes past it, so the tables print within the budget")
    p.add_argument("--out", default=None, help="folder for the run log and the JSON results")
    p.add_argument("--fit", choices=("micro-batch", "layers"), default=None,
                   help="instead of the breakdown: the largest micro-batch (or layer count, at micro-batch 1) of each "
                        "workload and precision that trains without running out of memory, by short runs from the "
                        "memory estimate's up or down")
    p.add_argument("--smoke", action="store_true", help="the tiny preset on the CPU")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    unknown = sorted(set(a.workloads.split(",")) - set(WORKLOADS)) + sorted(set(a.precisions.split(",")) -
                                                                            set(PRECISIONS))
    if unknown:
        p.error(f"unknown workload or precision {unknown}; workloads: {', '.join(WORKLOADS)}; precisions: "
                f"{', '.join(PRECISIONS)}")
    return a


def run_flags(workload: str, precision: str, a: argparse.Namespace, free: float | None) -> list[str]:
    """The `megadlms train` flags of one run."""
    flags = list(WORKLOADS[workload][0])
    flags += LORA_BASE[precision] if workload == "lora" else PRECISIONS[precision]
    if a.smoke:
        flags[1] = "tiny"
        flags += ["--hidden-size", "32", "--ffn-hidden-size", "64", "--num-attention-heads", "2",
                  "--num-query-groups", "1", "--kv-channels", "16"]
        if workload == "lora":
            flags += ["--lora-rank", "4"]
    elif workload == "llada-sft":
        layers = a.llada_layers
        if layers is None and free is not None:
            from memory_fit import fitting_layers
            from train_throughput import config_of

            layers = fitting_layers(config_of(flags, a.seq), a.seq, 1, free, fp8=True, recompute=True)
        if layers:
            flags += ["--num-layers", str(layers)]
    return flags


def main() -> None:
    from megadlms.triton_setup import use_torch_ptxas

    use_torch_ptxas()  # as the megadlms commands do: the FP8 Triton kernels compile with torch's ptxas
    a = parse_args()
    if a.worker:
        worker(json.loads(a.worker))
        return
    out = Path(a.out) if a.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    from memory_fit import free_bytes

    free = None if a.smoke else free_bytes()
    seq = 64 if a.smoke else a.seq
    workloads = a.workloads.split(",")
    results: dict[str, dict[str, dict]] = {}
    deadline = time.time() + a.budget if a.budget else float("inf")
    with tempfile.TemporaryDirectory() as tmp:
        synthetic = Path(tmp) / "synthetic_text_document"
        write_corpus(synthetic, vocab=128000, n_tokens=(a.warmup + a.steps + 3) * 4 * (seq + 1) * 2)
        sft = None
        if any(WORKLOADS[w][1] == "sft" for w in workloads):
            sft = sft_data(Path(tmp) / "sft" if a.smoke else Path(a.sft_work), 400 if a.smoke else 60000)

        def run(w: str, prec: str, batch: int | None = None, layers: int | None = None, profile: bool = True,
                label: str = "") -> dict:
            """One worker process; its result, or {"error": ...} (with "oom" where it ran out of memory)."""
            flags = run_flags(w, prec, a, free)
            if layers is not None:
                flags = [f for f in _without(flags, "--num-layers")] + ["--num-layers", str(layers)]
            opts = dict(zip(flags[::2], flags[1::2]))
            batch = batch or (1 if a.smoke else int(opts["--micro-batch-size"]))
            extra = ["--split", "98,2,0"] if WORKLOADS[w][1] == "sft" else []
            extra += a.extra.split() + (["--bf16", "--num-workers", "0"] if a.smoke else [])
            name = f"{w}/{prec}{label}"
            spec = {"name": name, "workload": w, "flags": flags, "seq": seq, "batch": batch,
                    "data": sft if WORKLOADS[w][1] == "sft" else str(synthetic), "warmup": a.warmup,
                    "steps": a.steps, "extra": extra, "device": "cpu" if a.smoke else None, "profile": profile}
            t0 = time.time()
            if deadline - t0 < 20:
                print(f"{name}: left out (--budget {a.budget:.0f} s spent)", flush=True)
                return {"name": name, "error": "left out: --budget spent"}
            rc, text = run_logged([sys.executable, __file__, "--worker", json.dumps(spec)],
                                  out / "runs.log" if out else None, int(min(a.timeout, deadline - t0)))
            m = re.search(r"^RESULT (.*)$", text, re.M)
            if m:
                r = json.loads(m.group(1))
                print(f"{name}: loss {r['loss']:.3f}, {r['tokens_per_s']:.0f} tok/s, peak {r['peak_gib']:.1f} GiB "
                      f"(reserved {r['reserved_gib']:.1f}), {r['layers'] or 'all'} layers x micro-batch "
                      f"{r['batch']} (wall {time.time() - t0:.0f} s)", flush=True)
                return r
            oom = "out of memory" in text.lower()
            tail = "\n".join(text.strip().splitlines()[-(2 if oom else 12):])
            print(f"{name}: {'OUT OF MEMORY' if oom else 'FAILED'} rc={rc}\n{tail}", flush=True)
            return {"name": name, "error": "out of memory" if oom else f"rc={rc}", "oom": oom}

        if a.fit:
            fits = {w: {p: largest_fitting(run, w, p, a.fit, fit_start(w, p, a, free, seq)) for p in
                        a.precisions.split(",")} for w in workloads}
            report_fit(fits, a.fit)
            if out is not None:
                (out / "step_breakdown_fit.json").write_text(json.dumps(fits, indent=1))
            return
        for w in workloads:
            for prec in a.precisions.split(","):
                results.setdefault(w, {})[prec] = run(w, prec)
    if out is not None:
        (out / "step_breakdown.json").write_text(json.dumps(results, indent=1))
    report(results, "GPU" if free is not None else "CPU (op self time)")


def _without(flags: list[str], name: str) -> list[str]:
    """flags (name, value pairs) without the pair `name`."""
    pairs = list(zip(flags[::2], flags[1::2]))
    return [x for k, v in pairs if k != name for x in (k, v)]


def fit_start(w: str, prec: str, a: argparse.Namespace, free: float | None, seq: int) -> int:
    """The first micro-batch (or layer count) `--fit` tries: the memory estimate's (benchmarks/memory_fit.py)."""
    from memory_fit import fitting_layers, fitting_micro_batch, training_memory, usable
    from train_throughput import config_of

    if free is None:  # the CPU: start at one
        return 1
    flags = run_flags(w, prec, a, free)
    cfg = config_of(flags, seq)
    fp8, recompute = prec == "fp8", "--recompute-granularity" in flags
    if a.fit == "layers":
        cfg = config_of(_without(flags, "--num-layers"), seq)
        return max(1, fitting_layers(cfg, seq, 1, free, fp8, recompute))
    mem = training_memory(cfg, seq, fp8, recompute)
    return max(1, fitting_micro_batch(cfg, seq, int((usable(free) - mem.fixed) // mem.per_sequence) + 1, free, fp8,
                                      recompute))


def largest_fitting(run, w: str, prec: str, what: str, start: int, probes: int = 5) -> dict:
    """The largest micro-batch (what="micro-batch") or layer count ("layers", at micro-batch 1) that trains without
    running out of memory, by short runs from `start` up (while they fit) or down (until one does), at most
    `probes` runs; {"largest": n or 0, "runs": {n: peak GiB or the error}}."""
    tried: dict[int, dict] = {}

    def probe(n: int) -> bool:
        kw = {"layers": n, "batch": 1} if what == "layers" else {"batch": n}
        r = tried[n] = run(w, prec, profile=False, label=f" {what} {n}", **kw)
        if "error" in r and not r.get("oom"):
            raise SystemExit(f"{w}/{prec} at {what} {n} failed for a reason other than memory: {r['error']}")
        return "error" not in r

    n = start
    if probe(n):
        while len(tried) < probes and probe(n + 1):
            n += 1
        largest = n
    else:
        while n > 1 and len(tried) < probes and not probe(n - 1):
            n -= 1
        largest = n - 1 if n > 1 and "error" not in tried.get(n - 1, {"error": 1}) else 0
    return {"largest": largest, "runs": {k: (round(v["peak_gib"], 2), round(v["reserved_gib"], 2))
                                         if "error" not in v else v["error"] for k, v in tried.items()}}


def report_fit(fits: dict[str, dict[str, dict]], what: str) -> None:
    print(f"\nlargest {what} that trains, per precision (peak allocated / reserved GiB of each run tried)")
    for w, by in fits.items():
        for prec, f in by.items():
            runs = "; ".join(f"{n}: {v if isinstance(v, str) else f'{v[0]:.1f} / {v[1]:.1f}'}"
                             for n, v in sorted(f["runs"].items()))
            print(f"{w + '/' + prec:16s} {what} {f['largest']:3d}   ({runs})")


def report(results: dict[str, dict[str, dict]], unit: str) -> None:
    """Per workload: ms per category and share of the step, a column per precision; then one summary line each."""
    for w, by in results.items():
        ok = {p: r for p, r in by.items() if "breakdown" in r}
        if not ok:
            continue
        print(f"\n{w}: one step's {unit} time by category (ms, share of the profiled step)")
        print(f"{'category':28s}" + "".join(f"{p + ' ms':>12s}{'share':>8s}" for p in ok))
        for cat in (*CATEGORIES, "kernels", "idle (host gaps)", "step (profiled)"):
            row = ""
            for r in ok.values():
                b = r["breakdown"]
                step = b["step (profiled)"] or 1.0
                row += f"{b[cat]:12.2f}{b[cat] / step * 100:7.1f}%"
            print(f"{cat:28s}{row}")
    print(f"\n{'workload':12s} {'bf16 tok/s':>11s} {'fp8 tok/s':>10s} {'fp8/bf16':>9s} {'bf16 GiB':>9s} "
          f"{'fp8 GiB':>8s} {'GiB x':>6s} {'bf16 rsv':>9s} {'fp8 rsv':>8s} {'untouched':>10s} {'ceiling':>8s}")
    for w, by in results.items():
        b, f = by.get("bf16", {}), by.get("fp8", {})
        if not b or not f:  # one precision only
            continue
        if "error" in b or "error" in f:
            print(f"{w:12s} ERROR {'; '.join(r['name'] + ': ' + r['error'] for r in (b, f) if 'error' in r)}")
            continue
        c = ceiling(b["breakdown"])
        ratio = f["tokens_per_s"] / b["tokens_per_s"]
        mem = f["peak_gib"] / b["peak_gib"] if math.isfinite(b["peak_gib"]) else float("nan")
        print(f"{w:12s} {b['tokens_per_s']:11.0f} {f['tokens_per_s']:10.0f} {ratio:9.3f} {b['peak_gib']:9.2f} "
              f"{f['peak_gib']:8.2f} {mem:6.2f} {b['reserved_gib']:9.2f} {f['reserved_gib']:8.2f} "
              f"{c['untouched share'] * 100:9.1f}% {c['ceiling']:8.2f}")
    print("GiB: peak allocated over the timed steps; rsv: peak reserved (with CUDA graphs the activations live in the "
          "graphs' pool, reserved but not allocated between replays)\nuntouched: the BF16 step's share outside the "
          "layers' GEMMs; ceiling: the BF16/FP8 step-time ratio if FP8 ran those GEMMs 2x faster and cost nothing "
          "else")


if __name__ == "__main__":
    main()
