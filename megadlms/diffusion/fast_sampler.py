"""Fast-dLLM style sampling: block-wise approximate KV cache + confidence-threshold parallel decoding.

Blocks are decoded left to right as in the reference sampler. Per block:
- the first step runs the whole sequence (and refreshes the cache);
- the following steps run only the block (`cache='dual'`: every other position's keys/values
  come from the cache, `DualCache`) or the block and everything after it (`cache='prefix'`: the
  committed prefix comes from the cache, `PrefixCache`), or the whole sequence again
  (`cache=None`, no approximation);
- each step commits every masked position of the block whose confidence exceeds `threshold`
  (at least the most confident one per row), or, with `threshold=None`, the reference
  sampler's per-step count.

Differences from the reference sampler: only the current block's masked positions are
candidates, and the mask token is never committed (x0 is the best token other than the mask;
its confidence is still its probability under the full softmax), so every step makes progress.
With `threshold=1.0` (one token per step) and `cache=None` this picks the same tokens as the
reference sampler with steps = gen_length, for models that do not predict the mask token.
With `cache='dual'` the shapes are fixed for the whole call and the two forwards (the refresh
over [B, L] and the block step over [B, block_length]) can be captured in CUDA graphs.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import nn

from ..config import ConfigError
from .kv_cache import DualCache, PrefixCache
from .sampler import (
    Progress,
    ProgressBar,
    Prompts,
    StaticGraph,
    check_sampling_args,
    eos_reached,
    get_num_transfer_tokens,
    guided_logits,
    initial_sequence,
    logits_shift,
    model_prompts,
    position_ids_from_mask,
    propose,
    reused_graphs,
    trim_at_eos,
)

CACHE_MODES = ("dual", "prefix", None)
CacheMode = Literal["dual", "prefix"] | None


class _CallState:
    """A call's cache and, with CUDA graphs, its two graphs (the refresh forward, the block step)."""

    def __init__(self, kv: DualCache | PrefixCache | None):
        self.kv = kv
        self.full: StaticGraph | None = None
        self.block: StaticGraph | None = None


def commit_step(window: torch.Tensor, logits: torch.Tensor, *, mask_id: int, threshold: float | None,
                count: int | None, temperature: float, remasking: str,
                generator: torch.Generator | None) -> torch.Tensor:
    """One decoding step on the block, in place.

    window: long [B, W] view of the block's tokens; logits: [B, W, V]. Commits (threshold) every
    masked position whose confidence exceeds `threshold` plus each row's most confident one, or
    (threshold None) the `count` most confident per row. Returns the committed count per row, long [B].
    """
    noise = rand = None
    if temperature > 0:
        noise = torch.rand(logits.shape, dtype=torch.float64, device=logits.device, generator=generator)
    if remasking == "random":
        rand = torch.rand(window.shape, device=logits.device, generator=generator)
    x0, score = propose(logits, temperature=temperature, remasking=remasking, noise=noise, random_scores=rand,
                        forbid=mask_id)
    masked = window == mask_id
    confidence = torch.where(masked, score, -math.inf)
    if threshold is not None:
        select = masked & (confidence > threshold)
        select.scatter_(1, confidence.argmax(dim=1, keepdim=True), True)
    else:
        assert count is not None
        select = torch.zeros_like(masked).scatter_(1, confidence.topk(count, dim=1).indices, True)
    select &= masked
    window.copy_(torch.where(select, x0, window))
    return select.sum(dim=1)


@torch.no_grad()
def fast_generate_tokens(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                         mask_id: int, gen_length: int = 128, block_length: int = 32, threshold: float | None = 0.9,
                         steps: int | None = None, cache: CacheMode = "dual", temperature: float = 0.0,
                         remasking: str = "low_confidence", cfg_scale: float = 0.0, eos_id: int | None = None,
                         generator: torch.Generator | None = None, progress: Progress = None,
                         cuda_graph: bool = False) -> tuple[torch.Tensor, int]:
    """Fast sampler on a batch. Returns (tokens long [B, P + gen_length], forwards run).

    input_ids long [B, P] (left-padded), attention_mask bool [B, P] or None as in
    `sampler.generate_tokens`. threshold in [0, 1]: parallel decoding (steps is ignored);
    threshold None: the reference schedule with `steps` (default gen_length). cache: 'dual',
    'prefix' or None. progress counts committed tokens. cuda_graph applies to cache='dual' and
    cache=None (the prefix cache changes shape every block).
    """
    if cache not in CACHE_MODES:
        raise ConfigError(f"cache={cache!r} is not one of {list(CACHE_MODES)}")
    if threshold is not None and not 0.0 <= threshold <= 1.0:
        raise ConfigError(f"threshold={threshold} must be in [0, 1] (e.g. 0.9), or None for the fixed step schedule")
    if threshold is None:
        steps = gen_length if steps is None else steps
    check_sampling_args(gen_length=gen_length, block_length=block_length, steps=steps if threshold is None else None,
                        temperature=temperature, remasking=remasking, cfg_scale=cfg_scale)
    x, real = initial_sequence(model, input_ids, attention_mask, mask_id=mask_id, gen_length=gen_length)
    b, p = input_ids.shape
    shift = logits_shift(model, p)  # difflm-shift: the block's logits come from the positions one to the left
    total = p + gen_length
    device = input_ids.device
    reps = 2 if cfg_scale > 0 else 1

    mask_in = pos_full = None
    if real is not None:
        mask_in = real.repeat(reps, 1)  # [rows, L]: covers every key the caches return
        pos_full = position_ids_from_mask(mask_in)
    elif cuda_graph:
        pos_full = torch.arange(total, device=device).expand(reps * b, total)

    def full_input() -> torch.Tensor:
        if reps == 1:
            return x
        un_x = x.clone()
        un_x[:, :p] = mask_id
        return torch.cat([x, un_x], dim=0)

    has_mask = mask_in is not None
    full_extra = [t for t in (mask_in, pos_full) if t is not None]  # graph inputs beside the tokens
    mask_extra = [] if mask_in is None else [mask_in]
    use_graph = cuda_graph and cache != "prefix"

    def new_state() -> _CallState:
        return _CallState(DualCache() if cache == "dual" else PrefixCache() if cache == "prefix" else None)

    # with CUDA graphs the cache and both graphs are kept for later calls of the same shapes (the cache's buffers
    # are baked into the graphs); without, each call has its own cache
    st = (reused_graphs(model, ("fast", cache, reps * b, total, block_length, has_mask), new_state) if use_graph
          else new_state())
    kv = st.kv

    def full_forward(ids: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:  # [rows, L] -> hidden [rows, L, H]
        mask, pos = (extra[0], extra[1]) if has_mask else (None, extra[0] if extra else None)
        if isinstance(st.kv, DualCache):
            st.kv.refresh()
        return model(ids, attention_mask=mask, position_ids=pos, kv_cache=st.kv, output_hidden=True)

    def block_forward(ids: torch.Tensor, pos: torch.Tensor, *mask: torch.Tensor) -> torch.Tensor:  # [rows, S]
        if isinstance(st.kv, PrefixCache):
            st.kv.extend()
        return model(ids, attention_mask=mask[0] if mask else None, position_ids=pos, kv_cache=st.kv,
                     output_hidden=True)

    if use_graph and st.full is None:
        st.full = StaticGraph(full_forward, [full_input(), *full_extra])

    def run_full(ids: torch.Tensor) -> torch.Tensor:
        return (st.full or full_forward)(ids, *full_extra)

    def run_block(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if use_graph and st.block is None:
            st.block = StaticGraph(block_forward, [ids, pos, *mask_extra])
        return (st.block or block_forward)(ids, pos, *mask_extra)

    num_blocks = gen_length // block_length
    schedule = None
    if threshold is None:
        assert steps is not None
        schedule = get_num_transfer_tokens(torch.ones(1, block_length, dtype=torch.bool),
                                           steps // num_blocks)[0].tolist()
    nfe = 0
    bar = ProgressBar(progress, b * gen_length, "tok")
    try:
        for blk in range(num_blocks):
            start, end = p + blk * block_length, p + (blk + 1) * block_length
            window = x[:, start:end]
            step = 0
            while True:
                count = None if schedule is None else schedule[step]
                if step == 0 or kv is None:
                    if isinstance(kv, PrefixCache):
                        kv.refresh(start - shift)
                    hidden = run_full(full_input())[:, start - shift:end - shift]
                    if isinstance(kv, DualCache):
                        kv.set_block(torch.arange(start - shift, end, device=device))
                else:
                    q_end = end if isinstance(kv, DualCache) else total
                    q_ids = x[:, start - shift:q_end].repeat(reps, 1)
                    q_pos = (torch.arange(start - shift, q_end, device=device) if pos_full is None
                             else pos_full[:, start - shift:q_end])
                    hidden = run_block(q_ids, q_pos)[:, :block_length]
                logits = model.logits(hidden)  # type: ignore[operator]  # a TransformerLM method
                if reps == 2:
                    logits = guided_logits(logits, cfg_scale)
                committed = commit_step(window, logits, mask_id=mask_id, threshold=threshold, count=count,
                                        temperature=temperature, remasking=remasking, generator=generator)
                nfe += 1
                step += 1
                if schedule is not None:
                    bar.update(b * schedule[step - 1])  # the count this step committed
                    if step == len(schedule):
                        break
                else:  # one host sync per step: is the block done?
                    if bar.active:
                        bar.update(int(committed.sum()))
                    if not bool((window == mask_id).any()):
                        break
            if eos_id is not None and blk + 1 < num_blocks and eos_reached(x[:, p:end], eos_id=eos_id,
                                                                          mask_id=mask_id):
                break
    finally:
        bar.close()
    return x, nfe


def fast_generate(model: nn.Module, prompts: Prompts, *, mask_id: int | None = None, gen_length: int = 128,
                  block_length: int = 32, threshold: float | None = 0.9, steps: int | None = None,
                  cache: CacheMode = "dual", temperature: float = 0.0, remasking: str = "low_confidence",
                  cfg_scale: float = 0.0, eos_id: int | None = None, pad_id: int | None = None,
                  generator: torch.Generator | None = None, progress: Progress = None,
                  cuda_graph: bool = False) -> list[list[int]]:
    """`fast_generate_tokens` on token-id prompts; returns the new tokens per prompt (cut before EOS)."""
    mask_id, ids, attn = model_prompts(model, prompts, mask_id, pad_id)
    out, _ = fast_generate_tokens(model, ids, attn, mask_id=mask_id, gen_length=gen_length,
                                  block_length=block_length, threshold=threshold, steps=steps, cache=cache,
                                  temperature=temperature, remasking=remasking, cfg_scale=cfg_scale, eos_id=eos_id,
                                  generator=generator, progress=progress, cuda_graph=cuda_graph)
    return trim_at_eos(out[:, ids.shape[1]:], eos_id)
