"""`KeptAmax`: a weight's max |value| kept by whoever writes the weight (the optimizer), valid while the
weight's version counter is unchanged. Below both the FP8 linear, which reads it, and `weight_amax`, which
attaches it."""

from __future__ import annotations

import torch


class KeptAmax:
    """max |weight| kept outside the cast: `value` (fp32 scalar tensor) holds it while the weight's `_version`
    equals `version`; whoever writes the weight and the value records the version after the write."""

    __slots__ = ("value", "version")

    def __init__(self, value: torch.Tensor, version: int):
        self.value, self.version = value, version

    def of(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The kept amax of `weight`, or None when the weight was written since (the caller computes it)."""
        return self.value if weight._version == self.version else None

    @torch.no_grad()
    def refresh(self, weight: torch.Tensor) -> None:
        self.value.copy_(torch.linalg.vector_norm(weight.detach(), float("inf")))
        self.version = weight._version
