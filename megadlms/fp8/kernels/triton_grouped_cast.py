"""One-pass FP8 casts of the MoE experts' grouped operands on CUDA (Triton), scales computed in the kernel.

The rows of a dispatched [M, K] are grouped by expert (`offs`: int32 [E], cumulative group ends, read on the device;
rows past offs[-1] count as the last expert's). Three kernels, each one launch, no host synchronisation:

    row_cast     x [R, K] -> q [R, K], scale_inv [R]: one scale per row (its amax, found in the same program:
                 whole rows kept in registers where they fit, else the row block read twice, the second time
                 from L2), or per expert (from `expert_amax`)
    col_cast     x [M, C] -> q^T [C, M] (or per expert [E, C, N] for a weight [E*N, C]), scale_inv [E, C]: one
                 scale per (expert, column) over the expert's rows (or per expert); one program per (expert,
                 column block) walks its group's rows twice (amax, then cast and transposed store), or, for a
                 weight whose N rows fit one tile (`WHOLE_GROUP_ELEMENTS`), reads them once and keeps them in
                 registers between the amax and the cast
    expert_amax  x [R, K] -> fp32 [E]: max |x| over each expert's rows (one atomic max per expert and row block),
                 the amax pass of per-expert current scaling (a scale that depends on a whole group cannot come
                 out of the cast that needs it)

Scales as `primitives.amax_to_scale`: scale = (fp8_max / amax) / 2**margin with correctly rounded divisions, 1.0
where amax is zero or not finite or the scale overflows; scale_inv = 1 / scale (correctly rounded). Each element is
cast(clamp(x * scale)) with round-to-nearest-even (`triton_cast.to_fp8`). `torch_*` are the same casts in torch
(the CPU path and the reference the kernels are checked against, bit for bit).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..recipe import FP8_MAX
from . import triton_cast
from .primitives import FP8_GRID, amax_to_scale

triton = triton_cast.triton
if triton is not None:
    import triton.language as tl

    from .triton_cast import amax_scale, to_fp8

    @triton.jit
    def _expert_of(rows, offs_ptr, E, BE: tl.constexpr):
        # rows [BM] -> the expert of each row: how many group ends are <= the row (clamped to the last expert)
        e = tl.arange(0, BE)
        ends = tl.load(offs_ptr + e, mask=e < E, other=2147483647)
        gid = tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)
        return tl.minimum(gid, E - 1)

    @triton.jit
    def row_cast_kernel(x_ptr, q_ptr, si_ptr, amax_ptr, offs_ptr, R, K, E, FMAX: tl.constexpr,
                        MARGIN_DIV: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, PER_EXPERT: tl.constexpr,
                        SW_ROUND: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BE: tl.constexpr,
                        WHOLE_ROWS: tl.constexpr):
        # WHOLE_ROWS (K <= BK): each row is read once, kept in registers between its amax and its cast
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        rmask = rows < R
        cols = tl.arange(0, BK)
        base = rows.to(tl.int64)[:, None] * K
        if WHOLE_ROWS:
            m = rmask[:, None] & (cols[None, :] < K)
            v = tl.load(x_ptr + base + cols[None, :], mask=m, other=0.0).to(tl.float32)
            if PER_EXPERT:
                amax = tl.load(amax_ptr + _expert_of(rows, offs_ptr, E, BE), mask=rmask, other=0.0)
            else:
                amax = tl.max(tl.abs(v), axis=1)
            scale = amax_scale(amax, FMAX, MARGIN_DIV)
            tl.store(si_ptr + rows, tl.math.div_rn(tl.full((BM,), 1.0, tl.float32), scale), mask=rmask)
            q = to_fp8(v, scale[:, None], q_ptr.dtype.element_ty, FMAX, MBITS, EMIN, SW_ROUND)
            tl.store(q_ptr + base + cols[None, :], q, mask=m)
        else:
            if PER_EXPERT:
                amax = tl.load(amax_ptr + _expert_of(rows, offs_ptr, E, BE), mask=rmask, other=0.0)
            else:
                amax = tl.zeros((BM,), tl.float32)
                for k0 in range(0, K, BK):
                    m = rmask[:, None] & (k0 + cols[None, :] < K)
                    v = tl.load(x_ptr + base + k0 + cols[None, :], mask=m, other=0.0).to(tl.float32)
                    amax = tl.maximum(amax, tl.max(tl.abs(v), axis=1))
            scale = amax_scale(amax, FMAX, MARGIN_DIV)
            tl.store(si_ptr + rows, tl.math.div_rn(tl.full((BM,), 1.0, tl.float32), scale), mask=rmask)
            for k0 in range(0, K, BK):
                m = rmask[:, None] & (k0 + cols[None, :] < K)
                v = tl.load(x_ptr + base + k0 + cols[None, :], mask=m, other=0.0).to(tl.float32)
                q = to_fp8(v, scale[:, None], q_ptr.dtype.element_ty, FMAX, MBITS, EMIN, SW_ROUND)
                tl.store(q_ptr + base + k0 + cols[None, :], q, mask=m)

    @triton.jit
    def col_cast_kernel(x_ptr, t_ptr, si_ptr, amax_ptr, offs_ptr, M, C, E, stride_e, stride_c, LOCAL: tl.constexpr,
                        FMAX: tl.constexpr, MARGIN_DIV: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
                        PER_EXPERT: tl.constexpr, SW_ROUND: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr,
                        WHOLE_GROUP: tl.constexpr, GROUP: tl.constexpr):
        # program (e, c-block): the rows of expert e (the last expert also takes the rows past offs[-1])
        e = tl.program_id(0)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        cmask = cols < C
        start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
        end = tl.where(e == E - 1, M, tl.load(offs_ptr + e))
        lr = tl.arange(0, BM)
        if WHOLE_GROUP:  # a weight's expert: GROUP (<= BM) rows, read once, cast from registers into its [C, N]
            m = (lr[:, None] < GROUP) & cmask[None, :]
            v = tl.load(x_ptr + (start + lr).to(tl.int64)[:, None] * C + cols[None, :], mask=m,
                        other=0.0).to(tl.float32)
            if PER_EXPERT:
                amax = tl.zeros((BC,), tl.float32) + tl.load(amax_ptr + e)
            else:
                amax = tl.max(tl.abs(v), axis=0)
            scale = amax_scale(amax, FMAX, MARGIN_DIV)
            tl.store(si_ptr + e * C + cols, tl.math.div_rn(tl.full((BC,), 1.0, tl.float32), scale), mask=cmask)
            qt = to_fp8(tl.trans(v), scale[:, None], t_ptr.dtype.element_ty, FMAX, MBITS, EMIN, SW_ROUND)
            out = t_ptr + e.to(tl.int64) * stride_e + cols.to(tl.int64)[:, None] * stride_c
            tl.store(out + lr[None, :], qt, mask=cmask[:, None] & (lr[None, :] < GROUP))
        else:
            if PER_EXPERT:
                amax = tl.zeros((BC,), tl.float32) + tl.load(amax_ptr + e)
            else:
                amax = tl.zeros((BC,), tl.float32)
                for r0 in range(start, end, BM):
                    rows = r0 + lr
                    m = (rows[:, None] < end) & cmask[None, :]
                    v = tl.load(x_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], mask=m, other=0.0)
                    amax = tl.maximum(amax, tl.max(tl.abs(v.to(tl.float32)), axis=0))
            scale = amax_scale(amax, FMAX, MARGIN_DIV)
            tl.store(si_ptr + e * C + cols, tl.math.div_rn(tl.full((BC,), 1.0, tl.float32), scale), mask=cmask)
            out = t_ptr + e.to(tl.int64) * stride_e + cols.to(tl.int64)[:, None] * stride_c
            for r0 in range(start, end, BM):
                rows = r0 + lr
                m = (rows[:, None] < end) & cmask[None, :]
                v = tl.load(x_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], mask=m, other=0.0).to(tl.float32)
                # the fp32 tile transposed, then converted (the one-pass cast's production formulation, triton_cast)
                qt = to_fp8(tl.trans(v), scale[:, None], t_ptr.dtype.element_ty, FMAX, MBITS, EMIN, SW_ROUND)
                if LOCAL:  # each expert's own [C, N] block
                    rel = rows - start
                else:
                    rel = rows
                tl.store(out + rel[None, :], qt, mask=cmask[:, None] & (rows[None, :] < end))

    @triton.jit
    def expert_amax_kernel(x_ptr, amax_ptr, offs_ptr, R, K, E, BM: tl.constexpr, BK: tl.constexpr,
                           BE: tl.constexpr):
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        rmask = rows < R
        cols = tl.arange(0, BK)
        acc = tl.zeros((BM,), tl.float32)
        for k0 in range(0, K, BK):
            m = rmask[:, None] & (k0 + cols[None, :] < K)
            v = tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + k0 + cols[None, :], mask=m, other=0.0)
            acc = tl.maximum(acc, tl.max(tl.abs(v.to(tl.float32)), axis=1))
        gid = _expert_of(rows, offs_ptr, E, BE)
        first = tl.min(tl.where(rmask, gid, E), axis=0)
        last = tl.max(tl.where(rmask, gid, -1), axis=0)
        for g in range(first, last + 1):  # the experts this row block touches (mostly one): one atomic each
            tl.atomic_max(amax_ptr + g, tl.max(tl.where(rmask & (gid == g), acc, 0.0), axis=0))


def _constants(fp8_dtype: torch.dtype, margin: int) -> dict:
    mbits, emin = FP8_GRID[fp8_dtype]
    return dict(FMAX=FP8_MAX[fp8_dtype], MARGIN_DIV=float(2 ** margin), MBITS=mbits, EMIN=emin,
                SW_ROUND=triton_cast.production_formulation()[1])


def _block_e(e: int) -> int:
    return max(16, triton.next_power_of_2(e))


# (rows, columns, warps) of one program of each kernel on the GPU (benchmarks/fp8_grouped_cast.py --sweep measures
# them; row_cast's columns 0: whole rows, up to WHOLE_ROW_ELEMENTS a program; col_cast_weight, col_cast of a weight
# [E*N, C] into [E, C, N]: rows 0, each expert's N rows whole, up to WHOLE_GROUP_ELEMENTS a program and at least
# WHOLE_GROUP_COLUMNS columns, else the row blocks of col_cast); under the interpreter smaller tiles (less emulation
# per test)
TILES = {"row_cast": (0, 0, 8), "col_cast": (64, 64, 4), "col_cast_weight": (64, 64, 4), "expert_amax": (16, 256, 4)}
WHOLE_ROW_ELEMENTS = 8192
WHOLE_GROUP_ELEMENTS = 8192
WHOLE_GROUP_COLUMNS = 8  # 32-byte row segments of an fp32 weight: whole DRAM sectors
INTERPRETER_TILES = {"row_cast": (16, 64, 1), "col_cast": (16, 32, 1), "col_cast_weight": (16, 32, 1),
                     "expert_amax": (16, 128, 1)}


def _tile(name: str, tile: tuple[int, int, int] | None) -> tuple[int, int, dict]:
    if triton_cast._interpret():
        bm, bn, _ = tile or INTERPRETER_TILES[name]
        return bm, bn, {}
    bm, bn, warps = tile or TILES[name]
    return bm, bn, {"num_warps": warps}


def row_cast(x: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0, offs: torch.Tensor | None = None,
             expert_amax: torch.Tensor | None = None, tile: tuple[int, int, int] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] contiguous -> (q [R, K], scale_inv fp32 [R]): per row, or with `expert_amax` (fp32 [E]) and `offs`
    per expert. tile: (rows, columns, warps) of a program (`TILES` when None)."""
    r, k = x.shape
    q = torch.empty(r, k, dtype=fp8_dtype, device=x.device)
    si = torch.empty(r, dtype=torch.float32, device=x.device)
    per_expert = expert_amax is not None
    e = offs.shape[0] if offs is not None else 1
    bm, bk, warps = _tile("row_cast", tile)
    if bk == 0:  # whole rows in one tile where they fit, else row blocks of 8 x 256
        whole = triton.next_power_of_2(k)
        bm, bk = (max(1, WHOLE_ROW_ELEMENTS // whole), whole) if whole <= WHOLE_ROW_ELEMENTS else (8, 256)
    row_cast_kernel[(triton_cast.triton_cdiv(r, bm),)](
        x, q, si, expert_amax if per_expert else si, offs if offs is not None else si, r, k, e,
        PER_EXPERT=per_expert, BM=bm, BK=bk, BE=_block_e(e), WHOLE_ROWS=k <= bk, **_constants(fp8_dtype, margin),
        **warps)
    return q, si


def col_cast(x: torch.Tensor, offs: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0,
             expert_amax: torch.Tensor | None = None, per_expert_out: bool = False,
             tile: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, C] contiguous, rows grouped by `offs` -> (q^T, scale_inv fp32 [E, C]), one scale per (expert, column),
    or with `expert_amax` (fp32 [E]) per expert. q^T: [C, M], or with `per_expert_out` (equal groups of N = M / E
    rows: a weight [E, N, C] viewed as [E*N, C]) [E, C, N], each expert's transpose. tile: as `row_cast`'s
    (`TILES["col_cast_weight"]` with per_expert_out); with per_expert_out, rows 0 reads each expert's N rows once,
    whole, in tiles of up to `WHOLE_GROUP_ELEMENTS` // next_pow2(N) columns (where that is under
    `WHOLE_GROUP_COLUMNS`, and without per_expert_out, the row blocks of `TILES["col_cast"]` instead)."""
    m, c = x.shape
    e = offs.shape[0]
    if per_expert_out:
        n = m // e
        t = torch.empty(e, c, n, dtype=fp8_dtype, device=x.device)
        stride_e, stride_c = c * n, n
    else:
        t = torch.empty(c, m, dtype=fp8_dtype, device=x.device)
        stride_e, stride_c = 0, m
    si = torch.empty(e, c, dtype=torch.float32, device=x.device)
    per_expert = expert_amax is not None
    bm, bc, warps = _tile("col_cast_weight" if per_expert_out else "col_cast", tile)
    group = 0
    if bm == 0:  # whole experts of a weight where they fit
        whole = triton.next_power_of_2(max(m // e, 1))
        if not per_expert_out or WHOLE_GROUP_ELEMENTS // whole < WHOLE_GROUP_COLUMNS:
            bm, bc, warps = _tile("col_cast", None)
        else:
            bm, bc, group = whole, min(bc or WHOLE_GROUP_ELEMENTS, WHOLE_GROUP_ELEMENTS // whole), m // e
    col_cast_kernel[(e, triton_cast.triton_cdiv(c, bc))](
        x, t, si, expert_amax if per_expert else si, offs, m, c, e, stride_e, stride_c, LOCAL=per_expert_out,
        PER_EXPERT=per_expert, BM=bm, BC=bc, WHOLE_GROUP=group > 0, GROUP=group, **_constants(fp8_dtype, margin),
        **warps)
    return t, si


def expert_amax(x: torch.Tensor, offs: torch.Tensor, tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [R, K] contiguous, rows grouped by `offs` -> fp32 [E]: max |x| over each expert's rows (0 without rows).
    tile: as `row_cast`'s."""
    r, k = x.shape
    e = offs.shape[0]
    out = torch.zeros(e, dtype=torch.float32, device=x.device)
    bm, bk, warps = _tile("expert_amax", tile)
    expert_amax_kernel[(triton_cast.triton_cdiv(r, bm),)](x, out, offs, r, k, e, BM=bm, BK=bk, BE=_block_e(e),
                                                          **warps)
    return out


# ------------------------------------------------------------------ the same casts in torch
# Rows of a torch cast computed at once: its fp32 temporaries stay this many rows tall (the first-call check of a
# kernel on a GPU runs them at the full routed shapes: hundreds of MiB each otherwise). Fixed by shape: no sync.
REFERENCE_ROWS = 8192


def _chunks(rows: int) -> list[slice]:
    return [slice(s, min(s + REFERENCE_ROWS, rows)) for s in range(0, rows, REFERENCE_ROWS)]


def group_ids(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows] int64: the expert of each row (rows past offs[-1] count as the last expert's)."""
    ids = torch.bucketize(torch.arange(rows, device=offs.device, dtype=offs.dtype), offs, right=True)
    return ids.clamp_(max=offs.shape[0] - 1)


def _cast_rows(x: torch.Tensor, scale_of: Callable[[slice], torch.Tensor], fp8_dtype: torch.dtype) -> torch.Tensor:
    """x [R, C] -> cast(clamp(x * scale)) computed in row chunks, scale_of(rows) giving the fp32 scales of a chunk of
    rows ([rows, 1] or [rows, C])."""
    fmax = FP8_MAX[fp8_dtype]
    q = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    for c in _chunks(x.shape[0]):
        q[c] = (x[c].float() * scale_of(c)).clamp(-fmax, fmax).to(fp8_dtype)
    return q


def _row_amax(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x[c].abs().amax(1).float() for c in _chunks(x.shape[0])]) if x.shape[0] else \
        x.new_zeros(0, dtype=torch.float32)


def torch_expert_amax(x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`expert_amax` in torch."""
    gid = group_ids(offs, x.shape[0])
    return x.new_zeros(offs.shape[0], dtype=torch.float32).scatter_reduce(0, gid, _row_amax(x), "amax")


def torch_row_cast(x: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0, offs: torch.Tensor | None = None,
                   expert_amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`row_cast` in torch."""
    if expert_amax is not None:
        assert offs is not None  # per-expert scales need the groups
        amax = expert_amax[group_ids(offs, x.shape[0])]
    else:
        amax = _row_amax(x)
    scale = amax_to_scale(amax, FP8_MAX[fp8_dtype], margin)
    return _cast_rows(x, lambda rows: scale[rows, None], fp8_dtype), scale.reciprocal()


def torch_col_cast(x: torch.Tensor, offs: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0,
                   expert_amax: torch.Tensor | None = None, per_expert_out: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """`col_cast` in torch."""
    m, c = x.shape
    e = offs.shape[0]
    gid = group_ids(offs, m)
    if expert_amax is not None:
        amax = expert_amax[:, None].expand(e, c)
    else:
        amax = x.new_zeros(e, c, dtype=torch.float32)
        for ch in _chunks(m):
            amax.scatter_reduce_(0, gid[ch, None].expand(-1, c), x[ch].abs().float(), "amax")
    scale = amax_to_scale(amax, FP8_MAX[fp8_dtype], margin)
    q = _cast_rows(x, lambda rows: scale[gid[rows]], fp8_dtype)  # each row's expert's scales
    t = q.reshape(e, m // e, c).transpose(1, 2).contiguous() if per_expert_out else q.t().contiguous()
    return t, scale.reciprocal().contiguous()


__all__ = ["row_cast", "col_cast", "expert_amax", "group_ids", "torch_row_cast", "torch_col_cast",
           "torch_expert_amax"]
