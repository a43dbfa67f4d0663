"""The MoE block (`megadlms.moe.MoE`): our BF16 and FP8 experts against torchao's FP8 rowwise grouped GEMMs, forward
and backward, at LLaDA-MoE-7B-A1B and Qwen3-30B-A3B shapes, with where the time goes.

Shapes (--shapes): llada-moe-7b-a1b (hidden 2048, 64 experts, top-8, expert FFN 1024, softmax over all experts then
top-k, as the preset) and qwen3-30b-a3b (hidden 2048, 128 experts, top-8, expert FFN 768, top-k renormalised).
Tokens: --tokens (default 16384), fewer where the free GPU memory is short. fp32 master weights under BF16 autocast,
as the trainer keeps them: each forward casts the expert weights to BF16 and each backward casts their gradients
back to fp32 (counted in "casts"). Gradients are set to None before each backward, as the trainer's optimizer step
leaves them (`zero_grad(set_to_none=True)`): the step writes them, it does not add into earlier ones.

Variants (--variants), all on the same block weights and inputs, hence the same routing:
  bf16             our grouped GEMMs (`torch._grouped_mm`)
  fp8-rowwise      our FP8 experts (`convert_to_fp8`), rowwise recipe
  fp8-tensorwise   our FP8 experts, per-tensor current scaling
  torchao-rowwise  our router, dispatch and combine with torchao's `torchao.prototype.moe_training` FP8 rowwise
                   grouped GEMMs for the experts (optional: without torchao the row says so)

Per variant and shape:
  fwd / bwd ms      the block, CUDA events, median of --iters
  routing share     the kernel time of router (its fp32 GEMM, top-k, aux losses), dispatch and combine over the
                    kernel time of the whole block, forward and backward (torch profiler; forward ops by phase,
                    backward ops by the forward op they undo)
  kernel breakdown  the kernel time by group: routing, dispatch, expert GEMMs, casts, activation, combine, other;
                    and the top kernels. Kernels, memory copies and sets only: the profiler's spans of the phase
                    labels on the device timeline are not kernel time. Printed beside the timed fwd + bwd: the two
                    agree where the device runs back to back
  expert TFLOP/s    the routed pairs' expert GEMM FLOPs, 18 T k H F (3 projections x forward, dgrad and wgrad x
                    2 T k H F; the padding rows' work not counted), over the whole block's timed forward +
                    backward; the same FLOPs over the expert GEMM kernels' time alone ("GEMM TFLOP/s"); and a dense
                    GEMM of one projection's shape ([T k, H] x [H, F]) in the same precision (BF16 mm; FP8:
                    torch._scaled_mm). "expert/dense" is the first over the last: the block's speed as a share of
                    what its expert math alone would run at as dense GEMMs
First a check on the device: the fused routing kernels against eager PyTorch, the grouped GEMMs against per-expert
GEMMs, the stacked gate/up product against two grouped GEMMs, the fused SwiGLU against eager PyTorch, and each
variant's block output against the BF16 block ("check ... ok" or "FAILED"). The summary table is
printed last.

    python benchmarks/moe_block.py            # on a GPU
    python benchmarks/moe_block.py --smoke    # tiny shapes on the CPU (FP8 emulated): checks the script runs
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import re
import sys
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timing import median_ms  # noqa: E402

from megadlms import moe_kernels, swiglu_kernels  # noqa: E402
from megadlms.config import TransformerConfig  # noqa: E402
from megadlms.fp8 import (  # noqa: E402
    Float8CurrentScaling,
    Float8RowwiseScaling,
    Format,
    convert_to_fp8,
    set_fp8_weight_caching,
)
from megadlms.grouped_gemm import backend, gmm, gmm_wgrad, grouped_gate_up, grouped_linear  # noqa: E402
from megadlms.model import SwiGLU, moe_block  # noqa: E402
from megadlms.moe import GroupedExperts, dispatch_plan  # noqa: E402
from megadlms.presets import PRESETS  # noqa: E402

_LLADA = PRESETS["llada-moe-7b-a1b"]
SHAPES: dict[str, dict[str, Any]] = {
    "llada-moe-7b-a1b": dict(hidden=_LLADA["hidden_size"], experts=_LLADA["num_moe_experts"],
                             topk=_LLADA["moe_router_topk"], ffn=_LLADA["moe_ffn_hidden_size"],
                             pre_softmax=_LLADA["moe_router_pre_softmax"]),
    "qwen3-30b-a3b": dict(hidden=2048, experts=128, topk=8, ffn=768, pre_softmax=False),
}
SMOKE_SHAPES = {"llada-moe-7b-a1b": dict(hidden=64, experts=8, topk=2, ffn=32, pre_softmax=True),
                "qwen3-30b-a3b": dict(hidden=64, experts=16, topk=4, ffn=48, pre_softmax=False)}
RECIPES = {"fp8-rowwise": Float8RowwiseScaling(fp8_format=Format.E4M3),
           "fp8-tensorwise": Float8CurrentScaling(fp8_format=Format.E4M3)}
VARIANTS = ("bf16", "fp8-rowwise", "fp8-tensorwise", "torchao-rowwise")
GROUPS = ("routing", "dispatch", "expert GEMMs", "casts", "activation", "combine", "other")
PHASES = {"moe/router": "routing", "moe/dispatch": "dispatch", "moe/experts": "experts", "moe/combine": "combine"}
_GEMM = re.compile(r"gemm|cutlass|nvjet|xmma|wgmma|grouped_mm|scaled_mm|aten::(mm|addmm|bmm|_grouped_mm)\b", re.I)
_ACT = re.compile(r"silu|swiglu|sigmoid|mul", re.I)
_CAST = re.compile(r"cast|quant|fp8|float8|e4m3|amax|scale|copy|convert|clamp|abs|max|reciprocal", re.I)


# ---------------------------------------------------------------- torchao's experts
def torchao_grouped_mm() -> tuple[Any, str]:
    """torchao's differentiable FP8 rowwise grouped GEMM (A [M, K], B_t [E, K, N], offs) and its name; raises
    ImportError where torchao (or its MoE training prototype) is missing."""
    if importlib.util.find_spec("torchao") is None:
        raise ImportError("torchao is not installed")
    import torchao.prototype.moe_training as mt

    fn = getattr(mt, "_to_fp8_rowwise_then_scaled_grouped_mm", None)
    if fn is not None:
        return fn, "_to_fp8_rowwise_then_scaled_grouped_mm"
    return mt._scaled_grouped_mm, "_scaled_grouped_mm"  # older releases: rowwise FP8 is the default scaling


class TorchaoExperts(GroupedExperts):
    """Our experts with torchao's FP8 rowwise grouped GEMMs (BF16 operands in, BF16 out)."""

    def __init__(self, experts: GroupedExperts):
        with torch.device("meta"):
            super().__init__(experts.num_experts, experts.hidden_size, experts.ffn_hidden_size, experts.act_fn)
        self.gate_proj, self.up_proj, self.down_proj = experts.gate_proj, experts.up_proj, experts.down_proj
        self.grouped_mm, _ = torchao_grouped_mm()

    def linear(self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        # the dispatch already pads each expert's rows to a multiple of 16 (`moe.ALIGN`), as torchao asks
        return self.grouped_mm(x.to(torch.bfloat16), w.to(torch.bfloat16).transpose(-2, -1), offs,
                               out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False)


class _OneLayer(torch.nn.Module):
    """The block as the one layer of a model, for `convert_to_fp8`."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.layers = torch.nn.ModuleList([block])


# ---------------------------------------------------------------- timing and profiling
def mark_phases(block: torch.nn.Module) -> None:
    """Name the block's forward phases for the profiler (record_function around the router, the dispatch, the
    experts and the combine; the instance's methods are wrapped, the model code is unchanged)."""
    def wrap(obj: Any, attr: str, label: str) -> None:
        inner = getattr(obj, attr)

        def run(*a: Any, **kw: Any) -> Any:
            with torch.profiler.record_function(label):
                return inner(*a, **kw)
        setattr(obj, attr, run)

    wrap(block.gate, "forward", "moe/router")
    wrap(block.gate, "route", "moe/router")
    wrap(block, "_aux_losses", "moe/router")
    wrap(block.dispatcher, "dispatch", "moe/dispatch")
    wrap(block.experts, "forward", "moe/experts")
    wrap(block.dispatcher, "combine", "moe/combine")


def _phase(evt: Any, seq_phase: dict[int, str]) -> str | None:
    """The phase of a profiler event: its forward record_function, or for a backward op the phase of the forward op
    that made its autograd node (matched by sequence number)."""
    e = evt
    while e is not None:
        if e.name in PHASES:
            return PHASES[e.name]
        if "Backward" in e.name and getattr(e, "sequence_nr", -1) >= 0 and e.sequence_nr in seq_phase:
            return seq_phase[e.sequence_nr]
        e = e.cpu_parent
    return None


def _device_work(evt: Any) -> bool:
    """Whether a profiler event is work on the device (a kernel, memory copy or set), not a record_function's span
    drawn on the device timeline (a user annotation: it covers kernels counted on their own)."""
    return (evt.device_type.name == "CUDA" and not getattr(evt, "is_user_annotation", False)
            and evt.name not in PHASES)


def kernel_breakdown(run, device, iters: int) -> tuple[dict[str, float], list[tuple[str, str, float]]]:
    """Profile `iters` calls of run() (forward + backward): milliseconds per call by group (GROUPS) and the top
    kernels (name, group, ms per call). On the CPU the operators' own time stands for the kernels."""
    from torch.profiler import ProfilerActivity, profile

    run()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(iters):
            run()
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = prof.events()
    seq_phase: dict[int, str] = {}
    for e in sorted(events, key=lambda e: e.time_range.start):
        if getattr(e, "sequence_nr", -1) >= 0 and "Backward" not in e.name:
            phase = _phase(e, seq_phase)
            if phase is not None:
                seq_phase.setdefault(e.sequence_nr, phase)
    work: list[tuple[str, float, Any]] = []
    for e in events:
        if device.type == "cuda":
            work += [(k.name, k.duration / 1e3, e) for k in e.kernels if k.name not in PHASES]
        elif e.name.startswith("aten::"):
            work.append((e.name, e.self_cpu_time_total / 1e3, e))
    if device.type == "cuda":  # device work no operator launched (kept, as "other", so the shares stay true)
        device_ms = sum(e.time_range.elapsed_us() for e in events if _device_work(e)) / 1e3
        unlinked = device_ms - sum(ms for _, ms, _ in work)
        if unlinked > 0.01 * device_ms:
            work.append(("(device time not linked to an operator)", unlinked, None))
    groups: dict[str, float] = defaultdict(float)
    per_kernel: dict[tuple[str, str], float] = defaultdict(float)
    for name, ms, e in work:
        phase = _phase(e, seq_phase)
        if phase == "experts":
            group = ("expert GEMMs" if _GEMM.search(name) else "activation" if _ACT.search(name)
                     else "casts" if _CAST.search(name) else "other")
        else:
            group = phase or "other"
        groups[group] += ms / iters
        per_kernel[(name[:70], group)] += ms / iters
    top = sorted(((n, g, ms) for (n, g), ms in per_kernel.items()), key=lambda r: -r[2])[:8]
    return dict(groups), top


# ---------------------------------------------------------------- checks
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def check_kernels(device, shape: dict[str, Any]) -> None:
    """The fused routing kernels against eager PyTorch, and the grouped GEMMs against per-expert GEMMs."""
    torch.manual_seed(0)
    t, e, k, h = 512, shape["experts"], shape["topk"], shape["hidden"]
    if moe_kernels.available(torch.empty(0, device=device)):
        logits = torch.randn(t, e, device=device)
        errs, same = [], True
        for score in moe_kernels.SCORE_FUNCTIONS:
            w, ex = moe_kernels.route_topk(logits, k, score)
            rw, rex = moe_kernels.route_topk_eager(logits, k, score, None, None)
            same &= bool(torch.equal(ex, rex))
            errs.append(_rel(w, rw))
        plan = dispatch_plan(rex, e)
        x = torch.randn(t, h, device=device, dtype=torch.bfloat16)
        same &= bool(torch.equal(moe_kernels.permute_rows(x, plan.pos, plan.row_pair, k),
                                 moe_kernels.permute_rows_eager(x, plan.pos, k, plan.rows)))
        y = torch.randn(plan.rows, h, device=device, dtype=torch.bfloat16)
        errs.append(_rel(moe_kernels.combine_rows(y, rw, plan.pos, plan.row_pair),
                         moe_kernels.combine_rows_eager(y, plan.pos, rw)))
        ok = same and max(errs) < 1e-5
        print(f"check fused routing, permute, combine: same experts and rows {same}, weights / combine rel err "
              f"{max(errs):.1e} {'ok' if ok else 'FAILED'}")
    else:
        print("check fused routing: Triton does not run here (the eager path runs)")
    sizes = [32, 0, 48, 16]
    offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    m, n = sum(sizes), shape["ffn"]
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    x, w, g = (torch.randn(m, h, device=device, dtype=dt), torch.randn(4, n, h, device=device, dtype=dt),
               torch.randn(m, n, device=device, dtype=dt))
    err = max(_rel(gmm(x, w.transpose(-2, -1), offs), gmm(x, w.transpose(-2, -1), offs, "loop")),
              _rel(gmm_wgrad(g.t(), x, offs), gmm_wgrad(g.t(), x, offs, "loop")))
    print(f"check gmm + wgrad ({backend(device, dt)}): rel err {err:.2e} {'ok' if err < 1e-2 else 'FAILED'}")
    check_expert_kernels(device, shape, offs, m, dt)


def check_expert_kernels(device, shape: dict[str, Any], offs: torch.Tensor, m: int, dt: torch.dtype) -> None:
    """The experts' own kernels on the device: the stacked gate/up product (its weights' casts in and its gradients'
    out) against two `grouped_linear`s, and the fused SwiGLU against eager PyTorch's, forward and backward."""
    h, f = shape["hidden"], shape["ffn"]
    gen = torch.Generator(device=device).manual_seed(2)
    x = torch.randn(m, h, device=device, generator=gen).to(dt)
    ws = [torch.randn(4, f, h, device=device, generator=gen).mul_(0.05).requires_grad_() for _ in range(2)]
    dy = [torch.randn(m, f, device=device, generator=gen).to(dt) for _ in range(2)]
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dt == torch.bfloat16):
        fused = grouped_gate_up(x, ws[0], ws[1], offs)
    sum((y.float() * d.float()).sum() for y, d in zip(fused, dy)).backward()
    got = [*fused, *(w.grad for w in ws)]
    for w in ws:
        w.grad = None
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dt == torch.bfloat16):
        apart = [grouped_linear(x, w, offs) for w in ws]
    sum((y.float() * d.float()).sum() for y, d in zip(apart, dy)).backward()
    err = max(_rel(a, b) for a, b in zip(got, [*apart, *(w.grad for w in ws)]))
    print(f"check stacked gate/up product vs two grouped GEMMs: rel err {err:.2e} {'ok' if err < 1e-2 else 'FAILED'}")
    gate, up = (torch.randn(m, f, device=device, generator=gen).mul_(3).to(dt).requires_grad_() for _ in range(2))
    fused_h = SwiGLU()(gate, up)
    fused_grads = torch.autograd.grad(fused_h, (gate, up), dy[0])
    eager_h = F.silu(gate) * up
    eager_grads = torch.autograd.grad(eager_h, (gate, up), dy[0])
    err = max(_rel(a, b) for a, b in zip((fused_h, *fused_grads), (eager_h, *eager_grads)))
    print(f"check fused SwiGLU ({'Triton' if swiglu_kernels.available(gate, up) else 'eager'}) vs eager: rel err "
          f"{err:.2e} {'ok' if err < 1e-2 else 'FAILED'}")


# ---------------------------------------------------------------- one variant
def build(name: str, shape: dict[str, Any], tokens: int, device) -> tuple[torch.nn.Module, Any]:
    """The block of `shape` (seeded: every variant gets the same weights) with `name`'s experts, and the context
    its forward runs in."""
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=1, hidden_size=shape["hidden"], num_attention_heads=16,
                            ffn_hidden_size=shape["ffn"], vocab_size=1024, seq_length=tokens,
                            num_moe_experts=shape["experts"], moe_router_topk=shape["topk"],
                            moe_ffn_hidden_size=shape["ffn"], moe_router_pre_softmax=shape["pre_softmax"],
                            moe_aux_loss_coeff=1e-2)
    block = moe_block(cfg, 0).to(device)
    for p in block.parameters():
        torch.nn.init.normal_(p, 0, 0.02)
    ctx: Any = contextlib.nullcontext
    if name in RECIPES:
        holder = convert_to_fp8(_OneLayer(block), RECIPES[name])
        # each forward + backward timed is a step of one micro-batch, whose weights the trainer casts every step
        set_fp8_weight_caching(holder, False)
        ctx = holder.layer_context
    elif name == "torchao-rowwise":
        block.experts = TorchaoExperts(block.experts)
    elif name != "bf16":
        raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
    return block, ctx


def backward_fresh(y: torch.Tensor, grad: torch.Tensor, leaves: list[torch.Tensor], retain_graph: bool = False
                   ) -> None:
    """y.backward(grad) into fresh gradients, as a training step after the optimizer's zero_grad(set_to_none=True)
    runs it: the leaves' gradients are written, not added to the previous call's."""
    for t in leaves:
        t.grad = None
    y.backward(grad, retain_graph=retain_graph)


def run_variant(name: str, shape: dict[str, Any], tokens: int, device, args,
                reference: torch.Tensor | None) -> dict[str, Any]:
    block, ctx = build(name, shape, tokens, device)
    mark_phases(block)
    amp = device.type == "cuda"
    gen = torch.Generator(device=device).manual_seed(1)
    xb = torch.randn(tokens, shape["hidden"], device=device, generator=gen).to(
        torch.bfloat16 if amp else torch.float32).requires_grad_()
    grad = torch.randn(xb.shape, device=device, generator=gen).to(xb.dtype)

    def forward() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp), ctx():
            return block(xb)

    holder: dict[str, torch.Tensor] = {}

    def fwd() -> None:
        holder["y"] = forward()

    leaves = [xb, *block.parameters()]

    def bwd() -> None:
        backward_fresh(holder["y"], grad, leaves, retain_graph=True)

    def step() -> None:
        backward_fresh(forward(), grad, leaves)

    out = forward().detach()
    err = None if reference is None else _rel(out, reference)
    fwd_ms = median_ms(fwd, device, args.iters, args.warmup)
    fwd()
    bwd_ms = median_ms(bwd, device, args.iters, args.warmup)
    holder.clear()
    groups, top = kernel_breakdown(step, device, max(1, min(3, args.iters)))
    total = sum(groups.values())
    h, f, tk = shape["hidden"], shape["ffn"], tokens * shape["topk"]
    flops = 18.0 * tk * h * f
    result = {"fwd": fwd_ms, "bwd": bwd_ms, "groups": groups, "top": top, "err": err, "out": out,
              "routing_share": sum(groups.get(g, 0.0) for g in ("routing", "dispatch", "combine")) / max(total, 1e-9),
              "expert_tflops": flops / ((fwd_ms + bwd_ms) * 1e9),
              "gemm_tflops": flops / (groups.get("expert GEMMs", 0.0) * 1e9) if groups.get("expert GEMMs") else 0.0}
    return result


def dense_tflops(shape: dict[str, Any], tokens: int, fp8: bool, device, args) -> float:
    """A dense GEMM of one expert projection's FLOPs ([T k, H] x [H, F]) in BF16, or FP8 (torch._scaled_mm)."""
    tk, h, f = tokens * shape["topk"], shape["hidden"], shape["ffn"]
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(tk, h, device=device, dtype=dt), torch.randn(f, h, device=device, dtype=dt)
    if fp8 and device.type == "cuda":
        aq, bq = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)
        ms = median_ms(lambda: torch._scaled_mm(aq, bq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                            use_fast_accum=True), device, args.iters, args.warmup)
    else:
        ms = median_ms(lambda: a @ b.t(), device, args.iters, args.warmup)
    return 2.0 * tk * h * f / (ms * 1e9)


def size_tokens(shape: dict[str, Any], wanted: int, device) -> int:
    """`wanted` tokens, or fewer (a multiple of 1024) where the free GPU memory would not hold a forward and
    backward: weights fp32 + gradients + per-variant copies, about 40 bytes per routed row and hidden/FFN unit."""
    if device.type != "cuda":
        return wanted
    free, _ = torch.cuda.mem_get_info()
    h, f, e, k = shape["hidden"], shape["ffn"], shape["experts"], shape["topk"]
    weights = 3 * e * h * f * 14
    per_token = k * (h + f) * 40 + h * 32
    fit = int((free * 0.7 - weights) // per_token) // 1024 * 1024
    return max(1024, min(wanted, fit))


def main() -> None:
    from megadlms.triton_setup import use_torch_ptxas

    use_torch_ptxas()  # as the megadlms commands do: the Triton kernels compile with torch's ptxas
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per block call (fewer if memory is short)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.smoke:
        args.tokens, args.iters, args.warmup = 64, 1, 1
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")
    try:
        _, ao_fn = torchao_grouped_mm()
        import torchao

        print(f"torchao {torchao.__version__}: torchao.prototype.moe_training.{ao_fn}")
    except Exception as e:  # noqa: BLE001  (an optional package: any import failure only drops its row)
        print(f"torchao: not available ({type(e).__name__}: {e})")
    rows = []
    for shape_name in args.shapes.split(","):
        shape = shapes[shape_name]
        tokens = size_tokens(shape, args.tokens, device)
        print(f"\n== {shape_name}: tokens {tokens}, hidden {shape['hidden']}, {shape['experts']} experts top-"
              f"{shape['topk']}, expert ffn {shape['ffn']}")
        check_kernels(device, shape)
        reference = None
        bf16_total = None
        dense = {fp8: dense_tflops(shape, tokens, fp8, device, args) for fp8 in (False, True)}
        for name in args.variants.split(","):
            if name == "torchao-rowwise":
                try:
                    torchao_grouped_mm()
                except Exception as e:  # noqa: BLE001  (optional: the row says why and the rest runs)
                    print(f"{name}: skipped, torchao not available ({type(e).__name__})")
                    rows.append((shape_name, name, None, f"torchao not available ({type(e).__name__})"))
                    continue
            try:
                r = run_variant(name, shape, tokens, device, args, reference)
            except Exception as e:  # noqa: BLE001  (report the variant and go on to the next)
                traceback.print_exc()
                rows.append((shape_name, name, None, f"ERROR {type(e).__name__}"))
                continue
            finally:
                gc.collect()  # the phase wrappers make reference cycles through the block: free it now
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            out = r.pop("out")
            if name == "bf16":
                reference, bf16_total = out, r["fwd"] + r["bwd"]
            elif r["err"] is not None:
                budget = 0.1 if name != "bf16" else 1e-6
                print(f"check {name} block output vs bf16: rel err {r['err']:.2e} "
                      f"{'ok' if r['err'] < budget else 'FAILED'}")
            r["speedup"] = bf16_total / (r["fwd"] + r["bwd"]) if bf16_total else None
            r["dense"] = dense[name != "bf16"]
            g = r["groups"]
            total = sum(g.values())
            print(f"{name}: kernel time per fwd+bwd {total:.3f} ms (timed {r['fwd'] + r['bwd']:.3f}): " + ", ".join(
                f"{k} {g.get(k, 0.0):.3f} ({g.get(k, 0.0) / max(total, 1e-9):.0%})" for k in GROUPS))
            for kname, group, ms in r["top"]:
                print(f"    {ms:8.3f} ms  {group:<13} {kname}")
            rows.append((shape_name, name, r, ""))
    print(f"\n{'shape':<17}| {'variant':<16}| fwd ms | bwd ms | x bf16 | routing | expert TFLOP/s | GEMM TFLOP/s | "
          "dense TFLOP/s | expert/dense")
    for shape_name, name, r, note in rows:
        if r is None:
            print(f"{shape_name:<17}| {name:<16}| {note}")
            continue
        speed = f"{r['speedup']:5.2f}x" if r["speedup"] else "   -  "
        print(f"{shape_name:<17}| {name:<16}| {r['fwd']:6.2f} | {r['bwd']:6.2f} | {speed} | {r['routing_share']:6.1%} "
              f"| {r['expert_tflops']:14.4g} | {r['gemm_tflops']:12.4g} | {r['dense']:13.4g} | "
              f"{r['expert_tflops'] / r['dense']:11.0%}")


if __name__ == "__main__":
    main()
