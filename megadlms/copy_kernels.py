"""Row-strided copies with a dtype conversion, as one Triton kernel at memory speed.

    copy_rows(src, dst)   dst[r, c] = src[r, c] in dst's dtype, for [R, C] views with a unit last stride and any
                          row strides (e.g. an [E, N, K] weight into one half of an [E, 2N, K] stack, or back)

torch's copy_ runs a widening cast (BF16 -> fp32) and a copy into a strided destination through its generic
unrolled kernel, well under the copy bandwidth; this one loads and stores contiguous runs of each row. It runs
where Triton runs (CUDA, or its interpreter on the CPU with TRITON_INTERPRET=1, as the tests do); elsewhere, and
with MEGADLMS_COPY_TRITON=0 or inside a torch.compile graph, `copy_` does the same copy.
"""

from __future__ import annotations

import os

import torch

try:  # the kernel exists where Triton does; `available` says whether it can run
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001  (any import failure of an optional dependency: copy_ runs)
    triton = None

BLOCK = 2048


def rows_view(t: torch.Tensor) -> tuple[int, int] | None:
    """(rows, row stride) of t seen as [rows, t.shape[-1]] with a unit last stride, or None where it is not one
    (the leading dimensions do not collapse into one row index)."""
    if t.dim() == 0 or t.stride(-1) != 1:
        return None
    ld, expected = None, None
    for size, stride in zip(reversed(t.shape[:-1]), reversed(t.stride()[:-1])):
        if size == 1:
            continue
        if ld is None:
            ld = stride
        elif stride != expected:
            return None
        expected = stride * size
    c = t.shape[-1]
    return (t.numel() // c if c else 0), (c if ld is None else ld)


def available(t: torch.Tensor) -> bool:
    """Whether the kernel runs for tensors on t's device; off with MEGADLMS_COPY_TRITON=0."""
    if triton is None or os.environ.get("MEGADLMS_COPY_TRITON", "1") == "0":
        return False
    return t.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def copy_rows_kernel(src_ptr, dst_ptr, C, ld_src, ld_dst, BLOCK: tl.constexpr):
        """One BLOCK-long run of one row: loaded, converted to dst's dtype, stored."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < C
        v = tl.load(src_ptr + row * ld_src + cols, mask=mask)
        tl.store(dst_ptr + row * ld_dst + cols, v.to(dst_ptr.dtype.element_ty), mask=mask)


def copy_rows(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """dst = src (converted to dst's dtype), in place; returns dst. src and dst have one shape; where both are
    row-strided matrices (see `rows_view`) and the kernel runs, one kernel copies them, else `dst.copy_(src)`."""
    if src.shape != dst.shape:
        raise ValueError(f"copy_rows: src {tuple(src.shape)} and dst {tuple(dst.shape)} differ in shape")
    if torch.compiler.is_compiling():  # inside a compiled graph the compiler makes the copy
        return dst.copy_(src)
    s, d = rows_view(src), rows_view(dst)
    if s is None or d is None or src.numel() == 0 or not available(dst):
        return dst.copy_(src)
    rows, c = s[0], src.shape[-1]
    copy_rows_kernel[(rows, triton.cdiv(c, BLOCK))](src, dst, c, s[1], d[1], BLOCK=BLOCK)
    return dst


__all__ = ["available", "copy_rows", "rows_view"]
