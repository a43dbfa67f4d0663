"""Text generation: autoregressive decoding and the `megadlms generate` command.

The diffusion samplers live in `megadlms.diffusion` (`sampler`: LLaDA's reference sampler,
`fast_sampler`: Fast-dLLM style cache + parallel decoding).
"""

from .ar import ar_generate, ar_generate_tokens, sample_next_token

__all__ = ["ar_generate", "ar_generate_tokens", "sample_next_token"]
