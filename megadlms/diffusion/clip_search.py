"""BD3-LM's clip-interval search: the training noise range [min, max] whose loss has the lowest variance.

The paper (Arriola et al., sec. 4) trains with t ~ U[min, max] and picks the interval during validation: for each
candidate, the validation windows are noised with t drawn from it (under the training rules: antithetic levels,
weight 1 above min 0.5, --bd3lm-resample) and the per-block losses are recorded; a batch's variance is the unbiased
variance over its windows x blocks; the interval with the lowest sum over batches is adopted for training.
Candidates (the reference's grid): the linear schedule [eps, 1], then for each width w, the intervals
[k d, k d + w] for k d <= 1 - w (starts clamped up to eps).

Pure functions and a local accumulator; the objective (`megadlms.training.objectives`) runs the forwards and sums
the accumulated statistics over the data-parallel ranks.
"""

from __future__ import annotations

import torch

CLIP_SEARCH_WIDTHS = (0.5, 0.6, 0.7, 0.8, 0.9)  # the paper's widths (its LM1B and OWT training scripts)
CLIP_SEARCH_DELTA = 0.05  # the step between the starts of the intervals of one width
CLIP_SEARCH_BATCHES = 100  # validation batches whose variance counts, per validation (as the reference)


def clip_grid(widths: tuple[float, ...] | list[float], delta: float, eps: float) -> list[tuple[float, float]]:
    """The candidate intervals, in search order: (eps, 1), then each width's [k delta, k delta + width] for
    k = 0, 1, ... while k delta <= 1 - width; bounds clamped up to eps, rounded to 10 digits, duplicates dropped."""
    out = [(eps, 1.0)]
    for w in widths:
        k_max = int((1.0 - w) / delta + 1e-9)
        for k in range(k_max + 1):
            lo = round(max(k * delta, eps), 10)
            hi = round(min(max(k * delta + w, eps), 1.0), 10)
            if (lo, hi) not in out:
                out.append((lo, hi))
    return out


def block_means(losses: torch.Tensor, block_size: int) -> torch.Tensor:
    """fp32 [B, L] per-token losses (weight x CE, 0 where unmasked) -> [B, L / block_size], each block's sum / B."""
    b, n = losses.shape
    return losses.view(b, n // block_size, block_size).sum(-1) / block_size


def moments(values: torch.Tensor) -> torch.Tensor:
    """fp64 [3]: (count, sum, sum of squares) of all the entries, which add up over ranks and micro-batches."""
    v = values.double().flatten()
    return torch.stack([torch.tensor(float(v.numel()), dtype=torch.float64, device=v.device), v.sum(), (v * v).sum()])


def variance(m: torch.Tensor) -> torch.Tensor:
    """[..., 3] moments -> [...] the unbiased variance (n - 1 in the denominator; 0 for fewer than two values)."""
    n, s, sq = m.unbind(-1)
    return torch.where(n > 1, (sq - s * s / n.clamp(min=1)) / (n - 1).clamp(min=1), torch.zeros_like(n))


def lowest_variance(per_batch: torch.Tensor) -> tuple[int, torch.Tensor]:
    """per_batch [batches, C, 3] moments -> (the index of the candidate with the lowest sum over batches of the
    batch variance, the first on a tie; the sums [C])."""
    total = variance(per_batch).sum(0)
    return int(torch.argmin(total)), total


class ClipSearch:
    """One validation's statistics: per batch and candidate, the moments of the per-block losses."""

    def __init__(self, candidates: list[tuple[float, float]], max_batches: int = CLIP_SEARCH_BATCHES):
        self.candidates = candidates
        self.max_batches = max_batches
        self._moments: dict[int, torch.Tensor] = {}  # batch index -> [C, 3]

    def reset(self) -> None:
        self._moments.clear()

    def wants(self, batch: int) -> bool:
        return batch < self.max_batches

    def observe(self, batch: int, candidate: int, per_block: torch.Tensor) -> None:
        """Add a micro-batch's per-block losses [rows, blocks] to the moments of (batch, candidate)."""
        m = self._moments.get(batch)
        if m is None:
            m = self._moments[batch] = torch.zeros(len(self.candidates), 3, dtype=torch.float64,
                                                   device=per_block.device)
        m[candidate] += moments(per_block)

    def stacked(self) -> torch.Tensor | None:
        """[batches, C, 3] in batch order (this rank's share: sum it over the data-parallel ranks), or None."""
        if not self._moments:
            return None
        return torch.stack([self._moments[k] for k in sorted(self._moments)])
