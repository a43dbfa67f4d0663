"""Sampling from a block-diffusion (BD3-LM) model: blocks left to right, each denoised in parallel.

The text is cut into blocks of the model's block size, aligned on positions as in training (block j holds
positions [j*B, (j+1)*B) of each row). A prompt fills whole blocks and possibly the start of one more: that
partial block is the first one generated, its prompt tokens fixed. Each block starts fully masked and is
denoised by `steps` forwards (its masked count spread evenly over them, the most confident positions
committed first) or, with `threshold`, by forwards that commit every position whose confidence exceeds it
(at least one) until none is masked. The model sees what it saw in training: the block being denoised
attends to itself and to the clean blocks before it; clean blocks attend block-causally.

KV cache (`BlockCache`): the clean blocks' keys and values are computed once, when their block is done, and
reused by every step of the later blocks. The forward that caches a finished block is also the first
step of the next block (one forward over both, the finished block's queries not seeing the next): a block
costs its step count in forwards. `use_cache=False` runs every step over the whole prefix instead (the same
tokens, for checking the cache).

Generation is variable-length: blocks are generated until every row holds an EOS (a block is final once
done, so nothing before that EOS changes later) or `max_new_tokens` are reached. Batches of prompts of any
lengths are left-padded by whole blocks, so every row's block boundaries fall on the same columns.

The reference's stopping rules (Arriola et al.'s sampler), checked per row after each block: `var_length` stops a
row at the second EOS of its text (the prompt's count: the paper's samples open with BOS = EOS, so one whole
document) and keeps that EOS; `entropy_floor` stops a row whose last `entropy_window` tokens have a unigram
entropy below it (nats; degenerate repetition) and drops those tokens.

Sliding context window (`context_window` W tokens, whole blocks; default the model's positions): the block at
columns [c, c + B) sees the window [max(0, c + B - W), c + B), at positions 0.. from the window's start (or the
row's first real token), so generation goes past the model's positions. When the window moves, the first step of
the block recomputes it whole (its clean blocks are cached by that forward): the tokens are those of recomputing
the window at every step, exactly.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import ConfigError
from .bd3lm import block_causal_mask
from .kv_cache import BlockCache
from .sampler import (
    REMASKING,
    Progress,
    ProgressBar,
    Prompts,
    get_num_transfer_tokens,
    model_device,
    prepare_prompts,
    propose,
)


def check_bd3lm_args(*, block_size: int, max_new_tokens: int, steps: int | None, threshold: float | None,
                     temperature: float, remasking: str, top_p: float = 1.0, entropy_floor: float | None = None,
                     entropy_window: int = 256) -> None:
    if not isinstance(block_size, int) or block_size <= 0:
        raise ConfigError(f"block_size={block_size!r} must be a positive integer (the model's, from training)")
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ConfigError(f"max_new_tokens={max_new_tokens!r} must be a positive integer")
    if steps is not None and threshold is not None:
        raise ConfigError("pass steps per block (--block-steps) or a confidence threshold (--threshold), not both")
    if steps is not None and (not isinstance(steps, int) or not 1 <= steps <= block_size):
        raise ConfigError(f"steps={steps!r} per block (--block-steps) must be in [1, block_size={block_size}] (a step "
                          "commits at least one token when the block has masks)")
    if threshold is not None and not 0.0 < threshold <= 1.0:
        raise ConfigError(f"threshold={threshold} must be in (0, 1], e.g. 0.9")
    if not math.isfinite(temperature) or temperature < 0:
        raise ConfigError(f"temperature={temperature} must be >= 0 (0 = greedy argmax)")
    if remasking not in REMASKING:
        raise ConfigError(f"remasking={remasking!r} is not one of {list(REMASKING)}")
    if not 0.0 < top_p <= 1.0:
        raise ConfigError(f"top_p={top_p} must be in (0, 1] (1 disables nucleus sampling; BD3-LM samples at 0.9)")
    if entropy_floor is not None and not (math.isfinite(entropy_floor) and entropy_floor > 0):
        raise ConfigError(f"entropy_floor={entropy_floor} must be > 0 nats (the reference stops below 4), or None")
    if not isinstance(entropy_window, int) or entropy_window < 2:
        raise ConfigError(f"entropy_window={entropy_window!r} must be an integer >= 2 (the reference's is 256)")


def context_window_of(model: nn.Module, block: int, context_window: int | None) -> int | None:
    """The sliding window in tokens: `context_window`, else the model's max_position_embeddings in whole blocks
    (None: no window, for a model that does not say)."""
    max_pos = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if context_window is None:
        if max_pos is not None and max_pos < block:
            raise ConfigError(f"the model's max_position_embeddings={max_pos} holds no whole block of {block}")
        return None if max_pos is None else max_pos // block * block
    if not isinstance(context_window, int) or context_window < block or context_window % block:
        low = max(block, context_window // block * block) if isinstance(context_window, int) else block
        raise ConfigError(f"context_window={context_window!r} must be a multiple of the block size {block} (at least "
                          f"one block), e.g. {low} or {low + block}")
    if max_pos is not None and context_window > max_pos:
        raise ConfigError(f"context_window={context_window} is more than the model's max_position_embeddings="
                          f"{max_pos}; use at most {max_pos // block * block}")
    return context_window


def unigram_entropy(tokens: torch.Tensor) -> torch.Tensor:
    """long [B, n] -> fp64 [B]: each row's entropy (nats) of its token frequencies, -sum_v p_v ln p_v."""
    counts = torch.zeros(tokens.shape[0], int(tokens.max()) + 1, dtype=torch.float64, device=tokens.device)
    counts.scatter_add_(1, tokens, torch.ones_like(tokens, dtype=torch.float64))
    return torch.special.entr(counts / tokens.shape[1]).sum(1)


def second_eos_end(x: torch.Tensor, real: torch.Tensor, eos_id: int) -> torch.Tensor:
    """long [B]: the column after each row's second EOS among its real columns (prompt and generation), or -1
    where the row holds fewer than two."""
    seen = ((x == eos_id) & real).long().cumsum(1)
    second = (seen == 2) & (x == eos_id)
    return torch.where(second.any(1), second.int().argmax(1) + 1, -1)


def _block_size_of(model: nn.Module, block_size: int | None) -> int:
    if block_size is not None:
        return block_size
    found = getattr(getattr(model, "config", None), "block_size", None)
    if found is None:
        raise ConfigError("the model has no block_size (not trained with --model-running-mode bd3lm); pass "
                          "block_size= or use a block-diffusion checkpoint")
    return found


def _commit(x_blk: torch.Tensor, open_: torch.Tensor, x0: torch.Tensor, score: torch.Tensor, count: torch.Tensor | None,
            threshold: float | None) -> None:
    """Commit in place, per row, the `count` most confident open positions, or every open position above
    `threshold` (at least the most confident one)."""
    confidence = torch.where(open_, score, -math.inf)
    if count is not None:
        ranks = confidence.argsort(dim=1, descending=True, stable=True).argsort(dim=1)
        chosen = open_ & (ranks < count[:, None])
    else:
        assert threshold is not None, "commit by a count or by a threshold"
        best = torch.zeros_like(open_).scatter_(1, confidence.argmax(dim=1, keepdim=True), True)
        chosen = open_ & ((confidence > threshold) | best)
    x_blk.copy_(torch.where(chosen, x0, x_blk))


@torch.no_grad()
def bd3lm_generate_tokens(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                          mask_id: int, block_size: int | None = None, max_new_tokens: int = 128,
                          steps: int | None = None, threshold: float | None = None, temperature: float = 0.0,
                          remasking: str = "low_confidence", eos_id: int | None = None,
                          generator: torch.Generator | None = None, use_cache: bool = True,
                          progress: Progress = None, top_p: float = 1.0, context_window: int | None = None,
                          var_length: bool = False, entropy_floor: float | None = None,
                          entropy_window: int = 256) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Block-diffusion decoding of left-padded prompts.

    input_ids long [B, P], attention_mask bool [B, P] (True = real) or None. block_size: the model's by
    default. steps: denoising steps per block (default: the block size, one token per step) unless
    `threshold` is given. Returns (x long [B, W]: each row's prompt right-aligned to block boundaries, then
    the generated blocks; start long [B]: the column where each row's generation begins; forwards run).
    Columns never generated (after an EOS stop) or cut by a stopping rule hold mask_id.
    context_window: the sliding window in tokens (default the model's positions); var_length: stop a row after
    the second EOS of its text (needs eos_id); entropy_floor: stop a row whose last entropy_window tokens have a
    lower unigram entropy (nats) and cut them (the reference's 4 and 256). See the module docstring.
    The paper's sampling: `remasking="random"` with one token a step (steps = block size), temperature 1 and
    top_p 0.9: each step unmasks one position drawn uniformly among the masked ones (the first-hitting order of a
    time-agnostic model) with a token drawn from the nucleus of its predicted distribution.
    """
    block = _block_size_of(model, block_size)
    if steps is None and threshold is None:
        steps = block
    check_bd3lm_args(block_size=block, max_new_tokens=max_new_tokens, steps=steps, threshold=threshold,
                     temperature=temperature, remasking=remasking, top_p=top_p, entropy_floor=entropy_floor,
                     entropy_window=entropy_window)
    if var_length and eos_id is None:
        raise ConfigError("var_length stops at the second EOS: give eos_id (megadlms generate: drop --ignore-eos)")
    window = context_window_of(model, block, context_window)
    device = input_ids.device
    b, p = input_ids.shape
    real_in = (torch.ones(b, p, dtype=torch.bool, device=device) if attention_mask is None
               else attention_mask.to(device=device, dtype=torch.bool))
    lengths = real_in.sum(1)
    full, tail = lengths // block, lengths % block
    prefix_blocks = int(full.max())
    num_blocks = -(-(max_new_tokens + int(tail.max())) // block)
    width = (prefix_blocks + num_blocks) * block
    pad = (prefix_blocks - full) * block  # whole blocks of left padding: block boundaries on shared columns
    cols = torch.arange(width, device=device)
    start = pad + lengths
    x = torch.full((b, width), mask_id, dtype=torch.long, device=device)
    real = cols[None] >= pad[:, None]
    prompt_cols = real & (cols[None] < start[:, None])
    x[prompt_cols] = input_ids[real_in]
    fixed = ~real | prompt_cols  # never decoded: pads and prompt tokens
    padded = not bool(real.all())

    cache = BlockCache(width if window is None else min(width, window)) if use_cache else None
    pre = prefix_blocks * block
    forwards = 0

    def window_start(c: int) -> int:
        """The first column the block at [c, c + block) sees."""
        return 0 if window is None else max(0, c + block - window)

    def run(c0: int, c1: int, keep: int, s: int) -> torch.Tensor:
        """Forward over columns [c0, c1) of the window that starts at column s (the cache holds [s, c0)); returns
        the last block's logits."""
        nonlocal forwards
        queries = c1 - c0
        mask = None
        if queries > block or padded:  # several blocks (block-causal) or pads among the keys
            mask = block_causal_mask(real[:, s:c1], block, queries=queries)
        if cache is not None:
            cache.keep = keep
        pos = (cols[None, c0:c1] - pad.clamp(min=s)[:, None]).clamp(min=0)  # from the window's first real token
        hidden = model(x[:, c0:c1], attention_mask=mask, position_ids=pos, kv_cache=cache, output_hidden=True)
        forwards += 1
        return model.logits(hidden[:, -block:])  # type: ignore[operator]  # a TransformerLM method

    cached_from = None  # the window start the cache's contents belong to
    if cache is not None and window_start(pre) == 0:
        if pre:
            run(0, pre, pre, 0)  # the prompt's whole blocks, cached once
        cached_from = 0
    done = torch.zeros(b, dtype=torch.bool, device=device)  # rows stopped by EOS or a stopping rule
    end = torch.full((b,), width, dtype=torch.long, device=device)  # where a stopping rule cut each row
    bar = ProgressBar(progress, num_blocks * (steps or block), "step")
    try:
        for j in range(num_blocks):
            c = pre + j * block
            s = window_start(c)
            blk = x[:, c:c + block]
            open_ = ~fixed[:, c:c + block]
            schedule = None if steps is None else get_num_transfer_tokens(open_, steps)
            step = 0
            while bool(open_.any()):
                if cache is None:
                    logits = run(s, c + block, 0, s)
                elif step == 0 and cached_from != s:  # the window moved: recompute it whole, caching its context
                    cache.reset()
                    logits = run(s, c + block, c - s, s)
                    cached_from = s
                elif step == 0 and j > 0:  # cache the finished block and denoise this one in one forward
                    logits = run(c - block, c + block, block, s)
                else:
                    logits = run(c, c + block, 0, s)
                noise = rand = None
                if temperature > 0:
                    noise = torch.rand(logits.shape, dtype=torch.float64, device=device, generator=generator)
                if remasking == "random":
                    rand = torch.rand(blk.shape, device=device, generator=generator)
                x0, score = propose(logits, temperature=temperature, remasking=remasking, noise=noise,
                                    random_scores=rand, forbid=mask_id, top_p=top_p)
                _commit(blk, open_, x0, score, None if schedule is None else schedule[:, step], threshold)
                open_ = open_ & (blk == mask_id)
                step += 1
                bar.update(1)
            fixed[:, c:c + block] = True
            stop = _stops(x[:, :c + block], real[:, :c + block], start, eos_id, var_length, entropy_floor,
                          entropy_window)
            end = torch.where(~done & (stop >= 0), stop, end)
            done |= stop != -1
            if bool(done.all()):
                break
    finally:
        bar.close()
    x[cols[None] >= end[:, None]] = mask_id
    return x, start, forwards


def _stops(x: torch.Tensor, real: torch.Tensor, start: torch.Tensor, eos_id: int | None, var_length: bool,
           entropy_floor: float | None, entropy_window: int) -> torch.Tensor:
    """After a block, over the columns so far: long [B], -1 where the row goes on, -2 where it stopped at its first
    generated EOS (the output is cut before it later), else the column where the row's output ends."""
    out = torch.full_like(start, -1)
    if eos_id is not None:
        if var_length:
            out = second_eos_end(x, real, eos_id)
        else:
            cols = torch.arange(x.shape[1], device=x.device)
            out = torch.where(((x == eos_id) & (cols[None] >= start[:, None])).any(1), -2, out)
    n = x.shape[1]
    if entropy_floor is not None and n > entropy_window:
        tail = x[:, n - entropy_window:]
        low = (real.sum(1) > entropy_window) & (unigram_entropy(tail) < entropy_floor)
        out = torch.where(low, start.clamp(min=n - entropy_window), out)  # cut the window off
    return out


def bd3lm_generate(model: nn.Module, prompts: Prompts, *, mask_id: int | None = None, block_size: int | None = None,
                   max_new_tokens: int = 128, steps: int | None = None, threshold: float | None = None,
                   temperature: float = 0.0, remasking: str = "low_confidence", eos_id: int | None = None,
                   pad_id: int = 0, generator: torch.Generator | None = None, use_cache: bool = True,
                   progress: Progress = None, top_p: float = 1.0, context_window: int | None = None,
                   var_length: bool = False, entropy_floor: float | None = None,
                   entropy_window: int = 256) -> list[list[int]]:
    """Generate from a block-diffusion model; returns each prompt's new tokens (at most max_new_tokens), cut
    before the first EOS (var_length: after the second EOS of the text, kept) and where a stopping rule cut.
    prompts: token-id lists of any lengths, or a long tensor [B, P]. mask_id and block_size default to the model
    config's. See `bd3lm_generate_tokens`."""
    cfg = getattr(model, "config", None)
    mask_id = mask_id if mask_id is not None else getattr(cfg, "mask_token_id", None)
    if mask_id is None:
        raise ConfigError("mask_id is not given and model.config.mask_token_id is None; pass mask_id=")
    ids, attn = prepare_prompts(prompts, pad_id=pad_id, device=model_device(model),
                                vocab_size=getattr(cfg, "vocab_size", None))
    x, start, _ = bd3lm_generate_tokens(model, ids, attn, mask_id=mask_id, block_size=block_size,
                                        max_new_tokens=max_new_tokens, steps=steps, threshold=threshold,
                                        temperature=temperature, remasking=remasking, eos_id=eos_id,
                                        generator=generator, use_cache=use_cache, progress=progress, top_p=top_p,
                                        context_window=context_window, var_length=var_length,
                                        entropy_floor=entropy_floor, entropy_window=entropy_window)
    return generated_rows(x, start, max_new_tokens, eos_id=None if var_length else eos_id, mask_id=mask_id)


def generated_rows(x: torch.Tensor, start: torch.Tensor, max_new_tokens: int, *, eos_id: int | None,
                   mask_id: int) -> list[list[int]]:
    """Each row's generated tokens: from its start, at most max_new_tokens, cut before EOS (and before
    positions left masked by an early stop)."""
    out = []
    for row, s in zip(x.tolist(), start.tolist()):
        new = row[s:s + max_new_tokens]
        for stop in (eos_id, mask_id):
            if stop is not None and stop in new:
                new = new[:new.index(stop)]
        out.append(new)
    return out
