"""Does launching through torchrun cost throughput on one GPU?

Runs the same `pretrain_difflm.py` command twice per round: plain (`python pretrain_difflm.py ...`)
and through the launcher (`torchrun --standalone --nproc_per_node=1 pretrain_difflm.py ...`, world
size 1), alternating over `--rounds` rounds so that drift hits both alike. Throughput is the
trainer's own tokens/s per log interval (metrics.jsonl), the median over the intervals after
`--skip` warm-up intervals (compilation, allocator growth). Prints a table and whether the torchrun
path is within `--tolerance` (default 2%) of the plain one; exits 1 when it is not.

The data is a synthetic Megatron corpus of random ordinary token ids (no special ids; written to a temporary
folder), with varying-length batches off so every step has the same shape. A run with a non-finite loss or a
skipped step fails the benchmark. torchrun also sets OMP_NUM_THREADS=1
for its workers unless it is set: that is part of the difference measured (on a busy CPU-only machine
it can make the torchrun path the faster one).

    python benchmarks/torchrun_overhead.py                 # on a GPU: qwen3-0.6b, seq 2048, 2 rounds
    python benchmarks/torchrun_overhead.py --smoke         # the tiny preset on the CPU
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from train_throughput import run_logged, write_corpus  # noqa: E402  (the sibling benchmark's helpers)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b", help="--model-path of the runs")
    p.add_argument("--batch", type=int, default=8, help="micro-batch size (sequences)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--iters", type=int, default=60, help="training iterations per run")
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument("--skip", type=int, default=2, help="log intervals left out at the start of each run")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tolerance", type=float, default=0.02)
    p.add_argument("--extra", default="", help="more flags for both runs, e.g. '--fp8-format hybrid'")
    p.add_argument("--smoke", action="store_true", help="tiny preset on the CPU, a few steps")
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
    p.add_argument("--out", default=None, help="folder for the run logs and the JSON result")
    a = p.parse_args()
    if a.smoke:
        a.model, a.batch, a.seq, a.iters, a.log_interval, a.skip, a.rounds = "tiny", 2, 128, 12, 2, 1, 1
    if a.iters // a.log_interval <= a.skip:
        p.error(f"--iters {a.iters} gives {a.iters // a.log_interval} log intervals, not more than --skip {a.skip}")
    return a


def interval_throughput(metrics_dir: Path, skip: int, name: str = "run") -> list[float]:
    """Tokens/s of the training log intervals after the first `skip`; exits with one line when any interval had
    a non-finite loss or skipped steps (its time would be of steps without an update)."""
    lines = (metrics_dir / "metrics.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, lines) if r.get("split") == "train"]
    bad = [r.get("iteration") for r in rows if r.get("skipped_steps") or not math.isfinite(r.get("loss", math.nan))]
    if bad:
        sys.exit(f"{name}: non-finite loss or skipped steps in the log intervals ending at iterations {bad}")
    return [r["tokens_per_s"] for r in rows[skip:]]


def main() -> None:
    a = parse_args()
    out = Path(a.out) if a.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    import torch

    device = "cpu" if a.smoke or not torch.cuda.is_available() else torch.cuda.get_device_name()
    paths = {"python pretrain_difflm.py": [sys.executable],
             "torchrun --nproc_per_node=1": [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                             "--nproc_per_node=1"]}
    samples: dict[str, list[float]] = {name: [] for name in paths}
    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "synthetic_text_document"
        write_corpus(prefix, vocab=4096 if a.smoke else 128000, n_tokens=(a.iters + 2) * a.batch * (a.seq + 1) * 2)
        flags = ["--model-path", a.model, "--seq-length", str(a.seq), "--micro-batch-size", str(a.batch),
                 "--train-iters", str(a.iters), "--log-interval", str(a.log_interval), "--data-path", str(prefix),
                 "--lr", "1e-4", "--lr-warmup-iters", "10", "--eval-iters", "0", "--difflm-varilen-prob", "0",
                 "--no-progress", "--no-generate-sample", *a.extra.split()]
        if a.smoke:
            flags += ["--device", "cpu"]
        for r in range(a.rounds):
            for name, launcher in paths.items():
                metrics = Path(tmp) / f"run{r}_{name.split()[0]}"  # metrics.jsonl only: no --save, no checkpoint
                cmd = [*launcher, str(ROOT / "pretrain_difflm.py"), *flags, "--tensorboard-dir", str(metrics)]
                rc, text = run_logged(cmd, out / "runs.log" if out else None, a.timeout)
                if rc:
                    tail = "\n".join(text.strip().splitlines()[-15:])
                    sys.exit(f"{name} (round {r}) failed with exit code {rc}:\n{tail}")
                tok = interval_throughput(metrics, a.skip, f"{name} (round {r})")
                samples[name] += tok
                print(f"round {r} {name}: median {statistics.median(tok):,.0f} tok/s over {len(tok)} intervals",
                      flush=True)

    medians = {name: statistics.median(v) for name, v in samples.items()}
    plain, launched = medians.values()
    ratio = launched / plain
    print(f"\n{a.model}, micro-batch {a.batch} x seq {a.seq}, {device}, torch {torch.__version__}")
    print("| path | tokens/s (median) | vs plain |\n|---|---:|---:|")
    for name, v in medians.items():
        print(f"| {name} | {v:,.0f} | {v / plain:.3f} |")
    ok = abs(ratio - 1) <= a.tolerance
    print(f"\ntorchrun / plain = {ratio:.4f}: {'within' if ok else 'OUTSIDE'} {a.tolerance:.0%}")
    if out is not None:
        (out / "torchrun_overhead.json").write_text(json.dumps(
            {"model": a.model, "batch": a.batch, "seq": a.seq, "device": device, "torch": torch.__version__,
             "tokens_per_s": medians, "ratio": ratio, "within_tolerance": ok, "samples": samples}, indent=1))
    sys.exit(0 if ok or a.smoke else 1)


if __name__ == "__main__":
    main()
