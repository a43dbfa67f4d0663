"""FP8 attention (`megadlms.fp8.attention.Float8DotProductAttention`, cuDNN's FP8 flash attention) against BF16 SDPA
at the trainer's attention shapes (bidirectional, grouped K/V): forward and backward time of the module as the
trainer calls it (its FP8 casts of q, k, v and dO and the BF16 conversions of O, dQ, dK, dV included), and the
error of O, dQ, dK, dV against an fp32 reference next to BF16 SDPA's own error. `--check` first compares the
cuDNN path with the CPU emulation's arithmetic on the same FP8 operands at a small shape.

The FP8 module runs with delayed scales (after one step and `fp8_step`), as in training from the second step on.
Needs the `nvidia-cudnn-frontend` package on the GPU machine (carry its wheel, `pip install --no-deps`).

    python benchmarks/fp8_attention.py --shapes qwen,llama --check
    python benchmarks/fp8_attention.py --smoke      # CPU, emulated, tiny (checks the script)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import megadlms.fp8.attention as attention  # noqa: E402
from benchmarks.adamw_speed import timed  # noqa: E402
from megadlms.fp8 import fp8_autocast, fp8_step  # noqa: E402
from megadlms.fp8.recipe import DelayedScaling, Format  # noqa: E402

SHAPES = {  # name: (batch, query heads, kv heads, seq, head dim), as train_throughput.py runs them
    "qwen": (4, 16, 8, 4096, 128),
    "llama": (2, 32, 8, 4096, 128),
    "small": (1, 4, 2, 512, 128),
    "tiny": (1, 4, 2, 64, 16),
}


def _inputs(shape: tuple[int, ...], device: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k, v, dO in fp32, [B, H, S, D] views of [B, S, H, D] memory (how the model's projections lay them out)."""
    b, hq, hk, s, d = shape
    g = torch.Generator(device=device).manual_seed(seed)
    q, do = (torch.randn(b, s, hq, d, device=device, generator=g).transpose(1, 2) for _ in range(2))
    k, v = (torch.randn(b, s, hk, d, device=device, generator=g).transpose(1, 2) for _ in range(2))
    return q, k, v, do * 1e-3


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref.float()).norm() / ref.float().norm())


def _attend(fn, q, k, v, do):
    """(O, dQ, dK, dV) of fn(q, k, v) with upstream gradient do."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    o = fn(q, k, v)
    return (o.detach(), *torch.autograd.grad(o, (q, k, v), do))


def _fp8_module(recipe: DelayedScaling, device: str, q, k, v, do) -> attention.Float8DotProductAttention:
    """A module with delayed scales from one step on these inputs."""
    mod = attention.Float8DotProductAttention(recipe, device=device)
    with fp8_autocast(enabled=True, fp8_recipe=recipe):
        _attend(lambda *a: mod(*a, None, False), q, k, v, do)
    fp8_step(mod)
    return mod


def check(device: str, recipe: DelayedScaling) -> None:
    """cuDNN against the emulation's arithmetic on the same FP8 operands and scales (the small shape)."""
    q, k, v, do = (t.to(torch.bfloat16) for t in _inputs(SHAPES["small"], device))
    mod = _fp8_module(recipe, device, q, k, v, do)
    results = {}
    for name, backend in (("cudnn", attention._backend(torch.device(device))), ("emulated", attention._EMULATED)):
        saved = attention._backend
        attention._backend = lambda _dev, b=backend: b
        try:
            with fp8_autocast(enabled=True, fp8_recipe=recipe):
                results[name] = _attend(lambda *a: mod(*a, None, False), q, k, v, do)
        finally:
            attention._backend = saved
    errs = [_rel(a, b) for a, b in zip(results["cudnn"], results["emulated"])]
    print("check: cuDNN vs emulation on the same FP8 operands, rel. difference O/dQ/dK/dV: "
          + "/".join(f"{e:.1e}" for e in errs))


def probe(name: str, device: str, recipe: DelayedScaling, iters: int) -> dict:
    q32, k32, v32, do32 = _inputs(SHAPES[name], device)
    q, k, v, do = (t.to(torch.bfloat16) for t in (q32, k32, v32, do32))
    row: dict = {"shape": name}
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        ref = _attend(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, enable_gqa=True), q32, k32, v32, do32)

    def bf16(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, enable_gqa=True)

    mod = _fp8_module(recipe, device, q, k, v, do)

    def fp8(a, b, c):
        with fp8_autocast(enabled=True, fp8_recipe=recipe):
            return mod(a, b, c, None, False)

    for label, fn in (("bf16", bf16), ("fp8", fp8)):
        row[f"{label} err"] = "/".join(f"{_rel(x, r):.1e}" for x, r in zip(_attend(fn, q, k, v, do), ref))
        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
        t_fwd = timed(lambda: fn(qg, kg, vg), iters)
        t_all = timed(lambda: torch.autograd.grad(fn(qg, kg, vg), (qg, kg, vg), do), iters)
        row[f"{label} fwd"], row[f"{label} bwd"] = t_fwd, t_all - t_fwd
    row["fwd x"] = row["bf16 fwd"] / row["fp8 fwd"]
    row["bwd x"] = row["bf16 bwd"] / row["fp8 bwd"]
    row["tot x"] = (row["bf16 fwd"] + row["bf16 bwd"]) / (row["fp8 fwd"] + row["fp8 bwd"])
    return row


def main() -> None:
    from megadlms.triton_setup import use_torch_ptxas

    use_torch_ptxas()  # as the megadlms commands do: the FP8 Triton kernels compile with torch's ptxas
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen,llama")
    p.add_argument("--format", choices=["hybrid", "e4m3"], default="hybrid")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--check", action="store_true", help="first compare cuDNN with the emulation (GPU)")
    p.add_argument("--smoke", action="store_true", help="CPU, emulated, the tiny shape")
    a = p.parse_args()
    device = "cpu" if a.smoke else "cuda"
    shapes = ["tiny"] if a.smoke else a.shapes.split(",")
    recipe = DelayedScaling(fp8_format=Format(a.format), amax_history_len=16)
    if device == "cuda":
        import cudnn

        print(f"torch {torch.__version__}, cuDNN {cudnn.backend_version_string()}, {torch.cuda.get_device_name()}")
    if a.check and device == "cuda":
        check(device, recipe)
    rows = [probe(name, device, recipe, a.iters) for name in shapes]
    keys = ["shape", "bf16 fwd", "bf16 bwd", "fp8 fwd", "fp8 bwd", "fwd x", "bwd x", "tot x", "bf16 err", "fp8 err"]
    print(f"ms per call; err: O/dQ/dK/dV against fp32 ({a.format})")
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(f"{r[k]:.3f}" if isinstance(r[k], float) else str(r[k]) for k in keys))


if __name__ == "__main__":
    main()
