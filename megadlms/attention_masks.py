"""Attention masks beyond plain causal / bidirectional: documents packed into one row, annealing, and any other
rule written as a FlexAttention `mask_mod(b, h, q_idx, kv_idx) -> bool` (True = attend).

`build_attention_mask` turns a mask_mod into what `DotProductAttention` takes: a FlexAttention `BlockMask` on
CUDA (run by `flex_attention` under torch.compile; blocks outside every document are skipped), or a dense bool
[B, 1, Q, KV] mask for SDPA elsewhere (FlexAttention has no backward on the CPU).
Every query must be allowed at least one key; the builders here always allow a token itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, and_masks, create_block_mask, flex_attention

MaskMod = Callable[[Any, Any, Any, Any], Any]

__all__ = ["BlockMask", "MaskMod", "and_masks", "anneal_mask_mod", "build_attention_mask", "dense_mask",
           "document_mask_mod", "eod_segment_ids", "run_flex_attention", "segment_positions"]


def document_mask_mod(segment_ids: torch.Tensor, causal: bool = False) -> MaskMod:
    """segment_ids long [B, S]: attend only within the same segment (and to earlier positions when causal)."""

    def mask_mod(b, h, q_idx, kv_idx):
        same = segment_ids[b, q_idx] == segment_ids[b, kv_idx]
        return same & (q_idx >= kv_idx) if causal else same

    return mask_mod


def anneal_mask_mod(open_upper: torch.Tensor) -> MaskMod:
    """Causal attention plus the future keys where open_upper bool [S, S] is True (DiffuLLaMA's annealing)."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) | open_upper[q_idx, kv_idx]

    return mask_mod


def dense_mask(mask_mod: MaskMod, batch: int, q_len: int, kv_len: int, device: torch.device | str) -> torch.Tensor:
    """The mask_mod evaluated on every (b, q, kv): bool [B, 1, Q, KV]."""
    b = torch.arange(batch, device=device)[:, None, None]
    q = torch.arange(q_len, device=device)[None, :, None]
    kv = torch.arange(kv_len, device=device)[None, None, :]
    h = torch.zeros((), dtype=torch.long, device=device)
    return mask_mod(b, h, q, kv).expand(batch, q_len, kv_len)[:, None]


def build_attention_mask(mask_mod: MaskMod, batch: int, q_len: int, kv_len: int, device: torch.device | str, *,
                         flex: bool | None = None) -> BlockMask | torch.Tensor:
    """A BlockMask (flex=None: on CUDA) or the dense bool [B, 1, Q, KV] mask of `mask_mod`."""
    device = torch.device(device)
    if flex is None:
        flex = device.type == "cuda"
    if flex:
        return create_block_mask(mask_mod, batch, None, q_len, kv_len, device=device)
    return dense_mask(mask_mod, batch, q_len, kv_len, device)


def segment_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """Positions that restart at 0 where the segment id changes: long [B, S] -> long [B, S]."""
    idx = torch.arange(segment_ids.shape[1], device=segment_ids.device).expand_as(segment_ids)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - first


def eod_segment_ids(tokens: torch.Tensor, eod_id: int) -> torch.Tensor:
    """Megatron's documents of a pre-training row: a document ends with (and includes) its EOD token."""
    eod = (tokens == eod_id).long()
    return eod.cumsum(dim=1) - eod


_compiled_flex: Any = None


def run_flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
    """flex_attention over q [B, N, S, D], k and v [B, G, T, D]; compiled (its fast path) when called eagerly."""
    global _compiled_flex
    gqa = q.shape[1] != k.shape[1]
    if torch.compiler.is_compiling() or q.device.type != "cuda":
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=gqa)
