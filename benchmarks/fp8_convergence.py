"""FP8 vs BF16 loss curves with the real trainer, on the same data and masks.

Trains the same model from the same initialisation in BF16 and in FP8 variants, then prints the final
training loss (mean of the last 20 iterations) and the validation loss of each, with the relative gap
to BF16 (target: within 1.5%), and the training-loss curve of each variant. `bf16 rechunked` (the
same run with the LM head + loss summed in other chunks: equal in exact arithmetic, different in the
last bits) and `bf16 seed2` (another initialisation, mask and data order) measure the run-to-run
spread a gap must be judged against;
the FP8 ablations (e4m3, BF16 weight gradient, unfused projections, tensorwise without the fused MLP, precise
forward accumulation, BF16 first/last layers) locate where a gap comes from; the `fp8-attention` variants add FP8
attention (`--fp8-dot-product-attention`: needs `nvidia-cudnn-frontend` on a GPU).

Variants run as separate processes, up to `--parallel` at a time (several small runs share one GPU well:
each alone leaves it idle between eager kernels). On a GPU the first run starts alone; once it logs its first
training line, the device's free memory gives its share, and as many more start beside it as fit (each given
1.25x the first's share: benchmarks/memory_fit.py).

Data: the bundled corpus (default) is procedurally generated English of ~3M tokens, which a 0.6B
model learns by heart within a few hundred iterations, in a sharp drop whose timing is chaotic.
`--corpus code` trains on the Python sources of the running interpreter's installation instead
(standard library and site-packages, `--corpus-mb` of text; real, varied text that no run repeats),
built once with tools/files_to_jsonl.py and `megadlms preprocess` under --corpus-dir.

    python benchmarks/fp8_convergence.py --model-path qwen3-0.6b --iters 500 --seq-length 512 --mbs 16 \
        --corpus code --variants all --parallel 4 --extra=--no-compile
    python benchmarks/fp8_convergence.py --smoke      # CPU, tiny, seconds (checks the script)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DELAYED = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "16",
           "--fp8-amax-compute-algo", "max"]
VARIANTS = {
    "bf16": [],
    "bf16 seed2": ["--seed", "1235"],
    "bf16 rechunked": ["--loss-chunk-tokens", "4096"],
    "fp8 delayed/hybrid": DELAYED,
    "fp8 delayed/hybrid seed2": DELAYED + ["--seed", "1235"],
    "fp8 tensorwise/hybrid": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "fp8 tensorwise nomlp": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--no-fp8-fuse-mlp"],
    "fp8 rowwise/hybrid": ["--fp8-format", "hybrid", "--fp8-recipe", "rowwise"],
    "fp8 delayed/e4m3": ["--fp8-format", "e4m3", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "16",
                         "--fp8-amax-compute-algo", "max"],
    "fp8 delayed no-fp8-wgrad": DELAYED + ["--no-fp8-wgrad"],
    "fp8 delayed unfused": DELAYED + ["--no-fp8-fuse-projections"],
    "fp8 delayed precise-fprop": DELAYED + ["--no-fp8-fprop-fast-accum"],
    "fp8 delayed bf16-first-last": DELAYED + ["--first-last-layers-bf16"],
    "fp8 delayed fp8-attention": DELAYED + ["--fp8-dot-product-attention"],
    "fp8 delayed/e4m3 fp8-attention": ["--fp8-format", "e4m3", "--fp8-recipe", "delayed", "--fp8-amax-history-len",
                                       "16", "--fp8-amax-compute-algo", "max", "--fp8-dot-product-attention"],
}
DEFAULT_VARIANTS = "bf16,fp8 delayed/hybrid,fp8 tensorwise/hybrid"


def train_flags(a: argparse.Namespace) -> list[str]:
    flags = ["--model-path", a.model_path, "--seq-length", str(a.seq_length), "--micro-batch-size", str(a.mbs),
             "--train-iters", str(a.iters), "--lr", str(a.lr), "--min-lr", str(a.lr / 10),
             "--lr-warmup-iters", str(max(1, a.iters // 10)), "--log-interval", "10", "--eval-iters", "8",
             "--eval-interval", str(a.iters), "--no-progress", "--no-generate-sample", "--fp8-stats"]
    if a.smoke:
        # narrow (the CPU's FP8 GEMM, torch._scaled_mm, is slow), the preset's vocabulary (its fused LM head)
        flags += ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--num-query-groups",
                  "1", "--kv-channels", "16", "--ffn-hidden-size", "64", "--eval-iters", "2", "--device", "cpu",
                  "--bf16", "--num-workers", "0"]
    return flags + a.extra.split()


def build_code_corpus(folder: Path, mb: float, smoke: bool = False) -> str:
    """The Python sources of this installation as a Megatron corpus (bundled tokenizer); returns its prefix."""
    import sysconfig

    prefix = folder / f"code_{mb:g}mb"
    data = f"{prefix}_text_document"
    if os.path.exists(data + ".idx"):
        return data
    folder.mkdir(parents=True, exist_ok=True)
    roots = sorted({sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]})
    jsonl = folder / f"code_{mb:g}mb.jsonl"
    tools = Path(__file__).resolve().parents[1] / "tools" / "files_to_jsonl.py"
    subprocess.run([sys.executable, str(tools), *roots, "--max-mb", str(mb), "--output", str(jsonl)], check=True)
    from megadlms.data.preprocess import main as preprocess

    workers = 1 if smoke else max(1, min(16, (os.cpu_count() or 2) - 1))
    if preprocess(["--input", str(jsonl), "--output-prefix", str(prefix), "--workers", str(workers),
                   "--append-eod", "--no-progress"]) != 0:
        raise SystemExit("preprocessing the code corpus failed")
    return data


def loss_by_mask_ratio(trainer, buckets: int) -> dict[str, float]:
    """The validation loss at each mask ratio t = (i + 0.5) / buckets (the bucket [i / buckets, (i + 1) / buckets)
    at its middle): the trainer's validation batches and masks with every row's t set to it, the loss as training
    computes it (the ELBO weight 1 / t included). Where FP8 departs from BF16 by how much of the sequence is
    masked."""
    import torch

    from megadlms.diffusion.objective import MaskSampler

    loader, iters = trainer.loaders.valid, trainer.run_config.train.eval_iters
    if loader is None or iters <= 0 or buckets <= 0:
        return {}
    out = {}
    trainer.model.eval()
    with torch.no_grad(), trainer.hooks.evaluation():  # as the trainer's own evaluation (FP8 weight caching)
        for i in range(buckets):
            t = (i + 0.5) / buckets
            loader.load_state_dict({"consumed_samples": 0})  # the same batches and masks in every bucket
            it = iter(loader)
            sampler = MaskSampler(trainer.run_config.train.seed + 2, device=trainer.device)
            total, n = torch.zeros((), device=trainer.device), 0
            for _ in range(iters):
                noise = trainer.objective.draw_noise(sampler, trainer.global_batch, trainer.accum, evaluation=True)
                noise.t.fill_(t)
                for batch in trainer.objective.micro_batches(it, noise, trainer.accum, trainer.device):
                    total += trainer._loss(batch)
                    n += 1
            out[f"{t:.2f}"] = (total / max(n, 1)).item()
    trainer.model.train()
    return out


def run_variant(a: argparse.Namespace, name: str) -> dict:
    """Train one variant in this process; its losses every --log-interval and the final eval loss."""
    import torch

    from megadlms.training.args import parse_train_args
    from megadlms.training.trainer import setup

    save = ["--save", a.save_baseline] if a.save_baseline and name == "bf16" else []
    trainer = setup(parse_train_args(train_flags(a) + VARIANTS[name] + save))
    t0 = time.perf_counter()
    state = trainer.run()
    logs = [m for m in state.history if "loss" in m and "eval_loss" not in m]
    evals = [m["eval_loss"] for m in state.history if "eval_loss" in m]
    bad = [m["iteration"] for m in logs if m.get("skipped_steps") or not math.isfinite(m["loss"])]
    if bad or not evals or not all(math.isfinite(v) for v in evals):
        raise SystemExit(f"variant {name!r}: non-finite loss or skipped steps at the log intervals ending at "
                         f"iterations {bad}, validation losses {evals}")
    tail = [m["loss"] for m in logs[-2:]]
    row = {"variant": name, "final_train_loss": sum(tail) / len(tail), "eval_loss": evals[-1],
           "seconds": time.perf_counter() - t0, "curve": {m["iteration"]: m["loss"] for m in logs},
           "tokens_per_s": logs[-1].get("tokens_per_s") if logs else None,
           "eval_by_t": loss_by_mask_ratio(trainer, a.t_buckets)}
    if torch.cuda.is_available():
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def run_parallel(a: argparse.Namespace, names: list[str]) -> list[dict]:
    """Each variant in its own process, `a.parallel` at a time; rows in the order of `names`. The children are
    stopped when this process ends early (a time cap's SIGTERM included), so none keeps the GPU busy."""
    tmp = tempfile.mkdtemp(prefix="fp8conv_")
    if a.log_dir:
        os.makedirs(a.log_dir, exist_ok=True)
    pending, running, rows = list(enumerate(names)), [], {}
    from memory_fit import GIB, concurrent_runs, free_bytes

    free_before = None if a.smoke or a.parallel == 1 else free_bytes()
    limit = a.parallel if free_before is None else 1  # on a GPU: one run until its memory is measured
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        while pending or running:
            if free_before is not None and running and "\niter " in "\n" + Path(running[0][3].name).read_text():
                free_now = free_bytes() or 0
                limit = concurrent_runs(free_before, free_now, a.parallel)
                print(f"one run holds {(free_before - free_now) / GIB:.1f} GiB of the {free_before / GIB:.1f} GiB "
                      f"free: {limit} at a time", flush=True)
                free_before = None
            while pending and len(running) < limit:
                i, name = pending.pop(0)
                out = os.path.join(tmp, f"{i}.json")
                log = open(os.path.join(a.log_dir or tmp, f"variant{i}.log"), "w")
                argv = [sys.executable, os.path.abspath(__file__), "--model-path", a.model_path, "--iters",
                        str(a.iters), "--seq-length", str(a.seq_length), "--mbs", str(a.mbs), "--lr", str(a.lr),
                        "--t-buckets", str(a.t_buckets),
                        f"--extra={a.extra}", "--variants", name, "--parallel", "1", "--json-out", out]
                argv += (["--smoke"] if a.smoke else []) + (["--save-baseline", a.save_baseline]
                                                             if a.save_baseline else [])
                running.append((i, name, out, log, subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)))
            time.sleep(1)
            for item in list(running):
                i, name, out, log, proc = item
                if proc.poll() is None:
                    continue
                running.remove(item)
                log.close()
                if free_before is not None:  # ended before its first log line: run the rest one at a time
                    free_before = None
                if proc.returncode != 0 or not os.path.exists(out):
                    print(f"variant {name!r} failed (exit {proc.returncode}): see {log.name}", file=sys.stderr)
                    continue
                with open(out) as f:
                    rows[i] = json.load(f)[0]
    finally:
        signal.signal(signal.SIGTERM, previous)
        for _, _, _, log, proc in running:
            proc.terminate()
            proc.wait()
            log.close()
    return [rows[i] for i in sorted(rows)]


def main() -> None:
    from megadlms.triton_setup import use_torch_ptxas

    use_torch_ptxas()  # as the megadlms commands do: the FP8 Triton kernels compile with torch's ptxas
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", default="qwen3-0.6b")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--seq-length", type=int, default=512)
    p.add_argument("--mbs", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--variants", default=DEFAULT_VARIANTS,
                   help=f"comma-separated, or 'all': {', '.join(VARIANTS)}")
    p.add_argument("--parallel", type=int, default=1,
                   help="at most this many variants trained at once, each in its own process (on a GPU, as many as "
                        "the free memory holds)")
    p.add_argument("--extra", default="", help="more train flags, space separated")
    p.add_argument("--json-out", default=None)
    p.add_argument("--log-dir", default=None, help="where the per-variant logs go (with --parallel > 1)")
    p.add_argument("--corpus", choices=("bundled", "code"), default="bundled",
                   help="bundled: the demo corpus; code: this Python installation's sources (see above)")
    p.add_argument("--corpus-mb", type=float, default=60.0, help="MB of text for --corpus code")
    p.add_argument("--corpus-dir", default="/tmp/megadlms_code_corpus", help="where --corpus code is built")
    p.add_argument("--save-baseline", default=None, help="checkpoint folder for the bf16 run's final weights")
    p.add_argument("--t-buckets", type=int, default=10,
                   help="after training, the validation loss at this many mask ratios (t at each bucket's middle), "
                        "each variant's gap to BF16 per bucket (0: off)")
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args()
    if a.smoke:  # small enough for several processes on a laptop (the 151k-vocab logits dominate memory)
        a.seq_length, a.mbs = min(a.seq_length, 32), min(a.mbs, 2)
    if a.corpus == "code":  # built once here; the variants (and children) get it as --data-path
        a.extra = f"{a.extra} --data-path {build_code_corpus(Path(a.corpus_dir), a.corpus_mb, a.smoke)}".strip()
        a.corpus = "bundled"
    names = list(VARIANTS) if a.variants == "all" else [v.strip() for v in a.variants.split(",")]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    if a.parallel > 1:
        rows = run_parallel(a, names)
    else:
        rows = []
        for name in names:
            rows.append(run_variant(a, name))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(rows, f, indent=2)
    if a.parallel == 1 and a.json_out and len(names) == 1:
        return  # a child of run_parallel: the parent prints
    if rows:
        report(rows)
    if len(rows) < len(names):
        missing = sorted(set(names) - {r["variant"] for r in rows})
        raise SystemExit(f"{len(missing)} of {len(names)} variants failed: {', '.join(missing)} (logs above)")


def report(rows: list[dict]) -> None:
    base = next((r for r in rows if r["variant"] == "bf16"), rows[0])
    print(f"\n{'variant':<28}{'train loss':>11}{'eval loss':>11}{'gap vs bf16':>13}{'tok/s':>10}{'GiB':>6}{'s':>6}")
    for r in rows:
        gap = (r["eval_loss"] - base["eval_loss"]) / base["eval_loss"] * 100
        r["eval_gap_pct"] = gap
        tok = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-"
        gib = f"{r['peak_gib']:.1f}" if r.get("peak_gib") else "-"
        print(f"{r['variant']:<28}{r['final_train_loss']:>11.4f}{r['eval_loss']:>11.4f}{gap:>+12.2f}%"
              f"{tok:>10}{gib:>6}{r['seconds']:>6.0f}")
    if any(r.get("peak_gib") for r in rows):
        print("GiB: peak allocated. FP8 variants record telemetry (--fp8-stats), whose steps run the layers\n"
              "eagerly with their activations allocated; in other steps (and in BF16) CUDA graphs keep them in the\n"
              "graphs' pool, which this does not count. Memory against BF16: benchmarks/train_throughput.py.")
    report_by_mask_ratio(rows, base)
    iters = sorted({int(i) for r in rows for i in r["curve"]})
    marks = [i for i in iters if i % 50 == 0] or iters[-6:]
    print("\ntraining loss (mean of the 10 iterations up to)")
    print(f"{'variant':<28}" + "".join(f"{i:>8}" for i in marks))
    for r in rows:
        curve = {int(k): v for k, v in r["curve"].items()}
        print(f"{r['variant']:<28}" + "".join(f"{curve.get(i, float('nan')):>8.3f}" for i in marks))


def report_by_mask_ratio(rows: list[dict], base: dict, budget_pct: float = 0.5) -> None:
    """The validation loss per mask-ratio bucket of each variant, and its gap to BF16 (marked `!` past the budget)."""
    ts = list(base.get("eval_by_t") or {})
    if not ts:
        return
    print(f"\nvalidation loss by mask ratio t (gap to {base['variant']} in %, '!' past {budget_pct}%)")
    print(f"{'variant':<28}" + "".join(f"{'t=' + t:>14}" for t in ts) + f"{'worst gap':>11}")
    for r in rows:
        by = r.get("eval_by_t") or {}
        cells, worst = "", 0.0
        for t in ts:
            v, b = by.get(t, float("nan")), base["eval_by_t"][t]
            gap = (v - b) / b * 100
            worst = max(worst, abs(gap)) if math.isfinite(gap) else float("nan")
            cells += f"{v:8.3f}" + (f"{gap:+5.1f}{'!' if abs(gap) > budget_pct else ' '}" if r is not base else " " * 6)
        r["worst_bucket_gap_pct"] = worst
        print(f"{r['variant']:<28}{cells}" + (f"{worst:>10.2f}%" if r is not base else ""))


if __name__ == "__main__":
    main()
