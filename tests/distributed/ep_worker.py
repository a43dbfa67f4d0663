"""Launched by test_expert_parallel.py under torchrun: expert-parallel models against the same model on one rank.

Each rank runs its own batch through the expert-parallel model (a deep copy of the reference, then
`apply_expert_parallel` over all ranks) and through the reference. The outputs must match the reference's on the
same batch; a dense gradient must be the reference's of the rank's own batch; an expert's gradient, which under
expert parallelism sums the tokens of every rank routed to it, must be the sum over the ranks of the reference's.
Rank 0 writes per case the largest relative differences, and the rows each rank's experts received, to argv[1].
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from megadlms.build import apply_fp8, construct_model
from megadlms.config import TransformerConfig
from megadlms.distributed.expert_parallel import AllToAllTokenDispatcher, apply_expert_parallel
from megadlms.distributed.init import destroy_parallel
from megadlms.moe import add_aux_losses, moe_layers

BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
            vocab_size=96, seq_length=16, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
            moe_aux_loss_coeff=1e-2)
CASES = {
    "shared_expert": dict(moe_shared_expert_intermediate_size=32),
    "one_expert_per_rank_top1_sigmoid": dict(num_moe_experts=2, moe_router_topk=1, moe_router_score_function="sigmoid"),
    # a zero router: every token of every rank goes to expert 0, so rank 1 receives no rows at all
    "collapsed_router": dict(moe_router_topk=1),
    # FP8 forward and input gradients (scaled per row and per expert: the same scales as on one rank), weight
    # gradients in the compute dtype
    "fp8_rowwise_hp_wgrad": dict(fp8=True, fp8_recipe="rowwise", fp8_wgrad=False),
    # FP8 weight gradients too: their scales span an expert's rows, here gathered from both ranks
    "fp8_rowwise": dict(fp8=True, fp8_recipe="rowwise"),
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def fwd_bwd(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    for p in model.parameters():
        p.grad = None
    out = model(x)
    add_aux_losses(model, out.float().square().mean()).backward()
    return out.detach()


def run_case(mesh, name: str, overrides: dict) -> dict[str, object]:
    torch.manual_seed(0)
    cfg = TransformerConfig(**{**BASE, **overrides})
    ref = apply_fp8(construct_model(cfg), cfg)
    if name == "collapsed_router":
        for m in moe_layers(ref):
            torch.nn.init.zeros_(m.gate.weight)
    model = copy.deepcopy(ref)
    apply_expert_parallel(model, mesh)
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(1 + rank))
    out_ref, out = fwd_bwd(ref, x), fwd_bwd(model, x)
    ref_grads = dict(ref.named_parameters())
    errs = {}
    for name, p in model.named_parameters():
        g_ref = ref_grads[name].grad
        if isinstance(p, DTensor):  # an expert weight: this rank's shard of the sum over every rank's tokens
            dist.all_reduce(g_ref)
            n = p.to_local().shape[0]
            g_ref, g = g_ref[rank * n:(rank + 1) * n], p.grad.to_local()
        else:
            g = p.grad
        errs[name] = rel(g, g_ref)
    worst = max(errs, key=errs.get)
    dispatchers = [m.dispatcher for m in moe_layers(model)]
    counts = torch.stack([m.step_tokens for m in moe_layers(model)])  # [layers, E]: this rank's pairs per expert
    dist.all_reduce(counts)
    received = counts.view(len(counts), world, -1).sum(-1)  # [layers, ranks]: the rows each rank's experts got
    with torch.no_grad():
        model.eval()
        out_eval = model(x)
    return {"out": rel(out, out_ref), "eval_out": rel(out_eval, out_ref), "grads": errs[worst], "worst": worst,
            "all_to_all": all(isinstance(d, AllToAllTokenDispatcher) for d in dispatchers),
            "local_experts": [p.to_local().shape[0] for p in model.parameters() if isinstance(p, DTensor)][0],
            "global_experts": [p.shape[0] for p in model.parameters() if isinstance(p, DTensor)][0],
            "received": received.tolist()}


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("edp", "ep"))["ep"]
    results = {name: run_case(mesh, name, case) for name, case in CASES.items()}
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)
    destroy_parallel()  # barrier first: no rank tears gloo down while a peer still talks to it


if __name__ == "__main__":
    main()
