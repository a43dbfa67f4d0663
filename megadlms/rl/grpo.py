"""diffu-GRPO (d1, arXiv 2504.12216): GRPO for masked-diffusion LMs.

For a prompt q and G completions o_1..o_G with rewards r_1..r_G:

    A_i = (r_i - mean(r)) / (std(r) + 1e-4)                 (std with Bessel's correction, as TRL's GRPO)

The per-token log-probability log pi(o_i^k | q) is d1's one-step estimate: one forward over [q' | all-mask], where
q' is the prompt with each token masked with probability p (0.15), a fresh prompt mask at each of the mu inner
updates (the old-policy and reference terms use the same mask as the policy term of the same update). With the
ratio rho = exp(log pi - log pi_old), the KL estimate kl = exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1 and
the completion's tokens up to and including its first EOS (mask m):

    loss = sum_{i,k} m_ik * (-min(rho_ik A_i, clip(rho_ik, 1 - eps, 1 + eps) A_i) + beta kl_ik) / sum_{i,k} m_ik
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group: int, eps: float = 1e-4) -> torch.Tensor:
    """rewards fp32 [P * G] (G consecutive completions per prompt) -> advantages fp32 [P * G]."""
    r = rewards.view(-1, group)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).view(-1)


def completion_mask(completions: torch.Tensor, eos_id: int | None) -> torch.Tensor:
    """long [N, C] -> bool [N, C]: the tokens up to and including each row's first EOS (all without one)."""
    if eos_id is None:
        return torch.ones_like(completions, dtype=torch.bool)
    is_eos = (completions == eos_id).long()
    before = is_eos.cumsum(1) - is_eos  # EOS seen strictly before this position
    return before == 0


def tidy_completions(completions: torch.Tensor, eos_id: int | None) -> torch.Tensor:
    """Every token after the first EOS becomes EOS (the sampler may stop early and leave masks there)."""
    if eos_id is None:
        return completions
    return torch.where(completion_mask(completions, eos_id), completions, torch.full_like(completions, eos_id))


def one_step_inputs(sequences: torch.Tensor, prompt_real: torch.Tensor, p_mask: float, generator: torch.Generator,
                    mask_id: int) -> torch.Tensor:
    """d1's one-step input: sequences long [N, P + C], prompt_real bool [N, P] (False: left padding) -> long
    [N, P + C] with every completion token masked and each real prompt token masked with probability p_mask."""
    n, p = prompt_real.shape
    u = torch.rand(n, p, generator=generator, device=generator.device).to(sequences.device)
    masked = torch.zeros_like(sequences, dtype=torch.bool)
    masked[:, :p] = (u < p_mask) & prompt_real
    masked[:, p:] = True
    return torch.where(masked, torch.full_like(sequences, mask_id), sequences)


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None, advantages: torch.Tensor,
              mask: torch.Tensor, *, clip_eps: float, kl_beta: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The diffu-GRPO loss of one batch of completions (module docstring). logp, old_logp, ref_logp fp32 [N, C]
    (ref_logp None: no KL term), advantages fp32 [N], mask bool [N, C]. Returns (loss fp32 scalar, stats: the
    masked means of the KL and of the clipped fraction, detached)."""
    m = mask.float()
    denom = m.sum().clamp(min=1.0)
    ratio = torch.exp(logp - old_logp)
    a = advantages[:, None]
    unclipped, clipped = ratio * a, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * a
    per_token = -torch.minimum(unclipped, clipped)
    stats = {"clip_fraction": (((clipped < unclipped).float() * m).sum() / denom).detach()}
    if ref_logp is not None:
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1
        per_token = per_token + kl_beta * kl
        stats["kl"] = ((kl * m).sum() / denom).detach()
    return (per_token * m).sum() / denom, stats
