"""The training objectives as pure functions: masked diffusion (LLaDA / MDLM) and autoregressive.

Both are expressed as `prepare(tokens) -> (inputs, targets, weights)` followed by the same
`weighted_cross_entropy(logits, targets, weights)`:
- masked diffusion: inputs are the tokens with a random subset replaced by the mask token,
  weights = 1/p on masked positions and 0 elsewhere, normalised by B*L (the ELBO);
- autoregressive (`vanilla`): inputs x[:-1], targets x[1:], weights 1;
- shifted masked diffusion (`difflm-shift`, Dream): masked as above, but the logits at position i predict
  token i + 1, keeping an AR model's head alignment (the first position is never masked).

Supervised fine-tuning (`prepare_sft_batch`) runs the same functions on packed chat windows with a loss mask
and segment ids (LLaDA's SFT): prompt tokens are never masked; each conversation draws its own t; a masked
response token weighs 1 / (p * n) with n the response tokens of its conversation; the loss is the sum of
weighted CE over the conversations of the batch divided by their number (the mean over conversations).

The loss of every diffusion mode is MDLM's SUBS parameterisation by default (`loss="subs"`): the [MASK] logit is
-inf before the log-softmax, so the cross-entropy is over the vocabulary minus [MASK], the bound of the model the
sampler draws from (it never emits [MASK]). `loss="full-vocab"` keeps [MASK] in the softmax, as LLaDA trains.

Randomness comes from one `MaskSampler` with its own `torch.Generator` (checkpointed). It draws
the noise for a whole global batch at once and every rank slices its rows, so the masks a sample
gets do not depend on how the global batch is split across ranks and micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..attention_masks import segment_positions
from ..config import DIFFUSION_LOSSES, ConfigError

RUNNING_MODES = ("difflm-noshift", "difflm-shift", "vanilla", "bd3lm")  # bd3lm: megadlms.diffusion.bd3lm
PMASK_MODES = ("sampled", "actual")


@dataclass
class ObjectiveConfig:
    mode: str = "difflm-noshift"  # difflm-noshift (masked diffusion) | difflm-shift (Dream) | vanilla (AR) | bd3lm
    mask_token_id: int = 0
    eps: float = 1e-3  # p = (1 - eps) * t + eps
    pmask: str = "sampled"  # sampled: weight by the drawn p; actual: by the row's masked fraction
    varilen_prob: float = 0.01  # share of micro-steps cut to a random length in [2, L]
    loss: str = "subs"  # diffusion modes: subs ([MASK] logit -inf before the softmax) or full-vocab (LLaDA's)
    ignore_bos: bool = False  # difflm-noshift: never mask position 0, and leave it out of the validation loss

    def __post_init__(self) -> None:
        if self.mode not in RUNNING_MODES:
            raise ConfigError(f"--model-running-mode {self.mode!r} is not one of {list(RUNNING_MODES)}")
        if self.pmask not in PMASK_MODES:
            raise ConfigError(f"--difflm-pmask {self.pmask!r} is not one of {list(PMASK_MODES)}")
        if self.loss not in DIFFUSION_LOSSES:
            raise ConfigError(f"--diffusion-loss {self.loss!r} is not one of {list(DIFFUSION_LOSSES)}")
        if self.ignore_bos and self.mode in ("vanilla", "difflm-shift"):
            raise ConfigError(f"--ignore-bos applies to difflm-noshift and bd3lm; --model-running-mode {self.mode} "
                              "never masks the first token already (it is no target): drop --ignore-bos")
        if not 0.0 < self.eps < 1.0:
            raise ConfigError(f"--difflm-eps {self.eps} must be in (0, 1), e.g. 1e-3")
        if not 0.0 <= self.varilen_prob <= 1.0:
            raise ConfigError(f"--difflm-varilen-prob {self.varilen_prob} must be in [0, 1], e.g. 0.01")

    @property
    def diffusion(self) -> bool:
        return self.mode != "vanilla"

    @property
    def shift(self) -> bool:
        """Logits at position i predict token i + 1 (vanilla and difflm-shift)."""
        return self.mode != "difflm-noshift"

    @property
    def subs_mask_id(self) -> int | None:
        """The token the loss gives no probability (SUBS: the [MASK] id), None for the full vocabulary (and AR)."""
        return self.mask_token_id if self.diffusion and self.loss == "subs" else None


@dataclass
class BatchNoise:
    """Noise for one global batch: rows in global sample order, plus per-micro-step lengths."""

    t: torch.Tensor  # [G, 1] fp32, t ~ U(0, 1) ([G, L] for SFT: per conversation, read at its first position)
    u: torch.Tensor  # [G, L] fp32, a token is masked where u < p
    lengths: torch.Tensor  # [M] int64 on the CPU, sequence length used by each global micro-step
    evaluation: bool = False  # validation noise (a first token left out by ignore_bos leaves the denominator too)


class MaskSampler:
    """Draws the masking noise from its own generators, identically on every rank.

    The per-token noise is drawn on the compute device; the per-micro-step lengths on the CPU,
    because slicing needs them on the host (no device sync in the step).
    """

    def __init__(self, seed: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.length_generator = torch.Generator()
        self.length_generator.manual_seed(seed + 1)

    def draw(self, global_batch: int, seq_len: int, micro_steps: int, varilen_prob: float,
             per_token_t: bool = False) -> BatchNoise:
        """per_token_t: t drawn per position ([G, L], SFT: a conversation takes the t of its first position)."""
        g, gl = self.generator, self.length_generator
        t = torch.rand(global_batch, seq_len if per_token_t else 1, generator=g, device=self.device)
        u = torch.rand(global_batch, seq_len, generator=g, device=self.device)
        cut = torch.rand(micro_steps, generator=gl) < varilen_prob
        short = torch.randint(2, seq_len + 1, (micro_steps,), generator=gl)
        lengths = torch.where(cut, short, torch.full_like(short, seq_len))
        return BatchNoise(t, u, lengths)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "length_generator": self.length_generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.length_generator.set_state(state["length_generator"])


def require_mask_token_id(mask_token_id: int | None, caller: str) -> int:
    """`mask_token_id`, or a one-line ConfigError where it is None (a TransformerConfig without a [MASK] id: the tiny
    preset, a plain AR config) naming the field and the fix."""
    if mask_token_id is None:
        raise ConfigError(f"{caller} needs a [MASK] id but mask_token_id is None (the model config records none): set "
                          "it, e.g. cfg = cfg.replace(mask_token_id=tokenizer.mask_token_id)")
    return mask_token_id


def mask_tokens(tokens: torch.Tensor, t: torch.Tensor, u: torch.Tensor, *, mask_token_id: int | None,
                eps: float = 1e-3, pmask: str = "sampled", maskable: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward diffusion: mask each token with probability p = (1 - eps) t + eps.

    tokens: long [B, L]; t: [B, 1] (or [B, L], a t per token); u: [B, L] uniform noise.
    Returns (noisy long [B, L], weights fp32 [B, L] = 1/p on masked positions, 0 elsewhere).
    maskable None: every row has at least one masked token (the position of its smallest u). maskable bool
    [B, L] (SFT: the response tokens): only those may be masked, and none is forced.
    """
    mask_token_id = require_mask_token_id(mask_token_id, "mask_tokens")
    p = (1.0 - eps) * t + eps  # [B, 1] or [B, L]
    masked = u < p
    if maskable is None:
        at_least_one = F.one_hot(u.argmin(dim=1), u.shape[1]).bool()
        masked = masked | at_least_one
    else:
        masked = masked & maskable
    if pmask == "actual":  # MegaDLMs' variant: weight by the fraction actually masked
        p = masked.float().mean(dim=1, keepdim=True)
    noisy = torch.where(masked, torch.full_like(tokens, mask_token_id), tokens)
    weights = masked.float() / p
    return noisy, weights


def prepare_batch(sample: torch.Tensor, noise_rows: tuple[torch.Tensor, torch.Tensor] | None,
                  length: int | None, cfg: ObjectiveConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A loader sample long [B, L+1] -> (inputs [B, l], targets [B, l], weights fp32 [B, l]).

    noise_rows: (t [B, 1], u [B, L]) for these rows (diffusion only); length: l <= L (varilen).
    cfg.ignore_bos: position 0 is never masked (weight 0).
    """
    if cfg.diffusion:
        tokens = sample[:, :-1]
        length = length or tokens.shape[1]
        tokens = tokens[:, :length]
        assert noise_rows is not None, "the diffusion objective needs noise rows"
        t, u = noise_rows
        u = u[:, :length]
        if cfg.shift or cfg.ignore_bos:  # shift: position 0 has no position before it to predict it
            u = torch.cat([torch.full_like(u[:, :1], 2.0), u[:, 1:]], dim=1)
        noisy, weights = mask_tokens(tokens, t, u, mask_token_id=cfg.mask_token_id,
                                     eps=cfg.eps, pmask=cfg.pmask)
        if cfg.shift:  # logits at i predict token i + 1
            return noisy, sample[:, 1:length + 1], shift_left(weights)
        return noisy, tokens, weights
    length = length or sample.shape[1] - 1
    inputs, targets = sample[:, :length], sample[:, 1:length + 1]
    return inputs, targets, torch.ones(targets.shape, dtype=torch.float32, device=targets.device)


def shift_left(x: torch.Tensor) -> torch.Tensor:
    """[B, L] -> [B, L]: x[:, i + 1] at i, zero at the last position (a target's weight moved to its predictor)."""
    return torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)


@dataclass
class SFTBatch:
    """One micro-batch of packed chat windows, ready for the model and the loss."""

    inputs: torch.Tensor  # long [B, L]
    targets: torch.Tensor  # long [B, L]
    weights: torch.Tensor  # fp32 [B, L]: 1/(p n) on masked response tokens (diffusion), 1/n on response targets (AR)
    segment_ids: torch.Tensor  # long [B, L], the conversation of each input position (0: padding)
    conversations: torch.Tensor  # long scalar: conversations with at least one response token in the batch


def _per_segment(values: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
    """Sum of values over each position's segment, broadcast back: [B, L] -> [B, L] (same dtype)."""
    sums = torch.zeros(values.shape[0], values.shape[1] + 1, dtype=values.dtype, device=values.device)
    sums.scatter_add_(1, segment_ids, values)
    return sums.gather(1, segment_ids)


def _segment_start(segment_ids: torch.Tensor) -> torch.Tensor:
    """Index of the first position of each position's segment: long [B, L]."""
    idx = torch.arange(segment_ids.shape[1], device=segment_ids.device)
    return idx - segment_positions(segment_ids)


def prepare_sft_batch(sample: torch.Tensor, noise_rows: tuple[torch.Tensor, torch.Tensor] | None,
                      cfg: ObjectiveConfig) -> SFTBatch:
    """Packed windows long [B, 3, L+1] (tokens, loss mask, segment ids; megadlms.data.sft) -> SFTBatch.

    noise_rows: (t [B, L], u [B, L]) for these rows (diffusion only); each conversation uses the t at its first
    position, so its masks do not depend on where it was packed. Prompt tokens (loss mask 0) are never masked.
    A response token whose predictor (the position before it, in the shifted modes) lies in another conversation
    is treated as prompt. Loss: `weighted_cross_entropy(..., denominator=conversations)` is LLaDA's SFT loss,
    the mean over conversations of sum(CE / p over masked response tokens) / response length.
    """
    tokens, loss_mask, seg = sample[:, 0], sample[:, 1].bool(), sample[:, 2]
    length = tokens.shape[1] - 1
    x, lm, s = tokens[:, :length], loss_mask[:, :length], seg[:, :length]
    if cfg.shift:  # the target at i is token i + 1: it must be a response token of the same conversation
        lm_next = loss_mask[:, 1:] & (seg[:, 1:] == s)  # [B, L], indexed by the predicting position
        if cfg.diffusion:  # the masked token is i + 1; as a token position, shift right
            lm = torch.cat([torch.zeros_like(lm[:, :1]), lm_next[:, :-1]], dim=1)
    if not cfg.diffusion:
        n = _per_segment(lm_next.float(), s)
        weights = torch.where(lm_next, 1.0 / n.clamp(min=1.0), torch.zeros_like(n))
        return SFTBatch(x, tokens[:, 1:], weights, s, _count_segments(lm_next, s))
    assert noise_rows is not None, "the diffusion objective needs noise rows"
    t, u = noise_rows
    t_tok = t.gather(1, _segment_start(s))
    noisy, w = mask_tokens(x, t_tok, u[:, :length], mask_token_id=cfg.mask_token_id, eps=cfg.eps, maskable=lm)
    n = _per_segment(lm.float(), s)
    w = w / n.clamp(min=1.0)
    if cfg.shift:
        return SFTBatch(noisy, tokens[:, 1:], shift_left(w), s, _count_segments(lm, s))
    return SFTBatch(noisy, x, w, s, _count_segments(lm, s))


def _count_segments(has_response: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
    """Number of distinct (row, segment) pairs holding at least one response position."""
    hit = torch.zeros(segment_ids.shape[0], segment_ids.shape[1] + 1, dtype=torch.long, device=segment_ids.device)
    hit.scatter_add_(1, segment_ids, has_response.long())
    return (hit > 0).sum()


def weighted_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor,
                           denominator: float | torch.Tensor | None = None, *,
                           mask_id: int | None = None) -> torch.Tensor:
    """sum_i w_i * CE(logits_i, targets_i) / denominator (default B * L), CE in fp32.

    logits [B, L, V] (any float dtype); targets long [B, L]; weights fp32 [B, L]. Returns a scalar.
    With diffusion weights this is the masked-diffusion ELBO; with unit weights the mean AR loss; with SFT
    weights and denominator = conversations, LLaDA's SFT loss. mask_id given: MDLM's SUBS parameterisation, the
    logit of that token is -inf before the log-softmax (the CE over the vocabulary minus [MASK]).
    """
    lf = logits.float()
    if mask_id is not None:
        lf = subs_logits(lf, mask_id, inplace=lf is not logits)  # in place only on the fp32 copy
    ce = F.cross_entropy(lf.flatten(0, 1), targets.flatten(), reduction="none")
    w = weights.flatten()
    ce = torch.where(w != 0, ce, 0.0)  # an unscored target may be [MASK] itself (CE inf under SUBS)
    return (ce * w).sum() / (targets.numel() if denominator is None else denominator)


def subs_logits(logits: torch.Tensor, mask_id: int, inplace: bool = False) -> torch.Tensor:
    """[..., V] -> the same logits with the [MASK] logit at -inf (SUBS: [MASK] gets probability 0)."""
    index = torch.tensor([mask_id], device=logits.device)
    if inplace:
        return logits.index_fill_(-1, index, float("-inf"))
    return logits.index_fill(-1, index, float("-inf"))


def chunked_weighted_cross_entropy(hidden: torch.Tensor, output_weight: torch.Tensor, targets: torch.Tensor,
                                   weights: torch.Tensor, chunk_tokens: int = 8192,
                                   num_rows: int | None = None,
                                   denominator: float | torch.Tensor | None = None, *,
                                   mask_id: int | None = None) -> torch.Tensor:
    """The LM head fused with the loss, over token chunks, so the [B*L, V] logits never exist at once.

    hidden [B, L, H]; output_weight [V, H]; targets long [B, L]; weights [B, L] -> fp32 scalar, the
    same value as `weighted_cross_entropy(hidden @ output_weight.T, targets, weights)`.
    Only tokens with a non-zero weight get logits (for diffusion: the masked ~50%). Finding them needs
    their count on the host: pass it as `num_rows` when known (the trainer copies it to the host before
    queuing the forward), else it is read here, a device sync. Because the loss is a scalar, each
    chunk's gradients with respect to `hidden` and `output_weight` are computed right after its
    logits, in the forward pass: backward only scales them, and nothing of size [tokens, V] is kept
    or recomputed.
    The head GEMMs run in the autocast dtype when autocast is on (else in hidden's dtype); the
    softmax and the loss in fp32. mask_id: SUBS, as in `weighted_cross_entropy`.
    """
    h = hidden.flatten(0, 1)
    y, w = targets.flatten(), weights.flatten()
    if num_rows is None:
        rows = w.nonzero().squeeze(1)
    else:  # the same indices, without a sync (the output size is known)
        rows = torch.nonzero_static(w, size=num_rows).squeeze(1)
    if rows.numel() < w.numel():
        h, y, w = h.index_select(0, rows), y[rows], w[rows]
    dev = hidden.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype
    if torch.is_grad_enabled() and (h.requires_grad or output_weight.requires_grad):
        total = _HeadLoss.apply(h, output_weight, y, w, dtype, chunk_tokens, mask_id)
    else:
        total = hidden.new_zeros((), dtype=torch.float32)
        wt = output_weight.to(dtype)
        for start in range(0, h.shape[0], chunk_tokens):
            sl = slice(start, start + chunk_tokens)
            hc = h[sl].to(dtype)
            total = total + _ce_kernel(hc)(hc @ wt.t(), y[sl], w[sl], False, _mask_column(mask_id, wt))[0]
    return total / (targets.numel() if denominator is None else denominator)


@torch.no_grad()
def token_losses(hidden: torch.Tensor, output_weight: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, *,
                 mask_id: int | None = None, chunk_tokens: int = 8192) -> torch.Tensor:
    """Per-token weighted losses without gradients: fp32 [B, L], w_i * CE(hidden_i @ output_weight.T, targets_i)
    where w_i != 0, else 0. hidden [B, L, H]; output_weight [V, H]; targets long [B, L]; weights [B, L].
    Logits only for the weighted tokens, `chunk_tokens` at a time (the [B*L, V] logits never exist at once); the
    head GEMM in the autocast dtype when autocast is on, the softmax in fp32. mask_id: SUBS ([MASK] logit -inf)."""
    h, y, w = hidden.flatten(0, 1), targets.flatten(), weights.flatten().float()
    rows = w.nonzero().squeeze(1)
    dev = hidden.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype
    wt = output_weight.to(dtype)
    out = torch.zeros_like(w)
    with torch.autocast(dev, enabled=False):
        for start in range(0, rows.numel(), chunk_tokens):
            idx = rows[start:start + chunk_tokens]
            logits = (h.index_select(0, idx).to(dtype) @ wt.t()).float()
            if mask_id is not None:
                logits = subs_logits(logits, mask_id, inplace=True)
            out[idx] = F.cross_entropy(logits, y[idx], reduction="none") * w[idx]
    return out.view(targets.shape)


def _mask_column(mask_id: int | None, weight: torch.Tensor) -> torch.Tensor | None:
    """bool [V], True at the [MASK] id (SUBS), or None (the full vocabulary)."""
    if mask_id is None:
        return None
    return torch.arange(weight.shape[0], device=weight.device) == mask_id


def _ce_loss_and_grad(logits: torch.Tensor, y: torch.Tensor, w: torch.Tensor, grad: bool = True,
                      excluded: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [T, V], y long [T], w [T] -> (sum_i w_i CE_i in fp32 or wider, d/dlogits in logits' dtype).
    excluded: bool [V], logits set to -inf before the softmax (SUBS: the [MASK] column; its gradient is 0)."""
    lf = logits.float()
    if excluded is not None:
        lf = lf.masked_fill(excluded, float("-inf"))
    lse = torch.logsumexp(lf, dim=-1, keepdim=True)
    loss = ((lse - lf.gather(1, y[:, None])).squeeze(1) * w).sum()
    if not grad:
        return loss, None
    onehot = torch.arange(lf.shape[1], device=lf.device) == y[:, None]
    dlogits = (torch.exp(lf - lse) - onehot.to(lf.dtype)) * w[:, None]
    return loss, dlogits.to(logits.dtype)


_compiled_ce: Any = None


def _ce_kernel(logits: torch.Tensor) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """`_ce_loss_and_grad`, compiled on CUDA (two passes over the logits instead of ~8 in eager)."""
    global _compiled_ce
    if logits.device.type != "cuda":
        return _ce_loss_and_grad
    if _compiled_ce is None:
        _compiled_ce = torch.compile(_ce_loss_and_grad, dynamic=True)
    return _compiled_ce


class _HeadLoss(torch.autograd.Function):
    """(h [T, H], weight [V, H], y [T], w [T]) -> sum_i w_i CE(h_i @ weight.T, y_i), gradients made in forward
    (mask_id: SUBS, the [MASK] logit -inf)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, w: torch.Tensor,
                dtype: torch.dtype, chunk: int, mask_id: int | None = None) -> torch.Tensor:
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty(h.shape, dtype=dtype, device=h.device) if need_h else None
        grad_w = None
        excluded = _mask_column(mask_id, weight)
        with torch.autocast(h.device.type, enabled=False):
            wt = weight.to(dtype)
            for start in range(0, h.shape[0], chunk):
                sl = slice(start, start + chunk)
                hc = h[sl].to(dtype)
                loss, dlogits = _ce_kernel(hc)(hc @ wt.t(), y[sl], w[sl], True, excluded)
                total = total + loss
                assert dlogits is not None  # asked for (grad=True)
                if grad_h is not None:
                    torch.mm(dlogits, wt, out=grad_h[sl])
                if need_w:
                    gw = dlogits.t() @ hc
                    grad_w = gw.to(torch.float32) if grad_w is None else grad_w.add_(gw)
        if need_w and grad_w is None:  # no token had a weight
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (h.dtype, weight.dtype)
        return total

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_h, grad_w = ctx.saved_tensors
        dh = (grad_h * g).to(ctx.dtypes[0]) if grad_h is not None else None
        dw = (grad_w * g).to(ctx.dtypes[1]) if grad_w is not None else None
        return dh, dw, None, None, None, None, None
