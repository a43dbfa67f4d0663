"""Check a conversion by running our model and transformers' on the same batch (fp32, CPU).

Pass criterion, with `tol` = DEFAULT_TOLERANCE = 1e-4 unless given:
    max |logit_ours - logit_hf|  <=  tol * max(1, max |logit_hf|)     over the non-pad positions
    |loss_ours - loss_hf|         <=  tol * max(1, loss_hf)
i.e. 1e-4 absolute for logits of magnitude <= 1, relative to the largest logit beyond that (fp32
rounding grows with the logit scale of a real model; a wrong mapping is off by O(1)).

The loss is the one the model is trained with: next-token cross-entropy for a causal model, the
masked-token cross-entropy (tokens replaced by `mask_token_id` at seeded random positions) for a
bidirectional one. The batch right-pads its second row, so the padding mask path is compared too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..config import TransformerConfig
from .hf import set_causal

DEFAULT_TOLERANCE = 1e-4


@dataclass
class VerifyResult:
    """Logit and loss agreement of two models on one batch."""

    max_abs_diff: float
    mean_abs_diff: float
    max_abs_logit: float
    loss_ours: float
    loss_hf: float
    tolerance: float
    attn_mask_type: str

    @property
    def loss_diff(self) -> float:
        return abs(self.loss_ours - self.loss_hf)

    @property
    def logit_limit(self) -> float:
        return self.tolerance * max(1.0, self.max_abs_logit)

    @property
    def loss_limit(self) -> float:
        return self.tolerance * max(1.0, abs(self.loss_hf))

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.logit_limit and self.loss_diff <= self.loss_limit

    def summary(self) -> str:
        verdict = "PASSED" if self.passed else "FAILED"
        return (f"verify ({self.attn_mask_type} attention, fp32 CPU): max |dlogit| = {self.max_abs_diff:.3e} "
                f"(limit {self.logit_limit:.1e}), mean |dlogit| = {self.mean_abs_diff:.3e}, "
                f"loss ours = {self.loss_ours:.6f}, transformers = {self.loss_hf:.6f}, |dloss| = {self.loss_diff:.3e} "
                f"(limit {self.loss_limit:.1e}) -> {verdict}")


@dataclass
class VerifyBatch:
    """input_ids, labels: long [B, S]; attention_mask: bool [B, S] (False = pad); loss_mask: bool [B, S]."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor


def verification_batch(cfg: TransformerConfig, *, batch_size: int = 2, seq_len: int = 64, seed: int = 0,
                       vocab_limit: int | None = None) -> VerifyBatch:
    """A seeded batch for `cfg`: random ids below `vocab_limit` (default vocab_size), the mask id excluded;
    row 1 right-padded by a quarter; for a bidirectional model with a mask id, ~half the tokens masked."""
    g = torch.Generator().manual_seed(seed)
    assert cfg.max_position_embeddings is not None  # filled in by TransformerConfig.__post_init__
    s = min(seq_len, cfg.max_position_embeddings)
    hi = min(vocab_limit or cfg.vocab_size, cfg.vocab_size)
    ids = torch.randint(0, hi, (batch_size, s), generator=g)
    if cfg.mask_token_id is not None:  # keep clean tokens distinct from [MASK]
        ids[ids == cfg.mask_token_id] = (cfg.mask_token_id + 1) % hi
    attn = torch.ones(batch_size, s, dtype=torch.bool)
    if batch_size > 1 and s >= 4:
        attn[1, s - s // 4:] = False
    labels = ids.clone()
    if cfg.causal:
        labels = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
        loss_mask = attn & torch.cat([attn[:, 1:], torch.zeros(batch_size, 1, dtype=torch.bool)], dim=1)
        return VerifyBatch(ids, labels, attn, loss_mask)
    masked = (torch.rand(batch_size, s, generator=g) < 0.5) & attn
    masked[:, 0] = True  # at least one target per row
    inputs = ids.clone()
    if cfg.mask_token_id is not None:
        inputs[masked] = cfg.mask_token_id
    return VerifyBatch(inputs, labels, attn, masked)


def load_transformers_model(path: str | Path, *, causal: bool, round_to: torch.dtype | None = None) -> nn.Module:
    """transformers' AutoModelForCausalLM for `path`: fp32, CPU, SDPA, eval, with the given attention.

    round_to: round the weights through this dtype first (to compare against a lower-precision copy).
    """
    try:
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError as e:  # verification is optional; conversion itself does not need transformers
        raise ImportError("--verify needs transformers >= 5: pip install 'transformers>=5'") from e
    if int(transformers.__version__.split(".")[0]) < 5:  # config.is_causal (bidirectional masks) arrived in 5
        raise ImportError(f"--verify needs transformers >= 5, found {transformers.__version__}: "
                          "pip install -U 'transformers>=5'")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa")
    if round_to is not None and round_to != torch.float32:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(round_to).float())
    return set_causal(model, causal).eval()


def _loss(logits: torch.Tensor, batch: VerifyBatch) -> float:
    return F.cross_entropy(logits[batch.loss_mask].double(), batch.labels[batch.loss_mask]).item()


@torch.no_grad()
def compare_models(ours: nn.Module, hf_model: nn.Module, batch: VerifyBatch, *,
                   tolerance: float = DEFAULT_TOLERANCE, attn_mask_type: str = "bidirectional") -> VerifyResult:
    """Run both models on `batch` (with its padding mask) and measure logit / loss agreement.

    ours(input_ids, attention_mask) -> logits [B, S, V]; hf_model(...).logits [B, S, V]. Pad positions
    are left out of the comparison (their rows are defined differently by the two implementations).
    """
    a = ours(batch.input_ids, attention_mask=batch.attention_mask).double()
    b = hf_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long()).logits.double()
    if a.shape != b.shape:
        raise ValueError(f"logit shapes differ: ours {list(a.shape)}, transformers {list(b.shape)}")
    keep = batch.attention_mask
    diff = (a[keep] - b[keep]).abs()
    return VerifyResult(max_abs_diff=diff.max().item(), mean_abs_diff=diff.mean().item(),
                        max_abs_logit=b[keep].abs().max().item(), loss_ours=_loss(a, batch),
                        loss_hf=_loss(b, batch), tolerance=tolerance, attn_mask_type=attn_mask_type)


def verify_against_folder(ours: nn.Module, cfg: TransformerConfig, hf_dir: str | Path, *,
                          tolerance: float = DEFAULT_TOLERANCE, seed: int = 0, vocab_limit: int | None = None,
                          round_to: torch.dtype | None = None) -> VerifyResult:
    """Compare `ours` (fp32, CPU, eval) with transformers' model of the folder `hf_dir`, run under
    `cfg.attn_mask_type`. round_to: see `load_transformers_model`."""
    hf_model = load_transformers_model(hf_dir, causal=cfg.causal, round_to=round_to)
    batch = verification_batch(cfg, seed=seed, vocab_limit=vocab_limit)
    return compare_models(ours.eval(), hf_model, batch, tolerance=tolerance, attn_mask_type=cfg.attn_mask_type)
