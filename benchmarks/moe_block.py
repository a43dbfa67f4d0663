"""The MoE block (`megadlms.moe.MoE`) at LLaDA-MoE-7B-A1B shapes, BF16 vs FP8, forward and backward.

Default shapes: hidden 2048, 64 experts, top-8, expert FFN 1024 (LLaDA-MoE-7B-A1B), 8192 tokens (B=2, S=4096), fp32
master weights under BF16 autocast. Prints, per variant (--variants: bf16, fp8-rowwise, fp8-tensorwise):
  fwd / bwd ms      the block (router, dispatch, grouped expert GEMMs, combine), CUDA events, median of --iters
  expert TFLOP/s    the experts' GEMM FLOPs (6 * T*k * 3*H*F for forward + backward) over the block's time
  gmm TFLOP/s       one grouped GEMM alone (the gate projection's fprop: [T*k, H] x E x [H, F]) ...
  dense TFLOP/s     ... and one dense GEMM of the same FLOPs ([T*k, H] x [H, F]; FP8: torch._scaled_mm)
  gmm/dense         the grouped GEMM's share of the dense rate (goal >= 70%)
  routing share     router + top-k + dispatch plan + dispatch + combine over the block's forward (goal < 10%)
First it checks the grouped GEMMs on this device against a loop of plain GEMMs (BF16: gmm and wgrad; FP8: the
same FP8 operands dequantized), printing "check ... ok" or "FAILED".

    python benchmarks/moe_block.py            # on a GPU
    python benchmarks/moe_block.py --smoke    # tiny shapes on the CPU (FP8 emulated): checks the script runs
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megadlms.config import TransformerConfig  # noqa: E402
from megadlms.fp8 import fp8_autocast  # noqa: E402
from megadlms.fp8.grouped import Float8GroupedExperts, scaled_gmm, scaled_gmm_wgrad  # noqa: E402
from megadlms.fp8.kernels.primitives import quantize  # noqa: E402
from megadlms.fp8.recipe import E4M3, Float8CurrentScaling, Float8RowwiseScaling, Format  # noqa: E402
from megadlms.grouped_gemm import backend, gmm, gmm_wgrad  # noqa: E402
from megadlms.model import moe_block  # noqa: E402
from megadlms.moe import dispatch_plan  # noqa: E402

RECIPES = {"fp8-rowwise": Float8RowwiseScaling(fp8_format=Format.E4M3),
           "fp8-tensorwise": Float8CurrentScaling(fp8_format=Format.E4M3)}


def timed(fn, device, iters: int, warmup: int) -> float:
    """Median milliseconds of fn() over `iters` runs after `warmup`."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def check(device, args) -> None:
    """The grouped GEMMs on this device against per-expert plain GEMMs."""
    torch.manual_seed(0)
    e, k, n = 4, args.hidden, args.ffn
    sizes = [32, 0, 48, 16]
    offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    m = sum(sizes)
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    x, w, g = (torch.randn(m, k, device=device, dtype=dt), torch.randn(e, n, k, device=device, dtype=dt),
               torch.randn(m, n, device=device, dtype=dt))

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()

    ref = gmm(x, w.transpose(-2, -1), offs, "loop")
    got = gmm(x, w.transpose(-2, -1), offs)
    ref_w, got_w = gmm_wgrad(g.t(), x, offs, "loop"), gmm_wgrad(g.t(), x, offs)
    err = max(rel(got, ref), rel(got_w, ref_w))
    print(f"check gmm + wgrad ({backend(device, dt)}): rel err {err:.2e} {'ok' if err < 1e-2 else 'FAILED'}")
    # FP8: the same FP8 operands through the device's kernel and through the dequantized emulation
    sx, sw = torch.rand(m, device=device) + 0.5, torch.rand(e, n, device=device) + 0.5
    xq, wq = quantize(x, sx[:, None], E4M3), quantize(w, sw[:, :, None], E4M3)
    got = scaled_gmm(xq, 1 / sx, wq, 1 / sw, offs, torch.float32, False)
    ref = gmm(xq.float() * (1 / sx)[:, None], (wq.float() * (1 / sw)[:, :, None]).transpose(-2, -1), offs, "loop")
    gid = torch.repeat_interleave(torch.arange(e, device=device), torch.tensor(sizes, device=device))
    sg, sxc = torch.rand(e, n, device=device) + 0.5, torch.rand(e, k, device=device) + 0.5
    gq_t = quantize(g, sg[gid], E4M3).t().contiguous()
    xq_t = quantize(x, sxc[gid], E4M3).t().contiguous()
    got_w = scaled_gmm_wgrad(gq_t, 1 / sg, xq_t, 1 / sxc, offs, gid, torch.float32)
    ref_w = gmm_wgrad(gq_t.float() * (1 / sg)[gid].t(), (xq_t.float() * (1 / sxc)[gid].t()).t(), offs, "loop")
    err = max(rel(got, ref), rel(got_w, ref_w))
    kind = "torch._scaled_grouped_mm" if device.type == "cuda" else "emulated"
    print(f"check fp8 gmm + wgrad ({kind}): rel err {err:.2e} {'ok' if err < 2e-2 else 'FAILED'}")


def run_variant(name: str, device, args) -> dict[str, float]:
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=16, ffn_hidden_size=args.ffn,
                            vocab_size=1024, seq_length=args.tokens, num_moe_experts=args.experts,
                            moe_router_topk=args.topk, moe_ffn_hidden_size=args.ffn, moe_aux_loss_coeff=1e-2)
    block = moe_block(cfg, 0).to(device)
    for p in block.parameters():
        torch.nn.init.normal_(p, 0, 0.02)
    fp8 = name.startswith("fp8")
    if fp8:
        block.experts = Float8GroupedExperts.from_experts(block.experts, RECIPES[name])
    amp = device.type == "cuda"
    x = torch.randn(args.tokens, args.hidden, device=device, requires_grad=True)
    xb = x.detach().to(torch.bfloat16 if amp else torch.float32).requires_grad_()
    grad = torch.randn_like(xb)

    def ctx():
        return fp8_autocast(enabled=fp8, fp8_recipe=RECIPES.get(name))

    def forward():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp), ctx():
            out = block(xb)
        block.aux_loss = None
        return out

    holder = {}

    def fwd():
        holder["y"] = forward()

    def bwd():
        holder["y"].backward(grad, retain_graph=True)

    fwd_ms = timed(fwd, device, args.iters, args.warmup)
    fwd()
    bwd_ms = timed(bwd, device, args.iters, args.warmup)

    def routing():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp), torch.no_grad():
            logits = block.gate(xb)
            weights, experts, _ = block.gate.route(logits)
            d = block.dispatcher.dispatch(xb, experts)
            block.dispatcher.combine(d.rows, weights, d.handle)

    route_ms = timed(routing, device, args.iters, args.warmup)
    # one grouped GEMM (gate projection fprop) and a dense GEMM of the same FLOPs
    tk, h, f = args.tokens * args.topk, args.hidden, args.ffn
    with torch.no_grad():
        logits = block.gate(xb)
        _, experts, _ = block.gate.route(logits)
        pos, offs, _, rows = dispatch_plan(experts, block.num_experts)
    dt = torch.bfloat16 if amp else torch.float32
    a = torch.randn(rows, h, device=device, dtype=dt)
    w = block.experts.gate_proj.detach().to(dt)
    dense_a, dense_b = torch.randn(tk, h, device=device, dtype=dt), torch.randn(f, h, device=device, dtype=dt)
    if fp8:
        aq, wq = a.to(E4M3), w.to(E4M3)
        sa, sw = torch.ones(rows, device=device), torch.ones(w.shape[0], f, device=device)
        gmm_ms = timed(lambda: scaled_gmm(aq, sa, wq, sw, offs, torch.bfloat16, True), device, args.iters,
                       args.warmup)
        da, db = dense_a.to(E4M3), dense_b.to(E4M3)
        one = torch.ones((), device=device)
        if device.type == "cuda":
            dense_ms = timed(lambda: torch._scaled_mm(da, db.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                                      use_fast_accum=True), device, args.iters, args.warmup)
        else:
            dense_ms = timed(lambda: da.float() @ db.float().t(), device, args.iters, args.warmup)
    else:
        gmm_ms = timed(lambda: gmm(a, w.transpose(-2, -1), offs), device, args.iters, args.warmup)
        dense_ms = timed(lambda: dense_a @ dense_b.t(), device, args.iters, args.warmup)
    gemm_flops = 2.0 * tk * h * f
    expert_flops = 6.0 * tk * 3 * h * f
    return {"fwd": fwd_ms, "bwd": bwd_ms, "expert_tflops": expert_flops / ((fwd_ms + bwd_ms) * 1e9),
            "gmm_tflops": gemm_flops / (gmm_ms * 1e9), "dense_tflops": gemm_flops / (dense_ms * 1e9),
            "routing_share": route_ms / fwd_ms}


def main() -> None:
    from megadlms.triton_setup import use_torch_ptxas

    use_torch_ptxas()  # as the megadlms commands do: the FP8 Triton kernels compile with torch's ptxas
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--variants", default="bf16,fp8-rowwise,fp8-tensorwise")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    if args.smoke:
        args.tokens, args.hidden, args.ffn, args.experts, args.topk, args.iters, args.warmup = 64, 64, 32, 4, 2, 1, 1
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'} | "
          f"tokens {args.tokens} hidden {args.hidden} experts {args.experts} top-{args.topk} ffn {args.ffn}")
    check(device, args)
    print(f"{'variant':<16}| fwd ms | bwd ms | expert TFLOP/s | gmm TFLOP/s | dense TFLOP/s | gmm/dense | routing")
    for name in args.variants.split(","):
        try:
            r = run_variant(name, device, args)
        except Exception:  # noqa: BLE001  (report the variant and go on to the next)
            traceback.print_exc()
            print(f"{name:<16}| ERROR")
            continue
        print(f"{name:<16}| {r['fwd']:6.2f} | {r['bwd']:6.2f} | {r['expert_tflops']:14.3g} | "
              f"{r['gmm_tflops']:11.3g} | {r['dense_tflops']:13.3g} | {r['gmm_tflops'] / r['dense_tflops']:8.0%} | "
              f"{r['routing_share']:6.1%}")


if __name__ == "__main__":
    main()
