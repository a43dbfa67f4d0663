"""Block diffusion (BD3-LM, Arriola et al., ICLR 2025) as pure functions: noise, masks, inputs, NELBO.

The sequence of L tokens is cut into blocks of B tokens. Across blocks the model is autoregressive; within
a block it is a masked-diffusion model conditioned on the clean blocks before it. Training is vectorised:
the model runs once over x_t (+) x_0 (2L positions; the positions of x_0 repeat those of x_t, 0..L-1) under
the block-diffusion mask, query q attends key k when
- both in x_t: same block (a noised block sees itself, bidirectionally);
- q in x_t, k in x_0: k's block is strictly before q's (the clean context of a noised block);
- both in x_0: k's block is not after q's (clean blocks are block-causal);
- q in x_0, k in x_t: never.
Only the hidden states of x_t are scored. The loss is the NELBO of the linear schedule (a token is masked
with probability t; weight 1/t on masked tokens, normalised by the tokens of the batch), with t drawn per
block or per sequence from U[clip_min, clip_max] (BD3-LM's clipped schedule; [eps, 1] is the plain linear
schedule and what evaluation always uses, so that the reported number is the bound itself), stratified over the
batch's blocks by default (the paper's antithetic sampling). The cross-entropy
is MDLM's SUBS parameterisation by default, as the paper's: the [MASK] logit is -inf before the log-softmax.

The noise comes from the trainer's `MaskSampler` generator (checkpointed: resume is exact) and is drawn for
the whole global batch, as the other objectives do.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..config import ConfigError
from .clip_search import CLIP_SEARCH_DELTA, CLIP_SEARCH_WIDTHS, clip_grid
from .objective import DIFFUSION_LOSSES, BatchNoise, MaskSampler, require_mask_token_id, subs_logits

NOISE_PER = ("block", "sequence")


@dataclass
class Bd3lmConfig:
    block_size: int
    seq_length: int
    mask_token_id: int = 0
    clip_min: float = 1e-3  # training t ~ U[clip_min, clip_max]
    clip_max: float = 1.0
    noise_per: str = "block"  # one t per block (the paper's) or per sequence
    eval_eps: float = 1e-3  # evaluation: t ~ U[eval_eps, 1], the linear schedule's NELBO
    loss: str = "subs"  # subs: the [MASK] logit -inf before the softmax (the paper's); full-vocab: [MASK] kept
    antithetic: bool = True  # t stratified over the global batch x blocks (the paper's); False: independent
    ignore_bos: bool = False  # never mask position 0; validation divides by the other L - 1 tokens (the paper's)
    resample: bool = False  # training: redraw a block's noise while its masked fraction is outside the clip
    clip_search: bool = False  # validation picks [clip_min, clip_max] of lowest loss variance (the paper's search)
    search_widths: tuple[float, ...] = CLIP_SEARCH_WIDTHS  # the candidate intervals' widths
    search_delta: float = CLIP_SEARCH_DELTA  # the step between the starts of one width's intervals

    def __post_init__(self) -> None:
        b, n = self.block_size, self.seq_length
        if not isinstance(b, int) or b <= 0:
            raise ConfigError(f"--block-size {b!r} must be a positive integer that divides --seq-length {n}")
        if n % b:
            divisors = [d for d in (1, 2, 4, 8, 16, 32, 64, 128, 256) if n % d == 0 and d <= n]
            raise ConfigError(f"--block-size {b} does not divide --seq-length {n}; use a divisor such as "
                              f"{', '.join(map(str, divisors[-4:]))}")
        if not 0.0 < self.clip_min <= self.clip_max <= 1.0:
            raise ConfigError(f"--bd3lm-clip-min {self.clip_min} / --bd3lm-clip-max {self.clip_max} must satisfy "
                              "0 < min <= max <= 1 (e.g. 0.3 and 0.8; 1e-3 and 1 is the linear schedule)")
        if self.noise_per not in NOISE_PER:
            raise ConfigError(f"--bd3lm-noise-per {self.noise_per!r} is not one of {list(NOISE_PER)}")
        if self.loss not in DIFFUSION_LOSSES:
            raise ConfigError(f"--diffusion-loss {self.loss!r} is not one of {list(DIFFUSION_LOSSES)}")
        if self.clip_search:
            bad = [w for w in self.search_widths if not 0.0 < w <= 1.0]
            if bad or not self.search_widths:
                raise ConfigError(f"--bd3lm-clip-search-widths {list(self.search_widths)}: give widths in (0, 1], "
                                  "e.g. 0.5 0.6 0.7 0.8 0.9 (the paper's)")
            if not 0.0 < self.search_delta < 1.0:
                raise ConfigError(f"--bd3lm-clip-search-delta {self.search_delta} must be in (0, 1), e.g. 0.05")
        if not self.reachable:
            raise ConfigError(f"--bd3lm-resample: no masked fraction k/{b} of a block of {b} lies in "
                                  f"[--bd3lm-clip-min {self.clip_min}, --bd3lm-clip-max {self.clip_max}]; widen "
                                  "the interval or use larger blocks")

    @property
    def num_blocks(self) -> int:
        return self.seq_length // self.block_size

    @property
    def subs_mask_id(self) -> int | None:
        """The token the loss gives no probability (SUBS: the [MASK] id), None for the full vocabulary."""
        return self.mask_token_id if self.loss == "subs" else None

    @property
    def resample_bounds(self) -> tuple[float, float]:
        """The masked fractions a block may have under --bd3lm-resample. As the reference: a bound at the linear
        schedule's own end (clip_min = 1e-3, clip_max = 1) is not enforced."""
        return (self.clip_min if self.clip_min != 1e-3 else 0.0, self.clip_max if self.clip_max != 1.0 else 1.0)

    @property
    def reachable(self) -> bool:
        """Whether some masked fraction k/B of a block lies within `resample_bounds` (always, without resample)."""
        lo, hi = self.resample_bounds
        return not self.resample or any(lo <= k / self.block_size <= hi for k in range(self.block_size + 1))

    def search_candidates(self) -> list[Bd3lmConfig]:
        """The clip search's candidates (`clip_search.clip_grid` from eval_eps), as configs of this one; with
        resample, the intervals no masked fraction k/B reaches are left out (they cannot be trained)."""
        out = []
        for lo, hi in clip_grid(self.search_widths, self.search_delta, self.eval_eps):
            cand = dataclasses.replace(self, clip_min=lo, clip_max=hi, resample=False, clip_search=False)
            cand.resample = self.resample  # set after the checks: an unreachable candidate is left out, no error
            if cand.reachable:
                out.append(cand)
        return out

    @property
    def unit_weight(self) -> bool:
        """Training weights 1 instead of 1/t on masked tokens, as the reference does when clip_min > 0.5."""
        return self.clip_min > 0.5


# --------------------------------------------------------------------------- the attention mask


def block_diffusion_mask_mod(seq_len: int, block_size: int) -> Any:
    """The mask as a function of (batch, head, query index, key index) over 2L positions: FlexAttention's
    `mask_mod`, and, on index grids, the dense mask."""

    def mask_mod(b: Any, h: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        q_clean, k_clean = q_idx >= seq_len, kv_idx >= seq_len
        q_block = (q_idx - q_clean * seq_len) // block_size
        k_block = (kv_idx - k_clean * seq_len) // block_size
        noisy_self = ~q_clean & ~k_clean & (q_block == k_block)
        noisy_context = ~q_clean & k_clean & (k_block < q_block)
        clean_causal = q_clean & k_clean & (k_block <= q_block)
        return noisy_self | noisy_context | clean_causal

    return mask_mod


def dense_block_diffusion_mask(seq_len: int, block_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """bool [1, 1, 2L, 2L] (True = attend): the CPU path (FlexAttention has no CPU backward)."""
    idx = torch.arange(2 * seq_len, device=device)
    return block_diffusion_mask_mod(seq_len, block_size)(None, None, idx[:, None], idx[None, :])[None, None]


@functools.lru_cache(maxsize=8)
def flex_block_diffusion_mask(seq_len: int, block_size: int, device: str) -> Any:
    """The mask as a FlexAttention BlockMask over 2L x 2L; tiles with no allowed score are never computed."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(block_diffusion_mask_mod(seq_len, block_size), None, None, 2 * seq_len, 2 * seq_len,
                             device=device)


@functools.lru_cache(maxsize=8)
def _dense_cached(seq_len: int, block_size: int, device: str) -> torch.Tensor:
    return dense_block_diffusion_mask(seq_len, block_size, device)


def block_diffusion_mask(seq_len: int, block_size: int, device: torch.device, flex: bool) -> Any:
    """The training mask for 2L positions: a BlockMask when `flex` (CUDA under torch.compile), else dense bool."""
    dev = str(device)
    return flex_block_diffusion_mask(seq_len, block_size, dev) if flex else _dense_cached(seq_len, block_size, dev)


def allowed_pairs_per_token(seq_len: int, block_size: int) -> int:
    """(query, key) pairs the mask allows, per token of x_t: L + B (of 4L for a dense 2L x 2L attention)."""
    return seq_len + block_size


def block_causal_mask(real: torch.Tensor, block_size: int, offset: int = 0, queries: int | None = None
                      ) -> torch.Tensor:
    """Inference mask over one sequence: bool [B, 1, S, T] where column c attends column c' iff c' is real and
    its block is not after c's (the clean prefix block-causal, the last block bidirectional).

    real: bool [B, T] (False = a left pad); blocks are counted from column `offset`; the queries are the
    last `queries` columns (default all T). A query with no real key attends everything (its output is unused).
    """
    t = real.shape[1]
    s = t if queries is None else queries
    cols = torch.arange(t, device=real.device)
    blocks = (cols - offset).div(block_size, rounding_mode="floor")
    mask = (blocks[None, :] <= blocks[t - s:, None])[None] & real[:, None, :]
    mask = mask | ~mask.any(dim=-1, keepdim=True)
    return mask[:, None]


# --------------------------------------------------------------------------- noise and inputs


def draw_noise(sampler: MaskSampler, global_batch: int, micro_steps: int, cfg: Bd3lmConfig, *,
               evaluation: bool = False) -> BatchNoise:
    """Noise for one global batch from the sampler's generator: t [G, blocks or 1] already on the schedule
    (U[clip_min, clip_max], or U[eval_eps, 1] for evaluation), u [G, L]; every micro-step at full length.

    antithetic (the paper's): the n = G x blocks levels are stratified, the k-th (row-major) drawn uniformly from
    the k-th of n equal parts of the schedule's range, so together they cover it evenly (lower-variance losses).
    Drawn for the whole global batch, the strata do not depend on how ranks and micro-batches split it.
    """
    g = sampler.generator
    lo, hi = (cfg.eval_eps, 1.0) if evaluation else (cfg.clip_min, cfg.clip_max)
    per = cfg.num_blocks if cfg.noise_per == "block" else 1
    r = torch.rand(global_batch, per, generator=g, device=sampler.device)
    if cfg.antithetic:
        n = global_batch * per
        offset = torch.arange(n, device=sampler.device).view(global_batch, per) / n
        r = (r / n + offset).clamp(max=1.0)
    t = lo + (hi - lo) * r
    u = torch.rand(global_batch, cfg.seq_length, generator=g, device=sampler.device)
    if cfg.resample and not evaluation:
        u = _resample(u, t, cfg, g)
    return BatchNoise(t, u, torch.full((micro_steps,), cfg.seq_length, dtype=torch.long), evaluation=evaluation)


MAX_RESAMPLE_ROUNDS = 1000


def _resample(u: torch.Tensor, t: torch.Tensor, cfg: Bd3lmConfig, g: torch.Generator) -> torch.Tensor:
    """u [G, L] with each block whose masked fraction mean(u < t) lies outside `cfg.resample_bounds` redrawn
    (fresh uniforms for the whole block, t kept) until none does (`training.resample` of the reference).
    The masks depend on the noise only, so this runs on the global batch's noise. Reads a flag on the host per
    round (a device sync)."""
    b, (lo, hi) = cfg.block_size, cfg.resample_bounds
    t_tok = t if t.shape[1] == 1 else t.repeat_interleave(b, dim=1)
    for _ in range(MAX_RESAMPLE_ROUNDS):
        frac = (u < t_tok).float().view(u.shape[0], -1, b).mean(dim=-1)  # [G, blocks]
        bad = (frac < lo) | (frac > hi)
        if not bool(bad.any()):
            return u
        fresh = torch.rand(u.shape, generator=g, device=u.device)
        u = torch.where(bad.repeat_interleave(b, dim=1), fresh, u)
    raise ConfigError(f"--bd3lm-resample: blocks of {b} still fall outside [{lo}, {hi}] after "
                      f"{MAX_RESAMPLE_ROUNDS} redraws; widen --bd3lm-clip-min / --bd3lm-clip-max")


def mask_blocks(tokens: torch.Tensor, t: torch.Tensor, u: torch.Tensor, *, block_size: int,
                mask_token_id: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward process: token i of block j is masked where u_i < t_j.

    tokens long [B, L]; t [B, L/block_size] (per block) or [B, 1] (per sequence); u [B, L].
    Returns (x_t long [B, L], weights fp32 [B, L] = 1/t on masked tokens, 0 elsewhere).
    """
    mask_token_id = require_mask_token_id(mask_token_id, "mask_blocks")
    t_tok = t if t.shape[1] == 1 else t.repeat_interleave(block_size, dim=1)
    masked = u < t_tok
    noisy = torch.where(masked, torch.full_like(tokens, mask_token_id), tokens)
    return noisy, masked.float() / t_tok


def prepare_batch(sample: torch.Tensor, noise_rows: tuple[torch.Tensor, torch.Tensor], cfg: Bd3lmConfig,
                  evaluation: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A loader sample long [B, L+1] -> (x_t (+) x_0 long [B, 2L], targets x_0 [B, L], weights fp32 [B, L]).
    cfg.ignore_bos: position 0 is never masked (weight 0). Training with clip_min > 0.5: weight 1 on masked
    tokens (the reference's rule); evaluation always 1/t."""
    tokens = sample[:, :cfg.seq_length]
    t, u = noise_rows
    if cfg.ignore_bos:
        u = torch.cat([torch.full_like(u[:, :1], 2.0), u[:, 1:]], dim=1)
    noisy, weights = mask_blocks(tokens, t, u, block_size=cfg.block_size, mask_token_id=cfg.mask_token_id)
    if cfg.unit_weight and not evaluation:
        weights = (weights > 0).float()
    return torch.cat([noisy, tokens], dim=1), tokens, weights


def position_ids(seq_len: int, device: torch.device | str) -> torch.Tensor:
    """long [2L]: x_t and x_0 both at positions 0..L-1."""
    return torch.arange(seq_len, device=device).repeat(2)


def forward_kwargs(cfg: Bd3lmConfig, device: torch.device, flex: bool) -> dict[str, Any]:
    """The model's keyword arguments for a forward over x_t (+) x_0."""
    return {"attention_mask": block_diffusion_mask(cfg.seq_length, cfg.block_size, device, flex),
            "position_ids": position_ids(cfg.seq_length, device)}


def flops_per_token(model_cfg: Any, block_size: int) -> float:
    """Training FLOPs per token of x_0: the linears run over 2L positions, attention over the allowed pairs."""
    d = model_cfg.num_attention_heads * model_cfg.kv_channels
    pairs = allowed_pairs_per_token(model_cfg.seq_length, block_size)
    return 2 * 6.0 * model_cfg.num_matmul_params() + 12.0 * model_cfg.num_layers * pairs * d


# --------------------------------------------------------------------------- likelihood


@torch.no_grad()
def nelbo(model: torch.nn.Module, tokens: torch.Tensor, *, block_size: int, mask_token_id: int,
          generator: torch.Generator | None = None, samples: int = 1, eps: float = 1e-3,
          loss: str = "subs", ignore_bos: bool = False) -> torch.Tensor:
    """The BD3-LM NELBO per token of each row (nats), averaged over `samples` noise draws; exp() of its
    mean over tokens bounds the perplexity. tokens long [B, L] with L a multiple of block_size (at most the
    model's positions). Noise: t ~ U[eps, 1] per block, from `generator` (seed it for the same noise every run).
    loss: subs (default, as trained: the bound of the model the sampler draws from, which never emits [MASK])
    or full-vocab ([MASK] kept in the softmax). ignore_bos: token 0 is never masked and the NELBO is per token of
    the other L - 1 (the paper's evaluation).
    """
    b, n = tokens.shape
    cfg = Bd3lmConfig(block_size=block_size, seq_length=n, mask_token_id=mask_token_id, eval_eps=eps, loss=loss)
    device = tokens.device
    kwargs = {"attention_mask": dense_block_diffusion_mask(n, block_size, device),
              "position_ids": position_ids(n, device)}
    total = torch.zeros(b, dtype=torch.float64, device=device)
    for _ in range(samples):
        t = eps + (1.0 - eps) * torch.rand(b, cfg.num_blocks, generator=generator, device=device)
        u = torch.rand(b, n, generator=generator, device=device)
        if ignore_bos:
            u[:, 0] = 2.0
        noisy, weights = mask_blocks(tokens, t, u, block_size=block_size, mask_token_id=mask_token_id)
        hidden = model(torch.cat([noisy, tokens], dim=1), output_hidden=True, **kwargs)[:, :n]
        logits = model.logits(hidden).float()  # type: ignore[operator]  # a TransformerLM method
        if cfg.subs_mask_id is not None:
            logits = subs_logits(logits, cfg.subs_mask_id)
        ce = F.cross_entropy(logits.transpose(1, 2), tokens, reduction="none")
        total += (torch.where(weights != 0, ce, 0.0) * weights).sum(dim=1).double() / (n - 1 if ignore_bos else n)
    return total / samples
