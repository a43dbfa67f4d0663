"""Dream's sampler (`diffusion_generate`): its four decoding orders over the whole generation at once.

The sequence is prompt + gen_length mask tokens, decoded without blocks. Timesteps run linearly from 1 down
to eps over `steps` steps; at step i (t -> s) the model proposes x0 for every masked position (argmax, or a
draw from softmax(logits / temperature) after top-p / top-k) and the decoding order `alg` decides which
proposals are kept:

- `origin`: each masked position is revealed independently with probability 1 - s/t (all at the last step);
- `maskgit_plus` (confidence = probability of x0), `topk_margin` (top-1 minus top-2 probability) and
  `entropy` (negative entropy of the distribution): int(mean masked count per row * (1 - s/t)) positions are
  revealed per row (all at the last step), the most confident ones, or with `alg_temp` > 0 a draw without
  replacement from softmax(confidence / alg_temp) over the row.

A difflm-shift model (Dream) predicts position j from the logits of position j - 1 (position 0 from its own);
an unshifted model (LLaDA) from its own. With the same model, inputs and a generator seeded as the global RNG
was for Dream's code, the tokens are Dream's: the random draws have its shapes and order. As Dream, when rows hold
different masked counts (a proposal of the mask token itself) the count is their mean, and a row with fewer masked
positions than that count has committed tokens masked again. The one difference: pads (attention_mask False)
are never decoded or overwritten, even when pad id = mask id.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError
from .sampler import (
    Progress,
    ProgressBar,
    Prompts,
    initial_sequence,
    logits_shift,
    model_prompts,
    position_ids_from_mask,
    trim_at_eos,
)

DREAM_ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")


def check_dream_args(*, gen_length: int, steps: int, alg: str, alg_temp: float | None, temperature: float,
                     top_p: float | None, top_k: int | None, eps: float) -> None:
    """Raise ConfigError naming the bad value and the fix."""
    if not isinstance(gen_length, int) or gen_length <= 0:
        raise ConfigError(f"gen_length={gen_length!r} must be a positive integer (the number of tokens to generate)")
    if not isinstance(steps, int) or steps <= 0:
        raise ConfigError(f"steps={steps!r} must be a positive integer (e.g. gen_length={gen_length})")
    if alg not in DREAM_ALGS:
        raise ConfigError(f"alg={alg!r} is not one of Dream's decoding orders {list(DREAM_ALGS)}")
    if alg_temp is not None and (not math.isfinite(alg_temp) or alg_temp < 0):
        raise ConfigError(f"alg_temp={alg_temp} must be >= 0 (0 or None = the most confident positions)")
    if alg_temp and alg == "origin":
        raise ConfigError("alg_temp has no effect with alg='origin' (it reveals positions at random); "
                          "use alg maskgit_plus, topk_margin or entropy, or drop alg_temp")
    if not math.isfinite(temperature) or temperature < 0:
        raise ConfigError(f"temperature={temperature} must be >= 0 (0 = greedy argmax)")
    if top_p is not None and not 0 < top_p <= 1:
        raise ConfigError(f"top_p={top_p} must be in (0, 1] (1 or None = no nucleus cut)")
    if top_k is not None and (not isinstance(top_k, int) or top_k <= 0):
        raise ConfigError(f"top_k={top_k!r} must be a positive integer (None = no cut)")
    if not 0 < eps < 1:
        raise ConfigError(f"eps={eps} must be in (0, 1) (the last timestep; Dream uses 1e-3)")


def propose_dream(logits: torch.Tensor, *, alg: str, temperature: float, top_p: float | None = None,
                  top_k: int | None = None, generator: torch.Generator | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] -> (confidence [N] in the logits' dtype, x0 long [N]) by `alg`'s rule.

    x0 is the argmax (temperature 0) or a draw from softmax(logits / temperature) after the top-p / top-k
    cuts (one multinomial draw per row, as torch's Categorical). confidence: the probability of x0
    (origin, maskgit_plus), top-1 minus top-2 probability (topk_margin) or sum p log(p + 1e-10) (entropy).
    """
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        ordered, order = logits.sort(dim=-1, descending=True)
        drop = ordered.softmax(-1).cumsum(-1) > top_p
        drop[..., 1:] = drop[..., :-1].clone()  # keep the token that crosses top_p
        drop[..., 0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter_(-1, order, drop), torch.finfo(logits.dtype).min)
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)
    probs = logits.softmax(-1)
    if temperature > 0:
        x0 = torch.multinomial(probs / probs.sum(-1, keepdim=True), 1, replacement=True, generator=generator)[:, 0]
        confidence = probs.gather(-1, x0[:, None])[:, 0]
    else:
        confidence, x0 = probs.max(dim=-1)
    if alg == "topk_margin":
        top2 = probs.topk(2, dim=-1).values
        confidence = top2[:, 0] - top2[:, 1]
    elif alg == "entropy":
        confidence = (probs * torch.log(probs + 1e-10)).sum(-1)
    return confidence, x0


@torch.no_grad()
def dream_generate_tokens(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                          mask_id: int, gen_length: int = 128, steps: int | None = None, alg: str = "origin",
                          alg_temp: float | None = None, temperature: float = 0.0, top_p: float | None = None,
                          top_k: int | None = None, eps: float = 1e-3, generator: torch.Generator | None = None,
                          progress: Progress = None) -> torch.Tensor:
    """Dream's sampler on a batch. Returns long [B, P + gen_length]: the prompt then the generation.

    input_ids: long [B, P], left-padded when prompts differ in length; attention_mask: bool [B, P] (True = real
    token) or None. steps defaults to gen_length. generator: the source of every random draw (the global RNG
    when None, as Dream). progress: True for a tqdm bar over steps, or a callable taking the step increment.
    """
    steps = gen_length if steps is None else steps
    check_dream_args(gen_length=gen_length, steps=steps, alg=alg, alg_temp=alg_temp, temperature=temperature,
                     top_p=top_p, top_k=top_k, eps=eps)
    x, real = initial_sequence(model, input_ids, attention_mask, mask_id=mask_id, gen_length=gen_length)
    b, p = input_ids.shape
    shift = logits_shift(model, p)
    device = x.device
    pos = None if real is None else position_ids_from_mask(real)
    timesteps = torch.linspace(1, eps, steps + 1, device=device)
    rows = torch.arange(b, device=device)[:, None]
    bar = ProgressBar(progress, steps, "step")
    try:
        for i in range(steps):
            masked = x == mask_id if real is None else (x == mask_id) & real
            hidden = model(x, attention_mask=real, position_ids=pos, output_hidden=True)  # [B, L, H]
            bi, ji = masked.nonzero(as_tuple=True)  # row-major, as Dream's boolean indexing
            logits = model.logits(hidden[bi, (ji - shift).clamp(min=0)])  # type: ignore[operator]  # [N, V]
            last = i == steps - 1
            ratio = 1 - timesteps[i + 1] / timesteps[i]
            if alg == "origin":
                reveal = torch.rand(bi.shape[0], device=device, generator=generator) < (1 if last else ratio)
                x0 = torch.full_like(bi, mask_id)
                if bool(reveal.any()):
                    x0[reveal] = propose_dream(logits[reveal], alg=alg, temperature=temperature, top_p=top_p,
                                               top_k=top_k, generator=generator)[1]
                x[bi, ji] = x0
            else:
                # proposed on every step, as Dream, even one that reveals nothing: the random stream stays Dream's
                confidence, x0 = propose_dream(logits, alg=alg, temperature=temperature, top_p=top_p,
                                               top_k=top_k, generator=generator)
                count = masked.sum() / b
                k = int(count) if last else int(count * ratio)
                if k > 0 and bi.numel():
                    full = torch.full(x.shape, -math.inf, dtype=logits.dtype, device=device)
                    full[bi, ji] = confidence
                    if not alg_temp:
                        idx = full.topk(k, dim=-1).indices
                    else:
                        idx = torch.multinomial(F.softmax(full / alg_temp, dim=-1), k, generator=generator)
                    proposal = torch.full_like(x, mask_id)
                    proposal[bi, ji] = x0
                    take = proposal.gather(1, idx)  # as Dream: a pick that was not masked is masked again
                    if real is not None:  # but a pad stays a pad
                        take = torch.where(real.gather(1, idx), take, x.gather(1, idx))
                    x[rows, idx] = take
            bar.update(1)
    finally:
        bar.close()
    return x


def dream_generate(model: nn.Module, prompts: Prompts, *, mask_id: int | None = None, gen_length: int = 128,
                   steps: int | None = None, alg: str = "origin", alg_temp: float | None = None,
                   temperature: float = 0.0, top_p: float | None = None, top_k: int | None = None,
                   eps: float = 1e-3, eos_id: int | None = None, pad_id: int | None = None,
                   generator: torch.Generator | None = None, progress: Progress = None) -> list[list[int]]:
    """Generate with Dream's sampler; returns the new tokens per prompt (cut before the first `eos_id`).

    prompts: token-id lists (any lengths; left-padded internally) or a long tensor [B, P]. mask_id defaults
    to model.config.mask_token_id. See `dream_generate_tokens`.
    """
    mask_id, ids, attn = model_prompts(model, prompts, mask_id, pad_id)
    out = dream_generate_tokens(model, ids, attn, mask_id=mask_id, gen_length=gen_length, steps=steps, alg=alg,
                                alg_temp=alg_temp, temperature=temperature, top_p=top_p, top_k=top_k, eps=eps,
                                generator=generator, progress=progress)
    return trim_at_eos(out[:, ids.shape[1]:], eos_id)
