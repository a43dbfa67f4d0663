"""Gradients of the attention paths the trainer runs on the GPU against dense eager attention.

For each attention plan (packed documents, block diffusion, annealing, plain pre-training) and each way of
running it (eager or per-layer compiled; FlexAttention BlockMask or dense SDPA mask; BF16 or FP8), one forward
and backward of the same model on the same batch; the per-parameter gradient cosines against eager dense BF16
(and fp32) are printed. Several batches run in a row so that a compiled graph that keeps a previous batch's mask
shows up. Needs a GPU.

What passes: BF16 rounding alone puts the smallest gradients (the q/k norms' weights) at cosines of ~0.993-0.999
against fp32, so a BF16 path passes when its worst per-parameter cosine against fp32 is within --margin of eager
dense BF16's on the same batch (a wrong mask or a stale graph drops it far below). An FP8 path is judged the same
way against FP8 eager dense (the same casts): within --margin-fp8 of FP8 eager dense's worst cosine against fp32.
FP8 paths are not compared with each other directly: a BF16-rounding difference in the attention output moves
gradient elements across E5M2 steps, so two correct FP8 paths differ by FP8 rounding (cosines ~0.97).

    python benchmarks/attention_grad_check.py [--layers 4] [--seq-length 4096] [--batch 2] [--plans documents,bd3lm]
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch

from megadlms.attention_masks import (
    anneal_mask_mod,
    build_attention_mask,
    document_mask_mod,
    segment_positions,
)
from megadlms.build import apply_fp8
from megadlms.diffusion import bd3lm
from megadlms.diffusion.objective import weighted_cross_entropy
from megadlms.model import TransformerLM
from megadlms.presets import load_model_config


def random_segments(batch: int, length: int, gen: torch.Generator, device: str) -> torch.Tensor:
    """long [B, L]: documents of 20 to 400 tokens packed into each row."""
    rows = []
    for _ in range(batch):
        lengths = []
        while sum(lengths) < length:
            lengths.append(int(torch.randint(20, 400, (1,), generator=gen)))
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:length]
        rows.append(ids)
    return torch.stack(rows).to(device)


def plan_batches(plan: str, cfg, batch: int, n: int, device: str):
    """n batches of (inputs, targets, weights, mask_mod or None, position ids or None, query/key length)."""
    gen = torch.Generator().manual_seed(0)
    length = cfg.seq_length
    out = []
    for _ in range(n):
        x = torch.randint(0, cfg.vocab_size - 1, (batch, length), generator=gen).to(device)
        t = torch.rand(batch, 1, generator=gen).clamp(min=0.05).to(device)
        masked = torch.rand(batch, length, generator=gen).to(device) < t
        inputs = torch.where(masked, cfg.vocab_size - 1, x)
        weights = masked.float() / t
        if plan == "documents":
            seg = random_segments(batch, length, gen, device)
            out.append((inputs, x, weights, document_mask_mod(seg), segment_positions(seg), length))
        elif plan == "anneal":
            open_upper = (torch.rand(length, length, generator=gen) < 0.3).to(device)
            out.append((inputs, x, weights, anneal_mask_mod(open_upper), None, length))
        elif plan == "bd3lm":
            both = torch.cat([inputs, x], dim=1)
            out.append((both, x, weights, bd3lm.block_diffusion_mask_mod(length, 16), bd3lm.position_ids(length,
                                                                                                           device),
                        2 * length))
        else:
            out.append((inputs, x, weights, None, None, length))
    return out


def grads(model: torch.nn.Module, batch, flex: bool, dtype: torch.dtype | None) -> tuple[float, dict]:
    inputs, targets, weights, mod, positions, kv = batch
    dev = inputs.device.type
    mask = None if mod is None else build_attention_mask(mod, inputs.shape[0], kv, kv, inputs.device, flex=flex)
    model.zero_grad(set_to_none=True)
    ctx = torch.autocast(dev, dtype=dtype) if dtype is not None else torch.autocast(dev, enabled=False)
    with ctx:
        hidden = model(inputs, attention_mask=mask, position_ids=positions, output_hidden=True)
        logits = model.logits(hidden[:, :targets.shape[1]])
        loss = weighted_cross_entropy(logits, targets, weights)
    loss.backward()
    named = model.named_parameters()
    return float(loss.detach()), {n: p.grad.detach().float().clone() for n, p in named if p.grad is not None}


def to_fp8(model: TransformerLM, base) -> TransformerLM:
    """A copy of `model` with FP8 (hybrid, delayed) linears."""
    cfg = copy.deepcopy(base)
    cfg.fp8, cfg.fp8_format, cfg.fp8_recipe = True, "hybrid", "delayed"
    copied = copy.deepcopy(model)
    copied.config = cfg
    return apply_fp8(copied, cfg)


def cosines(a: dict, b: dict) -> tuple[float, str]:
    worst, name = 1.0, ""
    for k, g in b.items():
        ref = a[k.replace("._orig_mod", "")] if k not in a else a[k]
        c = float(torch.nn.functional.cosine_similarity(g.flatten(), ref.flatten(), dim=0))
        if c < worst:
            worst, name = c, k
    return worst, name


def main() -> int:
    from megadlms.triton_setup import use_torch_ptxas

    use_torch_ptxas()  # as the megadlms commands do: the FP8 Triton kernels compile with torch's ptxas
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default="qwen3-0.6b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-length", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--plans", default="documents,bd3lm,anneal,pretrain")
    ap.add_argument("--variants", default="eager-flex,compiled-flex,compiled-dense,fp8-compiled-flex")
    ap.add_argument("--margin", type=float, default=0.003,
                    help="BF16: how far below eager dense BF16's worst cosine against fp32 a path may be")
    ap.add_argument("--margin-fp8", type=float, default=0.02,
                    help="how far below FP8 eager dense's worst cosine against fp32 an FP8 path may fall")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    device = args.device
    base = load_model_config(args.model_path, num_layers=args.layers, seq_length=args.seq_length,
                             max_position_embeddings=2 * args.seq_length, vocab_size=4096,
                             mask_token_id=4095)
    torch.manual_seed(0)
    reference = TransformerLM(base).to(device)
    rows = []
    failed = False
    for plan in args.plans.split(","):
        batches = plan_batches(plan, base, args.batch, args.batches, device)
        ref_bf16 = [grads(reference, b, flex=False, dtype=torch.bfloat16) for b in batches]
        ref_fp32 = [grads(reference, b, flex=False, dtype=None) for b in batches]
        floor = []  # per batch: eager dense BF16's worst cosine against fp32 (BF16 rounding alone)
        for i, ((l16, g16), (l32, g32)) in enumerate(zip(ref_bf16, ref_fp32)):
            c, _ = cosines(g32, g16)
            floor.append(c)
            rows.append((plan, "eager-dense-bf16", i, l16, l32, c, c))
        fp8_ref, fp8_floor = None, []
        for variant in args.variants.split(","):
            if plan == "pretrain" and "flex" in variant:
                continue
            fp8 = variant.startswith("fp8")
            if fp8 and fp8_ref is None:  # FP8 against FP8 eager dense: the same casts, only attention differs
                fp8_ref = [grads(to_fp8(reference, base), b, flex=False, dtype=torch.bfloat16) for b in batches]
                fp8_floor = []  # per batch: FP8 eager dense's worst cosine against fp32 (FP8 rounding alone)
                for i, (l8, g8) in enumerate(fp8_ref):
                    c, _ = cosines(ref_fp32[i][1], g8)
                    fp8_floor.append(c)
                    rows.append((plan, "fp8-eager-dense", i, l8, ref_fp32[i][0], 1.0, c))
            model = to_fp8(reference, base) if fp8 else copy.deepcopy(reference)
            if "compiled" in variant:
                for layer in model.layers:
                    layer.compile()
            for i, b in enumerate(batches):
                try:
                    loss, g = grads(model, b, flex="flex" in variant, dtype=torch.bfloat16)
                except Exception as e:  # report the variant as failed, go on with the others
                    print(f"{plan} {variant} batch {i}: {type(e).__name__}: {e}", file=sys.stderr)
                    rows.append((plan, variant, i, float("nan"), ref_fp32[i][0], float("nan"), float("nan")))
                    failed = True
                    break
                same = fp8_ref[i][1] if fp8 else ref_bf16[i][1]
                c16, worst = cosines(same, g)
                c32, _ = cosines(ref_fp32[i][1], g)
                rows.append((plan, variant, i, loss, ref_fp32[i][0], c16, c32))
                ok = c32 >= (fp8_floor[i] - args.margin_fp8 if fp8 else floor[i] - args.margin)
                if not ok:
                    failed = True
                    print(f"{plan} {variant} batch {i}: worst cosine {c16:.5f} (same precision) / {c32:.5f} (fp32) "
                          f"at {worst}", file=sys.stderr)
            del model
            torch._dynamo.reset()
    print(f"\n{'plan':<10} {'variant':<20} {'batch':>5} {'loss':>9} {'fp32 loss':>9} {'cos same':>9} "
          f"{'cos fp32':>9}")
    for plan, variant, i, loss, l32, c16, c32 in rows:
        print(f"{plan:<10} {variant:<20} {i:>5} {loss:>9.4f} {l32:>9.4f} {c16:>9.5f} {c32:>9.5f}")
    print("attention gradients:", "FAIL" if failed else "ok",
          "(cos same: the worst per-parameter cosine against eager dense attention in the same precision; cos fp32: "
          f"against eager dense fp32, within {args.margin} of eager dense BF16's for BF16 and within "
          f"{args.margin_fp8} of FP8 eager dense's for FP8)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
