"""Launched by test_tensor_parallel.py under torchrun: tensor-parallel models against the same model unsharded.

For each case the TP model (a deep copy of the reference, then `apply_tensor_parallel`) and the reference
run the same forward and backward; rank 0 writes, per case, the largest relative difference of the logits
and of any parameter gradient (and of the logits by the samplers' path, `model.logits` on the returned hidden
states) to the JSON file given as argv[1].
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from megadlms.build import build_model
from megadlms.config import TransformerConfig
from megadlms.distributed.init import destroy_parallel
from megadlms.distributed.tensor_parallel import apply_tensor_parallel
from megadlms.model import TransformerLM

CASES = {
    # name: (config overrides, sequence parallel, sequence length)
    "tied": ({}, False, 16),
    "tied_sp_odd_length": ({}, True, 5),
    "untied_qknorm_bias_sp": (dict(untie_embeddings_and_output_weights=True, qk_layernorm=True, add_qkv_bias=True),
                              True, 16),
    "uneven_vocab": (dict(vocab_size=97, qk_layernorm=True), False, 12),
    "fp8_sp": (dict(fp8=True, qk_layernorm=True), True, 16),
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def fwd_bwd(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    for p in model.parameters():
        p.grad = None
    out = model(x)
    (out.float().square().mean() + out.float().mean()).backward()
    return out.detach()


def run_case(mesh, overrides: dict, sequence_parallel: bool, seq: int) -> dict[str, float]:
    torch.manual_seed(0)
    cfg = TransformerConfig(**{**dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                      ffn_hidden_size=128, vocab_size=96, seq_length=16), **overrides})
    if cfg.fp8:  # per-projection GEMMs: under TP each projection runs on its own shard (no q/k/v fusion)
        from megadlms.fp8 import convert_to_fp8, recipe_from_config

        ref = convert_to_fp8(TransformerLM(cfg), recipe_from_config(cfg), fuse_projections=False)
    else:
        ref = build_model(cfg)
    model = copy.deepcopy(ref)
    apply_tensor_parallel(model, mesh, sequence_parallel)
    x = torch.randint(0, cfg.vocab_size, (2, seq), generator=torch.Generator().manual_seed(1))
    if cfg.fp8:
        from megadlms.fp8 import fp8_modules, fp8_step

        # The first FP8 step scales each weight shard by its own amax; after one fp8_step (amaxes reduced
        # over the TP group) both models hold global amaxes. Copy the reference's FP8 state so that both
        # quantize with identical scales, then compare.
        fwd_bwd(ref, x)
        fwd_bwd(model, x)
        fp8_step(ref)
        fp8_step(model, mesh.get_group())
        for a, b in zip(fp8_modules(model), fp8_modules(ref)):
            a.fp8_amax_history.copy_(b.fp8_amax_history)
            a.fp8_scale.copy_(b.fp8_scale)
    out_ref, out = fwd_bwd(ref, x), fwd_bwd(model, x)
    ref_grads = dict(ref.named_parameters())
    grads = {n: rel(full(p.grad), ref_grads[n].grad) for n, p in model.named_parameters()}
    worst = max(grads, key=grads.get)
    with torch.no_grad():  # the samplers' path: hidden states out, then the LM head on them
        head = model.logits(model(x, output_hidden=True))
    return {"logits": rel(out, out_ref), "sampler_logits": rel(head, out_ref), "grads": grads[worst],
            "worst_param": worst, "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters())}


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    results = {name: run_case(mesh, *case) for name, case in CASES.items()}
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)
    destroy_parallel()  # barrier first: no rank tears gloo down while a peer still talks to it


if __name__ == "__main__":
    main()
