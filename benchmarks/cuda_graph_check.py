"""CUDA graphs of the layers (`--cuda-graphs`) against eager execution on the GPU: same losses, same gradients.

For each precision, the real trainer (compiled layers, bundled corpus, gradient accumulation over 2
micro-batches, cut micro-batches with --difflm-varilen-prob 0.2, FP8 telemetry every 4th step) trains the same
model twice, `--cuda-graphs off` and `on`, and the losses are compared step by step. Then, on the graphed
trainer after its steps, one micro-batch's loss and layer gradients from the replayed graphs are compared with
the eager layers' at the same weights and FP8 state: a graph that kept a stale FP8 weight (a cast made before
the optimizer steps) would differ there by a whole update, not by rounding.

Both runs use the same kernels, so the differences are those of run-to-run nondeterminism (the attention
backward's atomics); `eager vs eager` gives that floor.

    python benchmarks/cuda_graph_check.py            # on a GPU
    python benchmarks/cuda_graph_check.py --smoke    # the CPU check of the script (graphs emulated)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megadlms.training.args import parse_train_args  # noqa: E402
from megadlms.training.trainer import setup  # noqa: E402

# the CPU check: a narrow model and few tokens (the CPU kernel of the FP8 GEMM, torch._scaled_mm, is slow)
SMOKE_FLAGS = ["--device", "cpu", "--no-compile", "--hidden-size", "32", "--ffn-hidden-size", "64",
               "--num-attention-heads", "2", "--num-query-groups", "1", "--kv-channels", "16"]
DOCUMENTS = ["--reset-attention-mask", "--reset-position-ids"]  # a document mask per batch (EOD-separated)
BD3LM = ["--model-running-mode", "bd3lm", "--block-size", "16"]  # the block-diffusion mask
VARIANTS = {"bf16": [], "fp8 delayed": ["--fp8-format", "hybrid"],
            "fp8 tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
            "bf16 documents": DOCUMENTS, "fp8 documents": ["--fp8-format", "hybrid", *DOCUMENTS],
            "bf16 bd3lm": BD3LM, "fp8 bd3lm": ["--fp8-format", "hybrid", *BD3LM]}
DEFAULT_VARIANTS = "bf16,fp8 delayed,fp8 tensorwise"


def _trainer(flags: list[str], graphs: str, a: argparse.Namespace):
    argv = ["--model-path", a.model, "--num-layers", str(a.layers), "--seq-length", str(a.seq),
            "--micro-batch-size", str(a.mbs), "--global-batch-size", str(2 * a.mbs), "--train-iters", str(a.iters),
            "--lr", "1e-3", "--lr-warmup-iters", "2", "--eval-iters", "0", "--eval-interval", "0",
            "--log-interval", "4", "--difflm-varilen-prob", "0.2", "--no-progress", "--num-workers", "0",
            "--cuda-graphs", graphs] + flags + (SMOKE_FLAGS if a.smoke else [])
    t = setup(parse_train_args(argv))
    t.model.train()
    t._train_iter = iter(t.loaders.train)
    return t


def _losses(t, iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        out.append(float(t.train_step()["loss"]))
    return out


def _loss_and_grads(t, batch) -> tuple[float, list[torch.Tensor]]:
    t.optimizer.zero_grad(set_to_none=True)
    loss = t._loss(batch)
    loss.backward()
    grads = [p.grad.detach().float().clone() for layer in t.model.layers for p in layer.parameters()]
    t.optimizer.zero_grad(set_to_none=True)
    return float(loss), grads


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = sum(float((x - y).square().sum()) for x, y in zip(a, b))
    den = sum(float(y.square().sum()) for y in b)
    return (num / max(den, 1e-30)) ** 0.5


class _SyncsWhenCaptured(torch.nn.Module):
    """A 'model' whose layer synchronises the device inside a capture: a capture that fails inside CUDA."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(64, 64)])

    def run_layers(self, x, rope, attn_mask=None, kv_cache=None):
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()
        return self.layers[0](x)


def check_failed_capture() -> str:
    """A failed capture falls back to eager layers and leaves the device usable: random ops (the mask noise of the
    next step) and a later capture of other graphs work."""
    from megadlms.training.cuda_graphs import LayerGraphs

    model = _SyncsWhenCaptured().cuda().train()
    graphs = LayerGraphs(model)
    graphs.arm()
    x = torch.randn(8, 64, device="cuda", requires_grad=True)
    rope = (torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda"))
    model.run_layers(x, rope, None, None).sum().backward()
    assert graphs.failed and graphs.num_eager == 1, (graphs.failed, graphs.num_eager)
    torch.rand(4, device="cuda").sum().item()  # raised "Offset increment outside graph capture" before
    model.layers[0].weight.data.normal_()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = torch.rand(4, device="cuda") * 2
    g.replay()
    assert bool(((y >= 0) & (y < 2)).all()), y
    return f"failed capture: eager fallback, RNG and later captures work ({graphs.failed.splitlines()[0][:80]})"


def main() -> None:
    from megadlms.triton_setup import use_torch_ptxas

    use_torch_ptxas()  # as the megadlms commands do: the FP8 Triton kernels compile with torch's ptxas
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma-separated, of: {', '.join(VARIANTS)}")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, graphs emulated (EmulatedGraph)")
    a = p.parse_args()
    if a.smoke:
        a.model, a.layers, a.seq, a.mbs, a.iters = "tiny", 2, 32, 1, 4
        os.environ["MEGADLMS_EMULATE_CUDA_GRAPHS"] = "1"
    # nine trainers in one process (3 variants x off/off/on), plus cut lengths: more than the default 8 graphs
    torch._dynamo.config.recompile_limit = 64
    from megadlms.fp8 import fp8_graph_capture

    recovery = check_failed_capture() if not a.smoke else "failed capture: not checked (CPU)"
    rows = []
    for name in a.variants.split(","):
        flags = VARIANTS[name]
        t0 = time.perf_counter()
        ref = _losses(_trainer(flags, "off", a), a.iters)
        # the CPU's kernels are deterministic: no floor to measure there
        again = ref if a.smoke else _losses(_trainer(flags, "off", a), a.iters)
        g = _trainer(flags, "on", a)
        got = _losses(g, a.iters)
        graphs = g.layer_graphs
        # one micro-batch at the trained weights: replayed graphs vs the eager layers, same FP8 state
        noise = g.objective.draw_noise(g.sampler, g.global_batch, g.accum, evaluation=True)  # whole windows
        batch = next(g.objective.micro_batches(g._train_iter, noise, 1, g.device))
        with fp8_graph_capture(g.model):  # restores the FP8 buffers after the two passes; casts afresh
            replays = graphs.num_replays
            l_graph, gr_graph = _loss_and_grads(g, batch)
            assert graphs.num_replays == replays + 1, "the check's pass did not replay"
        with fp8_graph_capture(g.model):
            graphs.armed = False  # eager layers
            l_eager, gr_eager = _loss_and_grads(g, batch)
            graphs.armed = True
        step_diff = max(abs(x - y) / abs(y) for x, y in zip(got, ref))
        floor = max(abs(x - y) / abs(y) for x, y in zip(again, ref))
        rows.append((name, step_diff, floor, abs(l_graph - l_eager) / abs(l_eager), _rel(gr_graph, gr_eager),
                     graphs.num_replays, graphs.num_eager, graphs.capture_seconds, time.perf_counter() - t0))
        print(f"{name}: losses off {['%.4f' % x for x in ref]}\n{name}: losses on  {['%.4f' % x for x in got]}",
              flush=True)
    print(f"\n{recovery}")
    print(f"CUDA graphs vs eager | {a.model} {a.layers} layers, seq {a.seq}, micro-batch {a.mbs} x 2 | "
          f"torch {torch.__version__} | {torch.cuda.get_device_name() if not a.smoke else 'cpu, graphs emulated'}")
    print(f"{'variant':16s} {'loss diff/step':>15s} {'eager vs eager':>15s} {'check loss':>11s} {'check grads':>12s} "
          f"{'replays':>8s} {'eager':>6s} {'capture s':>10s} {'wall s':>7s}")
    for r in rows:
        print(f"{r[0]:16s} {r[1]:15.2e} {r[2]:15.2e} {r[3]:11.2e} {r[4]:12.2e} {r[5]:8d} {r[6]:6d} {r[7]:10.1f} "
              f"{r[8]:7.0f}")


if __name__ == "__main__":
    main()
