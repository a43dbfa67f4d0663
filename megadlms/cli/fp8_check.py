"""`megadlms fp8-check`: can this machine run FP8, and how accurate and fast is one FP8 GEMM?

Prints the device, whether FP8 is supported, the relative error (against a float64 GEMM) of an
E4M3 x E4M3 `torch._scaled_mm` and of the high-precision GEMM (BF16 on CUDA, fp32 on CPU), and on
CUDA the TFLOP/s of both; which FP8 recipes (`--fp8-recipe`) run on the device; and whether FP8 attention
(`--fp8-dot-product-attention`) can run. Exit status 0
when FP8 runs and its error is within the E4M3 budget (FP8 attention is optional and does not count).
"""

from __future__ import annotations

import argparse

import torch

from ..fp8.attention import FP8AttentionUnsupportedError, check_fp8_attention_support
from ..fp8.gemm import scaled_mm
from ..fp8.hardware import FP8UnsupportedError, check_fp8_support, default_device, fp8_backend_note
from ..fp8.kernels.primitives import E4M3, quantize_tensorwise
from ..fp8.quantizer import make_quantizer
from ..fp8.recipe import RECIPE_CLASSES, RECIPE_NAMES, Recipe, names_with

RECIPES: dict[str, Recipe] = {name: cls() for name, cls in RECIPE_CLASSES.items()}  # each with its defaults

# E4M3 keeps 3 mantissa bits: ~2-3% relative error per operand on Gaussian data, ~4% for a product
MAX_REL_ERROR = 0.08


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="device to check (default: the current CUDA device, else cpu)")
    parser.add_argument("--size", type=int, nargs=3, metavar=("M", "N", "K"), default=None,
                        help="GEMM shape (default 8192 8192 8192 on CUDA, 256 256 512 on CPU)")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations on CUDA (default 20)")
    parser.add_argument("--seed", type=int, default=0)


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return f"cuda:{index} {torch.cuda.get_device_name(index)} (compute capability {major}.{minor})"
    return f"{device.type} ({torch.get_num_threads()} threads)"


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def _tflops(fn, flops: float, iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return flops * iters / (start.elapsed_time(end) * 1e-3) / 1e12


def describe_fp8_attention(device: torch.device) -> str:
    """One line: whether `--fp8-dot-product-attention` can run on `device`, and through what."""
    try:
        check_fp8_attention_support(device)
    except FP8AttentionUnsupportedError as e:
        return f"FP8 attention (--fp8-dot-product-attention): no\n  {e}"
    if device.type != "cuda":
        return "FP8 attention (--fp8-dot-product-attention): emulated on the CPU (for tests)"
    import cudnn

    return (f"FP8 attention (--fp8-dot-product-attention): yes (cuDNN {cudnn.backend_version_string()}, frontend "
            f"{getattr(cudnn, '__version__', '?')})")


def describe_recipes(device: torch.device) -> str:
    """Which `--fp8-recipe`s run on `device` (where FP8 runs at all), and why the others do not, one per line."""
    runs, lines = [], []
    for name in RECIPE_NAMES:
        recipe = RECIPES[name]
        try:
            if device.type == "cuda":
                index = device.index if device.index is not None else torch.cuda.current_device()
                make_quantizer(recipe, E4M3, None, 0).check_device(index)
        except FP8UnsupportedError as e:
            lines.append(f"  {name}: no ({e})")
            continue
        runs.append(name)
    emulated = " and ".join(names_with("cpu_emulated"))
    note = f" ({emulated} GEMMs emulated on the CPU, for tests)" if device.type == "cpu" else ""
    return "\n".join([f"FP8 recipes (--fp8-recipe): {', '.join(runs)}{note}"] + lines)


def run(args: argparse.Namespace) -> int:
    try:
        device = torch.device(args.device) if args.device else default_device()
    except RuntimeError:
        raise FP8UnsupportedError(f"--device {args.device!r} is not a device; use cpu, cuda or cuda:N") from None
    print(f"device: {describe_device(device)}")
    try:
        check_fp8_support(device)
    except FP8UnsupportedError as e:
        print(f"FP8 supported: no\n  {e}")
        return 1
    note = fp8_backend_note(device)
    print("FP8 supported: yes" + (f" ({note})" if note else ""))
    print(describe_recipes(device))
    print(describe_fp8_attention(device))

    cuda = device.type == "cuda"
    m, n, k = args.size or ((8192, 8192, 8192) if cuda else (256, 256, 512))
    gen = torch.Generator(device=device).manual_seed(args.seed)
    a = torch.randn(m, k, device=device, generator=gen)
    b = torch.randn(n, k, device=device, generator=gen)
    ref = a.double() @ b.double().t()
    hp = torch.bfloat16 if cuda else torch.float32
    aq, a_si, _ = quantize_tensorwise(a, E4M3)
    bq, b_si, _ = quantize_tensorwise(b, E4M3)
    a_hp, b_hp = a.to(hp), b.to(hp)

    def fp8_gemm() -> torch.Tensor:
        return scaled_mm(aq, bq.t(), a_si, b_si, hp, use_fast_accum=True)

    def hp_gemm() -> torch.Tensor:
        return a_hp @ b_hp.t()

    err8, err_hp = _rel(fp8_gemm(), ref), _rel(hp_gemm(), ref)
    hp_name = "BF16" if cuda else "FP32"
    print(f"GEMM {m}x{k} @ {k}x{n}, relative error vs float64:")
    print(f"  FP8 E4M3 x E4M3 (torch._scaled_mm, {hp} out): {err8:.4f}")
    print(f"  {hp_name}: {err_hp:.2e}")
    if cuda:
        flops = 2.0 * m * n * k
        t8, thp = _tflops(fp8_gemm, flops, args.iters), _tflops(hp_gemm, flops, args.iters)
        print(f"throughput: FP8 {t8:.0f} TFLOP/s, {hp_name} {thp:.0f} TFLOP/s ({t8 / thp:.2f}x)")
    if err8 > MAX_REL_ERROR:
        print(f"FAIL: FP8 relative error {err8:.4f} exceeds {MAX_REL_ERROR} (expected ~0.04 for E4M3)")
        return 1
    print("OK")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megadlms fp8-check", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
