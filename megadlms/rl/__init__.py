"""Reinforcement learning and preference optimisation for masked-diffusion LMs (docs/rl.md).

- `vrpo`: LLaDA 1.5's VRPO, DPO on ELBO estimates with variance reduction;
- `grpo`: d1's diffu-GRPO, group-normalised advantages, one-step log-likelihoods, a clipped ratio, KL;
- `rewards`: the registry of verifiable rewards;
- `data`: the jsonl records (preference pairs, prompts) and their loader.

Pure functions on tensors; the trainer's objectives (`megadlms.training.rl_objectives`) put them together.
"""

RL_KINDS = ("vrpo", "grpo")
