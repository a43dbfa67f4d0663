"""The quantizers of the MoE experts' grouped operands: the recipe's scaling for the three grouped GEMMs.

An expert projection y = x @ W_e^T (x's rows grouped by expert, `offs`) takes these FP8 operands
(`tensor.FP8Tensor`s, their layouts in `tensor.py`; rows / cols: what `quantize` and `quantize_weight` return):

    fprop:  y  = x @ W_e^T        x rows         [M, K]            W rows         [E, N, K]
    dgrad:  dx = g @ W_e          g rows         [M, N]            W cols (W^T)   [E, K, N]
    wgrad:  dW_e = g_e^T @ x_e    g cols (g^T)   [N, M] grouped    x cols (x^T)   [K, M] grouped

Every scale runs along a dimension its GEMM does not contract (what `torch._scaled_grouped_mm` takes), so `cols`
are casts of their own, grouped by expert. The recipe says the granularity (`Recipe.experts`):
- Scaling.ROW (`Float8RowwiseScaling`): per row of x / g, per (expert, output row) of W, per (expert, column) of
  x, g and W for the transposed copies, each from the values it scales: each copy is one kernel pass, its scales
  computed in it;
- Scaling.EXPERT (`Float8CurrentScaling`): one scale per expert for each operand (x, g: the amax of the expert's
  rows; W: of its weight), written out in the same layouts; one amax pass (`expert_amax`) serves both copies.
All operands are E4M3 (torch's FP8 grouped GEMM takes no E5M2). Delayed scaling is refused for the experts
(`recipe.experts_problem` says why).

Where the kernels run (`triton_cast.enabled`: CUDA, or the CPU under Triton's interpreter) the casts are
`kernels.triton_grouped_cast`; each variant's first call is checked bit for bit against the torch cast, which runs
instead (with a warning) if they differ, and which is the CPU path.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from .kernels import triton_cast
from .kernels import triton_grouped_cast as kernels
from .recipe import E4M3, Recipe, experts_problem
from .tensor import FP8Tensor, Scaling

# cast variant -> whether the Triton kernel agreed with the torch cast on its first call
_CHECKED: dict[tuple, bool] = {}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != torch.float32:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.shape == b.shape and torch.equal(a, b)


def _run(key: tuple, x: torch.Tensor, kernel: Callable[[], tuple[torch.Tensor, ...]],
         reference: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """kernel() where the Triton kernels run for x and this variant agreed with reference() on its first call (a first
    call inside CUDA-graph capture, where the comparison cannot synchronise, runs reference() and checks later)."""
    if not triton_cast.enabled(x.device):
        return reference()
    ok = _CHECKED.get(key)
    if ok is None and x.is_cuda and torch.cuda.is_current_stream_capturing():
        return reference()
    if ok is None:
        try:
            got = kernel()
        except Exception as e:  # a Triton build that cannot compile the kernel: the torch cast computes it
            got, why = None, f"{type(e).__name__}: {str(e)[:200]}"
        ref = reference()
        ok = got is not None and all(_same(a, b) for a, b in zip(got, ref))
        _CHECKED[key] = ok
        if not ok:
            why = why if got is None else "different bits"
            warnings.warn(f"megadlms.fp8: the Triton grouped cast {key[0]} disagreed with the torch cast ({why}); "
                          "this variant uses the torch cast", RuntimeWarning, stacklevel=3)
        return got if ok and got is not None else ref
    return kernel() if ok else reference()


class ExpertQuantizer:
    """Casts the experts' grouped operands with one `Scaling` (ROW or EXPERT, module docstring), E4M3, with the
    recipe's margin. Every method takes high-precision tensors (any float dtype) and returns `FP8Tensor`s."""

    def __init__(self, recipe: Recipe):
        problem = experts_problem(recipe)
        if problem or recipe.experts is None:
            raise ValueError(problem)
        self.recipe, self.scaling, self.margin, self.fp8_dtype = recipe, recipe.experts, recipe.margin, E4M3

    def __repr__(self) -> str:
        return f"ExpertQuantizer({self.scaling.value}, {self.fp8_dtype})"

    @property
    def per_expert(self) -> bool:
        return self.scaling is Scaling.EXPERT

    def _amax(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        key = ("expert_amax", x.dtype)
        return _run(key, x, lambda: (kernels.expert_amax(x, offs),), lambda: (kernels.torch_expert_amax(x, offs),))[0]

    def _rows(self, x: torch.Tensor, offs: torch.Tensor | None, amax: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        key = ("row_cast", x.dtype, amax is not None)
        q, si = _run(key, x, lambda: kernels.row_cast(x, self.fp8_dtype, self.margin, offs, amax),
                     lambda: kernels.torch_row_cast(x, self.fp8_dtype, self.margin, offs, amax))
        return q, si

    def _cols(self, x: torch.Tensor, offs: torch.Tensor, amax: torch.Tensor | None, per_expert_out: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
        key = ("col_cast", x.dtype, amax is not None, per_expert_out)
        t, si = _run(key, x, lambda: kernels.col_cast(x, offs, self.fp8_dtype, self.margin, amax, per_expert_out),
                     lambda: kernels.torch_col_cast(x, offs, self.fp8_dtype, self.margin, amax, per_expert_out))
        return t, si

    def quantize(self, x: torch.Tensor, offs: torch.Tensor, rows: bool = True, cols: bool = False
                 ) -> tuple[FP8Tensor | None, FP8Tensor | None]:
        """x [M, C] (rows grouped by `offs`, int32 [E]) -> (rows [M, C] with scale_inv [M], cols = x^T [C, M]
        grouped along M with scale_inv [E, C]), each when asked for."""
        x = x.detach().contiguous()
        amax = self._amax(x, offs) if self.per_expert else None
        r = c = None
        if rows:
            q, si = self._rows(x, offs, amax)
            r = FP8Tensor(q, si, self.scaling, offs=offs)
        if cols:
            t, si = self._cols(x, offs, amax, False)
            c = FP8Tensor(t, si, self.scaling, transposed=True, offs=offs)
        return r, c

    def weight_amax(self, w: torch.Tensor) -> torch.Tensor | None:
        """Per-expert scaling: max |w[e]| of w [E, N, K] (fp32 [E]), which `quantize_weight` takes to cast w again
        without another amax pass; None for per-row scaling (nothing to keep)."""
        if not self.per_expert:
            return None
        flat, offs = self._weight_groups(w)
        return self._amax(flat, offs)

    def _weight_groups(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """w [E, N, K] as [E*N, K] rows and the ends of its experts' row groups."""
        e, n, k = w.shape
        return w.detach().contiguous().reshape(e * n, k), torch.arange(1, e + 1, device=w.device,
                                                                       dtype=torch.int32) * n

    def quantize_weight(self, w: torch.Tensor, rows: bool = True, cols: bool = False,
                        amax: torch.Tensor | None = None) -> tuple[FP8Tensor | None, FP8Tensor | None]:
        """w [E, N, K] -> (rows [E, N, K] with scale_inv [E, N], cols = each expert's W^T [E, K, N] with scale_inv
        [E, K]), each when asked for. amax: `weight_amax(w)` when the caller kept it (per-expert scaling)."""
        e, n, k = w.shape
        flat, offs = self._weight_groups(w)
        if self.per_expert and amax is None:
            amax = self._amax(flat, offs)
        r = c = None
        if rows:
            q, si = self._rows(flat, offs, amax)
            r = FP8Tensor(q.view(e, n, k), si.view(e, n), self.scaling)
        if cols:
            t, si = self._cols(flat, offs, amax, True)
            c = FP8Tensor(t, si, self.scaling, transposed=True)
        return r, c


__all__ = ["ExpertQuantizer"]
