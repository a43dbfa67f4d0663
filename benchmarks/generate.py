"""Generation throughput: LLaDA's reference sampler vs the fast sampler (dual cache + threshold).

Random weights (no download), random prompts. Defaults are the H200 setting: qwen3-1.7b in bf16,
prompt 64, gen_length 256, block 32, steps 256, batch 1 and 16, threshold 0.9.

    python benchmarks/generate.py                                   # GPU, the defaults above
    python benchmarks/generate.py --device cpu --preset tiny --gen-length 64 --block-length 16 \
        --steps 64 --prompt-length 32 --batch-sizes 1 4              # a CPU run

Rows: the reference sampler eager and with its fixed-shape forward in a CUDA graph (the two must
give the same tokens), the fast sampler with and without CUDA graphs. tok/s counts generated
positions (batch * gen_length) over the wall time of one call, after an untimed call of each
sampler at the same shapes (one or two steps per block), so that kernel autotuning, with --compile
the compilation for these shapes, and the CUDA graph captures (kept for later calls of the same
shapes, as in `megadlms generate` over a prompt file) are not timed; "first call s" is that
untimed call's wall time, captures and compilation included. --profile adds the GPU time of one
reference forward by kernel class, and the GPU and wall time of an (eager) fast-sampler step.
A random model is never confident: with threshold 0.9 the fast sampler commits one token per
step, so its speed-up here comes from the cache alone. `--load CKPT` measures a trained checkpoint
of `megadlms train` instead, with prompts cut from the bundled corpus (real text in its tokenizer):
there parallel decoding commits several tokens per step where the model is sure. --logit-scale S
multiplies the logits (a crude emulation of confidence on random weights); "agree" is the share of
generated tokens equal to the reference's.

    python benchmarks/generate.py --load runs/ckpt --batch-sizes 1 16   # a trained model
"""

from __future__ import annotations

import argparse
import time

import torch

from megadlms.build import build_model
from megadlms.diffusion.fast_sampler import fast_generate_tokens
from megadlms.diffusion.sampler import generate_tokens
from megadlms.distributed.parallelize import apply_compile
from megadlms.generate.fuse import fuse_projections
from megadlms.presets import preset_config
from megadlms.training.checkpoint import load_model_from_checkpoint


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device, fn, *args, **kwargs):
    sync(device)
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    sync(device)
    return out, time.perf_counter() - t0


def prompts_from_corpus(tokenizer_dir: str | None, length: int, n: int) -> torch.Tensor:
    """[n, length] token ids: the first `length` tokens of the first n bundled-corpus documents that long."""
    import gzip
    import json

    from megadlms.data import load_tokenizer
    from megadlms.data.preprocess import BUNDLED_CORPUS

    tok = load_tokenizer(tokenizer_dir)
    rows = []
    with gzip.open(BUNDLED_CORPUS, "rt") as f:
        for line in f:
            ids = tok.encode(json.loads(line)["text"])
            if len(ids) >= length:
                rows.append(ids[:length])
                if len(rows) == n:
                    break
    return torch.tensor(rows)


def profile_forward(model, prompt: torch.Tensor, mask_id: int, args: argparse.Namespace) -> dict[str, float]:
    """GPU ms per reference step by kernel class (torch.profiler over a one-step-per-block call, eager)."""
    import sys
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from fp8_block import kernel_time_by_class  # the kernel classes of the block benchmark

    n = args.gen_length // args.block_length
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        generate_tokens(model, prompt, mask_id=mask_id, gen_length=args.gen_length, block_length=args.block_length,
                        steps=n)
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3 / n
    by, _ = kernel_time_by_class(prof, n)
    busy = sum(by.values())
    # the fast sampler over one block (no CUDA graph): GPU time of its average step against the step's wall time
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _, nfe = fast_generate_tokens(model, prompt, mask_id=mask_id, gen_length=args.block_length,
                                      block_length=args.block_length, threshold=args.threshold,
                                      cache=None if args.cache == "none" else args.cache)
        torch.cuda.synchronize()
    fast_wall = (time.perf_counter() - t0) * 1e3 / nfe
    fast_by, _ = kernel_time_by_class(prof, nfe)
    return {**{k: round(v, 2) for k, v in sorted(by.items(), key=lambda kv: -kv[1])},
            "kernels total": round(busy, 2), "wall (profiled, eager)": round(wall, 2),
            "fast step: kernels": round(sum(fast_by.values()), 2), "fast step: wall (no graph)": round(fast_wall, 2)}


def main() -> None:
    from megadlms.triton_setup import use_torch_ptxas

    use_torch_ptxas()  # as the megadlms commands do: the FP8 Triton kernels compile with torch's ptxas
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="qwen3-1.7b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-length", type=int, default=64)
    p.add_argument("--gen-length", type=int, default=256)
    p.add_argument("--block-length", type=int, default=32)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--cache", choices=("dual", "prefix", "none"), default="dual")
    p.add_argument("--logit-scale", type=float, default=1.0, help="multiply the logits (emulates confidence)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each layer for both samplers (fuses elementwise ops; may change the "
                        "last bits of the logits, so tokens can differ from eager)")
    p.add_argument("--fuse-projections", action=argparse.BooleanOptionalAction, default=None,
                   help="q/k/v and gate/up as one GEMM each, as `megadlms generate` (default: on for GPU)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    p.add_argument("--skip-eager", action="store_true", help="only the CUDA-graph rows")
    p.add_argument("--profile", action="store_true", help="GPU time of one reference forward by kernel class")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--load", default=None, help="a `megadlms train` checkpoint folder instead of random weights")
    args = p.parse_args()

    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda"
                                                                           else "fp32")]
    torch.manual_seed(args.seed)
    corpus_prompts = None
    if args.load:
        model, cfg, meta = load_model_from_checkpoint(args.load, device=device)
        model.eval()
        corpus_prompts = prompts_from_corpus(meta.get("tokenizer_dir"), args.prompt_length, max(args.batch_sizes))
        args.preset = f"checkpoint {meta['path']} ({cfg.num_layers} layers, hidden {cfg.hidden_size})"
    else:
        cfg = preset_config(args.preset)
        model = build_model(cfg, device=device).eval()
    for prm in model.parameters():  # weights in the compute dtype; RoPE tables stay fp32
        prm.data = prm.data.to(dtype)
    mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else cfg.vocab_size - 1
    head = model.logits

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        # a trained DLM never predicts [MASK]; a random model with tied embeddings would (its input is
        # mostly [MASK]), and the reference sampler would keep re-committing it
        out = head(hidden)
        if args.logit_scale != 1.0:
            out = out * args.logit_scale
        out[..., mask_id] = float("-inf")
        return out

    model.logits = logits
    if args.fuse_projections is None:
        args.fuse_projections = device.type == "cuda"
    if args.fuse_projections:  # after the dtype cast above: the fused weights are the final ones
        fuse_projections(model)
    if args.compile:  # per layer, as `megadlms generate --compile` (one compilation serves every layer)
        apply_compile(model)
    cache = None if args.cache == "none" else args.cache
    graph_modes = [False, True] if device.type == "cuda" else [False]
    if args.skip_eager and device.type == "cuda":
        graph_modes = [True]
    print(f"{args.preset} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, {dtype}) on "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; prompt {args.prompt_length}, "
          f"gen {args.gen_length}, block {args.block_length}, steps {args.steps}, threshold {args.threshold}, "
          f"cache {args.cache}, logit scale {args.logit_scale}, compile {args.compile}, "
          f"fused projections {args.fuse_projections}")

    # warm up kernels / allocator once (a short call of each path)
    warm = torch.randint(0, mask_id, (1, 8), device=device)
    generate_tokens(model, warm, mask_id=mask_id, gen_length=args.block_length, steps=2 if args.block_length > 1
                    else 1)
    fast_generate_tokens(model, warm, mask_id=mask_id, gen_length=args.block_length,
                         block_length=args.block_length, threshold=args.threshold, cache=cache)

    rows, profile_rows = [], []
    for b in args.batch_sizes:
        if corpus_prompts is not None:
            prompt = corpus_prompts[:b].to(device)
        else:
            prompt = torch.randint(0, min(mask_id, cfg.vocab_size), (b, args.prompt_length), device=device,
                                   generator=torch.Generator(device=device).manual_seed(args.seed + b))
        n_tok = b * args.gen_length
        n_blocks = args.gen_length // args.block_length
        first: dict[tuple[str, bool], float] = {}  # untimed calls at these shapes: compile, autotune, capture
        for graph in graph_modes:
            _, first["reference", graph] = timed(device, generate_tokens, model, prompt, mask_id=mask_id,
                                                 gen_length=args.gen_length, block_length=args.block_length,
                                                 steps=n_blocks, cuda_graph=graph)
            # two steps per block: the refresh forward and one block step (both graphs captured)
            _, first["fast", graph] = timed(device, fast_generate_tokens, model, prompt, mask_id=mask_id,
                                            gen_length=args.gen_length, block_length=args.block_length,
                                            threshold=None, steps=2 * n_blocks, cache=cache, cuda_graph=graph)
        if args.profile and device.type == "cuda":
            profile_rows.append((b, profile_forward(model, prompt, mask_id, args)))
        ref, batch_rows = None, []
        for graph in graph_modes:
            out, dt = timed(device, generate_tokens, model, prompt, mask_id=mask_id, gen_length=args.gen_length,
                            block_length=args.block_length, steps=args.steps, cuda_graph=graph)
            check = "-" if ref is None else ("same tokens" if torch.equal(out, ref) else "TOKENS DIFFER")
            ref = out if ref is None else ref
            batch_rows.append([b, "reference" + (" +graph" if graph else ""), dt, args.steps, check,
                               first["reference", graph]])
        for graph in graph_modes:
            (out, nfe), dt = timed(device, fast_generate_tokens, model, prompt, mask_id=mask_id,
                                   gen_length=args.gen_length, block_length=args.block_length,
                                   threshold=args.threshold, cache=cache, cuda_graph=graph)
            agree = (out[:, args.prompt_length:] == ref[:, args.prompt_length:]).float().mean().item()
            batch_rows.append([b, f"fast {args.cache}" + (" +graph" if graph else ""), dt, nfe, f"{agree:.0%} agree",
                               first["fast", graph]])
        base = batch_rows[len(graph_modes) - 1][2]  # the fastest reference variant
        rows += [(b, name, n_tok / dt, nfe, dt / nfe * 1e3, base / dt, check, f1)
                 for b, name, dt, nfe, check, f1 in batch_rows]

    if profile_rows:
        classes = list(dict.fromkeys(c for _, by in profile_rows for c in by))
        print("\nGPU ms of one reference forward (model + LM head over the block + proposal) by kernel class")
        print(f"{'class':30s}" + "".join(f"{'batch ' + str(b):>14s}" for b, _ in profile_rows))
        for c in classes:
            print(f"{c:30s}" + "".join(f"{by.get(c, 0.0):14.2f}" for _, by in profile_rows))
    print(f"\n{'batch':>5}  {'sampler':<20} {'tok/s':>9} {'forwards':>9} {'ms/fwd':>8} {'vs ref':>8} "
          f"{'first call s':>13}  check")
    for b, name, tps, nfe, ms, speedup, check, f1 in rows:
        print(f"{b:>5}  {name:<20} {tps:>9.1f} {nfe:>9} {ms:>8.2f} {speedup:>7.2f}x {f1:>13.2f}  {check}")


if __name__ == "__main__":
    main()
