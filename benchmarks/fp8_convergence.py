"""FP8 vs BF16 loss curves with the real trainer, on the same data and masks.

Trains the same model from the same initialisation in BF16, FP8 delayed scaling (hybrid) and FP8
tensorwise (current) scaling, then prints the final training loss (mean of the last 20
iterations) and the validation loss of each, with the relative gap to BF16. Target: within 1.5%.

    python benchmarks/fp8_convergence.py --model-path qwen3-0.6b --iters 300 --seq-length 1024 --mbs 16
    python benchmarks/fp8_convergence.py --smoke      # CPU, tiny, seconds (checks the script)
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from megadlms.training.args import parse_train_args
from megadlms.training.trainer import setup

VARIANTS = {
    "bf16": [],
    "fp8 delayed/hybrid": ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "16",
                           "--fp8-amax-compute-algo", "max"],
    "fp8 tensorwise/hybrid": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", default="qwen3-0.6b")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--mbs", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--extra", default="", help="more train flags, space separated")
    p.add_argument("--json-out", default=None)
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args()
    common = ["--model-path", a.model_path, "--seq-length", str(a.seq_length), "--micro-batch-size", str(a.mbs),
              "--train-iters", str(a.iters), "--lr", str(a.lr), "--min-lr", str(a.lr / 10),
              "--lr-warmup-iters", str(max(1, a.iters // 10)), "--log-interval", "10", "--eval-iters", "8",
              "--eval-interval", str(a.iters), "--no-progress", "--no-generate-sample", "--fp8-stats"]
    if a.smoke:
        common += ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups",
                   "2", "--ffn-hidden-size", "128", "--device", "cpu", "--bf16", "--num-workers", "0"]
    common += a.extra.split()
    rows = []
    for name, flags in VARIANTS.items():
        args = parse_train_args(common + flags)
        trainer = setup(args)
        t0 = time.perf_counter()
        state = trainer.run()
        train_losses = [m["loss"] for m in state.history if "loss" in m and "eval_loss" not in m]
        evals = [m["eval_loss"] for m in state.history if "eval_loss" in m]
        tail = train_losses[-2:] if len(train_losses) >= 2 else train_losses
        rows.append({"variant": name, "final_train_loss": sum(tail) / len(tail), "eval_loss": evals[-1],
                     "seconds": time.perf_counter() - t0,
                     "tokens_per_s": state.history[-2]["tokens_per_s"] if len(state.history) > 1 else None})
        del trainer
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    base = rows[0]
    print(f"\n{'variant':<24}{'train loss':>12}{'eval loss':>12}{'gap vs bf16':>14}{'tok/s':>12}{'time s':>9}")
    for r in rows:
        gap = (r["eval_loss"] - base["eval_loss"]) / base["eval_loss"] * 100
        r["eval_gap_pct"] = gap
        tok = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-"
        print(f"{r['variant']:<24}{r['final_train_loss']:>12.4f}{r['eval_loss']:>12.4f}{gap:>+13.2f}%"
              f"{tok:>12}{r['seconds']:>9.0f}")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
