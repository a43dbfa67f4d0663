"""Autoregressive decoding for models trained in vanilla (causal) mode.

Greedy (temperature 0), temperature and top-p (nucleus) sampling with a KV cache
(`AppendCache`): one prefill forward over the left-padded prompts, then one forward per new
token. Pads are never attended and each row's positions start at 0 at its first real token.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import ConfigError
from ..diffusion.kv_cache import AppendCache
from ..diffusion.sampler import Progress, ProgressBar, Prompts, model_device, position_ids_from_mask, prepare_prompts


def sample_next_token(logits: torch.Tensor, *, temperature: float = 0.0, top_p: float = 1.0,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] -> token ids long [B]: argmax (temperature 0) or a draw from softmax(logits/T)
    restricted to the smallest set of most likely tokens whose mass reaches top_p."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(dim=-1) - sorted_p > top_p  # the mass before a token already reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _check_args(temperature: float, top_p: float, max_new_tokens: int) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ConfigError(f"max_new_tokens={max_new_tokens!r} must be a positive integer")
    if not math.isfinite(temperature) or temperature < 0:
        raise ConfigError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    if not 0.0 < top_p <= 1.0:
        raise ConfigError(f"top_p={top_p} must be in (0, 1] (1 disables nucleus sampling)")


@torch.no_grad()
def ar_generate_tokens(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                       max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                       eos_id: int | None = None, generator: torch.Generator | None = None, use_cache: bool = True,
                       progress: Progress = None) -> torch.Tensor:
    """Decode up to max_new_tokens after left-padded prompts. Returns long [B, P + n], n <= max_new_tokens.

    input_ids long [B, P]; attention_mask bool [B, P] (True = real token) or None. Decoding stops
    when every row has produced eos_id; a finished row is filled with eos_id. use_cache=False
    recomputes the whole sequence each step (same tokens, slower; for checking the cache).
    """
    _check_args(temperature, top_p, max_new_tokens)
    cfg = getattr(model, "config", None)
    if cfg is not None and not cfg.causal:
        raise ConfigError("autoregressive decoding needs a causal model (attn_mask_type='causal'); this model is "
                         f"{cfg.attn_mask_type!r}: use the diffusion samplers (megadlms.diffusion)")
    b, p = input_ids.shape
    device = input_ids.device
    real = (torch.ones(b, p, dtype=torch.bool, device=device) if attention_mask is None
            else attention_mask.to(device=device, dtype=torch.bool))
    if not bool(real[:, -1].all()):
        raise ConfigError("every prompt needs at least one token and padding must be on the left; start empty "
                         "prompts with a BOS / EOD token")
    max_pos = getattr(cfg, "max_position_embeddings", None)
    longest = int(real.sum(1).max())
    if max_pos is not None and longest + max_new_tokens > max_pos:
        raise ConfigError(f"prompt length {longest} + max_new_tokens {max_new_tokens} = {longest + max_new_tokens} "
                         f"exceeds the model's max_position_embeddings={max_pos}; shorten the prompt or lower "
                         "max_new_tokens")
    padded = not bool(real.all())
    pos = position_ids_from_mask(real)
    cache = AppendCache(p + max_new_tokens) if use_cache else None
    seq, next_pos = input_ids, pos[:, -1] + 1
    # the prefill with a cache needs the mask (several causal queries); without pads it is all True
    hidden = model(input_ids, attention_mask=real if (use_cache or padded) else None,
                   position_ids=pos if padded else None, kv_cache=cache, output_hidden=True)
    logits = model.logits(hidden[:, -1])  # type: ignore[operator]  # a TransformerLM method
    finished = torch.zeros(b, dtype=torch.bool, device=device)
    bar = ProgressBar(progress, max_new_tokens, "tok")
    try:
        for t in range(max_new_tokens):
            tok = sample_next_token(logits, temperature=temperature, top_p=top_p, generator=generator)
            if eos_id is not None:
                tok = torch.where(finished, eos_id, tok)
                finished |= tok == eos_id
            seq = torch.cat([seq, tok[:, None]], dim=1)
            real = torch.cat([real, torch.ones(b, 1, dtype=torch.bool, device=device)], dim=1)
            bar.update(1)
            if t + 1 == max_new_tokens or (eos_id is not None and bool(finished.all())):
                break
            if use_cache:
                hidden = model(tok[:, None], attention_mask=real if padded else None,
                               position_ids=next_pos[:, None], kv_cache=cache, output_hidden=True)
            else:
                hidden = model(seq, attention_mask=real if padded else None,
                               position_ids=position_ids_from_mask(real) if padded else None, output_hidden=True)
            logits = model.logits(hidden[:, -1])  # type: ignore[operator]  # a TransformerLM method
            next_pos = next_pos + 1
    finally:
        bar.close()
    return seq


def ar_generate(model: nn.Module, prompts: Prompts, *, max_new_tokens: int = 128, temperature: float = 0.0,
                top_p: float = 1.0, eos_id: int | None = None, pad_id: int = 0,
                generator: torch.Generator | None = None, use_cache: bool = True,
                progress: Progress = None) -> list[list[int]]:
    """Autoregressive generation from token-id prompts; returns the new tokens per prompt, cut before EOS."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    ids, attn = prepare_prompts(prompts, pad_id=pad_id, device=model_device(model), vocab_size=vocab)
    out = ar_generate_tokens(model, ids, attn, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                             eos_id=eos_id, generator=generator, use_cache=use_cache, progress=progress)
    new = out[:, ids.shape[1]:].tolist()
    if eos_id is not None:
        new = [r[:r.index(eos_id)] if eos_id in r else r for r in new]
    return new
