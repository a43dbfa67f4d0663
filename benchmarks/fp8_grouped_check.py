"""The MoE experts' FP8 path on this device, checked (`gpu_validation.sh moe`):

1. casts: each grouped cast kernel (`triton_grouped_cast`: per row, per (expert, column), per expert, the weights'
   transposes, the per-expert amax) against its torch cast, bit for bit, for bf16 and fp32 inputs;
2. GEMMs: `fp8_grouped_gemm` (CUDA: `torch._scaled_grouped_mm`) against the same FP8 operands dequantized and
   multiplied in fp32 on the CPU, for fprop, dgrad and wgrad, with and without fast accumulation;
3. layer: an FP8 expert projection's forward and both gradients (x in bf16, fp32 master weight, BF16 autocast as in
   training) against the fp32 product, for each recipe the experts take, with the weight gradient in BF16 (the
   default) and in FP8.

    python benchmarks/fp8_grouped_check.py            # LLaDA-MoE shapes: 4096 tokens, top-8, 64 experts, 2048 x 1024
    python benchmarks/fp8_grouped_check.py --smoke    # tiny shapes (on the CPU: the torch casts and the emulation)

Prints one line per check with its error and ok / FAILED; exits 1 if any failed.

    python benchmarks/fp8_grouped_check.py --gemms    # the grouped GEMMs alone, timed

--gemms times each grouped product of an expert MLP (gate/up and down projections; fprop, dgrad, wgrad) at
LLaDA-MoE-7B-A1B (hidden 2048, 64 experts, FFN 1024) and Qwen3-30B-A3B (hidden 2048, 128 experts, FFN 768) shapes,
16384 tokens top-8 (--tokens), in BF16 (`grouped_gemm.gmm` / `gmm_wgrad`, as `grouped_linear` calls them) and in
FP8 (`fp8_grouped_gemm` on rowwise operands, as `fp8_grouped_linear` makes them), FP8 with Hopper's fast
accumulation and without (the layers use it in fprop only): ms (CUDA events, median of --iters) and TFLOP/s.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from timing import median_ms  # noqa: E402

from megadlms.fp8.expert_quantizer import ExpertQuantizer  # noqa: E402
from megadlms.fp8.gemm import fp8_grouped_gemm  # noqa: E402
from megadlms.fp8.grouped import fp8_grouped_linear  # noqa: E402
from megadlms.fp8.kernels import triton_cast  # noqa: E402
from megadlms.fp8.kernels import triton_grouped_cast as k  # noqa: E402
from megadlms.fp8.recipe import E4M3, Float8CurrentScaling, Float8RowwiseScaling, Recipe  # noqa: E402
from megadlms.fp8.tensor import FP8Tensor  # noqa: E402
from megadlms.grouped_gemm import gmm, gmm_wgrad, grouped_linear  # noqa: E402
from megadlms.moe import dispatch_plan  # noqa: E402

RECIPES: dict[str, Recipe] = {"rowwise": Float8RowwiseScaling(), "tensorwise": Float8CurrentScaling()}
# an FP8 product's relative error against fp32 (two E4M3 roundings of ~2**-4 relative, averaged over the sums)
LAYER_TOL = 0.08
failed: list[str] = []


def report(name: str, err: float, tol: float) -> None:
    ok = err <= tol
    if not ok:
        failed.append(name)
    print(f"{name:58} {err:10.3e}  (<= {tol:.0e}) {'ok' if ok else 'FAILED'}")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def differing(a: torch.Tensor, b: torch.Tensor) -> float:
    """The share of elements whose bits differ (0: equal)."""
    if a.shape != b.shape:
        return 1.0
    if a.dtype != torch.float32:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return (a != b).float().mean().item()


def to_cpu(t: FP8Tensor) -> FP8Tensor:
    return FP8Tensor(t.data.cpu(), t.scale_inv.cpu(), t.scaling, t.transposed,
                     t.offs.cpu() if t.offs is not None else None)


def check_casts(x: torch.Tensor, offs: torch.Tensor, w: torch.Tensor, repeats: int) -> None:
    if not triton_cast.enabled(x.device):
        print("casts: the Triton kernels do not run here (off CUDA): skipped")
        return
    e, n, c = w.shape
    wflat, woffs = w.reshape(e * n, c), torch.arange(1, e + 1, device=w.device, dtype=torch.int32) * n
    for dtype in (torch.bfloat16, torch.float32):
        xs = x.to(dtype)
        amax = k.expert_amax(xs, offs)
        report(f"cast {dtype}: per-expert amax", differing(amax, k.torch_expert_amax(xs, offs)), 0)
        for label, ea in (("per row", None), ("per expert", amax)):
            got, ref = k.row_cast(xs, E4M3, 0, offs, ea), k.torch_row_cast(xs, E4M3, 0, offs, ea)
            report(f"cast {dtype}: rows {label}", max(map(differing, got, ref)), 0)
        for label, ea in (("per (expert, column)", None), ("per expert", amax)):
            got, ref = k.col_cast(xs, offs, E4M3, 0, ea), k.torch_col_cast(xs, offs, E4M3, 0, ea)
            report(f"cast {dtype}: x^T {label}", max(map(differing, got, ref)), 0)
    # the transposed stores again on fresh inputs, other kernels in between (a store that goes wrong only sometimes)
    worst = 0.0
    for i in range(repeats):
        xs = torch.randn_like(x) * (i + 1)
        for ea in (None, k.expert_amax(xs, offs)):
            got, ref = k.col_cast(xs, offs, E4M3, 0, ea), k.torch_col_cast(xs, offs, E4M3, 0, ea)
            worst = max(worst, *map(differing, got, ref))
    report(f"cast bf16: x^T on {repeats} fresh inputs (worst)", worst, 0)
    wa = k.expert_amax(wflat, woffs)
    for label, ea in (("per (expert, column)", None), ("per expert", wa)):
        got = k.col_cast(wflat, woffs, E4M3, 0, ea, True)
        ref = k.torch_col_cast(wflat, woffs, E4M3, 0, ea, True)
        report(f"cast fp32 weight: W^T {label}", max(map(differing, got, ref)), 0)


def check_gemms(x: torch.Tensor, offs: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> None:
    for name, recipe in RECIPES.items():
        quant = ExpertQuantizer(recipe)
        xq, x_t = quant.quantize(x, offs, rows=True, cols=True)
        gq, g_t = quant.quantize(g, offs, rows=True, cols=True)
        wq, w_t = quant.quantize_weight(w, rows=True, cols=True)
        assert xq is not None and x_t is not None and gq is not None and g_t is not None
        assert wq is not None and w_t is not None
        for (label, a, b), fast in ((p, f) for p in (("fprop", xq, wq), ("dgrad", gq, w_t), ("wgrad", g_t, x_t))
                                    for f in (False, True)):
            got = fp8_grouped_gemm(a, b, torch.float32, fast)
            ref = fp8_grouped_gemm(to_cpu(a), to_cpu(b), torch.float32, False)
            if label != "wgrad":  # rows past offs[-1] are not computed by every backend
                rows = int(offs[-1])
                got, ref = got[:rows], ref[:rows]
            report(f"gemm {name}: {label}{' fast-accum' if fast else ''} vs dequantized fp32", rel(got, ref), 1e-2)


def check_layer(x: torch.Tensor, offs: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> None:
    dev = x.device.type
    for (name, recipe), fp8_wgrad in ((r, f) for r in RECIPES.items() for f in (False, True)):
        if fp8_wgrad:
            name += " fp8-wgrad"
        xf = x.detach().clone().requires_grad_()
        wf = w.detach().clone().requires_grad_()
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            y = fp8_grouped_linear(xf, wf, offs, recipe, fp8_wgrad=fp8_wgrad)
        y.backward(g.to(y.dtype))
        xr = x.detach().float().requires_grad_()
        wr = w.detach().clone().requires_grad_()
        grouped_linear(xr, wr, offs, impl="loop").backward(g.float())
        with torch.no_grad():
            yr = grouped_linear(x.float(), w, offs, impl="loop")
        rows = int(offs[-1])
        report(f"layer {name}: forward vs fp32", rel(y[:rows], yr[:rows]), LAYER_TOL)
        assert xf.grad is not None and xr.grad is not None and wf.grad is not None and wr.grad is not None
        report(f"layer {name}: input gradient vs fp32", rel(xf.grad[:rows], xr.grad[:rows]), LAYER_TOL)
        report(f"layer {name}: weight gradient vs fp32", rel(wf.grad, wr.grad), LAYER_TOL)


GEMM_SHAPES = {"llada-moe-7b-a1b": dict(hidden=2048, ffn=1024, experts=64),
               "qwen3-30b-a3b": dict(hidden=2048, ffn=768, experts=128)}
SMOKE_GEMM_SHAPES = {"llada-moe-7b-a1b": dict(hidden=64, ffn=32, experts=4),
                     "qwen3-30b-a3b": dict(hidden=64, ffn=48, experts=8)}


def gemm_products(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, offs: torch.Tensor
                  ) -> dict[str, tuple[Callable[[], object], Callable[[], object], Callable[[], object]]]:
    """One projection y = x @ W_e^T (x [M, K] bf16, w [E, N, K] fp32, g [M, N] bf16): per product, the BF16 GEMM
    as `grouped_linear` runs it and the FP8 one (fast accumulation, then precise) on rowwise operands."""
    quant = ExpertQuantizer(RECIPES["rowwise"])
    wb = w.to(torch.bfloat16)
    xq, x_t = quant.quantize(x, offs, rows=True, cols=True)
    gq, g_t = quant.quantize(g, offs, rows=True, cols=True)
    wq, w_t = quant.quantize_weight(w, rows=True, cols=True)
    assert xq is not None and x_t is not None and gq is not None and g_t is not None
    assert wq is not None and w_t is not None
    bf16 = {"fprop": lambda: gmm(x, wb.transpose(-2, -1), offs), "dgrad": lambda: gmm(g, wb, offs),
            "wgrad": lambda: gmm_wgrad(g.t(), x, offs)}
    fp8 = {"fprop": (xq, wq), "dgrad": (gq, w_t), "wgrad": (g_t, x_t)}

    def fp8_gemm(a: FP8Tensor, b: FP8Tensor, fast_accum: bool) -> Callable[[], object]:
        return lambda: fp8_grouped_gemm(a, b, torch.bfloat16, fast_accum)

    return {p: (bf16[p], fp8_gemm(a, b, True), fp8_gemm(a, b, False)) for p, (a, b) in fp8.items()}


def time_gemms(args: argparse.Namespace, device: torch.device) -> None:
    """--gemms: the table of the module docstring."""
    shapes = SMOKE_GEMM_SHAPES if args.smoke else GEMM_SHAPES
    print(f"{'shape':16} | {'projection':10} | {'GEMM':5} | {'BF16 ms':>7} | {'TFLOP/s':>7} | {'FP8 fast ms':>11} | "
          f"{'TFLOP/s':>7} | {'FP8 ms':>6} | {'TFLOP/s':>7} | FP8 fast / BF16")
    for shape, dims in shapes.items():
        h, f, e = dims["hidden"], dims["ffn"], dims["experts"]
        torch.manual_seed(0)
        plan = dispatch_plan(torch.randn(args.tokens, e, device=device).topk(args.topk, dim=-1).indices, e)
        offs, m = plan.offs, plan.rows
        for proj, (k_in, n_out) in (("gate/up", (h, f)), ("down", (f, h))):
            x = torch.randn(m, k_in, device=device).to(torch.bfloat16)
            w = torch.randn(e, n_out, k_in, device=device) * 0.02
            g = torch.randn(m, n_out, device=device).to(torch.bfloat16)
            tflop = 2 * m * n_out * k_in / 1e12
            for product, fns in gemm_products(x, w, g, offs).items():
                ms = [median_ms(fn, device, args.iters) for fn in fns]
                rates = [tflop / (t / 1e3) for t in ms]
                print(f"{shape:16} | {proj:10} | {product:5} | {ms[0]:7.3f} | {rates[0]:7.1f} | {ms[1]:11.3f} | "
                      f"{rates[1]:7.1f} | {ms[2]:6.3f} | {rates[2]:7.1f} | {ms[0] / ms[1]:.2f}x", flush=True)
            del x, w, g


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--repeats", type=int, default=10, help="fresh inputs for the transposed stores' second check")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU check of the script)")
    p.add_argument("--gemms", action="store_true", help="time the grouped GEMMs, BF16 and FP8, at both MoE shapes")
    p.add_argument("--iters", type=int, default=20, help="--gemms: timed runs per GEMM (median)")
    args = p.parse_args()
    if args.gemms and "--tokens" not in sys.argv:
        args.tokens = 16384  # as benchmarks/moe_block.py
    if args.smoke:
        args.tokens, args.hidden, args.ffn, args.experts, args.topk, args.repeats = 48, 64, 32, 4, 2, 2
        args.iters = 1
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        from megadlms.triton_setup import use_torch_ptxas

        use_torch_ptxas()  # as the megadlms commands do: the FP8 Triton kernels compile with torch's ptxas
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    if args.gemms:
        print(f"device {name}, torch {torch.__version__}; tokens {args.tokens} top-{args.topk}")
        time_gemms(args, device)
        return
    print(f"device {name}, torch {torch.__version__}; tokens {args.tokens} top-{args.topk} hidden {args.hidden} "
          f"ffn {args.ffn} experts {args.experts}")
    torch.manual_seed(0)
    logits = torch.randn(args.tokens, args.experts, device=device)
    logits[:, 1] = -1e9  # an expert without tokens
    plan = dispatch_plan(logits.topk(args.topk, dim=-1).indices, args.experts)
    offs, m = plan.offs, plan.rows
    x = torch.randn(m, args.hidden, device=device).to(torch.bfloat16)
    x[: m // 8] *= 30  # a few experts with larger inputs: their own scales
    w = torch.randn(args.experts, args.ffn, args.hidden, device=device) * 0.02
    g = torch.randn(m, args.ffn, device=device).to(torch.bfloat16)
    check_casts(x, offs, w, args.repeats)
    check_gemms(x, offs, w, g)
    check_layer(x, offs, w, g)
    print(f"{len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
