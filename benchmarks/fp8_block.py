"""One bidirectional transformer block (our `TransformerLayer`, torch.compile'd), BF16 vs FP8.

Default shapes: an 8B-class Llama block (hidden 4096, ffn 14336, 32 heads / 8 KV heads, head dim
128), B=2, S=4096, fp32 master weights under BF16 autocast, BF16 activations in and out. Times the
forward and the backward separately (CUDA events, median of --iters after warm-up) and prints
TFLOP/s (FLOPs: 6*N_linear + 12*S*H_attn per token for forward+backward, one third of it forward)
and the speed-up of each variant over our BF16 block. "peak GiB" is the variant's own peak: the most it
allocated on top of what was live before it was built (its parameters, FP8 copies and activations).

Variants (--variants, comma-separated):
  bf16           our block in BF16 (the model's default attention path)
  fp8-delayed    our FP8 engine, DelayedScaling, HYBRID (E4M3 forward, E5M2 gradients)
  fp8-delayed-unfused  the same with q/k/v and gate/up as separate FP8 linears and the MLP's layers
                 one by one (convert_to_fp8's fuse_projections=False, fuse_mlp=False)
  fp8-delayed-nomlp    fused projections, the MLP's layers one by one (fuse_mlp=False): the A/B of
                 the fused FP8 MLP
  fp8-tensorwise our FP8 engine, Float8CurrentScaling, HYBRID, as the trainer runs it: the weights' amaxes kept by
                 the optimizer step (StreamingAdamW, `fp8.integrations.weight_amax`; its cost there: adamw_speed.py), so
                 the weight casts make no amax pass (the weights do not change between the timed iterations)
  fp8-tensorwise-amax  the same with an amax pass before each weight cast (no optimizer keeping them)
  fp8-tensorwise-nomlp fp8-tensorwise with the MLP's layers one by one (fuse_mlp=False): the A/B of the fused FP8
                 MLP under current scaling
  fp8-rowwise    our FP8 engine, Float8RowwiseScaling, HYBRID
  fp8-blockwise  our FP8 engine, Float8BlockwiseScaling (1x128 tiles, 128x128 weight blocks), E4M3
  fp8-mxfp8      our FP8 engine, Float8MXScaling (32-element E8M0 blocks; Blackwell only)
  torchao        torchao.float8 tensorwise on the same block (a default variant where torchao is installed)
  NAME+graphs    the variant with its forward and backward replayed from CUDA graphs, as the trainer runs its
                 layers by default (`megadlms.training.cuda_graphs.LayerGraphs`, captured after one update);
                 its speed-ups are against `bf16+graphs` when that runs too
Before the blocks, an attention micro-benchmark compares SDPA backends at the block's shapes
(GQA via enable_gqa vs K/V expanded to all heads; default choice vs cuDNN vs flash).
--profile adds a per-kernel-class breakdown (GEMM, attention, Triton/elementwise, cast, other) of
one forward+backward for the variants named there.

    python benchmarks/fp8_block.py                 # the full table on a GPU
    python benchmarks/fp8_block.py --smoke         # tiny shapes, CPU, no compile: checks the script runs
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megadlms.config import TransformerConfig  # noqa: E402
from megadlms.model import RotaryEmbedding, TransformerLayer, TransformerLM  # noqa: E402
from megadlms.training.cuda_graphs import LayerGraphs  # noqa: E402


def default_variants() -> str:
    """Our BF16 and FP8 blocks, and torchao's where it is installed (an optional package: no error row without it)."""
    return "bf16,fp8-delayed,fp8-tensorwise" + (",torchao" if importlib.util.find_spec("torchao") else "")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--variants", default=default_variants(),
                   help="comma-separated (default: bf16,fp8-delayed,fp8-tensorwise, and torchao where it is installed)")
    p.add_argument("--profile", default="bf16,fp8-delayed", help="variants to break down by kernel class ('' = none)")
    p.add_argument("--trace", default="", help="variants whose 3 timed-loop iterations go to a Chrome trace in --out "
                   "(CPU and GPU activity; read it with benchmarks/trace_gaps.py)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None, help="default: on for CUDA")
    p.add_argument("--attention-bench", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--gemm-bench", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, no compile, 2 iterations")
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for the JSON results and profiles")
    a = p.parse_args()
    if a.smoke:
        a.hidden, a.ffn, a.heads, a.kv_heads, a.batch, a.seq = 32, 64, 2, 1, 1, 32  # the CPU FP8 GEMM is slow
        a.iters, a.warmup = 2, 1
        a.compile = False if a.compile is None else a.compile
    return a


def block_flops(cfg: TransformerConfig, tokens: int, seq: int) -> tuple[float, float]:
    """(forward, backward) FLOPs of one bidirectional block for `tokens` tokens of sequences of `seq`."""
    h, d = cfg.hidden_size, cfg.kv_channels
    q, kv = cfg.num_attention_heads * d, cfg.num_query_groups * d
    n_linear = h * (q + 2 * kv) + q * h + 3 * h * cfg.ffn_hidden_size
    fwd = tokens * (2 * n_linear + 4 * seq * q)
    return fwd, 2 * fwd


class _Holder(torch.nn.Module):
    """The minimum `convert_to_fp8` and `LayerGraphs` need: a `layers` ModuleList and a `run_layers` hook."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.layers = torch.nn.ModuleList([layer])

    def run_layers(self, x: torch.Tensor, rope, attn_mask=None, kv_cache=None) -> torch.Tensor:
        # the model's own loop: the layer's two outputs (MLP output, residual stream) summed as after a last layer
        return TransformerLM.run_layers(self, x, rope, attn_mask, kv_cache)


def build_variant(name: str, cfg: TransformerConfig, device: torch.device, compile_: bool):
    """-> (holder of the layer, context factory, per-step hook) for a variant (without its +graphs suffix)."""
    import contextlib

    torch.manual_seed(0)
    layer = TransformerLayer(cfg, 0).to(device)
    for p in layer.parameters():  # the model's init: normal(0.02), norms at 1
        if p.dim() > 1:
            torch.nn.init.normal_(p, 0.0, 0.02)
    holder = _Holder(layer)
    ctx, step = contextlib.nullcontext, (lambda: None)
    if name.startswith("fp8-"):
        from megadlms.fp8 import (
            DelayedScaling,
            Float8BlockwiseScaling,
            Float8CurrentScaling,
            Float8MXScaling,
            Float8RowwiseScaling,
            Format,
            convert_to_fp8,
            fp8_step,
        )

        delayed = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=1, amax_compute_algo="most_recent")
        recipe = {"fp8-delayed": delayed, "fp8-delayed-unfused": delayed, "fp8-delayed-nomlp": delayed,
                  "fp8-tensorwise": Float8CurrentScaling(fp8_format=Format.HYBRID),
                  "fp8-tensorwise-amax": Float8CurrentScaling(fp8_format=Format.HYBRID),
                  "fp8-tensorwise-nomlp": Float8CurrentScaling(fp8_format=Format.HYBRID),
                  "fp8-rowwise": Float8RowwiseScaling(fp8_format=Format.HYBRID),
                  "fp8-blockwise": Float8BlockwiseScaling(), "fp8-mxfp8": Float8MXScaling()}[name]
        holder = convert_to_fp8(holder, recipe, fuse_projections=not name.endswith("-unfused"),
                                fuse_mlp=not name.endswith(("-unfused", "-nomlp")))
        ctx = holder.layer_context
        if name in ("fp8-tensorwise", "fp8-tensorwise-nomlp"):
            from megadlms.fp8 import attach_weight_amaxes

            attach_weight_amaxes(holder)

        def step() -> None:  # what the trainer does after optimizer.step()
            fp8_step(holder)
    elif name == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(layer, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    elif name != "bf16":
        raise ValueError(f"unknown variant {name!r}")
    if compile_:
        layer.compile()
    return holder, ctx, step


def run_variant(name: str, cfg: TransformerConfig, a: argparse.Namespace, device: torch.device,
                compile_: bool, x0: torch.Tensor, g0: torch.Tensor, rope) -> dict:
    cuda = device.type == "cuda"
    # the variant's own memory: what it allocates on top of what was live before it was built (the shared
    # inputs, and earlier variants' layers kept for profiling)
    before = torch.cuda.memory_allocated() if cuda else 0
    base_name, graphed = name.removesuffix("+graphs"), name.endswith("+graphs")
    holder, ctx, step = build_variant(base_name, cfg, device, compile_)
    holder.train()
    graphs = LayerGraphs(holder, emulate=not cuda) if graphed else None
    amp = torch.autocast(device.type, dtype=torch.bfloat16)
    x = x0.detach().requires_grad_(True)

    def fwd():
        with amp, ctx():
            return holder.run_layers(x, rope, None, None)

    t0 = time.perf_counter()
    for i in range(a.warmup + (1 if graphed else 0)):
        if graphed and i == 1:
            graphs.arm()  # as the trainer: capture after one update (compiled code and FP8 scales exist)
        out = fwd()
        out.backward(g0)
        del out  # a live autograd graph of an earlier call would invalidate the capture (see LayerGraphs)
        step()
    if cuda:
        torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    f_ms, b_ms, events = [], [], []
    for _ in range(a.iters):
        x.grad = None
        for p in holder.parameters():
            p.grad = None
        if cuda:  # no synchronisation between iterations: the host runs ahead, as in training
            e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            e[0].record()
            out = fwd()
            e[1].record()
            out.backward(g0)
            e[2].record()
            del out
            step()
            events.append(e)
        else:
            t = time.perf_counter()
            out = fwd()
            t1 = time.perf_counter()
            out.backward(g0)
            f_ms.append((t1 - t) * 1e3)
            b_ms.append((time.perf_counter() - t1) * 1e3)
    if cuda:
        torch.cuda.synchronize()
        f_ms = [e[0].elapsed_time(e[1]) for e in events]
        b_ms = [e[1].elapsed_time(e[2]) for e in events]
    with torch.no_grad(), amp, ctx():
        # the block's update (the residual input would hide errors)
        y = (holder.run_layers(x0, rope, None, None) - x0).float()
    res = {"variant": name, "fwd_ms": statistics.median(f_ms), "bwd_ms": statistics.median(b_ms),
           "fwd_ms_all": f_ms, "bwd_ms_all": b_ms, "warmup_s": warm_s,
           "peak_gib": (torch.cuda.max_memory_allocated() - before) / 2**30 if cuda else float("nan")}
    if graphs is not None:  # a failed capture runs eagerly: say so rather than time eager as graphs
        res["graph_replays"], res["graph_failed"] = graphs.num_replays, graphs.failed
        if graphs.num_replays < a.iters:
            raise RuntimeError(f"{name}: {graphs.num_replays} of {a.iters} timed calls were replays "
                               f"(capture: {graphs.failed or 'not taken'})")
    res["_out"] = y
    res["_layer"] = (holder, ctx, step, fwd)
    return res


KERNEL_CLASSES = (  # first match wins
    ("attention", ("fmha", "flash", "attention", "cudnn", "sdpa", "mha")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "sm90_", "cublas", "scaled_mm", "wgmma")),
    ("fp8 swiglu + cast (fused)", ("swiglu_cast", "swiglu_bwd_cast")),
    ("fp8 cast", ("cast_transpose", "rowwise_cast", "clamp", "clone_t", "absmax", "amax", "norm_kernel", "normops")),
    ("triton (norm/rope/swiglu/...)", ("triton",)),
    ("aten elementwise", ("elementwise", "vectorized", "reduce", "copy", "fill", "cat", "index")),
)


def classify(kernel: str) -> str:
    k = kernel.lower()
    for cls, keys in KERNEL_CLASSES:
        if any(s in k for s in keys):
            return cls
    return "other"


def kernel_time_by_class(prof, n: int) -> tuple[dict[str, float], list[tuple[float, int, str, str]]]:
    """GPU kernel time of a torch.profiler run of n repetitions: ms per repetition by kernel class, and the
    kernels as (ms, calls, class, name) rows, longest first."""
    by_class: dict[str, float] = {}
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if t <= 0 or ev.key.startswith("ProfilerStep"):
            continue
        if getattr(ev, "device_type", None) is not None and "CUDA" not in str(ev.device_type):
            continue
        cls = classify(ev.key)
        by_class[cls] = by_class.get(cls, 0.0) + t / 1e3 / n
        rows.append((t / 1e3 / n, ev.count // n, cls, ev.key[:110]))
    rows.sort(reverse=True)
    return by_class, rows


def _iteration(res: dict, g0: torch.Tensor) -> None:
    """One forward + backward + FP8 step of a built variant, as the timed loop runs it (no synchronisation)."""
    holder, ctx, step, fwd = res["_layer"]
    for p in holder.parameters():
        p.grad = None
    out = fwd()
    out.backward(g0)
    del out  # a live autograd graph of an earlier call would invalidate a capture (see LayerGraphs)
    step()


def _file_stem(variant: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in variant)


def profile_variant(res: dict, g0: torch.Tensor, out_dir: Path | None) -> dict:
    """CUDA kernel time of one forward+backward (mean over 3), summed by kernel class."""
    from torch.profiler import ProfilerActivity, profile

    holder, ctx, step, fwd = res["_layer"]
    n = 3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            _iteration(res, g0)
        torch.cuda.synchronize()
    by_class, rows = kernel_time_by_class(prof, n)
    # the forward alone: one profiler session per forward, its backward outside it
    fwd_class: dict[str, float] = {}
    fwd_rows: dict[str, list] = {}
    for _ in range(n):
        for p in holder.parameters():
            p.grad = None
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = fwd()
            torch.cuda.synchronize()
        out.backward(g0)
        del out
        step()
        c, r = kernel_time_by_class(prof, 1)
        for k, v in c.items():
            fwd_class[k] = fwd_class.get(k, 0.0) + v / n
        for ms, cnt, cls, key in r:
            row = fwd_rows.setdefault(key, [0.0, 0, cls, key])
            row[0] += ms / n
            row[1] = cnt
    fwd_top = sorted((tuple(v) for v in fwd_rows.values()), reverse=True)
    if out_dir is not None:
        with open(out_dir / f"profile_{_file_stem(res['variant'])}.txt", "w") as f:
            f.write("forward + backward\n")
            for ms, cnt, cls, key in rows:
                f.write(f"{ms:9.3f} ms  x{cnt:<4d} {cls:17s} {key}\n")
            f.write("\nforward\n")
            for ms, cnt, cls, key in fwd_top:
                f.write(f"{ms:9.3f} ms  x{cnt:<4d} {cls:17s} {key}\n")
    return {"by_class_ms": by_class, "top": rows[:12], "fwd_by_class_ms": fwd_class, "fwd_top": fwd_top[:12]}


def trace_variant(res: dict, g0: torch.Tensor, out_dir: Path) -> None:
    """Three iterations of the timed loop (no synchronisation between them) as a Chrome trace."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            _iteration(res, g0)
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(out_dir / f"trace_{_file_stem(res['variant'])}.json"))


def attention_bench(cfg: TransformerConfig, a: argparse.Namespace, device: torch.device) -> list[dict]:
    """SDPA forward+backward at the block's shapes: grouped K/V vs expanded, per backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:  # [B, G, T, D] -> [B, G * n_rep, T, D]
        b, g_, t, d_ = x.shape
        return x[:, :, None].expand(b, g_, n_rep, t, d_).reshape(b, g_ * n_rep, t, d_)

    b, s, n, g, d = a.batch, a.seq, cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    torch.manual_seed(0)
    q = torch.randn(b, s, n, d, device=device, dtype=torch.bfloat16).transpose(1, 2).requires_grad_(True)
    k = torch.randn(b, s, g, d, device=device, dtype=torch.bfloat16).transpose(1, 2).requires_grad_(True)
    v = torch.randn(b, s, g, d, device=device, dtype=torch.bfloat16).transpose(1, 2).requires_grad_(True)
    do = torch.randn(b, n, s, d, device=device, dtype=torch.bfloat16)
    fl = 4 * b * s * s * n * d
    cases = [("gqa/default", None, False), ("gqa/cudnn", SDPBackend.CUDNN_ATTENTION, False),
             ("gqa/flash", SDPBackend.FLASH_ATTENTION, False), ("expanded/default", None, True),
             ("expanded/cudnn", SDPBackend.CUDNN_ATTENTION, True), ("expanded/flash", SDPBackend.FLASH_ATTENTION, True)]
    out = []
    ref = None
    for name, backend, expand in cases:
        try:
            def run(backend=backend, expand=expand):
                kk, vv = (repeat_kv(k, n // g), repeat_kv(v, n // g)) if expand else (k, v)
                if backend is None:
                    return F.scaled_dot_product_attention(q, kk, vv, enable_gqa=not expand)
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, kk, vv, enable_gqa=not expand)
            f_ms, b_ms = [], []
            for i in range(a.warmup + a.iters):
                e = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if device.type == "cuda" else None
                if e:
                    e[0].record()
                o = run()
                if e:
                    e[1].record()
                o.backward(do)
                if e:
                    e[2].record()
                    torch.cuda.synchronize()
                    if i >= a.warmup:
                        f_ms.append(e[0].elapsed_time(e[1]))
                        b_ms.append(e[1].elapsed_time(e[2]))
                q.grad = k.grad = v.grad = None
            o = run()
            o.backward(do)
            dq = q.grad.float()
            q.grad = k.grad = v.grad = None
            o = o.detach().float()
            ref = (o, dq) if ref is None else ref
            err = max(((o - ref[0]).norm() / ref[0].norm()).item(), ((dq - ref[1]).norm() / ref[1].norm()).item())
            fm = statistics.median(f_ms) if f_ms else float("nan")
            bm = statistics.median(b_ms) if b_ms else float("nan")
            out.append({"case": name, "fwd_ms": fm, "bwd_ms": bm, "fwd_tflops": fl / fm / 1e9,
                        "bwd_tflops": 2.5 * fl / bm / 1e9, "rel_err_vs_first": err})
        except Exception as e:  # a backend that cannot run these inputs
            out.append({"case": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"})
    return out


def _time_ms(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():  # --smoke on the CPU
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t) / iters * 1e3
    e = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in e:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in e)


def gemm_bench(cfg: TransformerConfig, a: argparse.Namespace, device: torch.device) -> dict:
    """The block's GEMMs alone (fprop, dgrad, wgrad of every linear): BF16 mm vs FP8 `_scaled_mm`
    tensorwise with and without fast accumulation. Returns ms per pass, summed over the linears."""
    m = a.batch * a.seq
    h, f, q, kv = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_attention_heads * cfg.kv_channels, \
        cfg.num_query_groups * cfg.kv_channels
    linears = [(h, q), (h, kv), (h, kv), (q, h), (h, f), (h, f), (f, h)]  # (in K, out N)
    one = torch.ones((), device=device)
    sums = {k: 0.0 for k in ("fwd", "dgrad", "wgrad")}
    out: dict = {}
    for kind in ("bf16", "fp8_fast", "fp8"):
        tot = dict.fromkeys(sums, 0.0)
        for k, n in linears:
            # (M, K) x (K, N): fprop; (M, N) x (N, K): dgrad; (N, M) x (M, K): wgrad
            for name, (mm, kk, nn_) in (("fwd", (m, k, n)), ("dgrad", (m, n, k)), ("wgrad", (n, m, k))):
                x = torch.randn(mm, kk, device=device, dtype=torch.bfloat16)
                w = torch.randn(nn_, kk, device=device, dtype=torch.bfloat16)
                if kind == "bf16":
                    fn = lambda x=x, w=w: x @ w.t()  # noqa: E731
                else:
                    xq, wq = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
                    fast = kind == "fp8_fast"
                    fn = lambda xq=xq, wq=wq, fast=fast: torch._scaled_mm(  # noqa: E731
                        xq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=fast)
                tot[name] += _time_ms(fn, 3, 10)
        out[kind] = tot
    flops = {name: 2.0 * m * sum(k * n for k, n in linears) for name in sums}
    out["tflops"] = {kind: {name: flops[name] / out[kind][name] / 1e9 for name in sums}
                     for kind in ("bf16", "fp8_fast", "fp8")}
    return out


def main() -> None:
    from megadlms.triton_setup import use_torch_ptxas

    use_torch_ptxas()  # as the megadlms commands do: the FP8 Triton kernels compile with torch's ptxas
    a = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    compile_ = device.type == "cuda" if a.compile is None else a.compile
    out_dir = Path(a.out) if a.out else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    cfg = TransformerConfig(num_layers=1, hidden_size=a.hidden, num_attention_heads=a.heads,
                            num_query_groups=a.kv_heads, ffn_hidden_size=a.ffn, seq_length=a.seq,
                            vocab_size=128, norm_epsilon=1e-5, rotary_base=500000.0)
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "compile": compile_, "shape": f"B={a.batch} S={a.seq} H={a.hidden} F={a.ffn} heads={a.heads}/{a.kv_heads}"}
    try:
        import torchao

        env["torchao"] = torchao.__version__
    except Exception as e:
        env["torchao"] = f"not importable ({type(e).__name__})"
    print(json.dumps(env), flush=True)

    results: dict = {"env": env}
    if a.attention_bench:
        results["attention"] = attention_bench(cfg, a, device)
        print("\nattention (SDPA, bf16)               fwd ms  bwd ms  fwd TF/s  bwd TF/s  rel err (out, dq)")
        for r in results["attention"]:
            if "error" in r:
                print(f"  {r['case']:28s} {r['error']}")
            else:
                print(f"  {r['case']:28s} {r['fwd_ms']:7.3f} {r['bwd_ms']:7.3f} {r['fwd_tflops']:8.0f} "
                      f"{r['bwd_tflops']:9.0f}   {r['rel_err_vs_first']:.1e}", flush=True)

    if a.gemm_bench:
        try:
            gb = gemm_bench(cfg, a, device)
            results["gemm"] = gb
            print("\nGEMMs of the block's linears alone (ms per pass, summed; TFLOP/s)")
            for kind in ("bf16", "fp8_fast", "fp8"):
                print(f"  {kind:9s} " + "  ".join(f"{n} {gb[kind][n]:.3f} ms ({gb['tflops'][kind][n]:.0f})"
                                                  for n in ("fwd", "dgrad", "wgrad")))
            for kind in ("fp8_fast", "fp8"):
                print(f"  bf16/{kind}: " + "  ".join(f"{n} {gb['bf16'][n] / gb[kind][n]:.2f}x"
                                                    for n in ("fwd", "dgrad", "wgrad")), flush=True)
        except Exception as e:
            print(f"gemm bench failed: {type(e).__name__}: {e}")

    torch.manual_seed(1)
    x0 = torch.randn(a.batch, a.seq, a.hidden, device=device, dtype=torch.bfloat16)
    g0 = torch.randn_like(x0)
    rope = RotaryEmbedding(cfg.kv_channels, a.seq, cfg.rotary_base).to(device)(torch.arange(a.seq, device=device))
    fwd_fl, bwd_fl = block_flops(cfg, a.batch * a.seq, a.seq)
    rows, ref_out, bases = [], None, {}
    profiles = {}
    for name in [v for v in a.variants.split(",") if v]:
        try:
            if device.type == "cuda":
                torch._dynamo.reset()
                gc.collect()  # earlier variants' layers sit in reference cycles (LayerGraphs): free them now,
                torch.cuda.empty_cache()  # not in the middle of this variant's peak accounting
            r = run_variant(name, cfg, a, device, compile_, x0, g0, rope)
            y = r.pop("_out")
            if ref_out is None:
                ref_out = y
            r["rel_err_vs_first"] = ((y - ref_out).norm() / ref_out.norm()).item()
            r["fwd_tflops"] = fwd_fl / r["fwd_ms"] / 1e9
            r["bwd_tflops"] = bwd_fl / r["bwd_ms"] / 1e9
            r["tot_tflops"] = (fwd_fl + bwd_fl) / (r["fwd_ms"] + r["bwd_ms"]) / 1e9
            if name in ("bf16", "bf16+graphs"):
                bases[name] = r
            if device.type == "cuda" and name in a.profile.split(","):
                try:
                    profiles[name] = profile_variant(r, g0, out_dir)
                except Exception as e:
                    profiles[name] = {"error": f"{type(e).__name__}: {e}"}
            if device.type == "cuda" and name in a.trace.split(",") and out_dir is not None:
                try:
                    trace_variant(r, g0, out_dir)
                except Exception as e:
                    print(f"trace {name} failed: {type(e).__name__}: {e}")
            r.pop("_layer")
            rows.append(r)
            print(f"{name}: fwd {r['fwd_ms']:.3f} ms bwd {r['bwd_ms']:.3f} ms ({r['tot_tflops']:.0f} TFLOP/s), "
                  f"warm-up {r['warmup_s']:.1f} s", flush=True)
        except Exception as e:
            traceback.print_exc()
            rows.append({"variant": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"})
        finally:
            if device.type == "cuda":
                torch.cuda.synchronize()
    results["blocks"] = rows
    results["profiles"] = {k: {kk: vv for kk, vv in v.items() if kk not in ("top", "fwd_top")}
                           for k, v in profiles.items()}
    if out_dir is not None:
        (out_dir / "fp8_block.json").write_text(json.dumps(results, indent=1, default=str))

    for name, p in profiles.items():
        if "error" in p:
            print(f"profile {name}: {p['error']}")
            continue
        cls = " ".join(f"{k} {v:.2f}" for k, v in sorted(p["by_class_ms"].items(), key=lambda kv: -kv[1]))
        print(f"profile {name} (ms per fwd+bwd, by kernel class): {cls} | total {sum(p['by_class_ms'].values()):.2f}")
        cls = " ".join(f"{k} {v:.2f}" for k, v in sorted(p["fwd_by_class_ms"].items(), key=lambda kv: -kv[1]))
        print(f"  forward alone: {cls} | total {sum(p['fwd_by_class_ms'].values()):.2f}")
        for ms, cnt, c, key in p["top"][:6]:
            print(f"    {ms:8.3f} ms x{cnt:<3d} {c:16s} {key[:90]}")
        print("  forward alone, longest kernels:")
        for ms, cnt, c, key in p["fwd_top"][:10]:
            print(f"    {ms:8.3f} ms x{cnt:<3d} {c:16s} {key[:90]}")
    from megadlms.fp8.kernels import triton_cast

    env["fp8_triton_cast"] = triton_cast._state["ok"]
    print(f"\nblock {env['shape']} | torch {env['torch']} | {env['device']} | compile={compile_} | "
          f"one-pass Triton FP8 cast: {triton_cast._state['ok']}")
    print(f"{'variant':22s} {'fwd ms':>8s} {'bwd ms':>8s} {'fwd TF/s':>9s} {'bwd TF/s':>9s} {'tot TF/s':>9s} "
          f"{'fwd x':>6s} {'bwd x':>6s} {'peak GiB':>9s} {'rel err':>8s}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:22s} ERROR {r['error']}")
            continue
        # against BF16 launched the same way (graphs or not), else against plain bf16
        base = bases.get("bf16+graphs" if r["variant"].endswith("+graphs") else "bf16") or bases.get("bf16")
        fx = base["fwd_ms"] / r["fwd_ms"] if base else float("nan")
        bx = base["bwd_ms"] / r["bwd_ms"] if base else float("nan")
        print(f"{r['variant']:22s} {r['fwd_ms']:8.3f} {r['bwd_ms']:8.3f} {r['fwd_tflops']:9.0f} {r['bwd_tflops']:9.0f} "
              f"{r['tot_tflops']:9.0f} {fx:6.2f} {bx:6.2f} {r['peak_gib']:9.2f} {r['rel_err_vs_first']:8.1e}")


if __name__ == "__main__":
    main()
