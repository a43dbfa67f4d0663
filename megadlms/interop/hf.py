"""Hugging Face interop: read and write checkpoints of the stock Qwen3 / Qwen2 / Llama architectures, and of
the diffusion models LLaDA (`LLaDAModelLM`, names in `megadlms.interop.llada`) and Dream (`DreamModel`, Qwen2's
names).

Our `TransformerLM` uses Hugging Face's module names, so the weight mapping is the `model.` prefix
plus the tied LM head (`lm_head.weight` absent when `tie_word_embeddings`). What this module adds is
the checking: every tensor is matched by name and shape against the architecture the config
describes, and each mismatch is an `InteropError` naming the tensor and both shapes.

Vocabulary padding: the model's `vocab_size` is the embedding's row count (HF's `config.vocab_size`),
which may exceed the tokenizer's (Qwen pads 151669 tokens to 151936 rows). Padding rows are kept on
import and export, unchanged, and a mask token may live in one. A tokenizer with *more* ids than the
embedding has rows is an error: those ids would index past the table.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..config import TransformerConfig
from ..data.tokenizer import complete_tokenizer_config
from ..model import RotaryEmbedding, TransformerLM
from ..moe import moe_layers, split_expert_weights, stack_expert_weights
from ..presets import (  # noqa: F401  (the config translation, re-exported: part of this module's API)
    SUPPORTED_ARCHITECTURES,
    InteropError,
    hf_architecture,
    hf_config_to_megadlms,
    hf_family,
    megadlms_config_to_hf,
    read_hf_config,
)
from ..safetensors_file import open_safetensors, save_safetensors
from . import llada

# Files a transformers tokenizer is made of (whichever the folder has are copied).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "vocab.txt", "chat_template.jinja",
                   "chat_template.json")
_TOKENIZER_MODEL_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
# The modeling code LLaDA's and Dream's folders ship (their config.json's and tokenizer_config.json's auto_map name
# it): copied with the tokenizer, so that an export loads with `trust_remote_code=True` as the original does.
REMOTE_CODE_FILES = ("configuration_llada.py", "modeling_llada.py", "configuration_dream.py", "modeling_dream.py",
                     "generation_utils.py", "tokenization_dream.py", "configuration_lladamoe.py",
                     "modeling_lladamoe.py")

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # transformers' "5GB"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
_DERIVED_KEYS = ("rotary_emb.inv_freq",)  # buffers older checkpoints stored; recomputed from the config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --------------------------------------------------------------------------------------- state dicts


def expected_shapes(cfg: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter names -> shapes for `cfg` (the plain, non-FP8 model), built on the meta device."""
    with torch.device("meta"):
        model = TransformerLM(cfg.replace(fp8=False) if cfg.fp8 else cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _names(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(sorted(keys)[:limit])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def _shape_hint(name: str, cfg: TransformerConfig) -> str:
    if any(k in name for k in ("embed_tokens", "lm_head", "wte", "transformer.ff_out")):
        return f" (vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size})"
    if any(k in name for k in ("proj", "norm", "attn_out", "ff_out")):
        return (f" (hidden_size={cfg.hidden_size}, heads={cfg.num_attention_heads}, kv heads={cfg.num_query_groups}, "
                f"head_dim={cfg.kv_channels}, intermediate_size={cfg.ffn_hidden_size})")
    return ""


def _hf_name(name: str) -> str:
    return name if name == "lm_head.weight" else f"model.{name}"


def _check_against(ours: Mapping[str, torch.Tensor], cfg: TransformerConfig, display: Callable[[str], str],
                   expected: Mapping[str, tuple[int, ...]] | None = None) -> None:
    """Every expected tensor present with its shape; nothing unexpected. display: name -> name in messages.
    expected: name -> shape (default: our names for `cfg`)."""
    expected = expected_shapes(cfg) if expected is None else expected
    missing = [n for n in expected if n not in ours]
    if missing:
        raise InteropError(f"missing tensors {_names([display(n) for n in missing])} for the architecture "
                           "in the config; is a shard missing, or does config.json describe another model "
                           f"(num_hidden_layers={cfg.num_layers}, qk norm={cfg.qk_layernorm}, "
                           f"qkv bias={cfg.add_qkv_bias})?")
    unexpected = [n for n in ours if n not in expected]
    if unexpected:
        raise InteropError(f"unexpected tensors {_names([display(n) for n in unexpected])}: the "
                           "architecture in the config has no such parameters (a different model family, or "
                           "config.json with fewer layers / no biases than the weights)")
    for n, shape in expected.items():
        got = tuple(ours[n].shape)
        if got != shape:
            raise InteropError(f"shape mismatch for {display(n)}: the checkpoint has {list(got)}, the "
                               f"config expects {list(shape)}{_shape_hint(n, cfg)}; fix config.json or the weights")


def hf_state_dict_to_megadlms(hf_state_dict: Mapping[str, torch.Tensor],
                              cfg: TransformerConfig) -> dict[str, torch.Tensor]:
    """HF names (`model.layers.0.self_attn.q_proj.weight`, `lm_head.weight`) -> ours (`layers.0...`).

    Tensors are passed through (same objects, any dtype). Checks names and shapes against `cfg`.
    Tied (`untie_embeddings_and_output_weights=False`): an `lm_head.weight` equal to the embedding is
    dropped; one that differs is an error (the tie would silently replace it). A LLaDA config (imported from
    `LLaDAModelLM`) takes LLaDA's names (`megadlms.interop.llada`).
    """
    if llada.is_llada(cfg):
        return _llada_to_megadlms(hf_state_dict, cfg)
    ours: dict[str, torch.Tensor] = {}
    lm_head = None
    for k, v in hf_state_dict.items():
        if k.endswith(_DERIVED_KEYS):
            continue
        if k == "lm_head.weight":
            lm_head = v
            continue
        name = k.removeprefix("model.") if k.startswith("model.") else None
        if name is None:
            raise InteropError(f"unexpected tensor {k!r}: a *ForCausalLM checkpoint has only 'model.*' tensors and "
                               "'lm_head.weight' (is this a different head, e.g. sequence classification?)")
        ours[name] = v
    embed = ours.get("embed_tokens.weight")
    if cfg.untie_embeddings_and_output_weights:
        if lm_head is None:
            raise InteropError("tie_word_embeddings is false but the checkpoint has no lm_head.weight; set "
                               "tie_word_embeddings true in config.json if the head shares the embedding, or "
                               "add the missing shard")
        ours["lm_head.weight"] = lm_head
    elif lm_head is not None:
        if embed is None or lm_head.shape != embed.shape or not torch.equal(lm_head, embed.to(lm_head.dtype)):
            raise InteropError(
                f"tie_word_embeddings is true but lm_head.weight {list(lm_head.shape)} differs from "
                f"model.embed_tokens.weight {None if embed is None else list(embed.shape)}; set "
                "tie_word_embeddings false in config.json to keep a separate head")
    if cfg.is_moe:
        ours = _moe_to_ours(ours)
    _check_against(ours, cfg, _hf_name)
    return ours


# LLaDA-MoE keeps a layer's shared expert beside its MoE block (`layers.N.shared_expert`); ours is inside it
_SHARED_HF = re.compile(r"^(layers\.\d+)\.shared_expert\.")
_SHARED_OURS = re.compile(r"^(layers\.\d+)\.mlp\.shared_expert\.")


def _moe_to_ours(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF MoE names (without `model.`) -> ours: per-expert tensors stacked [E, ...], the shared expert moved."""
    try:
        stacked = stack_expert_weights(tensors)
    except KeyError as e:
        raise InteropError(f"{e.args[0]}; is a shard missing?") from None
    return {_SHARED_HF.sub(r"\1.mlp.shared_expert.", k): v for k, v in stacked.items()}


def _moe_to_hf(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `_moe_to_ours` (without the `model.` prefix)."""
    return {_SHARED_OURS.sub(r"\1.shared_expert.", k): v for k, v in split_expert_weights(tensors)}


def _llada_to_megadlms(tensors: Mapping[str, torch.Tensor], cfg: TransformerConfig) -> dict[str, torch.Tensor]:
    """LLaDA names -> ours, checked by LLaDA name and shape first (messages name the file's tensors)."""
    block = llada.cfg_block_type(cfg)
    ours_shapes = expected_shapes(cfg)
    hf_sd = {k: v for k, v in tensors.items() if not k.endswith(_DERIVED_KEYS)}
    head = llada.PREFIX + "ff_out.weight"
    if not cfg.untie_embeddings_and_output_weights and head in hf_sd:  # a tied head saved twice
        wte = hf_sd.get(llada.PREFIX + "wte.weight")
        if wte is None or hf_sd[head].shape != wte.shape or not torch.equal(hf_sd[head], wte.to(hf_sd[head].dtype)):
            raise InteropError(f"weight_tying is true but {head} differs from {llada.PREFIX}wte.weight; set "
                               "weight_tying false in config.json to keep a separate head")
        hf_sd.pop(head)
    if cfg.untie_embeddings_and_output_weights and head not in hf_sd:
        raise InteropError(f"weight_tying is false but the checkpoint has no {head}; set weight_tying true in "
                           "config.json if the head shares the embedding, or add the missing shard")
    _check_against(hf_sd, cfg, lambda n: n, expected=llada.expected_shapes(ours_shapes, block))
    return llada.to_ours(hf_sd, ours_shapes, block)


def megadlms_state_dict_to_hf(state_dict: Mapping[str, torch.Tensor], cfg: TransformerConfig, *,
                              strict: bool = True, hf_format: str = "auto") -> dict[str, torch.Tensor]:
    """Our names -> HF names (`model.` prefix; `lm_head.weight` only when untied), or LLaDA's names when `cfg`
    is exported in LLaDA's format (see `megadlms.presets.hf_architecture`).

    strict=False drops tensors the plain architecture does not have (e.g. FP8 scale/amax buffers of an
    FP8-converted model, which are training state, not weights); missing or misshapen ones still fail.
    """
    expected = expected_shapes(cfg)
    if not cfg.untie_embeddings_and_output_weights and "lm_head.weight" in state_dict:
        raise InteropError("the config ties the LM head to the embedding (untie_embeddings_and_output_weights="
                           f"False) but the state dict has lm_head.weight {list(state_dict['lm_head.weight'].shape)}; "
                           "set untie_embeddings_and_output_weights=True to export a separate head")
    if cfg.untie_embeddings_and_output_weights and "lm_head.weight" not in state_dict:
        raise InteropError("the config has a separate LM head (untie_embeddings_and_output_weights=True) but the "
                           "state dict has no lm_head.weight; set untie_embeddings_and_output_weights=False for a "
                           "tied model")
    ours = dict(state_dict) if strict else {k: v for k, v in state_dict.items() if k in expected}
    _check_against(ours, cfg, lambda n: n)
    if llada.is_llada(cfg, hf_format):
        return llada.from_ours(ours, llada.cfg_block_type(cfg))
    if cfg.is_moe:
        hf_architecture(cfg, hf_format)  # refuses a format that has no experts
        ours = _moe_to_hf(ours)
    return {_hf_name(n): v for n, v in ours.items()}


# --------------------------------------------------------------------------------------- safetensors


def load_hf_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a folder's safetensors: `model.safetensors`, or the shards listed in
    `model.safetensors.index.json` (each must exist and hold the tensors the index assigns it)."""
    folder = Path(path)
    index_file = folder / SAFE_WEIGHTS_INDEX_NAME
    if index_file.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index_file.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise InteropError(f"{index_file} is not a safetensors index (needs a 'weight_map'): {e}") from e
        by_file: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            by_file.setdefault(fname, []).append(name)
        missing = {f: names for f, names in by_file.items() if not (folder / f).is_file()}
        if missing:
            f, names = next(iter(missing.items()))
            raise InteropError(f"missing shard {f!r} in {folder} (listed in {SAFE_WEIGHTS_INDEX_NAME}, holding "
                               f"{_names(names, 4)}); {len(missing)} of {len(by_file)} shards are missing: copy them "
                               "from the source model")
        out: dict[str, torch.Tensor] = {}
        for fname, names in by_file.items():
            with open_safetensors(folder / fname) as f:
                present = set(f.keys())
                absent = [n for n in names if n not in present]
                if absent:
                    raise InteropError(f"shard {fname!r} lacks {_names(absent, 4)} that {SAFE_WEIGHTS_INDEX_NAME} "
                                       "assigns to it; the shard is truncated or from another model")
                for n in names:
                    out[n] = f.get_tensor(n)
        return out
    files = [folder / SAFE_WEIGHTS_NAME] if (folder / SAFE_WEIGHTS_NAME).is_file() else sorted(
        folder.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        hint = (f" (found {other}: re-save them as safetensors with transformers, "
                "model.save_pretrained(dir) writes safetensors by default)") if other else ""
        raise InteropError(f"no {SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME} in {folder}{hint}")
    out = {}
    for file in files:
        with open_safetensors(file) as f:
            for n in f.keys():
                if n in out:
                    raise InteropError(f"tensor {n!r} appears in more than one of {[p.name for p in files]}; "
                                       f"keep one set of weights (or add a {SAFE_WEIGHTS_INDEX_NAME})")
                out[n] = f.get_tensor(n)
    return out


def save_safetensors_sharded(state_dict: Mapping[str, torch.Tensor], save_dir: str | Path, *,
                             max_shard_size: int = DEFAULT_MAX_SHARD_SIZE) -> list[Path]:
    """Write `state_dict` as transformers does: `model.safetensors`, or `model-0000i-of-0000n.safetensors`
    plus `model.safetensors.index.json` when the total exceeds `max_shard_size` bytes.

    Shards are filled greedily in order; a tensor larger than the limit gets a shard of its own.
    Earlier `model*.safetensors` files and index in `save_dir` are removed first (so no stale shard
    survives a re-export with fewer shards). Returns the files written.
    """
    if max_shard_size <= 0:
        raise InteropError(f"max_shard_size={max_shard_size} must be a positive number of bytes (e.g. 5e9)")
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*save_dir.glob("model*.safetensors"), save_dir / SAFE_WEIGHTS_INDEX_NAME]:
        stale.unlink(missing_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    total = 0
    for name, t in state_dict.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().to("cpu").contiguous()
        size += nbytes
        total += nbytes
    metadata = {"format": "pt"}  # transformers refuses safetensors without it
    if len(shards) == 1:
        path = save_dir / SAFE_WEIGHTS_NAME
        save_safetensors(shards[0], path, metadata=metadata)
        return [path]
    paths, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        path = save_dir / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors(shard, path, metadata=metadata)
        paths.append(path)
        weight_map.update({n: path.name for n in shard})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (save_dir / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return paths


def parse_size(text: str | int) -> int:
    """'5GB' -> 5_000_000_000, '500MiB' -> 524_288_000, '1234' -> 1234 (bytes; transformers' units)."""
    if isinstance(text, int):
        return text
    s = str(text).strip().upper()
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    unit = next((u for u in units if s.endswith(u)), "")
    num, mult = (s[: -len(unit)].strip(), units[unit]) if unit else (s, 1)
    try:
        value = float(num) * mult
    except ValueError:
        raise InteropError(f"size {text!r} is not a number of bytes or a size like '5GB' / '500MB' / '2GiB'") from None
    if not math.isfinite(value) or value <= 0:
        raise InteropError(f"size {text!r} must be positive")
    return int(value)


# ----------------------------------------------------------------------------------------- tokenizer


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy the transformers tokenizer files (and LLaDA's / Dream's modeling code, `REMOTE_CODE_FILES`) found in
    `src` to `dst`; returns the names copied."""
    src, dst = Path(src), Path(dst)
    names = [n for n in (*TOKENIZER_FILES, *REMOTE_CODE_FILES) if (src / n).is_file()]
    if names:
        dst.mkdir(parents=True, exist_ok=True)
    for n in names:
        shutil.copyfile(src / n, dst / n)
    return names


def tokenizer_vocab_size(folder: str | Path) -> int | None:
    """Ids the folder's tokenizer.json can produce (max id + 1, added tokens included); None without one."""
    f = Path(folder) / "tokenizer.json"
    if not f.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        vocab = Tokenizer.from_file(str(f)).get_vocab(with_added_tokens=True)
    except Exception as e:  # the Rust side raises a bare Exception on malformed files
        raise InteropError(f"cannot read tokenizer {f}: {e}") from e
    return max(vocab.values()) + 1 if vocab else 0


def check_vocab_fits(cfg: TransformerConfig, tokenizer_dir: str | Path | None) -> int | None:
    """Raise when the tokenizer has more ids than the embedding rows; returns the tokenizer's size."""
    if tokenizer_dir is None:
        return None
    n = tokenizer_vocab_size(tokenizer_dir)
    if n is not None and n > cfg.vocab_size:
        raise InteropError(
            f"the tokenizer in {tokenizer_dir} has {n} ids but embed_tokens.weight has shape "
            f"[{cfg.vocab_size}, {cfg.hidden_size}] (vocab_size={cfg.vocab_size}); ids >= {cfg.vocab_size} would "
            "index past the embedding: use the tokenizer the model was trained with, or resize the embedding")
    return n


def resolve_token(token: str | int, tokenizer_dir: str | Path | None) -> int:
    """An id given as an int / digit string, or a token string looked up in the folder's tokenizer.json."""
    if isinstance(token, int):
        return token
    if str(token).lstrip("-").isdigit():
        return int(token)
    f = Path(tokenizer_dir) / "tokenizer.json" if tokenizer_dir is not None else None
    if f is None or not f.is_file():
        raise InteropError(f"mask token {token!r} is a string but there is no tokenizer.json to look it up in; "
                           "pass its integer id instead")
    from tokenizers import Tokenizer

    i = Tokenizer.from_file(str(f)).token_to_id(token)
    if i is None:
        raise InteropError(f"token {token!r} is not in {f}; pass an integer id (a spare embedding row works too)")
    return int(i)


def _special_token_ids(tokenizer_dir: str | Path | None) -> dict[str, int | None]:
    """bos/eos/pad ids named by tokenizer_config.json, resolved through tokenizer.json."""
    if tokenizer_dir is None:
        return {}
    folder = Path(tokenizer_dir)
    if not (folder / "tokenizer.json").is_file() or not (folder / "tokenizer_config.json").is_file():
        return {}
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    conf = json.loads((folder / "tokenizer_config.json").read_text())
    out: dict[str, int | None] = {}
    for key in ("bos", "eos", "pad"):
        v = conf.get(f"{key}_token")
        v = v.get("content") if isinstance(v, dict) else v
        if isinstance(v, str):
            out[f"{key}_token_id"] = tok.token_to_id(v)
    return out


# ---------------------------------------------------------------------------------------- import / export


def _to_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise InteropError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def model_from_state_dict(cfg: TransformerConfig, state_dict: Mapping[str, torch.Tensor], *,
                          device: torch.device | str = "cpu",
                          dtype: torch.dtype | None = torch.float32) -> TransformerLM:
    """A plain TransformerLM holding `state_dict` (our names), without a random init of the weights.

    Built on the meta device and filled with assign=True; the RoPE tables (not in the state dict) are
    then computed on `device`. dtype=None keeps each tensor's stored dtype.
    """
    with torch.device("meta"):
        model = TransformerLM(cfg.replace(fp8=False) if cfg.fp8 else cfg)
    tensors = {k: v.to(device=device, dtype=dtype if dtype is not None and v.is_floating_point() else v.dtype)
               for k, v in state_dict.items()}
    model.load_state_dict(tensors, strict=True, assign=True)
    model.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_positions, cfg.rotary_base).to(device)
    for moe in moe_layers(model):  # the MoE blocks' token counters (not saved) start at zero
        for name, buf in list(moe.named_buffers(recurse=False)):
            if buf.is_meta:
                setattr(moe, name, torch.zeros(buf.shape, dtype=buf.dtype, device=device))
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:  # a buffer the model gained that this loader does not know how to rebuild
        raise InteropError(f"tensors {left} were not loaded; the model has state this loader does not fill")
    return model.eval()


def load_hf_model(path: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype | None = torch.float32,
                  attn_mask_type: str | None = None, mask_token_id: int | str | None = None
                  ) -> tuple[TransformerLM, TransformerConfig]:
    """Load a local Hugging Face Qwen3 / Qwen2 / Llama / LLaDA / Dream folder as our TransformerLM (in eval mode).

    attn_mask_type: 'bidirectional' | 'causal'; None -> as recorded in config.json (`attn_mask_type` or
    `is_causal: false`; always bidirectional for LLaDA and Dream), else causal. mask_token_id: an id or a token
    string of the folder's tokenizer (default: config.json's `mask_token_id`).
    dtype: of the floating-point weights (None keeps the stored dtype, e.g. bfloat16).
    Errors name the file: config.json, or the safetensors file holding the tensor at fault.
    """
    folder = Path(path)
    hf = read_hf_config(folder)
    mask_id = resolve_token(mask_token_id, folder) if mask_token_id is not None else None
    try:
        cfg = hf_config_to_megadlms(hf, attn_mask_type=attn_mask_type, mask_token_id=mask_id)
    except InteropError as e:
        raise InteropError(f"{folder / 'config.json'}: {e}") from e
    gen_file = folder / "generation_config.json"
    if gen_file.is_file():  # kept for export (sampling defaults, eos ids)
        try:
            cfg.extra["hf_generation_config"] = json.loads(gen_file.read_text())
        except json.JSONDecodeError as e:
            raise InteropError(f"{gen_file} is not valid JSON: {e}; fix or delete it") from e
    check_vocab_fits(cfg, folder)
    tensors = load_hf_state_dict(folder)
    try:
        ours = hf_state_dict_to_megadlms(tensors, cfg)
    except InteropError as e:
        raise InteropError(f"{_file_at_fault(folder, str(e))}: {e}") from e
    return model_from_state_dict(cfg, ours, device=device, dtype=_to_dtype(dtype)), cfg


def _file_at_fault(folder: Path, message: str) -> Path:
    """The safetensors file of `folder` holding the first tensor that `message` names (the folder when none)."""
    index_file = folder / SAFE_WEIGHTS_INDEX_NAME
    if index_file.is_file():
        weight_map: dict[str, str] = json.loads(index_file.read_text()).get("weight_map", {})
    else:
        weight_map = {}
        for file in sorted(folder.glob("*.safetensors")):
            with open_safetensors(file) as f:
                weight_map.update(dict.fromkeys(f.keys(), file.name))
    hits = [(message.find(name), fname) for name, fname in weight_map.items() if name in message]
    return folder / min(hits)[1] if hits else folder


def plain_state_dict(model: torch.nn.Module, cfg: TransformerConfig) -> dict[str, torch.Tensor]:
    """The weights of `model` under our names, as the plain architecture has them (FP8 training buffers
    such as amax histories left out); missing or misshapen tensors raise InteropError."""
    expected = expected_shapes(cfg)
    ours = {k: v for k, v in model.state_dict().items() if k in expected}
    _check_against(ours, cfg, lambda n: n)
    return ours


def save_hf_model(model: torch.nn.Module, cfg: TransformerConfig, save_dir: str | Path, *,
                  tokenizer_dir: str | Path | None = None, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                  dtype: torch.dtype | str | None = None, tensors: Mapping[str, torch.Tensor] | None = None,
                  quantization_config: dict[str, Any] | None = None, hf_format: str = "auto") -> Path:
    """Export `model` as a folder that `transformers.AutoModelForCausalLM.from_pretrained` loads with
    its stock classes: safetensors (sharded above `max_shard_size` bytes), config.json,
    generation_config.json, and the tokenizer files of `tokenizer_dir`.

    dtype: of the saved weights (None keeps the model's). tensors: what to write instead of the model's state
    dict, under our names, as they are (an FP8 export's weights with their `<linear>.weight_scale_inv` scales:
    `megadlms.fp8.export.export_hf`); quantization_config: config.json's entry describing them.
    hf_format: 'auto' (LLaDA's or Dream's own format when imported from one, else stock), 'stock', 'llada',
    'dream' (`megadlms.presets.hf_architecture`); LLaDA and Dream folders load with `trust_remote_code=True` and
    their modeling code, which is copied from `tokenizer_dir` when there (an import puts it there). Returns
    `save_dir`.
    """
    save_dir = Path(save_dir)
    check_vocab_fits(cfg, tokenizer_dir)
    megadlms_config_to_hf(cfg, hf_format=hf_format)  # refuses a model the format cannot hold before writing
    source = model.state_dict() if tensors is None else tensors
    scales = {k: v for k, v in (tensors or {}).items() if k.endswith(".weight_scale_inv")}
    if scales and llada.is_llada(cfg, hf_format):
        raise InteropError("an FP8 export (weights with .weight_scale_inv scales) has no LLaDA form; export in "
                           "BF16 (--dtype bfloat16) or with --hf-format stock")
    hf_sd = megadlms_state_dict_to_hf({k: v for k, v in source.items() if k not in scales}, cfg, strict=False,
                                      hf_format=hf_format)
    hf_sd.update({_hf_name(k): v for k, v in scales.items()})
    dt = _to_dtype(dtype)
    if dt is not None:
        hf_sd = {k: v.to(dt) if v.is_floating_point() else v for k, v in hf_sd.items()}
    saved_dtype = next(v.dtype for k, v in hf_sd.items() if k.endswith(("embed_tokens.weight", "wte.weight")))
    save_safetensors_sharded(hf_sd, save_dir, max_shard_size=parse_size(max_shard_size))
    copied = copy_tokenizer_files(tokenizer_dir, save_dir) if tokenizer_dir is not None else []
    if "tokenizer.json" in copied and complete_tokenizer_config(save_dir, mask_id=cfg.mask_token_id):
        copied.append("tokenizer_config.json")  # (a checkpoint saved before checkpoints carried one)
    if tokenizer_dir is not None and not any(n in copied for n in _TOKENIZER_MODEL_FILES):
        warnings.warn(f"no tokenizer files ({', '.join(_TOKENIZER_MODEL_FILES)}) in {tokenizer_dir}; "
                      "AutoTokenizer.from_pretrained will not load the export", stacklevel=2)
    token_ids = _special_token_ids(save_dir if copied else None)
    hf_cfg = megadlms_config_to_hf(cfg, dtype=saved_dtype, token_ids=token_ids, hf_format=hf_format)
    if quantization_config is not None:
        hf_cfg["quantization_config"] = quantization_config
    (save_dir / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    if "auto_map" in hf_cfg and not all((save_dir / f"{ref.split('.')[0]}.py").is_file()
                                        for ref in hf_cfg["auto_map"].values()):
        warnings.warn(f"{save_dir} names modeling code in config.json's auto_map ({sorted(hf_cfg['auto_map'])}) "
                      "that the tokenizer folder did not bring; copy those .py files from the original model "
                      "to load it with trust_remote_code=True", stacklevel=2)
    if hf_cfg["model_type"] == "qwen2" and "tokenizer.json" in copied:
        _check_autotokenizer(save_dir)
    # the source model's generation_config.json when imported from one, else derived from config.json
    gen = dict((cfg.extra or {}).get("hf_generation_config") or {"_from_model_config": True})
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if gen.get(k) is None and hf_cfg.get(k) is not None:
            gen[k] = hf_cfg[k]
    (save_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return save_dir


_PROBE_TEXT = "The quick brown fox, 12345 jumps!\n  Over\tthe lazy dog's back: naïve café."


def _check_autotokenizer(folder: Path) -> None:
    """Warn when AutoTokenizer would not reproduce the folder's tokenizer.json.

    transformers >= 5 loads the tokenizer of a `qwen2` model as Qwen2Tokenizer, rebuilt from the
    vocabulary with Qwen's own pre-tokenizer, whatever tokenizer_config.json names; a tokenizer that is
    not Qwen's then tokenizes differently.
    """
    try:
        from transformers import AutoTokenizer
    except ImportError:  # nothing to check against
        return
    from tokenizers import Tokenizer

    want = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(_PROBE_TEXT, add_special_tokens=False).ids
    try:
        got = AutoTokenizer.from_pretrained(str(folder))(_PROBE_TEXT, add_special_tokens=False)["input_ids"]
    except Exception as e:  # any failure to load is what the warning is about
        got = f"an error ({e})"
    if got != want:
        warnings.warn(
            f"AutoTokenizer.from_pretrained({str(folder)!r}) does not reproduce tokenizer.json: transformers loads "
            "the tokenizer of a qwen2 model as Qwen2Tokenizer, and this tokenizer is not Qwen's. Load it with "
            "transformers.PreTrainedTokenizerFast.from_pretrained(folder) instead", stacklevel=3)


def set_causal(hf_model: torch.nn.Module, causal: bool) -> torch.nn.Module:
    """Switch a transformers decoder between causal and bidirectional attention, in place; returns it.

    Sets `config.is_causal` (transformers >= 5 then builds a bidirectional mask, padding included, and
    passes is_causal to the attention kernel) and `is_causal` on every attention module (what
    flash-attention and older releases read).
    """
    config: Any = hf_model.config  # a transformers PretrainedConfig
    config.is_causal = causal
    for m in hf_model.modules():
        if hasattr(m, "is_causal"):
            setattr(m, "is_causal", causal)  # a plain attribute of transformers' attention modules
    return hf_model


def make_bidirectional(hf_model: torch.nn.Module) -> torch.nn.Module:
    """Run a transformers decoder with full (non-causal) attention, in place: `set_causal(hf_model, False)`."""
    return set_causal(hf_model, False)
