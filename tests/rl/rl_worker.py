"""Launched by test_rl_data_parallel.py: `megadlms train` with

- one more reward, `letters` (the share of letters in the completion), dense enough that an untrained model's
  completions get different rewards (non-zero advantages);
- on rank 1, one more forward of the policy in every rollout's sampler, as confidence-threshold decoding takes more
  steps on some ranks' prompts than on others' (under FSDP2 each forward would otherwise all-gather on its own).
"""

import os
import sys

import torch

import megadlms.diffusion.fast_sampler as fast_sampler
from megadlms.cli import train_main
from megadlms.rl.rewards import REWARDS


def letter_share(text: str, record: dict) -> float:
    return sum(ch.isalpha() for ch in text) / max(len(text), 1)


def one_more_step_on_rank_1(sample):
    def run(model, ids, *args, **kwargs):
        out = sample(model, ids, *args, **kwargs)
        if os.environ.get("RANK") == "1":
            with torch.no_grad():
                model(out[0])
        return out

    return run


if __name__ == "__main__":
    REWARDS["letters"] = (letter_share, ())
    fast_sampler.fast_generate_tokens = one_more_step_on_rank_1(fast_sampler.fast_generate_tokens)
    sys.exit(train_main(sys.argv[1:], prog="rl_worker.py"))
