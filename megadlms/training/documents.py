"""What the model attends to in training beyond its plain causal / bidirectional attention.

- Document-level attention (`--reset-attention-mask`): a token attends only inside its own document: the
  conversations of packed SFT windows (their segment ids), or in pre-training the documents that end at EOD
  tokens (Megatron's rule). `--reset-position-ids`: positions restart at 0 in each document.
- Attention annealing (`--attention-anneal-iters N`, DiffuLLaMA): adapting an AR model, iteration i < N attends
  causally plus each future key with probability (i + 1) / N, one random [L, L] pattern per iteration drawn from
  a checkpointed generator (so a resumed run anneals exactly as an uninterrupted one); from iteration N on the
  model's own bidirectional attention.

The masks are FlexAttention BlockMasks on CUDA and dense bool masks elsewhere (`megadlms.attention_masks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..attention_masks import (
    and_masks,
    anneal_mask_mod,
    build_attention_mask,
    document_mask_mod,
    eod_segment_ids,
    segment_positions,
)


@dataclass
class AttentionPlan:
    """Per-batch attention mask and positions for training; `None, None` when the model's defaults apply."""

    reset_attention_mask: bool = False
    reset_position_ids: bool = False
    anneal_iters: int = 0
    causal: bool = False  # the model's own attention
    eod_id: int | None = None  # documents of pre-training rows end at this token
    seed: int = 0
    device: torch.device | str = "cpu"

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(self.seed)
        self._open_upper: torch.Tensor | None = None
        self._segments: dict[tuple, torch.Tensor] = {}  # per shape and dtype (a cut micro-batch has its own)

    def needs_masks(self) -> bool:
        """Whether batches may carry an attention mask (CUDA-graph replays need none)."""
        return self.reset_attention_mask or self.anneal_iters > 0

    def begin_step(self, iteration: int, seq_length: int) -> None:
        """Draw this iteration's annealing pattern (shared by its micro-batches); none after annealing."""
        self._open_upper = None
        if iteration < self.anneal_iters:
            ratio = (iteration + 1) / self.anneal_iters
            u = torch.rand(seq_length, seq_length, generator=self.generator, device=self.device)
            self._open_upper = u < ratio

    def for_batch(self, tokens: torch.Tensor, segment_ids: torch.Tensor | None, *, dense: bool = False
                  ) -> tuple[Any | None, torch.Tensor | None]:
        """(attention mask or None, position ids [B, L] or None) for input rows `tokens` long [B, L] (the clean
        tokens); segment_ids long [B, L] for packed SFT windows, None for pre-training rows. dense: a dense bool
        mask also on CUDA (a cut micro-batch: compiled FlexAttention has no kernel for every short length)."""
        b, length = tokens.shape
        need_segments = self.reset_attention_mask or self.reset_position_ids
        if segment_ids is None and need_segments:
            segment_ids = eod_segment_ids(tokens, self.eod_id) if self.eod_id is not None else None
        mods = []
        if self.reset_attention_mask and segment_ids is not None:
            mods.append(document_mask_mod(self._segment_buffer(segment_ids), causal=self.causal))
        if self._open_upper is not None:
            mods.append(anneal_mask_mod(self._open_upper[:length, :length]))
        mask = None
        if mods:
            mod = mods[0] if len(mods) == 1 else and_masks(*mods)
            mask = build_attention_mask(mod, b, length, length, tokens.device, flex=False if dense else None)
        positions = segment_positions(segment_ids) if self.reset_position_ids and segment_ids is not None else None
        return mask, positions

    def _segment_buffer(self, segment_ids: torch.Tensor) -> torch.Tensor:
        """On CUDA a BlockMask's mask_mod reads the segment ids when its kernels run, so they live in one buffer
        that each batch refills (the same tensor for every batch: the one a CUDA-graph replay reads). A mask
        from `for_batch` is therefore valid until the next call, which is queued after the previous batch's
        kernels on the same stream."""
        if segment_ids.device.type != "cuda":
            return segment_ids
        key = (tuple(segment_ids.shape), segment_ids.dtype)
        if key not in self._segments:
            self._segments[key] = torch.empty_like(segment_ids)
        buf = self._segments[key]
        buf.copy_(segment_ids)
        return buf

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


def attended_pairs(segment_ids: torch.Tensor, document_masks: bool, causal: bool) -> int:
    """The (query, key) pairs attention computes over rows of segment ids [B, L] (host tensor): within each
    document under document-level masks, else over whole rows; n^2 per span of n tokens, n(n+1)/2 causal. What the
    trainer's FLOPs count for packed windows (`TransformerConfig.attention_flops_per_pair`)."""
    b, length = segment_ids.shape
    if document_masks:
        ids = segment_ids.long()
        span = int(ids.max()) + 1 if ids.numel() else 1
        counts = torch.bincount((ids + torch.arange(b).unsqueeze(1) * span).flatten()).double()
    else:
        counts = torch.full((b,), float(length), dtype=torch.float64)
    return int((counts * (counts + 1) / 2).sum() if causal else (counts * counts).sum())
