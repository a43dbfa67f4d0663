"""The optimizer step on an 8B-class model's parameters: torch's fused AdamW against StreamingAdamW (one Triton pass
per large parameter), each against a device copy of the same bytes (AdamW moves 28 bytes per fp32 parameter:
reads p, g, m, v; writes p, m, v); and the gradient norm that clipping needs (4 bytes read per parameter). For FP8
current scaling: StreamingAdamW keeping each weight's amax out of its update (`publish_amaxes`) against the amax pass
per weight that the casts make otherwise (4 bytes read per weight element).

    python3 benchmarks/adamw_speed.py --preset llama3-8b --layers 16
    TRITON_INTERPRET=1 python3 benchmarks/adamw_speed.py --smoke   # the same code on the CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from megadlms.fp8.integrations.weight_amax import KeptAmax
from megadlms.model import TransformerLM
from megadlms.presets import preset_config
from megadlms.training.triton_adamw import StreamingAdamW, adamw_update_, available


def parameter_shapes(preset: str, layers: int, **overrides) -> list[torch.Size]:
    """The shapes of the model's parameters, from the model built on the meta device (no memory)."""
    with torch.device("meta"):
        model = TransformerLM(preset_config(preset, num_layers=layers, **overrides))
    return [p.shape for p in model.parameters()]


def timed(fn, iters: int) -> float:
    """Milliseconds per call (CUDA events on a GPU, the wall clock on the CPU)."""
    fn()
    if not torch.cuda.is_available():
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) * 1e3 / iters
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def optimizer_step_ms(cls: type, params: list[torch.Tensor], grads: list[torch.Tensor], scale: torch.Tensor,
                      iters: int, amaxes: list[KeptAmax] | None = None, **kwargs
                      ) -> tuple[float, list[torch.Tensor]]:
    """amaxes: one per 2-D parameter, kept = max |p| by the optimizer (StreamingAdamW.publish_amaxes)."""
    ps = [p.clone().requires_grad_() for p in params]
    groups = [{"params": [p for p in ps if p.ndim == 2], "weight_decay": 0.1},
              {"params": [p for p in ps if p.ndim == 1], "weight_decay": 0.0}]
    opt = cls(groups, lr=1e-4, betas=(0.9, 0.95), **kwargs)
    if amaxes is not None:
        opt.publish_amaxes(zip([p for p in ps if p.ndim == 2], amaxes))

    def step():
        for p, g in zip(ps, grads):
            p.grad = g  # torch's fused kernel writes the unscaled gradient back: give it the same one every time
        opt.grad_scale = scale
        opt.step()
    ms = timed(step, iters)
    return ms, ps


def copy_ms(n: int, dev: torch.device, iters: int) -> float:
    """A device-to-device copy of n fp32 elements (8 bytes moved per element)."""
    src, dst = torch.empty(n, device=dev), torch.empty(n, device=dev)
    return timed(lambda: dst.copy_(src), iters)


def kernels_ms(params: list[torch.Tensor], grads: list[torch.Tensor], block: int, warps: int, iters: int,
               amax: bool = False) -> float:
    """The update kernel alone over the parameters StreamingAdamW streams, scaled to all of them; amax: each also
    raises an fp32 scalar to max |p| (the FP8 weight amax)."""
    big = [i for i, p in enumerate(params) if p.numel() >= StreamingAdamW.min_numel]
    ps, ms, vs = ([params[i].clone() for i in big] for _ in range(3))
    steps = [torch.ones((), device=ps[0].device) for _ in big]
    outs = [torch.zeros((), device=ps[0].device) for _ in big] if amax else [None] * len(big)

    def kernels():
        for p, i, m, v, s, a in zip(ps, big, ms, vs, steps, outs):
            adamw_update_(p, grads[i], m, v, s, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                          amax_out=a, block=block, num_warps=warps)
    share = sum(params[i].numel() for i in big) / sum(p.numel() for p in params)
    return timed(kernels, iters) / share


def main() -> None:
    from megadlms.triton_setup import use_torch_ptxas

    use_torch_ptxas()  # as the megadlms commands do: the FP8 Triton kernels compile with torch's ptxas
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--smoke", action="store_true",
                    help="the tiny preset narrowed, 1 layer, one tile, on the CPU (needs TRITON_INTERPRET=1)")
    args = ap.parse_args()
    if args.smoke:
        args.preset, args.layers, args.iters = "tiny", 1, 1
    # the interpreter runs each tile in Python: few parameters, yet the embedding and both MLP weights large enough
    # for StreamingAdamW's kernel (min_numel)
    narrow = {"hidden_size": 128, "ffn_hidden_size": 512} if args.smoke else {}
    dev = torch.device("cpu" if args.smoke else "cuda")
    if not available(dev):
        sys.exit(f"the Triton AdamW kernel cannot run on {dev} (on the CPU: set TRITON_INTERPRET=1)")
    gen = torch.Generator(device=dev).manual_seed(0)
    shapes = parameter_shapes(args.preset, args.layers, **narrow)
    params = [torch.randn(s, device=dev, generator=gen) * 0.02 for s in shapes]
    grads = [torch.randn(s, device=dev, generator=gen) * 1e-3 for s in (p.shape for p in params)]
    n = sum(p.numel() for p in params)
    scale = torch.tensor(1.0, device=dev)  # the clipping divisor (1: unclipped; the agreement check stays exact)
    rows = []

    rows.append(("device copy, same bytes as AdamW", copy_ms(n, dev, args.iters) * 28 / 8, 28))

    torch_ms, ref = optimizer_step_ms(torch.optim.AdamW, params, grads, scale, args.iters, fused=True)
    rows.append(("torch AdamW fused=True", torch_ms, 28))
    ours_ms, ours = optimizer_step_ms(StreamingAdamW, params, grads, scale, args.iters)
    rows.append(("StreamingAdamW", ours_ms, 28))
    # both took iters + 1 steps from the same start
    err = max(float((a - b).abs().max() / (a - p0).abs().max()) for a, b, p0 in zip(ref, ours, params))
    del ref, ours
    amaxes = [KeptAmax(torch.zeros((), device=dev), -1) for p in params if p.ndim == 2]
    amax_ms, kept = optimizer_step_ms(StreamingAdamW, params, grads, scale, args.iters, amaxes)
    rows.append(("StreamingAdamW + FP8 weight amaxes", amax_ms, 28))
    exact = all(torch.equal(a.value, p.detach().abs().amax()) and a.of(p) is not None
                for a, p in zip(amaxes, (p for p in kept if p.ndim == 2)))
    weights = [p for p in kept if p.ndim == 2]
    share = sum(w.numel() for w in weights) / n
    pass_ms = timed(lambda: [torch.linalg.vector_norm(w, float("inf")) for w in weights], args.iters)
    rows.append(("amax pass per weight (the casts' otherwise)", pass_ms / share, 4))  # scaled to all parameters
    del kept
    torch.cuda.empty_cache()

    for block, warps in ((1024, 4),) if args.smoke else ((1024, 4), (2048, 4), (2048, 8), (4096, 8)):
        ms = kernels_ms(params, grads, block, warps, args.iters)
        rows.append((f"kernel only, block {block} warps {warps}", ms, 28))
        if (block, warps) == (1024, 4):  # the tile StreamingAdamW runs
            ms = kernels_ms(params, grads, block, warps, args.iters, amax=True)
            rows.append((f"kernel + amax, block {block} warps {warps}", ms, 28))

    norm_ms = timed(lambda: torch.nn.utils.get_total_norm(grads, foreach=True), args.iters)
    rows.append(("gradient norm (get_total_norm foreach)", norm_ms, 4))

    print(f"\noptimizer step | {args.preset} {args.layers} layers | {n / 1e6:,.0f}M fp32 parameters | "
          f"torch {torch.__version__} | {torch.cuda.get_device_name() if dev.type == 'cuda' else 'CPU'}")
    print(f"{'what':42s} {'ms':>8s} {'TB/s':>6s}")
    for name, ms, bytes_per in rows:
        print(f"{name:42s} {ms:8.2f} {bytes_per * n / ms / 1e9:6.2f}")
    print(f"StreamingAdamW vs torch: {torch_ms / ours_ms:.2f}x; max |difference| / |update| after "
          f"{args.iters + 1} steps: {err:.1e}; FP8 weight amaxes kept by the step: "
          f"{'exact' if exact else 'NOT EXACT'} ({pass_ms:.2f} ms of amax passes per step saved, "
          f"{amax_ms - ours_ms:+.2f} ms in the step)")


if __name__ == "__main__":
    main()
