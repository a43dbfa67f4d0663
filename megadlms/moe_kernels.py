"""The MoE block's routing, dispatch and combine as fused Triton kernels, with the eager PyTorch they replace.

    route_topk    logits [T, E] fp32 -> weights [T, k] fp32, experts [T, k] int64: score function, top-k and the
                  normalisation in one kernel (one pass over the logits); backward in eager PyTorch over [T, E]
    permute_rows  x [T, H] -> rows [M, H]: row r holds token row_pair[r] // k (zeros where row_pair[r] < 0), a
                  gather; backward: each token's k rows summed (a gather-sum, no atomics)
    combine_rows  y [M, H], weights [T, k] -> [T, H] fp32: sum_j weights[t, j] y[pos[t k + j]], a gather and
                  weighted sum; backward: dy (each token's gradient scaled into its k rows, zeros in the padding)
                  and dweights (the row dot products) in one pass over the tokens

Every index is read on the device: no host synchronisation, fixed output shapes (CUDA graphs replay them). The
kernels run where Triton runs (CUDA, or Triton's interpreter on the CPU with TRITON_INTERPRET=1, as the tests do);
elsewhere, and with MEGADLMS_MOE_TRITON=0, the eager functions run. Both compute in fp32 and store in the inputs'
dtypes; they agree to fp32 rounding (the kernels' sums may contract into fused multiply-adds).

Shapes: T tokens, H hidden, E experts, k experts per token, M dispatched rows (pos [T*k]: each pair's row;
row_pair [M]: each row's pair t k + j, -1 for a padding row).
"""

from __future__ import annotations

import os
from typing import Any

import torch

try:  # the kernels exist where Triton does; `available` says whether they can run
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001  (any import failure of an optional dependency: the eager path runs)
    triton = None

SCORE_FUNCTIONS = ("softmax", "softmax-pre", "sigmoid")


def available(t: torch.Tensor) -> bool:
    """Whether the fused kernels run for tensors on t's device (CUDA with Triton, or Triton's CPU interpreter);
    off with MEGADLMS_MOE_TRITON=0."""
    if triton is None or os.environ.get("MEGADLMS_MOE_TRITON", "1") == "0":
        return False
    return t.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


# ---------------------------------------------------------------- eager reference (and the CPU path)
def topk_weights(logits: torch.Tensor, experts: torch.Tensor, score: str, k: int,
                 scaling: float | None) -> torch.Tensor:
    """The routing weights [T, k] fp32 of the chosen `experts` [T, k] (differentiable in logits [T, E] fp32).
    softmax: the softmax of the chosen logits; softmax-pre: the chosen softmax probabilities (not renormalised);
    sigmoid: the chosen sigmoid scores normalised to sum 1 (k > 1). Times `scaling` where given."""
    if score == "sigmoid":
        w = torch.sigmoid(logits).gather(1, experts)
        if k > 1:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
    elif score == "softmax-pre":
        w = torch.softmax(logits, dim=-1).gather(1, experts)
    else:
        w = torch.softmax(logits.gather(1, experts), dim=-1)
    return w if scaling is None else w * scaling


def route_topk_eager(logits: torch.Tensor, k: int, score: str, bias: torch.Tensor | None,
                     scaling: float | None, scores: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_topk` in eager PyTorch: the experts by the top-k of the logits (sigmoid: of sigmoid(logits) + bias).
    scores: sigmoid(logits) or softmax(logits) where the caller has it already (reused, not recomputed)."""
    if score == "sigmoid":
        scores = torch.sigmoid(logits) if scores is None else scores
        select = scores if bias is None else scores + bias
        experts = select.topk(k, dim=-1).indices
        weights = scores.gather(1, experts)
        if k > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    elif score == "softmax-pre":
        weights, experts = (torch.softmax(logits, dim=-1) if scores is None else scores).topk(k, dim=-1)
    else:
        top, experts = logits.topk(k, dim=-1)
        weights = torch.softmax(top, dim=-1)
    return (weights if scaling is None else weights * scaling), experts


def permute_rows_eager(x: torch.Tensor, pos: torch.Tensor, k: int, rows: int) -> torch.Tensor:
    """x [T, H] -> [rows, H]: row pos[t k + j] holds x[t], the other rows zeros."""
    src = x.repeat_interleave(k, dim=0) if k > 1 else x
    return x.new_zeros(rows, x.shape[1]).index_copy(0, pos, src)


def combine_rows_eager(y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor,
                       out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """y [M, H], weights [..., k] (T tokens) -> [..., H]: sum_j weights[t, j] y[pos[t k + j]] in fp32, then out_dtype.
    """
    return (y[pos].view(*weights.shape, -1).float() * weights.unsqueeze(-1)).sum(-2).to(out_dtype)


# ---------------------------------------------------------------- Triton kernels
if triton is not None:

    @triton.jit
    def moe_route_topk_kernel(logits_ptr, bias_ptr, w_ptr, e_ptr, T, E, scaling, K: tl.constexpr,
                              SCORE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr,
                              BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
        """BLOCK_T rows of logits: scores, k rounds of arg-max (ties to the lower index), normalised weights.
        SCORE 0: softmax of the top-k logits; 1: the top-k softmax probabilities; 2: sigmoid scores (+ bias for
        the choice only), normalised where K > 1."""
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, BLOCK_E)
        kcols = tl.arange(0, BLOCK_K)
        row_ok = rows < T
        mask = row_ok[:, None] & (cols < E)[None, :]
        logits = tl.load(logits_ptr + rows[:, None].to(tl.int64) * E + cols[None, :], mask=mask,
                         other=float("-inf"))
        if SCORE == 2:
            value = tl.sigmoid(logits)
            select = value
            if HAS_BIAS:
                select = value + tl.load(bias_ptr + cols, mask=cols < E, other=0.0)[None, :]
            select = tl.where(mask, select, float("-inf"))
        elif SCORE == 1:
            m = tl.max(logits, axis=1)
            p = tl.exp(logits - m[:, None])
            p = tl.where(mask, p, 0.0)
            value = p / tl.sum(p, axis=1)[:, None]
            select = logits
        else:
            value = logits
            select = logits
        top = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
        for j in tl.static_range(K):
            best = tl.max(select, axis=1)
            idx = tl.min(tl.where(select == best[:, None], cols[None, :], BLOCK_E), axis=1)
            chosen = cols[None, :] == idx[:, None]
            val = tl.sum(tl.where(chosen, value, 0.0), axis=1)
            top = tl.where(kcols[None, :] == j, val[:, None], top)
            tl.store(e_ptr + rows.to(tl.int64) * K + j, idx.to(tl.int64), mask=row_ok)
            select = tl.where(chosen, float("-inf"), select)
        kmask = (kcols < K)[None, :]
        if SCORE == 0:
            tmax = tl.max(tl.where(kmask, top, float("-inf")), axis=1)
            ex = tl.where(kmask, tl.exp(top - tmax[:, None]), 0.0)
            w = ex / tl.sum(ex, axis=1)[:, None]
        elif SCORE == 2 and K > 1:
            w = top / (tl.sum(tl.where(kmask, top, 0.0), axis=1)[:, None] + 1e-20)
        else:
            w = top
        w = w * scaling
        tl.store(w_ptr + rows[:, None].to(tl.int64) * K + kcols[None, :], w, mask=row_ok[:, None] & kmask)

    @triton.jit
    def moe_gather_rows_kernel(src_ptr, row_pair_ptr, out_ptr, M, H, K: tl.constexpr, BLOCK_R: tl.constexpr,
                               BLOCK_H: tl.constexpr):
        """out[r] = src[p // K] for p = row_pair[r] >= 0, zeros where p < 0 (the dispatch)."""
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = r < M
        pair = tl.load(row_pair_ptr + r, mask=r_ok, other=-1)
        valid = pair >= 0
        tok = tl.where(valid, pair // K, 0).to(tl.int64)
        r64 = r.to(tl.int64)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            col_ok = (cols < H)[None, :]
            v = tl.load(src_ptr + tok[:, None] * H + cols[None, :], mask=valid[:, None] & col_ok, other=0.0)
            tl.store(out_ptr + r64[:, None] * H + cols[None, :], v, mask=r_ok[:, None] & col_ok)

    @triton.jit
    def moe_combine_bwd_kernel(g_ptr, y_ptr, pos_ptr, w_ptr, dy_ptr, dw_ptr, T, H, K: tl.constexpr,
                               BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
        """Per token t and slot j (r = pos[t K + j]): dy[r] = w[t, j] g[t] and dw[t, j] = g[t] . y[r]; each tile of g
        read once for the k rows of its tokens."""
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = t < T
        t64 = t.to(tl.int64)
        kcols = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            mask = t_ok[:, None] & (cols < H)[None, :]
            gv = tl.load(g_ptr + t64[:, None] * H + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            for j in tl.static_range(K):
                p = tl.load(pos_ptr + t64 * K + j, mask=t_ok, other=0).to(tl.int64)
                w = tl.load(w_ptr + t64 * K + j, mask=t_ok, other=0.0)
                yv = tl.load(y_ptr + p[:, None] * H + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                acc = tl.where(kcols[None, :] == j, acc + tl.sum(gv * yv, axis=1)[:, None], acc)
                tl.store(dy_ptr + p[:, None] * H + cols[None, :], (gv * w[:, None]).to(dy_ptr.dtype.element_ty),
                         mask=mask)
        tl.store(dw_ptr + t64[:, None] * K + kcols[None, :], acc, mask=t_ok[:, None] & (kcols < K)[None, :])

    @triton.jit
    def moe_zero_padding_kernel(out_ptr, row_pair_ptr, M, H, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
        """out[r] = 0 where row_pair[r] < 0 (the padding rows); the other rows untouched."""
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        pad = tl.load(row_pair_ptr + r, mask=r < M, other=0) < 0
        if tl.max(pad.to(tl.int32), axis=0) > 0:
            r64 = r.to(tl.int64)
            for h0 in range(0, H, BLOCK_H):
                cols = h0 + tl.arange(0, BLOCK_H)
                zeros = tl.zeros([BLOCK_R, BLOCK_H], dtype=out_ptr.dtype.element_ty)
                tl.store(out_ptr + r64[:, None] * H + cols[None, :], zeros, mask=pad[:, None] & (cols < H)[None, :])

    @triton.jit
    def moe_gather_sum_kernel(y_ptr, pos_ptr, w_ptr, out_ptr, T, H, K: tl.constexpr, HAS_W: tl.constexpr,
                              BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
        """out[t] = sum_j w[t, j] y[pos[t K + j]] in fp32 (combine: w the routing weights; the dispatch's
        backward: no w), stored in out's dtype."""
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        t_ok = t < T
        mask = t_ok[:, None] & (cols < H)[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(K):
            p = tl.load(pos_ptr + t.to(tl.int64) * K + j, mask=t_ok, other=0).to(tl.int64)
            v = tl.load(y_ptr + p[:, None] * H + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_W:
                v = v * tl.load(w_ptr + t.to(tl.int64) * K + j, mask=t_ok, other=0.0)[:, None]
            acc += v
        tl.store(out_ptr + t[:, None].to(tl.int64) * H + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _block_h(h: int) -> int:
    return min(triton.next_power_of_2(h), 64 if _interpret() else 1024)


def _route_launch(logits: torch.Tensor, k: int, score: str, bias: torch.Tensor | None,
                  scaling: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    t, e = logits.shape
    w = torch.empty(t, k, device=logits.device, dtype=torch.float32)
    experts = torch.empty(t, k, device=logits.device, dtype=torch.int64)
    block_e = triton.next_power_of_2(e)
    block_t = max(1, min(64, 1024 // block_e))  # 8 values a thread per [T, E] tile: small code, no spills
    moe_route_topk_kernel[(triton.cdiv(t, block_t),)](
        logits, bias if bias is not None else logits, w, experts, t, e, 1.0 if scaling is None else float(scaling),
        K=k, SCORE=SCORE_FUNCTIONS.index(score), HAS_BIAS=bias is not None, BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(k))
    return w, experts


def _gather_rows(src: torch.Tensor, row_pair: torch.Tensor, k: int) -> torch.Tensor:
    m, h = row_pair.shape[0], src.shape[1]
    out = torch.empty(m, h, device=src.device, dtype=src.dtype)
    block_r = 4 if _interpret() else 8
    moe_gather_rows_kernel[(triton.cdiv(m, block_r),)](src, row_pair, out, m, h, K=k, BLOCK_R=block_r,
                                                        BLOCK_H=_block_h(h))
    return out


def _combine_bwd(g: torch.Tensor, y: torch.Tensor, pos: torch.Tensor, row_pair: torch.Tensor,
                 w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t, k = w.shape
    m, h = y.shape
    dy = torch.empty_like(y)
    dw = torch.empty(t, k, device=g.device, dtype=torch.float32)
    block_t, block_h = (4, 64) if _interpret() else (4, 512)
    moe_combine_bwd_kernel[(triton.cdiv(t, block_t),)](g, y, pos, w, dy, dw, t, h, K=k, BLOCK_T=block_t,
                                                        BLOCK_H=block_h, BLOCK_K=triton.next_power_of_2(k))
    _zero_padding(dy, row_pair)
    return dy, dw


def _zero_padding(out: torch.Tensor, row_pair: torch.Tensor) -> None:
    """Zeros in the rows of out [M, H] that hold no pair (row_pair < 0), in place."""
    m, h = out.shape
    block_r = 4 if _interpret() else 64
    moe_zero_padding_kernel[(triton.cdiv(m, block_r),)](out, row_pair, m, h, BLOCK_R=block_r, BLOCK_H=_block_h(h))


def _gather_sum(y: torch.Tensor, pos: torch.Tensor, k: int, w: torch.Tensor | None, out_dtype: torch.dtype,
                lead: tuple[int, ...] | None = None) -> torch.Tensor:
    """[T, H] (or [*lead, H]: made in that shape) of out_dtype."""
    t, h = pos.shape[0] // k, y.shape[1]
    out = torch.empty(*(lead or (t,)), h, device=y.device, dtype=out_dtype)
    block_t, block_h = (4, 64) if _interpret() else (8, 256)
    moe_gather_sum_kernel[(triton.cdiv(t, block_t), triton.cdiv(h, block_h))](
        y, pos, w if w is not None else y, out, t, h, K=k, HAS_W=w is not None, BLOCK_T=block_t, BLOCK_H=block_h)
    return out


# ---------------------------------------------------------------- autograd over the kernels
def topk_weights_backward(logits: torch.Tensor, experts: torch.Tensor, g: torch.Tensor, score: str, k: int,
                          scaling: float | None) -> torch.Tensor:
    """d logits [T, E] (in logits' dtype) of `topk_weights` given d weights g [T, k] (closed forms, no autograd)."""
    g = g.to(logits.dtype) if scaling is None else g.to(logits.dtype) * scaling
    if score == "softmax-pre":
        p = torch.softmax(logits, dim=-1)
        dense = torch.zeros_like(logits).scatter_(1, experts, g)
        return p * (dense - (p * dense).sum(-1, keepdim=True))
    top = logits.gather(1, experts)
    if score == "sigmoid":
        s = torch.sigmoid(top)
        if k > 1:
            total = s.sum(-1, keepdim=True) + 1e-20
            g = (g - (g * s).sum(-1, keepdim=True) / total) / total
        dtop = g * s * (1 - s)
    else:
        w = torch.softmax(top, dim=-1)
        dtop = w * (g - (w * g).sum(-1, keepdim=True))
    return torch.zeros_like(logits).scatter_(1, experts, dtop)


class _RouteTopk(torch.autograd.Function):
    """Forward: the fused kernel. Backward: `topk_weights_backward` (a few [T, k] / [T, E] fp32 operations)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, bias: torch.Tensor | None, k: int, score: str,
                scaling: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        w, experts = _route_launch(logits, k, score, bias, scaling)
        ctx.save_for_backward(logits, experts)
        ctx.k, ctx.score, ctx.scaling = k, score, scaling
        ctx.mark_non_differentiable(experts)
        return w, experts

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, _: Any) -> tuple[torch.Tensor | None, ...]:
        logits, experts = ctx.saved_tensors
        return topk_weights_backward(logits, experts, g, ctx.score, ctx.k, ctx.scaling), None, None, None, None


class _PermuteRows(torch.autograd.Function):
    """x [T, H] -> [M, H] (gather); backward: dx[t] = sum_j g[pos[t k + j]] (gather-sum)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, pos: torch.Tensor, row_pair: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(pos)
        ctx.k, ctx.dtype = k, x.dtype
        return _gather_rows(x.contiguous(), row_pair, k)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (pos,) = ctx.saved_tensors
        return _gather_sum(g.contiguous(), pos, ctx.k, None, ctx.dtype), None, None, None


class _CombineRows(torch.autograd.Function):
    """y [M, H], weights [T, k] -> [T, H] fp32 (gather + weighted sum); backward: dy[pos[t k + j]] = w[t, j] g[t] (zeros
    in the padding) and dw[t, j] = g[t] . y[pos[t k + j]], in one kernel over the tokens."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, weights: torch.Tensor, pos: torch.Tensor, row_pair: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
        y, w = y.contiguous(), weights.reshape(-1, weights.shape[-1]).float().contiguous()
        ctx.save_for_backward(y, w, pos, row_pair)
        ctx.weights_shape, ctx.weights_dtype = weights.shape, weights.dtype
        return _gather_sum(y, pos, w.shape[1], w, out_dtype, tuple(weights.shape[:-1]))

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        y, w, pos, row_pair = ctx.saved_tensors
        dy, dw = _combine_bwd(g.reshape(-1, g.shape[-1]).contiguous(), y, pos, row_pair, w)
        return dy, dw.view(ctx.weights_shape).to(ctx.weights_dtype), None, None, None


# ---------------------------------------------------------------- the entry points
def route_topk(logits: torch.Tensor, k: int, score: str, bias: torch.Tensor | None = None,
               scaling: float | None = None, scores: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 -> (weights [T, k] fp32, differentiable; experts [T, k] int64). score: 'softmax' (the
    softmax of the top-k logits), 'softmax-pre' (the top-k of the softmax over all experts, not renormalised) or
    'sigmoid' (the top-k of sigmoid + bias, the chosen sigmoid scores normalised where k > 1); times `scaling`.
    scores: the caller's softmax / sigmoid of the logits, which the eager path reuses (the kernel recomputes)."""
    if available(logits):
        return _RouteTopk.apply(logits.contiguous(), bias, k, score, scaling)
    return route_topk_eager(logits, k, score, bias, scaling, scores)


def permute_rows(x: torch.Tensor, pos: torch.Tensor, row_pair: torch.Tensor, k: int) -> torch.Tensor:
    """x [T, H] -> [M, H] (M = row_pair's length): row pos[t k + j] holds x[t], the padding rows zeros."""
    if available(x):
        return _PermuteRows.apply(x, pos, row_pair, k)
    return permute_rows_eager(x, pos, k, row_pair.shape[0])


def combine_rows(y: torch.Tensor, weights: torch.Tensor, pos: torch.Tensor, row_pair: torch.Tensor,
                 out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """y [M, H] (the experts' rows), weights [..., k] (T tokens) -> [..., H] of out_dtype (made in that shape, not a
    view): sum_j weights[t, j] y[pos[t k + j]], summed in fp32."""
    if available(y):
        return _CombineRows.apply(y, weights, pos, row_pair, out_dtype)
    return combine_rows_eager(y, pos, weights, out_dtype)


__all__ = ["available", "route_topk", "permute_rows", "combine_rows", "route_topk_eager", "permute_rows_eager",
           "combine_rows_eager", "topk_weights", "topk_weights_backward", "SCORE_FUNCTIONS"]
