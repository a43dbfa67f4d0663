"""CPU training losses of a tiny FP8 model for every recipe, format and option: the numerics the FP8 engine must
keep through refactors (test_numerics.py compares them with the fixture `data/fp8_losses.json`).

    PYTHONPATH=$PWD python tests/fp8/numerics_losses.py            # print the losses of every case
    PYTHONPATH=$PWD python tests/fp8/numerics_losses.py --check    # compare every case with the fixture
    PYTHONPATH=$PWD python tests/fp8/numerics_losses.py --write    # record this machine's results (after a
                                                                    # deliberate change: on every machine recorded)

The fixture holds one recording per machine kind (`machine_key`: CPU vendor, vector ISA, torch version): the CPU
matmul kernels differ between them in the last bits, which FP8 rounding can turn into ~1e-4 of a loss.

Under TRITON_INTERPRET=1 the Triton kernels (one-pass casts, the fused MLP's SwiGLU casts) run in Triton's
interpreter: those cases are recorded under "interpret/<name>" (only the fused per-tensor ones: `--only` picks).

Each case: a 2-layer model (hidden 64, token counts not multiples of 16), 3 optimizer steps of 2 micro-batches,
`fp8_step` after each; the losses of every micro-batch and a checksum of the final weights are recorded. The `moe-`
cases train the `tiny-moe` preset's model (vocabulary 128) instead: FP8 grouped experts, the router in fp32, the
auxiliary losses in the loss.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys

import torch
import torch.nn.functional as F

from megadlms.config import TransformerConfig
from megadlms.fp8 import (
    DelayedScaling,
    Float8CurrentScaling,
    Float8RowwiseScaling,
    Format,
    convert_to_fp8,
    fp8_step,
)
from megadlms.model import TransformerLM
from megadlms.moe import add_aux_losses
from megadlms.presets import PRESETS

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "fp8_losses.json")
RECIPES = {"delayed": lambda fmt: DelayedScaling(fp8_format=fmt, amax_history_len=4),
           "tensorwise": lambda fmt: Float8CurrentScaling(fp8_format=fmt),
           "rowwise": lambda fmt: Float8RowwiseScaling(fp8_format=fmt)}
FUSED = dict(fuse_projections=True, fuse_mlp=True)
UNFUSED = dict(fuse_projections=False, fuse_mlp=False)


def cases() -> dict[str, tuple]:
    """name -> (recipe, format, convert_to_fp8 options, bf16 autocast[, model: "dense" or "moe"])."""
    out: dict[str, tuple] = {}
    for recipe in RECIPES:
        for fmt in ("hybrid", "e4m3"):
            out[f"{recipe}-{fmt}-fused"] = (recipe, fmt, FUSED, False)
        out[f"{recipe}-hybrid-unfused"] = (recipe, "hybrid", UNFUSED, False)
        out[f"{recipe}-hybrid-fused-bf16wgrad"] = (recipe, "hybrid", {**FUSED, "fp8_wgrad": False}, False)
        out[f"{recipe}-hybrid-unfused-bf16wgrad"] = (recipe, "hybrid", {**UNFUSED, "fp8_wgrad": False}, False)
        out[f"{recipe}-hybrid-fused-fp8store"] = (recipe, "hybrid", {**FUSED, "activation_func_fp8_input_store": True},
                                                  False)
        out[f"{recipe}-hybrid-fused-autocast"] = (recipe, "hybrid", FUSED, True)
        out[f"{recipe}-hybrid-unfused-precise"] = (recipe, "hybrid", {**UNFUSED, "fprop_fast_accum": False}, False)
    out["rowwise-e4m3-fused-fp8store"] = ("rowwise", "e4m3", {**FUSED, "activation_func_fp8_input_store": True}, False)
    out["delayed-hybrid-fused-fp8attention"] = ("delayed", "hybrid", {**FUSED, "dot_product_attention": True}, False)
    out["delayed-hybrid-bf16edges"] = ("delayed", "hybrid", {**FUSED, "num_layers_at_start_in_bf16": 1}, False)
    for recipe in ("rowwise", "tensorwise"):  # the recipes the FP8 experts take
        out[f"moe-{recipe}-hybrid"] = (recipe, "hybrid", FUSED, False, "moe")
        out[f"moe-{recipe}-e4m3-autocast"] = (recipe, "e4m3", FUSED, True, "moe")
    out["moe-rowwise-hybrid-bf16wgrad"] = ("rowwise", "hybrid", {**FUSED, "fp8_wgrad": False}, False, "moe")
    for recipe in ("rowwise", "tensorwise"):  # the experts' weight gradients in FP8 too (not their default)
        out[f"moe-{recipe}-hybrid-fp8wgrad"] = (recipe, "hybrid", {**FUSED, "experts_fp8_wgrad": True}, False, "moe")
    return out


def train(recipe: str, fmt: str, options: dict, autocast: bool, model_kind: str = "dense", steps: int = 3,
          accum: int = 2) -> dict:
    if model_kind == "moe":
        cfg = TransformerConfig(**{**PRESETS["tiny-moe"], "vocab_size": 128, "seq_length": 32})
    else:
        cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                ffn_hidden_size=96, vocab_size=128, seq_length=32,
                                untie_embeddings_and_output_weights=True)
    torch.manual_seed(0)
    model = convert_to_fp8(TransformerLM(cfg), RECIPES[recipe](Format(fmt)), **options)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        for micro in range(accum):
            g = torch.Generator().manual_seed(step * 10 + micro)
            ids = torch.randint(0, 128, (2, 19), generator=g)  # 38 tokens: not a multiple of 16
            ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
            with ctx:
                logits = model(ids)
            loss = F.cross_entropy(logits.float().flatten(0, 1), torch.roll(ids, -1, 1).flatten())
            if model_kind == "moe":
                loss = add_aux_losses(model, loss)
            (loss / accum).backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        fp8_step(model)
    checksum = sum(p.detach().double().abs().sum().item() for p in model.parameters())
    return {"losses": losses, "weights_abs_sum": checksum}


def machine_key() -> str:
    """The CPU kernels' identity: the same torch build gives the same bits only on the same vendor and vector
    ISA (oneDNN / MKL pick their matmul kernels by them; an FP8 rounding flip then moves a loss by ~1e-4)."""
    vendor = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            vendor = next((line.split(":")[1].strip() for line in f if line.startswith("vendor_id")), vendor)
    except OSError:
        pass
    return f"{platform.machine()}-{vendor}-{torch.backends.cpu.get_cpu_capability()}-torch{torch.__version__}"


def load_fixture(key: str | None = None) -> dict:
    """The recorded results of machine `key` (default: this one), or of the first recorded machine when this one
    has none (compare those with a tolerance: `exact_fixture()` says which)."""
    with open(FIXTURE) as f:
        stored = json.load(f)
    key = key or machine_key()
    return stored[key] if key in stored else next(iter(stored.values()))


def exact_fixture() -> bool:
    """Whether the fixture holds this machine's own recording (then results must equal it bit for bit)."""
    with open(FIXTURE) as f:
        return machine_key() in json.load(f)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"write the results to {FIXTURE}")
    ap.add_argument("--check", action="store_true", help="exit 1 unless every case equals the fixture bit for bit")
    ap.add_argument("--only", default=None, help="run the cases whose name contains this")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    prefix = "interpret/" if os.environ.get("TRITON_INTERPRET") == "1" else ""
    results = {}
    for name, case in cases().items():
        if args.only and args.only not in name:
            continue
        results[prefix + name] = train(*case)
        print(prefix + name, results[prefix + name]["losses"], flush=True)
    if args.check:
        if not exact_fixture():
            print(f"the fixture has no recording of this machine ({machine_key()}): record one with --write")
            return 1
        stored = load_fixture()
        bad = [n for n, r in results.items() if stored.get(n) != r]
        print("differ:" if bad else f"all {len(results)} cases equal the fixture", *bad)
        return 1 if bad else 0
    if args.write:
        stored = {}
        if os.path.exists(FIXTURE):
            with open(FIXTURE) as f:
                stored = json.load(f)
        stored.setdefault(machine_key(), {}).update(results)
        os.makedirs(os.path.dirname(FIXTURE), exist_ok=True)
        with open(FIXTURE, "w") as f:
            json.dump(stored, f, indent=1, sort_keys=True)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
