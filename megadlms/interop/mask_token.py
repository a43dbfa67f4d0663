"""Adding a diffusion [MASK] token to an autoregressive checkpoint (AR-to-DLM adaptation).

The token is appended to the tokenizer as a special token (the id after its last one). When that id has no
embedding row, the vocabulary grows to the next multiple of `VOCAB_MULTIPLE` rows (the GEMM-friendly padding
Qwen uses). The mask row, and any new padding rows, start as the mean of the tokenizer's embedding rows (the
head's too when it is untied), so the new token's logit starts at an average score. What was added is recorded
in `cfg.extra['added_tokens']`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import TransformerConfig
from .hf import InteropError

VOCAB_MULTIPLE = 128
DEFAULT_MASK_TOKEN = "<|mask|>"


def add_token_to_tokenizer(folder: str | Path, token: str) -> int:
    """Add `token` as a special token to the tokenizer files in `folder` (tokenizer.json, and tokenizer_config.json
    as `mask_token` with its added_tokens_decoder entry); returns its id."""
    from tokenizers import AddedToken, Tokenizer

    folder = Path(folder)
    tok_file = folder / "tokenizer.json"
    if not tok_file.is_file():
        raise InteropError(f"--add-mask-token needs the model's tokenizer.json, which {folder} lacks; add it or pass "
                           "--mask-token ID of a row the model already has")
    tok = Tokenizer.from_file(str(tok_file))
    existing = tok.token_to_id(token)
    if existing is not None:
        raise InteropError(f"the tokenizer already has {token!r} (id {existing}); pass --mask-token {existing} "
                           "instead of --add-mask-token")
    ids = tok.get_vocab(with_added_tokens=True).values()
    expected = max(ids) + 1 if ids else 0
    tok.add_special_tokens([AddedToken(token, special=True, normalized=False)])
    new_id = tok.token_to_id(token)
    if new_id != expected:
        raise InteropError(f"the tokenizer gave {token!r} id {new_id}, not the next free id {expected}: its ids have "
                           "gaps; pass --mask-token ID of a spare row instead")
    tok.save(str(tok_file))
    cfg_file = folder / "tokenizer_config.json"
    conf = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    conf["mask_token"] = token
    conf.setdefault("added_tokens_decoder", {})[str(new_id)] = {
        "content": token, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    cfg_file.write_text(json.dumps(conf, indent=2, ensure_ascii=False) + "\n")
    return new_id


def add_mask_rows(state_dict: dict[str, torch.Tensor], cfg: TransformerConfig, mask_id: int, token: str,
                  tokenizer_ids: int) -> tuple[dict[str, torch.Tensor], TransformerConfig]:
    """Embedding (and untied head) rows for `mask_id`: the vocabulary grown to a multiple of VOCAB_MULTIPLE when
    the id has no row; the mask row and new rows set to the mean of the first `tokenizer_ids` rows.
    Returns (new state dict with our names, new config recording the token)."""
    rows = cfg.vocab_size
    new_rows = rows if mask_id < rows else -(-(mask_id + 1) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    out = dict(state_dict)
    names = ["embed_tokens.weight"] + (["lm_head.weight"] if cfg.untie_embeddings_and_output_weights else [])
    for name in names:
        w = state_dict[name]
        mean = w[:min(tokenizer_ids, rows)].float().mean(dim=0).to(w.dtype)
        grown = torch.cat([w, mean.expand(new_rows - rows, -1)]) if new_rows > rows else w.clone()
        grown[mask_id] = mean
        out[name] = grown
    extra = dict(cfg.extra or {})
    extra["added_tokens"] = {**extra.get("added_tokens", {}), token: mask_id}
    if new_rows > rows:
        extra["vocab_padded"] = {"from": rows, "to": new_rows, "multiple": VOCAB_MULTIPLE}
    return out, cfg.replace(vocab_size=new_rows, mask_token_id=mask_id, extra=extra)


def source_rows(state_dict: dict[str, torch.Tensor], cfg: TransformerConfig, source: str | Path, mask_id: int
                ) -> tuple[dict[str, torch.Tensor], TransformerConfig]:
    """The weights as the source checkpoint had them (its row count; the mask row, if it lies inside, taken from
    the source), to verify that adding the token changed nothing else."""
    from .hf import load_hf_state_dict, read_hf_config

    rows = int(read_hf_config(source)["vocab_size"])
    src = load_hf_state_dict(source)
    out = dict(state_dict)
    for name, hf_name in (("embed_tokens.weight", "model.embed_tokens.weight"), ("lm_head.weight", "lm_head.weight")):
        if name in out:
            w = out[name][:rows].clone()
            if mask_id < rows:
                w[mask_id] = src[hf_name][mask_id].to(w.dtype)
            out[name] = w
    return out, cfg.replace(vocab_size=rows, mask_token_id=None)
