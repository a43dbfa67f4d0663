"""Generation caches: implementations of the model's `KVCache` protocol.

The attention of layer i calls `cache.update(i, k, v)` with this forward's keys and values
[B, G, S, D] (after RoPE) and attends to what it returns, [B, G, T, D]. The caller passes the
query positions as `position_ids` and an `attention_mask` [B, T] that covers the returned keys.

- `AppendCache`: the standard autoregressive cache (keys appended forward after forward).
- `BlockCache`: block diffusion's cache of clean blocks. A forward attends to the kept blocks and to
  itself; only its first `keep` positions (a block just completed) are kept, the rest (the block being
  denoised) are overwritten by the next forward. Exact: the kept keys/values are those of final tokens.
- `PrefixCache`: Fast-dLLM's prefix cache. One full forward per block stores the keys/values of
  the committed prefix [0, start); the following steps run only positions >= start.
- `DualCache`: Fast-dLLM's DualCache. One full forward per block stores the keys/values of every
  position; each following step runs only the block's positions, writes their keys/values into
  the block's slots in place and attends to all positions. Shapes are fixed for a whole call and
  the block's slots are a device tensor, so the step can be captured in a CUDA graph.

The diffusion caches are approximate (Fast-dLLM): the cached keys/values of positions outside
the block are those of the step that refreshed them, not of the current tokens.
"""

from __future__ import annotations

import torch


class AppendCache:
    """Autoregressive cache: each forward's keys/values are appended after the previous ones.

    Buffers [B, G, capacity, D] are allocated on the first update of each layer (in k's dtype and
    device); `update` returns views of the filled part.
    """

    def __init__(self, capacity: int):
        if capacity <= 0:
            raise ValueError(f"AppendCache capacity={capacity} must be > 0 (prompt length + new tokens)")
        self.capacity = capacity
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}
        self._len: dict[int, int] = {}

    def __len__(self) -> int:
        """Positions cached (in layer 0; every layer holds the same count after a full forward)."""
        return self._len.get(0, 0)

    def reset(self) -> None:
        self._len.clear()

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [B, G, S, D] -> all keys/values of this layer so far [B, G, T, D] (T = cached + S)."""
        start, s = self._len.get(layer_idx, 0), k.shape[2]
        if start + s > self.capacity:
            raise ValueError(f"AppendCache is full: {start} cached + {s} new positions exceed capacity="
                             f"{self.capacity}; create the cache with capacity >= prompt length + new tokens")
        if layer_idx not in self._k:
            b, g, _, d = k.shape
            self._k[layer_idx] = k.new_empty(b, g, self.capacity, d)
            self._v[layer_idx] = v.new_empty(b, g, self.capacity, v.shape[3])
        kb, vb = self._k[layer_idx], self._v[layer_idx]
        kb[:, :, start:start + s] = k
        vb[:, :, start:start + s] = v
        self._len[layer_idx] = start + self._kept(s)
        return kb[:, :, :start + s], vb[:, :, :start + s]

    def _kept(self, s: int) -> int:
        """How many of a forward's s positions stay cached."""
        return s


class BlockCache(AppendCache):
    """Block diffusion's cache: each forward's keys/values are written after the kept ones and attended to;
    the first `keep` of them stay (set `keep` before each forward: the clean block the forward completes,
    or 0 for a denoising step), the others are scratch overwritten by the next forward. Capacity: the
    prompt, the generated blocks and one block being denoised.
    """

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.keep = 0

    def _kept(self, s: int) -> int:
        return min(self.keep, s)


class PrefixCache:
    """Fast-dLLM prefix cache.

    `refresh(prefix_len)`: the next forward runs the whole sequence; its keys/values of positions
    [0, prefix_len) are kept. `extend()`: the following forwards run positions >= prefix_len and
    attend to the kept prefix followed by their own keys/values.
    """

    def __init__(self) -> None:
        self.mode: str | None = None
        self.prefix_len = 0
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}

    def refresh(self, prefix_len: int) -> None:
        if prefix_len < 0:
            raise ValueError(f"PrefixCache.refresh: prefix_len={prefix_len} must be >= 0")
        self.mode, self.prefix_len = "refresh", prefix_len

    def extend(self) -> None:
        if not self._k:
            raise RuntimeError("PrefixCache.extend() before any refresh forward: call refresh(prefix_len) and "
                               "run one forward over the whole sequence first")
        self.mode = "extend"

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """refresh: k, v [B, G, L, D] returned unchanged (prefix kept); extend: [B, G, prefix + S, D]."""
        if self.mode == "refresh":
            if k.shape[2] < self.prefix_len:
                raise ValueError(f"PrefixCache: the refresh forward has {k.shape[2]} positions, fewer than "
                                 f"prefix_len={self.prefix_len}; run the refresh forward over the whole sequence")
            self._k[layer_idx] = k[:, :, :self.prefix_len].contiguous()
            self._v[layer_idx] = v[:, :, :self.prefix_len].contiguous()
            return k, v
        if self.mode == "extend":
            return torch.cat([self._k[layer_idx], k], dim=2), torch.cat([self._v[layer_idx], v], dim=2)
        raise RuntimeError("PrefixCache used before refresh(prefix_len)")


class DualCache:
    """Fast-dLLM DualCache: cached keys/values for every position, the block's slots rewritten each step.

    `refresh()`: the next forward runs the whole sequence [B, L]; its keys/values are stored (into
    the same buffers on every refresh, so their addresses stay fixed). `set_block(index)`: the
    following forwards run only the positions `index` (long [S], the block's slots); their
    keys/values overwrite those slots in place and attention sees all L positions.
    """

    def __init__(self) -> None:
        self.mode: str | None = None
        self.index: torch.Tensor | None = None
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}

    def refresh(self) -> None:
        self.mode = "refresh"

    def set_block(self, index: torch.Tensor) -> None:
        """index: long [S] slots of the positions the next forwards run (copied into a fixed buffer)."""
        if not self._k:
            raise RuntimeError("DualCache.set_block() before any refresh forward: call refresh() and run one "
                               "forward over the whole sequence first")
        if index.dim() != 1:
            raise ValueError(f"DualCache.set_block: index must be 1-D [S], got shape {tuple(index.shape)}")
        length = next(iter(self._k.values())).shape[2]
        if self.index is not None and self.index.shape == index.shape and self.index.device == index.device:
            self.index.copy_(index)
        else:
            self.index = index.to(dtype=torch.long).clone()
        if index.numel() and not (0 <= int(index.min()) and int(index.max()) < length):
            raise ValueError(f"DualCache.set_block: slots {index.tolist()} outside the cached length {length}")
        self.mode = "block"

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """refresh: k, v [B, G, L, D] stored and returned; block: [B, G, S, D] written in, [B, G, L, D] returned."""
        if self.mode == "refresh":
            kb = self._k.get(layer_idx)
            if kb is not None and kb.shape == k.shape and kb.dtype == k.dtype and kb.device == k.device:
                kb.copy_(k)
                self._v[layer_idx].copy_(v)
            else:
                self._k[layer_idx], self._v[layer_idx] = k.clone(), v.clone()
            return k, v
        if self.mode == "block":
            assert self.index is not None
            if k.shape[2] != self.index.numel():
                raise ValueError(f"DualCache: the forward runs {k.shape[2]} positions but set_block() gave "
                                 f"{self.index.numel()} slots; run exactly the block's positions")
            kb, vb = self._k[layer_idx], self._v[layer_idx]
            kb.index_copy_(2, self.index, k)
            vb.index_copy_(2, self.index, v)
            return kb, vb
        raise RuntimeError("DualCache used before refresh()")
