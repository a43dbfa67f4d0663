"""One rank of the FP8 parameter all-gather test: a small stack of FP8 linears under FSDP2 (gloo, CPU), trained a
few steps with and without --fp8-param-gather for each recipe; writes its losses and all-gather bytes as JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from megadlms.fp8.blockwise import dequantize_blocks, quantize_blocks
from megadlms.fp8.param_gather import KINDS, enable_fp8_param_gather, gathered_fp8, quantize_weight_tensorwise

SHAPES = [(256, 128), (256, 256)]  # weights [N, K]: whole 128-row blocks on each of 2 shards
STEPS = 3


class _WeightFP8Linear(torch.autograd.Function):
    """y = x @ dequant(fp8(w))^T; dx through the dequantised weight, dw = dy^T x (fp32)."""

    @staticmethod
    def forward(ctx, x, weight, kind):
        g = gathered_fp8(weight)
        if g is None:  # the weight arrived in high precision: cast it whole, as the gather would
            if kind == "tensorwise":
                q, s = quantize_weight_tensorwise(weight, weight.abs().amax())
                w = q.float() * s
            else:
                b, _ = quantize_blocks(weight)
                w = dequantize_blocks(b.data, b.scale_inv)[: weight.shape[0], : weight.shape[1]]
        else:
            w = g.data.float() * g.scale_inv if g.kind == "tensorwise" else dequantize_blocks(g.data, g.scale_inv)
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        return dy @ w, dy.t() @ x, None


class FP8Linear(nn.Module):
    def __init__(self, n: int, k: int, kind: str):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, k) / k ** 0.5)
        self.kind = kind

    def forward(self, x):
        return _WeightFP8Linear.apply(x, self.weight, self.kind)


def count_all_gathers(log: list[int]) -> None:
    """Record the input bytes of every all-gather collective (the outermost call only)."""
    depth = [0]
    for name in ("all_gather_into_tensor", "all_gather_single"):
        if not hasattr(dist, name):
            continue
        fn = getattr(dist, name)

        def counted(*args, _fn=fn, **kwargs):
            inp = kwargs.get("input_tensor", args[1] if len(args) > 1 else None)
            if depth[0] == 0:
                log.append(inp.numel() * inp.element_size())
            depth[0] += 1
            try:
                return _fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        setattr(dist, name, counted)


def train(kind: str, gather: bool, mesh, rank: int, log: list[int]) -> list[float]:
    torch.manual_seed(0)
    layers = [FP8Linear(n, k, kind) for n, k in SHAPES]
    model = nn.Sequential(layers[0], nn.ReLU(), layers[1])
    if gather:
        enable_fp8_param_gather(layers, kind, mesh.size())
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    del log[:]
    for _ in range(STEPS):
        x = torch.randn(64, SHAPES[0][1], generator=g)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        log: list[int] = []
        count_all_gathers(log)
        result = {}
        for kind in KINDS:
            for gather in (False, True):
                losses = train(kind, gather, mesh, rank, log)
                result[f"{kind}/{'fp8' if gather else 'hp'}"] = {"losses": losses, "bytes": list(log)}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
