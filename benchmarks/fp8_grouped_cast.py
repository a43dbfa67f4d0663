"""Bandwidth of the MoE experts' grouped FP8 casts (`megadlms/fp8/kernels/triton_grouped_cast.py`) against the
device's copy bandwidth.

    python benchmarks/fp8_grouped_cast.py                    # LLaDA-MoE-7B-A1B shapes (8192 tokens, top-8, 64 experts)
    python benchmarks/fp8_grouped_cast.py --experts 128 --ffn 768    # Qwen3-30B-A3B's experts
    python benchmarks/fp8_grouped_cast.py --sweep            # also each kernel's tiles: the fastest per cast

Each cast of one MoE layer's step (the dispatched tokens x [M, H] and the gradient of the down projection's output
[M, H], the SwiGLU output h [M, F], the fp32 weights [E, F, H] / [E, H, F]) is timed with CUDA events (median of
--iters). bytes: what the cast must move (its input read once, the FP8 output and scales written); GB/s = bytes /
time; copy GB/s: a plain device copy moving as many bytes (`torch.Tensor.copy_` of bytes / 2); of copy: the copy's
time over the cast's. The goal is
>= 70% of copy for every one-pass cast; `+amax` rows add the per-expert amax pass that per-expert (tensorwise)
scaling needs before its casts. Off CUDA (--smoke) the torch casts run on the CPU, to check the script itself.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from timing import median_ms  # noqa: E402

from megadlms.fp8.kernels import triton_grouped_cast as k  # noqa: E402
from megadlms.fp8.recipe import E4M3  # noqa: E402
from megadlms.moe import dispatch_plan  # noqa: E402

SWEEP = {"row_cast": [(0, 0, 8), (0, 0, 4), (0, 0, 16), (8, 256, 4), (16, 256, 8), (4, 1024, 8), (2, 2048, 8)],
         "col_cast": [(32, 64, 4), (64, 64, 4), (128, 64, 8), (64, 128, 8), (64, 32, 4), (128, 32, 4), (256, 32, 8),
                      (128, 16, 4), (256, 16, 4)],
         "expert_amax": [(16, 256, 4), (8, 512, 8), (32, 256, 8), (4, 2048, 8)]}
# a weight's transposes: also each expert's rows whole in one tile (rows 0; columns 0: as many as fit)
SWEEP["col_cast_weight"] = SWEEP["col_cast"] + [(0, 0, 8), (0, 0, 4), (0, 0, 16), (0, 8, 4), (0, 8, 8), (0, 16, 8)]


def timed_copy(nbytes: int, device: torch.device, iters: int, warmup: int) -> float:
    """Median milliseconds of a device copy moving `nbytes` (nbytes / 2 read, as many written)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return median_ms(lambda: dst.copy_(src), device, iters, warmup)


def casts(args, device: torch.device) -> list[tuple[str, str, int, int, object]]:
    """(name, kernel, bytes moved, elements, fn(tile)) of each cast of one MoE layer's step."""
    torch.manual_seed(0)
    tokens, e, h, f = args.tokens, args.experts, args.hidden, args.ffn
    logits = torch.randn(tokens, e, device=device)
    plan = dispatch_plan(logits.topk(args.topk, dim=-1).indices, e)
    offs, m = plan.offs, plan.rows
    x = torch.randn(m, h, device=device, dtype=torch.bfloat16)
    hid = torch.randn(m, f, device=device, dtype=torch.bfloat16)
    w = torch.randn(e, f, h, device=device)
    wflat, woffs = w.reshape(e * f, h), torch.arange(1, e + 1, device=device, dtype=torch.int32) * f
    gpu = device.type == "cuda"
    row = k.row_cast if gpu else (lambda *a, tile=None: k.torch_row_cast(*a))
    col = k.col_cast if gpu else (lambda *a, tile=None: k.torch_col_cast(*a))
    amax = k.expert_amax if gpu else (lambda *a, tile=None: k.torch_expert_amax(*a))
    ax, aw = amax(x, offs), amax(wflat, woffs)

    def size(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def moved(src: torch.Tensor, scales: int) -> int:
        return size(src) + src.numel() + 4 * scales

    return [
        ("x rows, per row", "row_cast", moved(x, m), x.numel(), lambda t: row(x, E4M3, 0, None, None, tile=t)),
        ("x^T, per (expert, column)", "col_cast", moved(x, e * h), x.numel(),
         lambda t: col(x, offs, E4M3, 0, None, False, tile=t)),
        ("h rows, per row", "row_cast", moved(hid, m), hid.numel(), lambda t: row(hid, E4M3, 0, None, None, tile=t)),
        ("h^T, per (expert, column)", "col_cast", moved(hid, e * f), hid.numel(),
         lambda t: col(hid, offs, E4M3, 0, None, False, tile=t)),
        ("x rows, per expert", "row_cast", moved(x, m), x.numel(), lambda t: row(x, E4M3, 0, offs, ax, tile=t)),
        ("x^T, per expert", "col_cast", moved(x, e * h), x.numel(),
         lambda t: col(x, offs, E4M3, 0, ax, False, tile=t)),
        ("x +amax, per expert", "expert_amax", size(x), x.numel(), lambda t: amax(x, offs, tile=t)),
        ("W rows fp32, per (expert, row)", "row_cast", moved(w, e * f), w.numel(),
         lambda t: row(wflat, E4M3, 0, None, None, tile=t)),
        ("W^T fp32, per (expert, column)", "col_cast_weight", moved(w, e * h), w.numel(),
         lambda t: col(wflat, woffs, E4M3, 0, None, True, tile=t)),
        ("W^T fp32, per expert", "col_cast_weight", moved(w, e * h), w.numel(),
         lambda t: col(wflat, woffs, E4M3, 0, aw, True, tile=t)),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=1024, help="expert FFN width")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--sweep", action="store_true",
                   help="time each kernel's tiles (SWEEP: rows x columns, warps; whole: whole rows), show the fastest")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU check of the script)")
    args = p.parse_args()
    if args.smoke:
        args.tokens, args.hidden, args.ffn, args.experts, args.topk, args.iters, args.warmup = 64, 64, 32, 4, 2, 1, 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        from megadlms.triton_setup import use_torch_ptxas

        use_torch_ptxas()  # as the megadlms commands do: the FP8 Triton kernels compile with torch's ptxas
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (torch casts)"
    print(f"device {name}, torch {torch.__version__}; tokens {args.tokens} top-{args.topk} hidden {args.hidden} "
          f"ffn {args.ffn} experts {args.experts}")
    print(f"{'cast':32} | {'tile':>13} | {'ms':>7} | {'GB/s':>7} | {'copy GB/s':>9} | {'of copy':>7}")
    print(f"{'-' * 32}-|-{'-' * 13}-|-{'-' * 7}-|-{'-' * 7}-|-{'-' * 9}-|-{'-' * 7}")
    worst = 1.0
    for label, kernel, nbytes, _, fn in casts(args, device):
        tiles = SWEEP[kernel] if args.sweep and device.type == "cuda" else [None]
        best = min(((median_ms(lambda t=t: fn(t), device, args.iters, args.warmup), t) for t in tiles),
                   key=lambda r: r[0])
        ms, tile = best
        copy_ms = timed_copy(nbytes, device, args.iters, args.warmup)
        gbs, copy_gbs = nbytes / ms / 1e6, nbytes / copy_ms / 1e6
        share = copy_ms / ms
        if kernel != "expert_amax":
            worst = min(worst, share)
        t = tile or k.TILES[kernel]  # (rows, columns, warps); columns 0: whole rows
        whole = "whole" if t[1] == 0 else f"whole x{t[1]}"  # row_cast: whole rows; col_cast_weight: whole experts
        tile_s = "-" if device.type != "cuda" else f"{whole if 0 in t[:2] else f'{t[0]}x{t[1]}'} {t[2]}w"
        print(f"{label:32} | {tile_s:>13} | {ms:7.3f} | {gbs:7,.0f} | {copy_gbs:9,.0f} | {share:7.0%}")
    print(f"slowest one-pass cast: {worst:.0%} of copy (goal >= 70%)")


if __name__ == "__main__":
    main()
