"""Does the host wait for the GPU inside a training step? The real trainer (as `train_throughput.py` builds it,
on a synthetic corpus) after its warm-up steps:

1. a few steps under `torch.cuda.set_sync_debug_mode("warn")`: every synchronizing ATen call is listed with the
   Python lines that made it (CUDA only);
2. a few more steps timing, per step, the host's wait for the masked-token count in the loss (the one
   deliberate device-to-host read of a step) and the host time of `train_step`.

A host that runs ahead of the GPU spends far less time in the first `train_step` than the GPU needs for it; from
then on its time per step equals the GPU's whatever holds it back (a sync, or a full launch queue): (1) and (2)
tell the two apart.

    python benchmarks/host_sync_probe.py --model-path qwen3-1.7b --fp8      # on the GPU
    python benchmarks/host_sync_probe.py --smoke                            # the tiny preset on the CPU
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="qwen3-1.7b")
    p.add_argument("--fp8", action="store_true", help="--fp8-format hybrid")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="steps of each probe")
    p.add_argument("--smoke", action="store_true", help="tiny preset, narrowed, on the CPU, short sequences")
    a = p.parse_args()
    if a.smoke:
        a.model_path, a.batch, a.seq, a.warmup, a.steps = "tiny", 1, 32, 1, 2
    return a


def build_trainer(a: argparse.Namespace, data: Path):
    from benchmarks.train_throughput import build_trainer as throughput_trainer

    flags = ["--model-path", a.model_path] + (["--fp8-format", "hybrid"] if a.fp8 else [])
    # the smoke run's tiny vocabulary would not turn on the fused LM head, whose count this probes; a narrow model:
    # the CPU's FP8 GEMM (torch._scaled_mm) is slow
    extra = ["--loss-chunk-tokens", "64", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-attention-heads",
             "2", "--num-query-groups", "1", "--kv-channels", "16"] if a.smoke else []
    return throughput_trainer(flags, a.seq, a.batch, 1, data, "cpu" if a.smoke else None, extra)


def sync_calls(step, steps: int = 1) -> dict[str, int]:
    """The synchronizing calls of `steps` calls of `step` (a train step): message and the Python lines above it ->
    count."""
    import torch

    found: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        if "prototype feature" in str(message):  # the notice that the mode is on, not a sync
            return
        stack = "".join(traceback.format_stack(limit=14)[:-2])
        key = f"{str(message)[:160]}\n{stack[-900:]}"
        found[key] = found.get(key, 0) + 1

    shown = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown
    torch.cuda.synchronize()
    return found


def host_times(trainer, steps: int) -> tuple[list[float], list[float]]:
    """Per step: the host's ms in `train_step`, and its ms waiting for the masked-token count."""
    from megadlms.training.batch import HostCount

    waits: list[float] = []
    original = HostCount.get

    def timed_get(self):
        t0 = time.perf_counter()
        value = original(self)
        waits.append((time.perf_counter() - t0) * 1e3)
        return value

    HostCount.get = timed_get
    step_ms = []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            trainer.train_step()
            step_ms.append((time.perf_counter() - t0) * 1e3)
    finally:
        HostCount.get = original
    return step_ms, waits


def main() -> None:
    from megadlms.triton_setup import use_torch_ptxas

    use_torch_ptxas()  # as the megadlms commands do: the FP8 Triton kernels compile with torch's ptxas
    a = parse_args()
    import torch

    from benchmarks.train_throughput import write_corpus

    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "synthetic_text_document"
        write_corpus(prefix, vocab=128000, n_tokens=(a.warmup + 2 * a.steps + 2) * a.batch * (a.seq + 1) * 2)
        trainer = build_trainer(a, prefix)
        cuda = trainer.device.type == "cuda"
        for _ in range(a.warmup):
            trainer.train_step()
        if cuda:
            torch.cuda.synchronize()
        name = f"{a.model_path}/{'fp8' if a.fp8 else 'bf16'}"
        print(f"host sync probe | {name} | B={a.batch} S={a.seq} | torch {torch.__version__} | "
              f"{torch.cuda.get_device_name() if cuda else 'cpu'}")
        if cuda:
            calls = sync_calls(trainer.train_step, a.steps)
            print(f"synchronizing calls in {a.steps} steps: {sum(calls.values())}")
            for key, n in calls.items():
                print(f"--- x{n}\n{key}")
        else:
            print("synchronizing calls: not checked (torch's sync debug mode needs CUDA)")
        step_ms, waits = host_times(trainer, a.steps)
        if cuda:
            torch.cuda.synchronize()
        skipped = int(float(trainer.guard.window_skipped))
        if skipped:  # the probe's steps must be training steps: none skipped on a non-finite loss
            raise SystemExit(f"host sync probe: {skipped} of the probed steps skipped on a non-finite loss")
        print("host ms per train_step:      " + " ".join(f"{v:7.1f}" for v in step_ms))
        print("host ms waiting for the count: " + (" ".join(f"{v:5.1f}" for v in waits) or "(no fused LM head)"))


if __name__ == "__main__":
    main()
