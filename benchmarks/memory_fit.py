"""How much of a benchmark fits the GPU: micro-batches, layers or concurrent runs sized from the free memory
(`torch.cuda.mem_get_info`) and a per-run estimate, computed from the model's shape or measured on a first run.

The computed estimate of full training (AdamW, fp32 master weights):
- fixed: 16 bytes a parameter (fp32 weights and gradients, two fp32 AdamW moments), plus 2 bytes a linear
  weight for FP8's cached weight and its transpose;
- per sequence: the activations the backward keeps, ~34 bytes per hidden unit, token and layer in BF16 with
  fused attention (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"); under
  full recompute each layer keeps its BF16 input (2 bytes) and one layer's activations live at a time.
It is an estimate: the scripts still halve a micro-batch that runs out of memory.

    python benchmarks/memory_fit.py llada-8b --seq 4096 --recompute     # the largest layer count / micro-batch
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

GIB = 2**30


def usable(free: float) -> float:
    """The part of `free` bytes a run may plan to fill: the rest is for the CUDA context's growth, the allocator's
    fragmentation and the kernels' workspaces."""
    return free - max(2.0 * GIB, 0.03 * free)


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes of one training run: `fixed` (weights, gradients, optimizer, FP8 caches) and `per_sequence`."""

    fixed: float
    per_sequence: float

    def total(self, micro_batch: int) -> float:
        return self.fixed + micro_batch * self.per_sequence


def free_bytes() -> int | None:
    """Free memory of CUDA device 0, net of what every process holds; None without CUDA. Asked in a child process,
    so that the caller (a benchmark's parent, whose runs are its children) holds no CUDA context of its own."""
    code = "import torch; print(torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else -1)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"memory_fit.py: asking the GPU's free memory failed: {res.stderr.strip()[-300:]}")
    free = int(res.stdout.split()[-1])
    return None if free < 0 else free


def parameter_counts(cfg) -> tuple[int, int]:
    """(all parameters, parameters of the decoder layers' linears) of a `TransformerConfig`."""
    emb = cfg.vocab_size * cfg.hidden_size
    matmul = cfg.num_matmul_params()  # the linears and the LM head (the tied embedding)
    total = matmul + (emb if cfg.untie_embeddings_and_output_weights else 0)
    return total, matmul - emb


def training_memory(cfg, seq: int, fp8: bool = False, recompute: bool = False) -> TrainingMemory:
    """The computed estimate (module docstring) for `cfg` at sequence length `seq`."""
    total, linear = parameter_counts(cfg)
    fixed = 16.0 * total + (2.0 * linear if fp8 else 0.0)
    per_layer_token = 34.0 * cfg.hidden_size
    if recompute:
        per_sequence = seq * (2.0 * cfg.hidden_size * cfg.num_layers + per_layer_token)
    else:
        per_sequence = seq * per_layer_token * cfg.num_layers
    return TrainingMemory(fixed, per_sequence)


def fitting_count(room: float, fixed: float, per_item: float, want: int) -> int:
    """The most items (sequences, runs), at most `want`, such that fixed + n * per_item <= room bytes; 0 when not
    even one fits."""
    if per_item <= 0:
        return want
    return max(0, min(want, int((room - fixed) // per_item)))


def fitting_micro_batch(cfg, seq: int, want: int, free: float | None, fp8: bool = False,
                        recompute: bool = False) -> int:
    """The micro-batch to run: `want`, or fewer where the estimate says `want` does not fit `free` bytes (at least
    1: a run that does not fit at 1 fails with the allocator's own message). Without a GPU, `want`."""
    if free is None:
        return want
    mem = training_memory(cfg, seq, fp8, recompute)
    return max(1, fitting_count(usable(free), mem.fixed, mem.per_sequence, want))


def fitting_layers(cfg, seq: int, micro_batch: int, free: float, fp8: bool = False, recompute: bool = False) -> int:
    """The most decoder layers of `cfg` (at most its own count) whose training fits `free` bytes at `micro_batch`."""
    for layers in range(cfg.num_layers, 0, -1):
        mem = training_memory(cfg.replace(num_layers=layers), seq, fp8, recompute)
        if mem.total(micro_batch) <= usable(free):
            return layers
    return 0


def concurrent_runs(free_before: float, free_with_one: float, want: int, margin: float = 1.25) -> int:
    """Runs to have going at once, at most `want`, from a measurement: the device's free memory before the first
    run and while it trains. The others each get `margin` times the first's share (later steps, FP8 telemetry and
    validation may hold more than the first log line shows)."""
    one = max(free_before - free_with_one, 1.0)
    return max(1, min(want, 1 + fitting_count(usable(free_with_one), 0.0, margin * one, want - 1)))


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from megadlms.presets import load_model_config

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="--model-path of the run (a preset or a config.json)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--recompute", action="store_true", help="full activation recompute")
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--free-gib", type=float, default=None, help="instead of the current GPU's free memory")
    p.add_argument("--print", choices=("layers", "micro-batch", "table"), default="table",
                   help="layers / micro-batch: print only that number (for shell scripts)")
    a = p.parse_args()
    cfg = load_model_config(a.model, tokenizer_vocab_size=32000, seq_length=a.seq)
    free = a.free_gib * GIB if a.free_gib is not None else free_bytes()
    if free is None:
        raise SystemExit("memory_fit.py: no CUDA device; give --free-gib")
    layers = fitting_layers(cfg, a.seq, a.micro_batch, free, a.fp8, a.recompute)
    mem = training_memory(cfg, a.seq, a.fp8, a.recompute)
    mb = fitting_count(usable(free), mem.fixed, mem.per_sequence, want=1024)
    if a.print == "layers":
        print(layers)
    elif a.print == "micro-batch":
        print(mb)
    else:
        print(f"{a.model} seq {a.seq}{' recompute' if a.recompute else ''}{' fp8' if a.fp8 else ''}: fixed "
              f"{mem.fixed / GIB:.1f} GiB, {mem.per_sequence / GIB:.2f} GiB a sequence; free {free / GIB:.1f} GiB: "
              f"micro-batch {mb} fits all {cfg.num_layers} layers, {layers} layers fit at micro-batch "
              f"{a.micro_batch}")


if __name__ == "__main__":
    main()
