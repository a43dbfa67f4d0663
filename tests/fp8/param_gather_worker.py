"""One of 4 gloo ranks of the FP8 parameter all-gather test (forked by test_param_gather.py).

1. Library: a one-layer FP8 TransformerLM (fused q/k/v and gate/up) under FSDP2 on 2-rank sub-meshes and on all 4
   ranks, trained a few steps with and without the FP8 all-gather for each recipe that has it; records the losses
   and the bytes every all-gather sends, with what they should be.
2. The trainer: `setup(parse_train_args(...)).run()` on the 4 ranks (ZeRO-1), without and with --fp8-param-gather,
   and a run without the flag resumed from the second one's checkpoint. Rank 0 writes the library's results as
   JSON; the trainer writes its metrics.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from megadlms.build import apply_fp8, construct_model
from megadlms.config import TransformerConfig
from megadlms.distributed.config import ParallelConfig
from megadlms.distributed.data_parallel import apply_fsdp
from megadlms.distributed.init import ParallelContext
from megadlms.distributed.parallelize import apply_fp8_param_gather
from megadlms.fp8 import fp8_modules, fp8_step
from tests.distributed.launch import TINY

RECIPES = [("delayed", "hybrid"), ("tensorwise", "hybrid"), ("blockwise", "e4m3")]
STEPS = 3
SENT: list[tuple[int, str]] = []  # (bytes, dtype) of every all-gather's input on this rank


def count_all_gathers() -> None:
    """Record the input of every all-gather FSDP2 issues (torch names it all_gather_single or
    all_gather_into_tensor, depending on the version)."""
    for name in ("all_gather_single", "all_gather_into_tensor"):
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def counted(output, input, *args, _fn=fn, **kwargs):
            SENT.append((input.numel() * input.element_size(), str(input.dtype)))
            return _fn(output, input, *args, **kwargs)

        setattr(dist, name, counted)


def model_config(recipe: str, fmt: str, shards: int) -> TransformerConfig:
    """Blockwise: every weight [N, K] has N = 128 x shards rows, whole 128-row blocks on each shard. The per-tensor
    recipes take any shape: smaller ones (the CPU's FP8 GEMM, which they run, is slow)."""
    h = 128 * shards if recipe == "blockwise" else 64
    return TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=shards, num_query_groups=shards,
                             ffn_hidden_size=h, vocab_size=64, seq_length=16, fp8=True, fp8_format=fmt,
                             fp8_recipe=recipe)


def expected_bytes(model: torch.nn.Module, shards: int, blockwise: bool) -> dict[str, int]:
    """What each rank's all-gather of the layer and of the root should send, in high precision (fp32) and FP8."""
    fp8_weights = {id(m.weight) for m in fp8_modules(model)}
    layer = list(model.layers[0].parameters())
    lin = sum(p.numel() for p in layer if id(p) in fp8_weights)
    other = sum(p.numel() for p in layer if id(p) not in fp8_weights)
    blocks = sum(-(-p.shape[0] // 128) * -(-p.shape[1] // 128) for p in layer if id(p) in fp8_weights)
    root = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("layers."))
    return {"root": 4 * root // shards, "layer_hp": 4 * (lin + other) // shards,
            "layer_fp8": (lin + 4 * other + (4 * blocks if blockwise else 0)) // shards}


def train(recipe: str, fmt: str, mesh, gather: bool) -> dict:
    shards = mesh.size()
    cfg = model_config(recipe, fmt, shards)
    torch.manual_seed(0)
    model = apply_fp8(construct_model(cfg), cfg)
    expected = expected_bytes(model, shards, recipe == "blockwise")
    if gather:
        ctx = ParallelContext(world_size=shards)
        apply_fp8_param_gather(model, ctx, ParallelConfig(data_parallel_sharding_strategy="optim_grads_params"))
    apply_fsdp(model, mesh, reshard_after_forward=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    SENT.clear()
    for _ in range(STEPS):
        ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=gen)
        loss = F.cross_entropy(model(ids).float().flatten(0, 1), ids.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        fp8_step(model)
        losses.append(loss.item())
    return {"losses": losses, "sent": list(SENT), "expected": expected}


def run_trainer(argv: list[str]) -> None:
    from megadlms.training.args import parse_train_args
    from megadlms.training.trainer import setup

    trainer = setup(parse_train_args(argv))
    try:
        trainer.run()
        trainer.finish_save()
    finally:
        trainer.control.uninstall()


def main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        count_all_gathers()
        pairs = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))["shard"]
        meshes = {2: pairs, world: init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))}
        result: dict = {}
        for shards, mesh in meshes.items():
            for recipe, fmt in RECIPES:
                for gather in (False, True):
                    result[f"{shards}/{recipe}/{'fp8' if gather else 'hp'}"] = train(recipe, fmt, mesh, gather)
        out = Path(out_dir)
        fp8 = TINY + ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--use-distributed-optimizer",
                      "--micro-batch-size", "1", "--train-iters", "3", "--save-interval", "2"]
        run_trainer(fp8 + ["--save", str(out / "hp")])
        run_trainer(fp8 + ["--save", str(out / "fp8"), "--fp8-param-gather"])
        # the checkpoint of a run with the flag holds plain master weights: it resumes without the flag
        run_trainer(fp8 + ["--save", str(out / "resumed"), "--load", str(out / "fp8"), "--ckpt-step", "2"])
        if rank == 0:
            (out / "library.json").write_text(json.dumps(result))
    finally:
        dist.barrier()
        dist.destroy_process_group()
