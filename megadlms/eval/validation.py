"""The validation ELBO of trained models, side by side on the same windows and masks (`megadlms eval --ppl`).

A masked-diffusion model is scored per mask ratio (its ELBO is the mean over the ratios: a perplexity upper
bound), a causal model by its exact NLL, a block-diffusion model by its BD3-LM NELBO. The diffusion bounds use the
training default, MDLM's SUBS parameterisation (the [MASK] logit -inf: the bound of the model the sampler draws
from), unless `loss="full-vocab"` (LLaDA's CE over the whole vocabulary).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import Any

import torch

from ..config import ConfigError
from .likelihood import ar_loglikelihood, elbo_nll

LOSS_NAMES = {"subs": "SUBS, [MASK] out of the softmax", "full-vocab": "full vocabulary, [MASK] kept"}


def validation_windows(tokenizer: Any, *, data_path: str, seq_length: int, samples: int, split: str = "969,30,1",
                       seed: int = 1234, data_cache_path: str | None = None,
                       mask_token_ids: Sequence[int] = ()) -> list[list[int]]:
    """The first `samples` windows [seq_length + 1] of the validation split of a Megatron dataset prefix.

    mask_token_ids: the [MASK] ids of the diffusion models to score; a window holding one is refused, naming the
    file and document (`megadlms.data.dataset.MaskTokenInDataError`)."""
    from ..data import DataConfig, build_loaders
    from ..data.sft import is_chat_dataset

    if samples < 1:
        raise ConfigError(f"samples={samples} must be >= 1 (validation windows to score)")
    if is_chat_dataset(data_path):  # the loader's own message names `train --sft`, no flag of this command
        raise ConfigError(f"--data-path {data_path} is a chat dataset (`megadlms preprocess --chat`, loss masks beside "
                          "it): the ELBO is scored on plain-text datasets (`megadlms preprocess` without --chat); the "
                          "validation loss on chat data is what `megadlms train --sft` logs")
    windows: list[list[int]] = []
    ids: list[int | None] = [*dict.fromkeys(mask_token_ids)] or [None]
    for mask_id in ids:  # the same windows, checked for each id
        cfg = DataConfig(data_path=[data_path], split=split, data_cache_path=data_cache_path, seq_length=seq_length,
                         micro_batch_size=1, seed=seed, num_workers=0, eval_samples=samples, mask_token_id=mask_id)
        valid = build_loaders(cfg, tokenizer, require_train=False).valid
        if valid is None:
            raise ConfigError(f"--split {split} leaves no validation documents in {data_path}; give the validation "
                              "part a share, e.g. --split 98,2,0")
        it = iter(valid)
        windows = [next(it)[0].tolist() for _ in range(samples)]
    return windows


def scored_tokens(cfg: Any, seq_length: int, ignore_bos: bool = False) -> int:
    """The tokens of a window [seq_length + 1] that `score_windows` scores: an AR model's seq_length targets; a
    diffusion model's seq_length, less its first token for a shifted model (nothing predicts it) or with
    ignore_bos (never masked, out of the bound)."""
    if cfg.attn_mask_type == "causal":
        return seq_length
    return seq_length - 1 if ignore_bos or getattr(cfg, "diffusion_shift", False) else seq_length


def score_windows(model: Any, cfg: Any, windows: list[list[int]], *, seq_length: int, ratios: list[float],
                  mask_id: int | None, seed: int, batch_size: int, loss: str = "subs",
                  ignore_bos: bool = False) -> torch.Tensor:
    """Summed loss over the windows' tokens, fp64: per mask ratio [R] for a masked-diffusion model (each entry
    (L / k) x CE over k masked tokens, summed over windows), the exact NLL [1] for a causal model, the NELBO [1]
    for a block-diffusion model. loss: subs or full-vocab (the diffusion models' cross-entropy). ignore_bos: the
    diffusion models' first token is never masked and not scored (`scored_tokens` counts what is)."""
    if cfg.attn_mask_type == "causal":
        pairs = [(w[:1], w[1:seq_length + 1]) for w in windows]
        return torch.tensor([-sum(lp for lp, _ in ar_loglikelihood(model, pairs, batch_size=batch_size))],
                            dtype=torch.float64)
    if mask_id is None:
        raise ConfigError("the ELBO of a masked-diffusion model needs its [MASK] id: the checkpoint config has no "
                          "mask_token_id; pass --mask-token ID")
    if cfg.block_size is not None:  # block diffusion: its own NELBO (noise per block), not a per-ratio ELBO
        return torch.tensor([bd3lm_nelbo_sum(model, windows, seq_length=seq_length, block_size=cfg.block_size,
                                             mask_id=mask_id, seed=seed, loss=loss, ignore_bos=ignore_bos)],
                            dtype=torch.float64)
    # a difflm-shift model predicts token i at position i - 1, and ignore_bos never masks the first token: the
    # first token is then the prefix of the rest
    first = 1 if ignore_bos or getattr(cfg, "diffusion_shift", False) else 0
    pairs = [(w[:first], w[first:seq_length]) for w in windows]
    return elbo_nll(model, pairs, mask_id=mask_id, ratios=ratios, seed=seed, batch_size=batch_size,
                    subs_mask_id=mask_id if loss == "subs" else None).sum(0)


def objective_loss_sum(model: Any, cfg: Any, windows: list[list[int]], *, seq_length: int, mask_id: int | None,
                       seed: int, batch_size: int, loss: str = "subs", ignore_bos: bool = False) -> float | None:
    """The trainer's validation loss of the windows [seq_length + 1], summed over windows: the objective the model
    trains with (masked diffusion, shifted or not, AR, or BD3-LM) through the same methods as `train`'s step and
    validation (`megadlms.training.objectives`), with evaluation noise from a generator seeded by `seed` and the
    diffusion loss `loss` (subs | full-vocab). None for
    a model without the LM-head weight (a Hugging Face class)."""
    from ..config import TransformerConfig
    from ..diffusion import bd3lm
    from ..diffusion.objective import MaskSampler, ObjectiveConfig
    from ..training.documents import AttentionPlan
    from ..training.objectives import Sharding, build_objective

    if not hasattr(model, "output_weight"):
        return None
    device = next(model.parameters()).device
    model_config = TransformerConfig.from_dict({**cfg.to_dict(), "seq_length": seq_length,
                                                "max_position_embeddings": max(seq_length,
                                                                               cfg.max_position_embeddings)})
    mode = model_config.running_mode
    if mode != "vanilla" and mask_id is None:
        raise ConfigError("the diffusion loss needs the model's [MASK] id: pass --mask-token ID")
    ignore_bos = ignore_bos and mode in ("difflm-noshift", "bd3lm")  # the others never score the first token
    blocks = None if cfg.block_size is None else bd3lm.Bd3lmConfig(
        block_size=cfg.block_size, seq_length=seq_length, mask_token_id=mask_id or 0, loss=loss,
        ignore_bos=ignore_bos)
    sampler = MaskSampler(seed, device=device)
    total = 0.0
    for start in range(0, len(windows), batch_size):
        chunk = torch.tensor([w[:seq_length + 1] for w in windows[start:start + batch_size]], device=device)
        n = chunk.shape[0]
        objective = build_objective(ObjectiveConfig(mode=mode, mask_token_id=mask_id or 0, loss=loss,
                                                    ignore_bos=ignore_bos and blocks is None), model_config,
                                    AttentionPlan(causal=cfg.causal, device=device), Sharding(n), sft=False,
                                    bd3lm_config=blocks, flex=False, loss_chunk_tokens=0)
        noise = objective.draw_noise(sampler, n, 1, evaluation=True)
        batch = next(objective.micro_batches(iter([chunk]), noise, 1, device))
        total += float(objective.loss(model, batch, lambda: model.output_weight)) * n
    return total


def bd3lm_nelbo_sum(model: Any, windows: list[list[int]], *, seq_length: int, block_size: int, mask_id: int,
                    seed: int, loss: str = "subs", ignore_bos: bool = False) -> float:
    """The BD3-LM NELBO summed over the windows' tokens (nats). Each window draws its noise from a generator seeded by
    `seed` and its own tokens, so a score does not depend on the order or on how ranks split the windows."""
    from ..diffusion.bd3lm import nelbo

    if seq_length % block_size:
        raise ConfigError(f"--seq-length {seq_length} must be a multiple of the checkpoint's block size {block_size}")
    device = next(model.parameters()).device
    total = 0.0
    for w in windows:
        g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(str(w[:seq_length]).encode()))
        tokens = torch.tensor([w[:seq_length]], device=device)
        nats = nelbo(model, tokens, block_size=block_size, mask_token_id=mask_id, generator=g, loss=loss,
                     ignore_bos=ignore_bos)
        total += float(nats[0]) * (seq_length - 1 if ignore_bos else seq_length)
    return total


def model_report(cfg: Any, per_token: list[float]) -> dict[str, Any]:
    """One model's entry of the report from its per-token loss (`score_windows` / tokens): the mode, the bound
    (or exact NLL) and its perplexity."""
    if cfg.block_size is not None:
        return {"mode": f"block diffusion (block {cfg.block_size})", "nelbo": per_token[0], "elbo": per_token[0],
                "elbo_ppl": math.exp(min(per_token[0], 50))}
    if cfg.attn_mask_type == "causal":
        return {"mode": "autoregressive", "nll": per_token[0], "ppl": math.exp(min(per_token[0], 50))}
    elbo = sum(per_token) / len(per_token)
    return {"mode": "masked diffusion", "loss_per_ratio": per_token, "elbo": elbo,
            "elbo_ppl": math.exp(min(elbo, 50))}


def format_ppl_table(report: dict[str, Any]) -> str:
    """A markdown table: the loss per mask ratio per model, then the ELBO and its perplexity bound."""
    names = list(report["models"])
    loss = report.get("loss")
    each = [m["loss"] for m in report["models"].values() if m.get("loss")]  # models scored with different CEs
    ce = (f" (diffusion CE: {LOSS_NAMES[loss]})" if loss else
          f" (diffusion CE per model: {', '.join(each)})" if each else "")
    lines = [f"validation ELBO: {report['windows']} windows x {report['seq_length']} tokens of {report['data_path']}"
             + ce,
             "", "| mask ratio | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for j, r in enumerate(report["mask_ratios"]):
        cells = [f"{m['loss_per_ratio'][j]:.4f}" if "loss_per_ratio" in m else "-" for m in report["models"].values()]
        lines.append(f"| {r:g} | " + " | ".join(cells) + " |")
    bound = [f"{m.get('elbo', m.get('nll')):.4f}" for m in report["models"].values()]
    ppl = [f"{m.get('elbo_ppl', m.get('ppl')):.3f}" for m in report["models"].values()]
    lines.append("| ELBO (nats/token; AR: exact NLL; BD3-LM: its NELBO) | " + " | ".join(bound) + " |")
    lines.append("| perplexity (upper bound; AR: exact) | " + " | ".join(ppl) + " |")
    if any(m.get("objective_loss") is not None for m in report["models"].values()):
        loss = [f"{m['objective_loss']:.4f}" if m.get("objective_loss") is not None else "-"
                for m in report["models"].values()]
        lines.append("| training objective (as `train` validates: sampled noise) | " + " | ".join(loss) + " |")
    return "\n".join(lines)
