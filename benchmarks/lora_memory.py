"""LoRA training memory and speed with the frozen base in BF16 and in FP8 (`megadlms.lora`), one GPU.

Each base runs in its own process (fresh memory): the model of a preset (random weights: the values do not change
the cost), `apply_lora` on all seven linears of every layer, AdamW over the adapters, then warm-up steps and
timed steps of a masked-diffusion-shaped step (forward of the whole model under BF16 autocast, cross-entropy over
every position, backward, optimizer step) between device synchronisations. Prints the weights' memory after
setup, the peak memory of the timed steps, tokens/s, and the FP8 base's ratios against the BF16 base.

    python benchmarks/lora_memory.py                          # llada-8b, seq 4096, rank 64, micro-batch 1
    python benchmarks/lora_memory.py --preset qwen3-8b --recompute
    python benchmarks/lora_memory.py --smoke                  # the tiny preset on the CPU
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def random_ids(cfg, shape: tuple[int, ...], device):
    """long `shape`: uniform ids of cfg's vocabulary without its mask id (never a token of real text)."""
    import torch

    mask = cfg.mask_token_id
    if mask is None or not 0 <= mask < cfg.vocab_size:
        return torch.randint(0, cfg.vocab_size, shape, device=device)
    ids = torch.randint(0, cfg.vocab_size - 1, shape, device=device)
    return ids + (ids >= mask).long()  # the ids above the mask id shifted up by one


def build_step(args: argparse.Namespace):
    """One base's model, adapters and optimizer: (step, setup), where step() runs one training step and returns its
    loss (a 0-dim tensor) and setup holds the memory after setup (bytes) and `memory_accounting`'s figures. The LM
    head + loss and the optimizer run under profiler ranges of those names (benchmarks/step_breakdown.py)."""
    import torch
    import torch.nn.functional as F

    from megadlms.build import construct_model
    from megadlms.distributed.parallelize import apply_activation_checkpointing, apply_compile
    from megadlms.lora import LoraConfig, apply_lora, memory_accounting
    from megadlms.presets import load_model_config
    from megadlms.training.optim import allocate_optimizer_state, build_optimizer

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    overrides = {"seq_length": args.seq, "max_position_embeddings": max(args.seq, 64)}
    if args.layers:
        overrides["num_layers"] = args.layers
    cfg = load_model_config(args.preset, tokenizer_vocab_size=32000, **overrides)
    torch.manual_seed(0)
    # the base is built on the CPU and moved after LoRA stored it: an 8B model in fp32 does not fit beside the rest
    build_device = "cpu" if args.build_on_cpu else device
    model = construct_model(cfg, device=build_device)
    model = apply_lora(model, LoraConfig(rank=args.rank, alpha=2 * args.rank, base=args.base))
    model.to(device)
    if args.recompute:
        apply_activation_checkpointing(model)
    if args.compile:
        apply_compile(model)
    opt = build_optimizer(model, lr=1e-4, weight_decay=0.0, betas=(0.9, 0.95))
    allocate_optimizer_state(opt)
    acc = memory_accounting(model)
    if cuda:
        torch.cuda.synchronize()
    setup = {"bytes": torch.cuda.memory_allocated() if cuda else float("nan"), **acc}
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    ids = random_ids(cfg, (args.mbs, args.seq), device)

    def step() -> torch.Tensor:
        with autocast:
            hidden = model(ids, output_hidden=True)
        # the loss over chunks of positions (as the trainer's fused head + loss): no [tokens, V] fp32 logits
        with torch.profiler.record_function("lm head + loss"):
            loss = torch.zeros((), device=device)
            flat, target = hidden.reshape(-1, cfg.hidden_size), ids.reshape(-1)
            for h, t in zip(flat.split(1024), target.split(1024)):
                with autocast:
                    logits = model.logits(h)
                loss = loss + F.cross_entropy(logits.float(), t, reduction="sum")
            loss = loss / target.numel()
        loss.backward()
        with torch.profiler.record_function("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, setup


def measure(args: argparse.Namespace) -> dict:
    """One base: setup, warm-up, timed steps. Returns the row of the table."""
    import torch

    step, setup = build_step(args)
    cuda = torch.device(args.device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    for _ in range(args.warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    losses = [step() for _ in range(args.steps)]
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    losses_f = torch.stack(losses).float().tolist()
    if not all(math.isfinite(v) for v in losses_f):
        raise SystemExit(f"{args.base} base: non-finite loss in the timed steps {losses_f}")
    return {"base": args.base, "loss": sum(losses_f) / len(losses_f),
            "tokens_per_s": args.steps * args.mbs * args.seq / seconds,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
            "setup_gib": setup["bytes"] / 2**30, "base_fp8_gib": setup["base_fp8"] / 2**30,
            "frozen_gib": setup["frozen"] / 2**30, "trainable_m": setup["trainable_params"] / 1e6}


def main() -> None:
    from megadlms.triton_setup import use_torch_ptxas

    use_torch_ptxas()  # as the megadlms commands do: the FP8 Triton kernels compile with torch's ptxas
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llada-8b")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the preset (a quick look)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--mbs", type=int, default=1)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--bases", default="bf16,fp8")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--recompute", action="store_true", help="activation checkpointing of every layer")
    p.add_argument("--compile", action="store_true", help="torch.compile each layer")
    p.add_argument("--build-on-cpu", action=argparse.BooleanOptionalAction, default=True,
                   help="construct the fp32 model on the CPU, store the base, then move it")
    p.add_argument("--device", default=None)
    p.add_argument("--smoke", action="store_true", help="the tiny preset on the CPU, seq 64, rank 4, one step")
    p.add_argument("--base", help=argparse.SUPPRESS)  # the child process's one base
    args = p.parse_args()
    if args.smoke:
        args.preset, args.seq, args.rank, args.steps, args.warmup, args.device = "tiny", 64, 4, 1, 1, "cpu"
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.base is not None:
        print("RESULT " + json.dumps(measure(args)))
        return
    forwarded = [a for a in sys.argv[1:] if a != "--smoke"]
    if args.smoke:
        forwarded += ["--preset", "tiny", "--seq", "64", "--rank", "4", "--steps", "1", "--warmup", "1",
                      "--device", "cpu"]
    rows = {}
    print(f"LoRA rank {args.rank} on q,k,v,o,gate,up,down | {args.preset}"
          f"{f' ({args.layers} layers)' if args.layers else ''} | seq {args.seq} x micro-batch {args.mbs} | "
          f"{args.device}{' | recompute' if args.recompute else ''}{' | compiled' if args.compile else ''}")
    print(f"{'base':6} {'tokens/s':>10} {'peak GiB':>9} {'setup GiB':>10} {'FP8 weights GiB':>16} "
          f"{'other frozen GiB':>17} {'trainable M':>12}")
    for base in args.bases.split(","):
        res = subprocess.run([sys.executable, __file__, *forwarded, "--base", base], capture_output=True, text=True)
        line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
        if res.returncode or line is None:
            tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
            print(f"{base:6} ERROR {tail[0][:200]}")
            continue
        r = rows[base] = json.loads(line[len("RESULT "):])
        print(f"{base:6} {r['tokens_per_s']:10.1f} {r['peak_gib']:9.2f} {r['setup_gib']:10.2f} "
              f"{r['base_fp8_gib']:16.2f} {r['frozen_gib']:17.2f} {r['trainable_m']:12.2f}")
    if "bf16" in rows and "fp8" in rows:
        b, f = rows["bf16"], rows["fp8"]
        print(f"fp8 vs bf16 base: peak memory x{f['peak_gib'] / b['peak_gib']:.2f} (goal <= 0.6), "
              f"tokens/s x{f['tokens_per_s'] / b['tokens_per_s']:.2f} (goal >= 1.2)")


if __name__ == "__main__":
    main()
