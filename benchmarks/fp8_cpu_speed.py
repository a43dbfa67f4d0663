"""FP8 training on the CPU against BF16 autocast: milliseconds per training iteration of a small model for each
per-tensor and rowwise recipe, and the ratio to BF16 (the CPU runs FP8 for tests and debugging: its GEMMs are
dequantised fp32 matmuls, `megadlms.fp8.gemm.cpu_scaled_mm`; the goal is FP8 within 3x of BF16).

    python3 benchmarks/fp8_cpu_speed.py                       # hidden 256, 2 layers, 4 x 128 tokens, 6 iterations
    python3 benchmarks/fp8_cpu_speed.py --smoke               # tiny shapes, 2 iterations
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from megadlms.config import TransformerConfig
from megadlms.fp8 import DelayedScaling, Float8CurrentScaling, Float8RowwiseScaling, Format, convert_to_fp8, fp8_step
from megadlms.model import TransformerLM

RECIPES = {"bf16": None, "fp8 delayed": lambda: DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16),
           "fp8 tensorwise": lambda: Float8CurrentScaling(), "fp8 rowwise": lambda: Float8RowwiseScaling()}


def ms_per_iter(recipe, hidden: int, tokens: int, iters: int) -> float:
    """Mean wall-clock milliseconds of iterations 2..iters (forward, backward, AdamW, fp8_step) under bf16 autocast."""
    cfg = TransformerConfig(num_layers=2, hidden_size=hidden, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=3 * hidden, vocab_size=512, seq_length=tokens,
                            untie_embeddings_and_output_weights=True)
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    if recipe is not None:
        model = convert_to_fp8(model, recipe())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for _ in range(iters):
        ids = torch.randint(0, 512, (4, tokens))
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids)
        F.cross_entropy(logits.float().flatten(0, 1), torch.roll(ids, -1, 1).flatten()).backward()
        opt.step()
        opt.zero_grad()
        if recipe is not None:
            fp8_step(model)
        times.append(time.perf_counter() - start)
    rest = times[1:] or times
    return sum(rest) / len(rest) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=128, help="tokens per sequence (4 sequences a batch)")
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--smoke", action="store_true", help="hidden 64, 32 tokens, 2 iterations")
    args = ap.parse_args()
    if args.smoke:
        args.hidden, args.tokens, args.iters = 64, 32, 2
    torch.set_num_threads(1)
    print(f"hidden {args.hidden}, 2 layers, 4 x {args.tokens} tokens, torch {torch.__version__}, 1 thread")
    print(f"{'variant':16s} | {'ms/iter':>8s} | vs bf16")
    base = None
    for name, recipe in RECIPES.items():
        ms = ms_per_iter(recipe, args.hidden, args.tokens, args.iters)
        base = base or ms
        print(f"{name:16s} | {ms:8.1f} | {ms / base:5.2f}x")


if __name__ == "__main__":
    main()
