"""FP8 numerics of Float8Linear with the real kernels: relative errors of the three GEMMs against float64.

For every recipe (delayed / tensorwise / rowwise x hybrid / e4m3) and shape (odd token counts and
odd feature dims included) this runs Float8Linear forward + backward under BF16 autocast, and prints
  fprop / dgrad / wgrad: relative error (Frobenius) against float64 GEMMs of the unquantized tensors;
  plumbing: the largest relative error against float64 GEMMs of the *same quantized operands*
            (catches layout, scale or padding bugs: it should be at the BF16 output rounding level);
  ms: forward + backward time (CUDA only), next to a BF16 nn.Linear;
plus a BF16 baseline row per shape. Delayed recipes are measured after a few steps (fp8_step), so
they use history-derived scales, not the first-step current scales.

    python benchmarks/fp8_numerics.py                 # CUDA, default shapes
    python benchmarks/fp8_numerics.py --device cpu --small
Exit status 1 if any error exceeds its budget.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megadlms.fp8 import (  # noqa: E402
    DelayedScaling,
    Float8CurrentScaling,
    Float8Linear,
    Float8RowwiseScaling,
    Format,
    fp8_autocast,
    fp8_step,
)
from megadlms.fp8.kernels.primitives import dequantize, quantize_rowwise, quantize_tensorwise  # noqa: E402

SHAPES = [  # (tokens M, in K, out N)
    (4095, 4096, 4096),    # a 2047/4095-token DLM batch: M not a multiple of 16
    (8192, 4096, 14336),   # Llama-3-8B MLP up-projection
    (8191, 14336, 4096),   # ... down-projection, odd token count
    (2000, 1000, 3000),    # no dim a multiple of 16
]
SMALL_SHAPES = [(95, 128, 64), (128, 64, 192), (50, 40, 24)]


def recipes() -> dict[str, object]:
    out = {}
    for fmt in (Format.HYBRID, Format.E4M3):
        out[f"delayed/{fmt.value}"] = DelayedScaling(fp8_format=fmt, amax_history_len=16)
        out[f"tensorwise/{fmt.value}"] = Float8CurrentScaling(fp8_format=fmt)
        out[f"rowwise/{fmt.value}"] = Float8RowwiseScaling(fp8_format=fmt)
    return out


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.detach().double() - ref).norm() / ref.norm())


def fake_quant(x: torch.Tensor, dtype: torch.dtype, axis: int | None) -> torch.Tensor:
    """The quantize-dequantize (float64) a recipe applies to a 2-D operand (current scales)."""
    if axis is None:
        q, si, _ = quantize_tensorwise(x, dtype)
    else:
        q, si = quantize_rowwise(x, dtype, axis)
    return dequantize(q, si, torch.float64)


def quantized_reference(recipe, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor):
    """float64 GEMMs of the operands as the recipe quantizes them on a first step."""
    e4, bwd = torch.float8_e4m3fn, recipe.fp8_format.bwd_dtype
    if isinstance(recipe, Float8RowwiseScaling):
        y = fake_quant(x, e4, 1) @ fake_quant(w, e4, 1).T
        dx = fake_quant(g, bwd, 1) @ fake_quant(w, e4, 0)
        dw = fake_quant(g, bwd, 0).T @ fake_quant(x, e4, 0)
    else:
        xq, wq, gq = fake_quant(x, e4, None), fake_quant(w, e4, None), fake_quant(g, bwd, None)
        y, dx, dw = xq @ wq.T, gq @ wq, gq.T @ xq
    return y, dx, dw


def fwd_bwd(layer, x: torch.Tensor, g: torch.Tensor, dtype: torch.dtype, fp8: bool):
    x = x.detach().requires_grad_()
    layer.weight.grad = None
    amp = torch.autocast(x.device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    with amp, fp8_autocast(enabled=fp8):
        y = layer(x)
    y.backward(g)
    return y, x.grad, layer.weight.grad


def timed(fn, device: torch.device, iters: int) -> float:
    if device.type != "cuda":
        return float("nan")
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters * 1e3


def main() -> int:
    from megadlms.triton_setup import use_torch_ptxas

    use_torch_ptxas()  # as the megadlms commands do: the FP8 Triton kernels compile with torch's ptxas
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="small shapes (CPU smoke run)")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations on CUDA")
    parser.add_argument("--grad-scale", type=float, default=1e-4, help="std of the output gradient")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = SMALL_SHAPES if args.small else SHAPES
    gen = torch.Generator(device=device).manual_seed(0)
    failed = False
    header = f"{'recipe':<18}{'M x K x N':>22}{'fprop':>9}{'dgrad':>9}{'wgrad':>9}{'plumbing':>10}{'ms':>9}  status"
    print(f"device {device}, compute dtype {dtype}, output-gradient std {args.grad_scale}")
    print(header)
    print("-" * len(header))
    for m, k, n in shapes:
        x = torch.randn(m, k, device=device, generator=gen)
        x[:, :8] *= 20  # a few outlier channels, as real activations have
        g = torch.randn(m, n, device=device, generator=gen) * args.grad_scale
        base = torch.nn.Linear(k, n, bias=False, device=device)
        x64, w64, g64 = x.double(), base.weight.detach().double(), g.double()
        ref = (x64 @ w64.T, g64 @ w64, g64.T @ x64)
        shape = f"{m} x {k} x {n}"

        y, dx, dw = fwd_bwd(base, x, g.to(dtype), dtype, fp8=False)
        ms = timed(lambda b=base, x=x, g=g: fwd_bwd(b, x, g.to(dtype), dtype, False), device, args.iters)
        errs = [rel(t, r) for t, r in zip((y, dx, dw), ref)]
        print(f"{'bf16 (reference)':<18}{shape:>22}" + "".join(f"{e:>9.4f}" for e in errs) + f"{'':>10}{ms:>9.2f}")

        for name, recipe in recipes().items():
            layer = Float8Linear(k, n, bias=False, device=device, recipe=recipe)
            with torch.no_grad():
                layer.weight.copy_(base.weight)
            # plumbing check on the first step (current scales in every recipe)
            y, dx, dw = fwd_bwd(layer, x, g.to(dtype), dtype, fp8=True)
            qref = quantized_reference(recipe, x, layer.weight.detach(), g.to(dtype).float())
            plumbing = max(rel(t, r) for t, r in zip((y, dx, dw), qref))
            if isinstance(recipe, DelayedScaling):  # move on to history-derived scales
                for _ in range(3):
                    fp8_step(layer)
                    y, dx, dw = fwd_bwd(layer, x, g.to(dtype), dtype, fp8=True)
            errs = [rel(t, r) for t, r in zip((y, dx, dw), ref)]
            ms = timed(lambda f=layer, x=x, g=g: fwd_bwd(f, x, g.to(dtype), dtype, True), device, args.iters)
            bwd_budget = 0.12 if recipe.fp8_format is Format.HYBRID else 0.07
            ok = errs[0] < 0.07 and errs[1] < bwd_budget and errs[2] < bwd_budget and plumbing < 0.01
            failed |= not ok
            print(f"{name:<18}{shape:>22}" + "".join(f"{e:>9.4f}" for e in errs) +
                  f"{plumbing:>10.1e}{ms:>9.2f}  {'ok' if ok else 'FAIL'}")
        print()
    print("budgets: fprop < 0.07; dgrad/wgrad < 0.07 (e4m3) or 0.12 (hybrid, E5M2 gradients); plumbing < 0.01")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
