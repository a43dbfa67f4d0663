"""VRPO (LLaDA 1.5, arXiv 2505.19223): DPO whose log-likelihoods are ELBO estimates, with variance reduction.

The ELBO of a response y (L tokens) given a prompt x, estimated from n timesteps with one mask each:

    B(y|x) = 1/n * sum_k 1/p_k * sum_{i masked in mask k} log p(y_i | x, y_masked_k),   p_k = (1 - eps) t_k + eps

The timesteps are stratified over [0, 1) (t_k = (k + v) / n, one v per estimate) and every response token is masked
independently with probability p_k. Antithetic sampling: the policy's and the reference's estimates of the same
response use the same timesteps and the same masks, so their difference (what DPO needs) loses most of the noise.

    loss = -log sigmoid(beta * ((B_pi(y_w) - B_ref(y_w)) - (B_pi(y_l) - B_ref(y_l))))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..diffusion.objective import subs_logits


def elbo_noise(n: int, length: int, generator: torch.Generator, *, eps: float = 1e-3,
               stratified: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The noise of one estimate: (p fp32 [n], masked bool [n, length]), drawn on the generator's device.

    stratified: t_k = (k + v) / n with one v ~ U(0, 1); else n independent t ~ U(0, 1)."""
    device = generator.device
    if stratified:
        v = torch.rand(1, generator=generator, device=device)
        t = (torch.arange(n, device=device, dtype=torch.float32) + v) / n
    else:
        t = torch.rand(n, generator=generator, device=device)
    p = (1 - eps) * t + eps
    masked = torch.rand(n, length, generator=generator, device=device) < p[:, None]
    return p, masked


def masked_rows(sequence: torch.Tensor, response_start: int, p: torch.Tensor, masked: torch.Tensor, *,
                mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n noised copies of one sequence (prompt + response, long [S]) and their weights.

    masked bool [n, R] covers the R = S - response_start response positions (the prompt is never masked).
    Returns (inputs long [n, S], weights fp32 [n, S]: 1 / p_k at the masked response positions, else 0)."""
    n = p.shape[0]
    full = torch.zeros(n, sequence.shape[0], dtype=torch.bool, device=sequence.device)
    full[:, response_start:] = masked.to(sequence.device)
    inputs = torch.where(full, torch.full_like(full, mask_id, dtype=torch.long), sequence.expand(n, -1))
    weights = full.float() / p.to(sequence.device)[:, None]
    return inputs, weights


def token_logps(logits: torch.Tensor, targets: torch.Tensor, mask_id: int | None = None) -> torch.Tensor:
    """log p(target) per position: logits [B, S, V], targets long [B, S] -> fp32 [B, S]. mask_id: the model's
    SUBS parameterisation (trained, and sampled, with [MASK] out of the softmax): its logit is -inf here too."""
    lf = logits.float()
    if mask_id is not None:
        lf = subs_logits(lf, mask_id, inplace=lf is not logits)  # in place only on the fp32 copy
    logp = torch.log_softmax(lf, dim=-1)
    return logp.gather(-1, targets[..., None]).squeeze(-1)


def elbo_estimates(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, n: int,
                   mask_id: int | None = None) -> torch.Tensor:
    """The estimates B of `logits` [E * n, S, V] (E estimates of n rows each): fp32 [E], the mean over each estimate's
    n rows of sum_i weights * log p(targets_i) (mask_id: SUBS, as in `token_logps`)."""
    per_row = (token_logps(logits, targets, mask_id) * weights).sum(-1)
    return per_row.view(-1, n).mean(-1)


def dpo_loss(policy_chosen: torch.Tensor, reference_chosen: torch.Tensor, policy_rejected: torch.Tensor,
             reference_rejected: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DPO on log-likelihood estimates, each fp32 [P] (one per pair). Returns (loss fp32 [P], margin fp32 [P]):
    margin = (pi_w - ref_w) - (pi_l - ref_l), loss = -log sigmoid(beta * margin)."""
    margin = (policy_chosen - reference_chosen) - (policy_rejected - reference_rejected)
    return -F.logsigmoid(beta * margin), margin
