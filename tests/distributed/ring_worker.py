"""Launched by test_context_parallel.py under torchrun (4 ranks, one cp group): ring attention (--cp-comm-type p2p)
against the all-gather path, on the same rank-local q, k and v.

For each case every rank draws the whole sequence's q, k, v and output weights from one seed, keeps its positions
(`shard_sequence`) and runs `ContextParallelAttention` with each exchange; the loss sum(out * w) is backpropagated.
Rank 0 writes, per case, the largest relative difference over the ranks of the outputs and of the q, k and v
gradients to the JSON file argv[1].
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from megadlms.distributed.context_parallel import ContextParallelAttention, shard_mask, shard_sequence
from megadlms.distributed.init import destroy_parallel
from megadlms.model import DotProductAttention

B, N, G, S, D = 2, 4, 2, 16, 8
CASES = ("bidirectional", "causal", "documents", "documents_with_empty_rows")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def whole_mask(case: str) -> torch.Tensor | None:
    """bool [B, 1, S, S] over the whole sequence (True = attend), or None."""
    if case in ("bidirectional", "causal"):
        return None
    doc = torch.tensor([0] * 5 + [1] * 7 + [2] * 4)
    mask = (doc[:, None] == doc[None, :]) & (torch.arange(S)[None, :] <= torch.arange(S)[:, None])
    mask = mask[None, None].repeat(B, 1, 1, 1)
    if case == "documents_with_empty_rows":
        mask[0, :, 3] = False  # a query that attends nothing (a padded position)
        mask[1, :, 14] = False
    return mask


def run(case: str, comm: str, group: dist.ProcessGroup) -> list[torch.Tensor]:
    n, r = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(B, h, S, D, generator=g) for h in (N, G, G))
    w = torch.randn(B, N, S, D, generator=g)
    q, k, v = (shard_sequence(x, n, r, dim=2).requires_grad_() for x in (q, k, v))
    mask = whole_mask(case)
    local_mask = None if mask is None else shard_mask(mask, n, r)
    attn = ContextParallelAttention(DotProductAttention(), group, n, r, comm)
    out = attn(q, k, v, local_mask, case == "causal")
    (out * shard_sequence(w, n, r, dim=2)).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]  # type: ignore[list-item]


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    group = dist.group.WORLD
    results = {}
    for case in CASES:
        ring, gathered = run(case, "p2p", group), run(case, "all_gather", group)
        diffs = torch.tensor([rel(a, b) for a, b in zip(ring, gathered)])
        finite = torch.tensor([float(all(torch.isfinite(t).all() for t in ring))])
        dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        results[case] = {"out": float(diffs[0]), "dq": float(diffs[1]), "dk": float(diffs[2]),
                         "dv": float(diffs[3]), "finite": bool(finite.item())}
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)
    destroy_parallel()


if __name__ == "__main__":
    main()
