"""Ring attention for context parallelism (--cp-comm-type p2p): the K/V blocks travel around the cp ranks by
point-to-point sends instead of being all-gathered, so a rank holds its own block and one in flight, never the
whole sequence's K/V.

Each of the cp steps attends the rank's queries to the block it holds (the block of cp rank (r - i) mod cp at step
i), while the next block is already being received, and merges the partial result into the running one by its
log-sum-exp (the online softmax): out = sum_i exp(lse_i - lse) out_i, lse = log sum_i exp(lse_i). Backward runs
the same ring again, recomputing each block's probabilities from the saved log-sum-exp; each block's K/V gradient
travels with the block and, after the last step, one more hop brings it home. The blocks are computed in fp32 by
matrix products (no fused attention kernel), one block's scores [B, N, S/cp, S/cp] at a time; the result equals
the all-gather path's to fp32 rounding, for every mask that path takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def _start_shift(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> tuple[list[Any], list[torch.Tensor]]:
    """Begin sending each tensor (contiguous) to the next cp rank and receiving the previous rank's (same shapes):
    returns the requests to wait on and the tensors they fill."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    nxt, prev = dist.get_global_rank(group, (rank + 1) % n), dist.get_global_rank(group, (rank - 1) % n)
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, prev, group) for t in received]
    return dist.batch_isend_irecv(ops), received


def _shift(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """`_start_shift`, waited for: the previous rank's tensors."""
    works, received = _start_shift(tensors, group)
    for work in works:
        work.wait()
    return received


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp with 0 for rows that attend nothing (-inf), so exp(-inf - it) is 0, not nan."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q [B, N, Sq, D] fp32, k [B, N, Sk, D] fp32 -> scaled scores [B, N, Sq, Sk], -inf where mask is False."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    """K or V [B, G, S, D] -> fp32 [B, N, S, D] (query head h reads group h // (N / G))."""
    return x.float().repeat_interleave(heads // x.shape[1], dim=1)


def _group_sum(x: torch.Tensor, groups: int) -> torch.Tensor:
    """A gradient per query head [B, N, S, D] -> per K/V group [B, G, S, D]."""
    b, n, s, d = x.shape
    return x.view(b, groups, n // groups, s, d).sum(2)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                masks: list[torch.Tensor | None], group: dist.ProcessGroup) -> torch.Tensor:
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        heads, scale = q.shape[1], q.shape[-1] ** -0.5
        with torch.autocast(q.device.type, enabled=False):
            qf = q.float()
            out = torch.zeros_like(qf)
            lse = torch.full((*q.shape[:-1], 1), float("-inf"), device=q.device)
            kv = [k.contiguous(), v.contiguous()]
            for i in range(n):
                pending = _start_shift(kv, group) if i < n - 1 else None
                s = _scores(qf, _expand(kv[0], heads), masks[(rank - i) % n], scale)
                block_lse = s.logsumexp(-1, keepdim=True)
                block_out = torch.matmul(torch.exp(s - _finite(block_lse)), _expand(kv[1], heads))
                new = torch.logaddexp(lse, block_lse)
                out = out * torch.exp(lse - _finite(new)) + block_out * torch.exp(block_lse - _finite(new))
                lse = new
                if pending is not None:
                    for work in pending[0]:
                        work.wait()
                    kv = pending[1]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.masks, ctx.group = masks, group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        group, masks = ctx.group, ctx.masks
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        heads, groups, scale = q.shape[1], k.shape[1], q.shape[-1] ** -0.5
        with torch.autocast(q.device.type, enabled=False):
            qf, dout = q.float(), grad.float()
            delta = (dout * out).sum(-1, keepdim=True)  # [B, N, S, 1]: rowsum(dO o O)
            lse = _finite(lse)
            dq = torch.zeros_like(qf)
            kv = [k.contiguous(), v.contiguous()]
            dkv = [torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in (k, v)]  # contiguous
            for i in range(n):
                kf, vf = _expand(kv[0], heads), _expand(kv[1], heads)
                p = torch.exp(_scores(qf, kf, masks[(rank - i) % n], scale) - lse)  # [B, N, S, S/cp]
                dp = torch.matmul(dout, vf.transpose(-1, -2))
                ds = p * (dp - delta)
                dq += torch.matmul(ds, kf) * scale
                dkv[0] += _group_sum(torch.matmul(ds.transpose(-1, -2), qf) * scale, groups)
                dkv[1] += _group_sum(torch.matmul(p.transpose(-1, -2), dout), groups)
                if i < n - 1:  # the block and its gradient so far move on together
                    kv[0], kv[1], dkv[0], dkv[1] = _shift([*kv, *dkv], group)
            if n > 1:
                dkv = _shift(dkv, group)  # the last hop: each block's gradient back to its owner
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


@torch.compiler.disable  # point-to-point sends inside: an opaque call in a compiled layer
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masks: Sequence[torch.Tensor | None],
                   group: dist.ProcessGroup) -> torch.Tensor:
    """softmax(q K^T / sqrt(D)) V over the keys of every cp rank of `group`, by ring exchange. q [B, N, S/cp, D],
    k and v [B, G, S/cp, D] (this rank's positions); masks[j]: bool [B or 1, 1, S/cp, S/cp], this rank's queries
    over cp rank j's keys (True = attend), or None (all). Returns [B, N, S/cp, D] in q's dtype, differentiable in
    q, k and v; a query that attends no key gets 0."""
    return _RingAttention.apply(q, k, v, list(masks), group)
