"""Likelihoods of token sequences under a trained model, for benchmarks and perplexity.

Masked diffusion (bidirectional) models have no exact likelihood; they get estimates of the masked-diffusion
bound -log p(target | prefix) <= E_k [ (L / k) * sum of CE over k masked target tokens ], k ~ U{1..L}, the prefix
never masked (LLaDA's conditional likelihood):
- `mc_loglikelihood`: the Monte-Carlo estimate of LLaDA's evaluation: `mc_num` draws whose mask counts are
  stratified over 1..L from one random start, each a random subset of the target;
- `elbo_nll`: a deterministic estimate over a fixed grid of mask ratios (0.1, 0.2, ..., 1.0 by default): the
  loss at a ratio grows with the ratio, so the right-endpoint average over the grid does not fall below the
  bound it estimates; the per-ratio losses are returned as well;
- `greedy_decodes_target`: LLaDA's greedy check: decoding the target from all-masked, one most confident
  token per step, gives back the target; `tokens_are_argmax`: each target token is the argmax when it alone
  is masked.
Autoregressive (causal) models get the exact `ar_loglikelihood`.

The masked-diffusion scores take `subs_mask_id`: given, the [MASK] logit is -inf before the softmax (MDLM's SUBS
parameterisation, the default of training and of `eval --ppl` for a model that records no other loss); None keeps
LLaDA's full-vocabulary CE (the harness's default, as LLaDA evaluates).

Randomness is per request: each draws from a generator seeded with the seed and the request's tokens, so a
score does not depend on the batch it ran in, on the other requests, or on how they were split across ranks.
Requests are packed into right-padded batches of `batch_size` rows (pads are never attended).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError
from ..diffusion.objective import subs_logits
from ..diffusion.sampler import guided_logits, logits_shift, model_device

Pair = tuple[Sequence[int], Sequence[int]]  # (prefix token ids, target token ids)
Progress = Callable[[int], None] | None

DEFAULT_RATIOS = tuple(round(0.1 * i, 1) for i in range(1, 11))


def request_generator(seed: int, prefix: Sequence[int], target: Sequence[int]) -> torch.Generator:
    """A CPU generator seeded with `seed` and the request's tokens (the same draws wherever it runs)."""
    h = hashlib.sha256(f"{seed}|{list(prefix)}|{list(target)}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(h[:8], "little") & (2**63 - 1))


def stratified_masks(target_len: int, num: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`num` random mask patterns over `target_len` positions -> (masked bool [num, L], counts long [num]).

    One start k ~ U{1..L}; the counts step from it by L / num (wrapping within 1..L), so the draws cover the
    mask ratios evenly; each row masks a random subset of its count (one permutation per row). The random
    calls (one randint, then one randperm per row) and their order are LLaDA's.
    """
    length = target_len
    k = torch.randint(1, length + 1, (), generator=generator)
    counts = torch.linspace(float(k), k + (num - 1) * (length / num), steps=num).round().long()
    counts = (counts - 1) % length + 1
    masked = torch.stack([torch.randperm(length, generator=generator) < c for c in counts.tolist()])
    return masked, counts


def grid_masks(target_len: int, ratios: Sequence[float], generator: torch.Generator
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One pattern per ratio: round(ratio * L) (at least 1) random positions -> (bool [R, L], counts long [R])."""
    counts = torch.tensor([min(target_len, max(1, round(r * target_len))) for r in ratios], dtype=torch.long)
    masked = torch.stack([torch.randperm(target_len, generator=generator) < c for c in counts.tolist()])
    return masked, counts


@dataclass
class _Row:
    """One forward row: prefix + target with `masked` target positions replaced by the mask token."""

    request: int
    prefix: list[int]
    target: list[int]
    masked: torch.Tensor  # bool [L]
    weight: float  # L / k


def _batches(rows: Sequence[_Row], batch_size: int) -> list[list[_Row]]:
    # rows of similar lengths together: less padding
    order = sorted(range(len(rows)), key=lambda i: -(len(rows[i].prefix) + len(rows[i].target)))
    return [[rows[i] for i in order[s:s + batch_size]] for s in range(0, len(order), batch_size)]


def _padded(seqs: Sequence[Sequence[int]], pad_id: int, device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Right-padded ids long [B, T] and the key mask bool [B, T] (None when no row is padded)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    real = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        real[i, :len(s)] = True
    mask = None if bool(real.all()) else real.to(device)
    return ids.to(device), mask


def _aligned(model: nn.Module, logits: torch.Tensor, prefix_lengths: Sequence[int]) -> torch.Tensor:
    """Logits [B, S, V] whose position i scores token i: a difflm-shift model (Dream) predicts token i at position
    i - 1, so its logits move one position right (each row needs a prefix for its first target)."""
    if not any(logits_shift(model, p) for p in prefix_lengths):
        return logits
    return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)


def _score_rows(model: nn.Module, rows: Sequence[_Row], *, mask_id: int, cfg: float, batch_size: int,
                progress: Progress, subs_mask_id: int | None = None) -> torch.Tensor:
    """Weighted CE sums fp64 [len(rows)]: weight * sum of CE over each row's masked target positions.

    cfg > 0: each row also runs with its prefix masked (the unconditional input) and the logits are
    un + (cfg + 1) * (cond - un).
    """
    device = model_device(model)
    out = torch.zeros(len(rows), dtype=torch.float64)
    index = {id(r): i for i, r in enumerate(rows)}
    for batch in _batches(rows, batch_size):
        seqs, uncond = [], []
        for r in batch:
            tgt = torch.as_tensor(r.target, dtype=torch.long)
            noisy = torch.where(r.masked, mask_id, tgt).tolist()
            seqs.append(r.prefix + noisy)
            uncond.append([mask_id] * len(r.prefix) + noisy)
        ids, real = _padded(seqs + uncond if cfg > 0 else seqs, mask_id, device)
        prefixes = [len(r.prefix) for r in batch]
        logits = _aligned(model, model(ids, attention_mask=real).float(), prefixes * (2 if cfg > 0 else 1))
        if cfg > 0:
            logits = guided_logits(logits, cfg)
        if subs_mask_id is not None:
            logits = subs_logits(logits, subs_mask_id, inplace=True)
        for j, r in enumerate(batch):
            p = len(r.prefix)
            pos = r.masked.nonzero().squeeze(1).to(device) + p
            tgt = torch.as_tensor(r.target, dtype=torch.long, device=device)[pos - p]
            ce = F.cross_entropy(logits[j, pos], tgt, reduction="sum")
            out[index[id(r)]] = ce.double().item() * r.weight
        if progress is not None:
            progress(len(batch))
    return out


def _check_pairs(pairs: Sequence[Pair], max_length: int | None) -> None:
    for n, (prefix, target) in enumerate(pairs):
        if not target:
            raise ConfigError(f"request {n} has an empty continuation; there is nothing to score")
        total = len(prefix) + len(target)
        if max_length is not None and total > max_length:
            raise ConfigError(f"request {n}: context {len(prefix)} + continuation {len(target)} = {total} tokens "
                             f"exceeds the model's max_position_embeddings={max_length}; shorten the few-shot "
                             "context (--num-fewshot) or evaluate a model with longer positions")


def _max_length(model: nn.Module) -> int | None:
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)


@torch.no_grad()
def mc_loglikelihood(model: nn.Module, pairs: Sequence[Pair], *, mask_id: int, mc_num: int = 128, seed: int = 0,
                     cfg: float = 0.0, batch_size: int = 32, progress: Progress = None) -> list[float]:
    """LLaDA's Monte-Carlo estimate of log p(target | prefix) per pair (a lower bound in expectation).

    Each pair gets `mc_num` draws from `stratified_masks`; a draw masking k of the L target tokens scores
    (L / k) * sum of their CE; the estimate is minus the mean over the draws. Only target tokens are masked.
    """
    if not isinstance(mc_num, int) or mc_num < 1:
        raise ConfigError(f"mc_num={mc_num!r} must be a positive integer (LLaDA uses 128; 1 suffices for "
                         "single-token continuations)")
    _check_pairs(pairs, _max_length(model))
    rows = []
    for n, (prefix, target) in enumerate(pairs):
        masked, counts = stratified_masks(len(target), mc_num, request_generator(seed, prefix, target))
        rows += [_Row(n, list(prefix), list(target), m, len(target) / int(c)) for m, c in zip(masked, counts)]
    scores = _score_rows(model, rows, mask_id=mask_id, cfg=cfg, batch_size=batch_size, progress=progress)
    per_request = torch.zeros(len(pairs), dtype=torch.float64)
    per_request.index_add_(0, torch.tensor([r.request for r in rows]), scores)
    return (-per_request / mc_num).tolist()


@torch.no_grad()
def elbo_nll(model: nn.Module, pairs: Sequence[Pair], *, mask_id: int, ratios: Sequence[float] = DEFAULT_RATIOS,
             seed: int = 0, batch_size: int = 32, progress: Progress = None,
             subs_mask_id: int | None = None) -> torch.Tensor:
    """Deterministic masked-diffusion bound on -log p(target | prefix): fp64 [len(pairs), len(ratios)].

    Entry [n, j] is (L / k_j) * sum of CE over k_j = round(ratios[j] * L) masked target tokens of pair n (one
    fixed pattern per ratio, from `grid_masks`); the row mean is the estimate of the bound, in nats.
    subs_mask_id: SUBS (the [MASK] logit -inf), None: the full vocabulary.
    """
    if not ratios or any(not 0.0 < r <= 1.0 for r in ratios):
        raise ConfigError(f"mask ratios {list(ratios)} must be in (0, 1], e.g. 0.1,0.2,...,1.0")
    _check_pairs(pairs, _max_length(model))
    rows = []
    for n, (prefix, target) in enumerate(pairs):
        masked, counts = grid_masks(len(target), ratios, request_generator(seed, prefix, target))
        rows += [_Row(n, list(prefix), list(target), m, len(target) / int(c)) for m, c in zip(masked, counts)]
    scores = _score_rows(model, rows, mask_id=mask_id, cfg=0.0, batch_size=batch_size, progress=progress,
                         subs_mask_id=subs_mask_id)
    return scores.view(len(pairs), len(ratios))


@torch.no_grad()
def greedy_decodes_target(model: nn.Module, pairs: Sequence[Pair], *, mask_id: int, cfg: float = 0.0,
                          batch_size: int = 32) -> list[bool]:
    """LLaDA's greedy check per pair: start from the target all masked; each step commits the most confident
    argmax among the still-masked target positions (L steps); True when the result is the target."""
    _check_pairs(pairs, _max_length(model))
    device = model_device(model)
    out: list[bool] = []
    for s in range(0, len(pairs), batch_size):
        chunk = pairs[s:s + batch_size]
        seqs = [list(p) + [mask_id] * len(t) for p, t in chunk]
        x, real = _padded(seqs, mask_id, device)
        target_pos = torch.zeros_like(x, dtype=torch.bool)
        for i, (p, t) in enumerate(chunk):
            target_pos[i, len(p):len(p) + len(t)] = True
        prompt_pos = (real if real is not None else torch.ones_like(target_pos)) & ~target_pos
        steps_left = torch.tensor([len(t) for _, t in chunk], device=device)
        for _ in range(int(steps_left.max())):
            ids = x if cfg <= 0 else torch.cat([x, x.masked_fill(prompt_pos, mask_id)])
            logits = model(ids, attention_mask=None if real is None else real.repeat(ids.shape[0] // x.shape[0], 1))
            logits = _aligned(model, logits, [len(p) for p, _ in chunk] * (ids.shape[0] // x.shape[0]))
            logits = guided_logits(logits.float(), cfg) if cfg > 0 else logits.float()
            x0 = logits.argmax(-1)
            conf = torch.softmax(logits, -1).gather(-1, x0[..., None]).squeeze(-1)
            open_ = (x == mask_id) & target_pos
            conf = torch.where(open_, conf, -math.inf)
            best = conf.argmax(-1)
            live = (steps_left > 0) & open_.any(-1)
            rows = live.nonzero().squeeze(1)
            x[rows, best[rows]] = x0[rows, best[rows]]
            steps_left -= 1
        for i, (p, t) in enumerate(chunk):
            out.append(x[i, len(p):len(p) + len(t)].tolist() == list(t))
    return out


@torch.no_grad()
def tokens_are_argmax(model: nn.Module, pairs: Sequence[Pair], *, mask_id: int, batch_size: int = 32) -> list[bool]:
    """Per pair: every target token is the argmax of the logits when it alone is masked (one row per token)."""
    _check_pairs(pairs, _max_length(model))
    device = model_device(model)
    ok = [True] * len(pairs)
    rows = [(n, j) for n, (_, t) in enumerate(pairs) for j in range(len(t))]
    for s in range(0, len(rows), batch_size):
        chunk = rows[s:s + batch_size]
        seqs = []
        for n, j in chunk:
            seq = list(pairs[n][0]) + list(pairs[n][1])
            seq[len(pairs[n][0]) + j] = mask_id
            seqs.append(seq)
        ids, real = _padded(seqs, mask_id, device)
        logits = _aligned(model, model(ids, attention_mask=real), [len(pairs[n][0]) for n, _ in chunk])
        for i, (n, j) in enumerate(chunk):
            ok[n] = ok[n] and int(logits[i, len(pairs[n][0]) + j].argmax()) == pairs[n][1][j]
    return ok


@torch.no_grad()
def ar_loglikelihood(model: nn.Module, pairs: Sequence[Pair], *, batch_size: int = 32,
                     progress: Progress = None) -> list[tuple[float, bool]]:
    """Exact (log p(target | prefix), greedy) per pair for a causal model; the prefix must be non-empty."""
    _check_pairs(pairs, _max_length(model))
    if any(len(p) == 0 for p, _ in pairs):
        raise ConfigError("an autoregressive likelihood needs at least one prefix token (e.g. BOS / EOD)")
    device = model_device(model)
    out: list[tuple[float, bool] | None] = [None] * len(pairs)
    order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
    for s in range(0, len(order), batch_size):
        idx = order[s:s + batch_size]
        seqs = [(list(pairs[i][0]) + list(pairs[i][1]))[:-1] for i in idx]
        ids, real = _padded(seqs, 0, device)
        logp = torch.log_softmax(model(ids, attention_mask=real).float(), -1)
        for j, i in enumerate(idx):
            p, t = len(pairs[i][0]), torch.as_tensor(list(pairs[i][1]), device=device)
            lp = logp[j, p - 1:p - 1 + len(t)]
            out[i] = (lp.gather(-1, t[:, None]).sum().double().item(), bool((lp.argmax(-1) == t).all()))
        if progress is not None:
            progress(len(idx))
    return out  # type: ignore[return-value]
